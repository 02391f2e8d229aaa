"""Any number of outputs at a bounded cost (issue 39): the GGN estimator chosen from the output size,
batches taken in parts where an exact factor is large, and the warning when a run would cost more than twice
a plain one, whatever chose the estimator, with the same Monte-Carlo samples for ``"auto"`` and an explicit
count (issue 51)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_marglik.callbacks.cost as cost_module
import lightning_marglik.curvature as curvature
from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence
from lightning_marglik.callbacks.cost import cost_message
from lightning_marglik.curvature import CurvatureOptions
from lightning_marglik.curvature.estimator import EXACT_COLUMNS, resolve_mc_samples
from lightning_marglik.likelihoods import categorical_traces, sample_classes
from tests.lightning_models import Classifier, trainer

STRUCTURES = ["kron", "ekfac", "diag", "full"]


def _classification(classes: int, n: int = 24, seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, classes)).double()
    x = torch.randn(n, 3, dtype=torch.float64)
    return net, DataLoader(TensorDataset(x, torch.randint(0, classes, (n,))), batch_size=12)


class TokenNet(nn.Module):
    """Embedding -> Linear over positions: outputs (B, T, C), a token model's layout."""

    def __init__(self, vocabulary: int = 7, width: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def _tokens(n: int = 12, length: int = 4, vocabulary: int = 7):
    torch.manual_seed(1)
    net = TokenNet(vocabulary).double()
    tokens = torch.randint(0, vocabulary, (n, length))
    labels = torch.randint(0, vocabulary, (n, length))
    labels[::3, -1] = -100  # padded positions
    return net, DataLoader(TensorDataset(tokens, labels), batch_size=6)


# --- the estimator ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "likelihood, shape, expected",
    [
        (CategoricalLikelihood(), (8, EXACT_COLUMNS + 1), 0),  # C - 1 = 10 columns: exact
        (CategoricalLikelihood(), (8, EXACT_COLUMNS + 2), 1),
        (CategoricalLikelihood(), (8, 1000), 1),
        (GaussianLikelihood(), (8, EXACT_COLUMNS), 0),  # C columns: exact
        (GaussianLikelihood(), (8, EXACT_COLUMNS + 1), 1),
        (CategoricalLikelihood(), (8, 2, 6), 0),  # 2 positions x 5 columns
        (CategoricalLikelihood(), (8, 3, 6), 1),  # 3 x 5 > 10
    ],
)
def test_auto_is_exact_up_to_the_measured_crossover_and_sampled_beyond(likelihood, shape, expected):
    mc_samples, reason = resolve_mc_samples("auto", "ggn", likelihood, shape)
    assert mc_samples == expected
    assert reason.startswith("auto: the exact GGN" if expected == 0 else "auto: the Monte-Carlo GGN")


def test_the_users_setting_wins_and_the_ef_has_one_column():
    assert resolve_mc_samples(0, "ggn", CategoricalLikelihood(), (8, 1000)) == (0, "as set: the exact GGN")
    assert resolve_mc_samples(3, "ggn", CategoricalLikelihood(), (8, 5))[0] == 3
    assert resolve_mc_samples("auto", "ef", CategoricalLikelihood(), (8, 1000))[0] == 0


@pytest.mark.parametrize("bad", ["exact", -1, 1.5, True])
def test_mc_samples_refuses_what_is_neither_a_count_nor_auto(bad):
    with pytest.raises(ValueError, match="mc_samples"):
        CurvatureOptions("kron", "ggn", bad)
    assert CurvatureOptions("kron", "ggn", " AUTO ").mc_samples == "auto"


def test_a_count_given_as_a_string_is_told_counts_are_ints():
    with pytest.raises(ValueError, match=r"got '1'\. Or an int >= 0: Monte-Carlo samples, 0 = exact GGN\."):
        CurvatureOptions("kron", "ggn", "1")


def test_the_engine_records_which_estimator_ran():
    net, data = _classification(classes=30)
    evidence = LaplaceEvidence.fit(net, data, CategoricalLikelihood(), GaussianPrior(net))
    assert evidence.options.mc_samples == 1 and "29 backward passes" in evidence.estimator
    exact = LaplaceEvidence.fit(net, data, CategoricalLikelihood(), GaussianPrior(net), mc_samples=0)
    assert exact.options.mc_samples == 0 and exact.estimator == "as set: the exact GGN"


# --- the likelihood's per-class work: draws and traces (issue 54: a 50,257-token vocabulary) -----------


def test_sampled_classes_follow_the_probabilities_and_never_take_an_impossible_one():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    draws = sample_classes(probs.repeat(50_000, 1), 2, torch.Generator().manual_seed(0)).reshape(50_000, 2, 2)
    counts = torch.stack([torch.bincount(draws[:, i].reshape(-1), minlength=4) for i in range(2)]).double()
    expected = probs * 100_000
    assert torch.all((counts - expected).abs() <= 5 * (expected * (1 - probs)).sqrt() + 1e-9)  # 5 sigma
    assert counts[0, 1] == 0 and counts[1, :3].sum() == 0
    again = sample_classes(probs.repeat(50_000, 1), 2, torch.Generator().manual_seed(0)).reshape(50_000, 2, 2)
    assert torch.equal(draws, again)


def test_a_sampled_factor_column_is_the_drawn_class_minus_the_probabilities():
    logits = torch.randn(6, 4, 9, dtype=torch.float64)
    labels = torch.randint(0, 9, (6, 4))
    labels[0, 1] = -100
    factor = CategoricalLikelihood().hessian_sqrt(logits, labels, "ggn", 3, torch.Generator().manual_seed(1))
    probs = logits.reshape(-1, 9).softmax(1)
    draws = sample_classes(probs, 3, torch.Generator().manual_seed(1))
    expected = (nn.functional.one_hot(draws, 9) - probs[:, None]).transpose(1, 2) / 3 ** 0.5  # (terms, C, k)
    expected = expected * (labels.reshape(-1) != -100).reshape(-1, 1, 1)
    assert torch.equal(factor, expected.reshape(6, 4 * 9, 3))


def test_the_categorical_traces_stay_accurate_however_confident_the_fit():
    """Against 60-digit arithmetic, ``1 - p_c`` as the other classes' mass (60 digits cannot hold ``1 - p_c`` at
    ``p_c = 1 - e^-1000``): ``||y - p||^2`` and ``1 - ||p||^2`` per datum, from logits up to thousands apart
    (beyond float64's range: 0)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(60, 5, generator=g, dtype=torch.float64) * torch.logspace(-1, 3, 60, dtype=torch.float64)[:, None]
    labels = torch.randint(0, 5, (60,), generator=g)
    labels[::2] = logits[::2].argmax(1)  # every other datum fit: its residual is the others' mass
    ef, ggn = categorical_traces(logits, labels)
    for row, label, got_ef, got_ggn in zip(logits.tolist(), labels.tolist(), ef.tolist(), ggn.tolist()):
        exps = [mpmath.exp(mpmath.mpf(v)) for v in row]
        p = [e / sum(exps) for e in exps]
        rest = [sum(p[:c] + p[c + 1:]) for c in range(len(p))]  # 1 - p_c
        want_ef = sum((rest[c] if c == label else pc) ** 2 for c, pc in enumerate(p))
        want_ggn = sum(pc * rest[c] for c, pc in enumerate(p))
        for got, want in ((got_ef, want_ef), (got_ggn, want_ggn)):  # relative, down to float64's smallest normal
            assert abs(got - want) <= 1e-13 * want + 1e-307


def test_the_likelihoods_confidence_and_correct_count_are_the_kept_rows_top_probabilities_and_hits():
    """What ``predict``'s default reads: per kept row the softmax's top probability and whether it is the label's,
    summed over a sequence batch with ignored positions, against the dense softmax of the kept rows."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, 7, generator=g) * 3
    labels = torch.randint(0, 7, (4, 9), generator=g)
    labels[:, ::2] = logits[:, ::2].argmax(2)  # half the positions predicted right
    labels[1, 3:] = -100
    stats = CategoricalLikelihood().statistics(logits, labels)
    kept = labels != -100
    p = logits[kept].double().softmax(1)
    assert float(stats["confidence"]) == pytest.approx(p.max(1).values.sum().item(), rel=1e-14)
    assert int(stats["correct"]) == int((p.argmax(1) == labels[kept]).sum()) and stats["correct"].dtype == torch.int64
    assert int(stats["n_data"]) == int(kept.sum()) == 30
    assert 15 < int(stats["correct"]) < 30  # both hits and misses among the kept rows


# --- batches in parts: the same statistics -------------------------------------------------------


def _log_marglik(net, data, structure, likelihood=None):
    prior = GaussianPrior(net, precision=0.7, structure="layerwise")
    evidence = LaplaceEvidence.fit(net, data, likelihood or CategoricalLikelihood(), prior, structure=structure, mc_samples=0)
    return evidence.log_marglik().item()


@pytest.mark.parametrize("structure", STRUCTURES)
def test_a_batch_taken_in_parts_gives_the_whole_batchs_evidence(structure, monkeypatch):
    net, data = _classification(classes=13)
    whole = _log_marglik(net, data, structure)
    monkeypatch.setattr(curvature, "PART_BYTES", 1)  # one example per part
    assert _log_marglik(net, data, structure) == pytest.approx(whole, rel=1e-12, abs=1e-10)


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_token_outputs_with_padding_taken_in_parts_give_the_same_evidence(structure, monkeypatch):
    net, data = _tokens()
    whole = _log_marglik(net, data, structure)
    monkeypatch.setattr(curvature, "PART_BYTES", 1)
    assert _log_marglik(net, data, structure) == pytest.approx(whole, rel=1e-12, abs=1e-10)


def test_parts_are_sized_by_the_factor_and_gradients_of_all_columns(monkeypatch):
    """At C = 1000 with the exact GGN a batch of 16 is split; at C = 3 it is not."""
    sizes = []
    original = curvature._part_size

    def spy(*args, **kwargs):
        sizes.append(original(*args, **kwargs))
        return sizes[-1]

    monkeypatch.setattr(curvature, "_part_size", spy)
    monkeypatch.setattr(curvature, "PART_BYTES", 2**20)
    for classes in (3, 1000):
        net, data = _classification(classes=classes, n=16)
        LaplaceEvidence.fit(net, DataLoader(data.dataset, batch_size=16), CategoricalLikelihood(), GaussianPrior(net),
                            structure="diag", mc_samples=0)
    # 999 columns x (1000 float64 factor values + 6 + 1000 float64 gradients) per example = 16 MB > 1 MB
    assert sizes == [16, 1]


# --- the callback ----------------------------------------------------------------------------


def _fit(classes: int, n: int = 40, **options):
    from lightning_marglik import MargLikCallback

    module = Classifier(n_data=n, classes=classes)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(n, 2, generator=g), torch.randint(0, classes, (n,), generator=g)),
                      batch_size=20)
    callback = MargLikCallback(**{"frequency": 1, **options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], max_epochs=1).fit(module, data)
    return callback, [str(w.message) for w in caught if "training epochs" in str(w.message)]


def test_the_callback_samples_the_ggn_for_many_classes_and_says_why():
    callback, cost = _fit(classes=200)
    assert callback.options.mc_samples == 1 and callback.mc_samples == "auto"
    assert "199 backward passes" in callback.estimator
    assert not cost  # a toy's estimate: under MIN_SECONDS


def test_an_explicit_exact_ggn_over_many_classes_is_warned_about_with_its_cost(monkeypatch):
    monkeypatch.setattr(cost_module, "MIN_SECONDS", 0.0)  # a toy's estimate: its ratio counts here
    callback, cost = _fit(classes=200, mc_samples=0)
    assert callback.options.mc_samples == 0 and callback.estimator == "as set: the exact GGN"
    assert len(cost) == 1
    assert "(as set: the exact GGN;" in cost[0]
    assert "mc_samples=1 (one backward pass per batch instead of 199)" in cost[0]
    epochs = float(cost[0].split("costs about ")[1].split(" training epochs")[0])  # printed to 0.1
    frequency = int(cost[0].split("frequency=")[-1].rstrip("."))
    assert epochs > 1 and math.ceil(epochs - 0.05) <= frequency <= math.ceil(epochs + 0.05)  # not frequency=1


def test_a_toys_estimate_is_not_warned_about_whatever_its_ratio():
    callback, cost = _fit(classes=3, mc_samples=0)
    assert callback.options.mc_samples == 0 and not cost
    assert callback._cost.estimate_epochs is not None  # measured: the first estimate took under MIN_SECONDS


# --- the cost warning, whatever chose the estimator (issue 51 item 3) -----------------------------

EXACT = CurvatureOptions("kron", "ggn", 0)


@pytest.mark.parametrize(
    "options, columns, frequency, epochs, seconds, cheaper",
    [
        (EXACT, 10, 1, 2.5, 30.0, ["mc_samples=1 (one backward pass per batch instead of 10)", "frequency=3"]),
        (EXACT, 10, 2, 2.5, 30.0, ["mc_samples=1", "frequency=3"]),
        (EXACT, 10, 3, 2.5, 30.0, None),  # 2.5 / 3 + 1 < 2
        (EXACT, 10, 5, 5.0, 30.0, None),  # exactly twice a plain run: within the bound
        (EXACT, 10, 1, 2.5, 0.5, None),  # under MIN_SECONDS
        (CurvatureOptions("kron", "ggn", 1), 1, 1, 4.2, 30.0, ["frequency=5"]),  # already one backward pass
        (CurvatureOptions("kron", "ef"), 1, 1, 4.2, 30.0, ["frequency=5"]),
        (CurvatureOptions("kron", "ef"), 1, 1, 4.2, 30.0, ["solver='newton' (a few Newton steps, not 2000 Adam steps)",
                                                           "frequency=5"]),
        (CurvatureOptions("full", "ggn", 1), 1, 10, 40.0, 30.0, ["structure='kron'", "frequency=40"]),
        (CurvatureOptions("ekfac", "ggn", 0), 2, 1, 3.0, 30.0,
         ["mc_samples=1", "structure='kron' (one pass", "frequency=3"]),
    ],
)
def test_a_run_predicted_above_twice_a_plain_one_is_warned_with_the_cheaper_settings_that_apply(
    options, columns, frequency, epochs, seconds, cheaper
):
    adam_steps = 2000 if cheaper and any("solver" in c for c in cheaper) else 0
    message = cost_message("MargLikCallback", "auto: the exact GGN (10 backward passes per batch, at most 10)", options,
                           columns, frequency, epochs, seconds, "measured", adam_steps)
    if cheaper is None:
        assert message is None
        return
    assert message is not None and f"one estimate costs about {epochs:.1f} training epochs, {seconds:.3g} s" in message
    assert f"costs about {epochs / frequency + 1:.1f}x one without the callback" in message
    offered = message.split("cheaper: ")[1]
    assert all(setting in offered for setting in cheaper), offered
    assert ("mc_samples=1" in offered) == any(c.startswith("mc_samples") for c in cheaper)
    assert ("structure=" in offered) == any(c.startswith("structure") for c in cheaper)
    assert ("solver=" in offered) == bool(adam_steps)


def _mlp_fit(classes: int, frequency: int, width: int, n: int, epochs: int = 1):
    from lightning_marglik import MargLikCallback

    torch.manual_seed(0)
    module = Classifier(n_data=n, classes=classes, in_features=64, width=width)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, classes, (n,), generator=g)),
                      batch_size=128)
    callback = MargLikCallback(frequency=frequency)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], max_epochs=epochs).fit(module, data)
    return callback, [str(w.message) for w in caught if "training epochs" in str(w.message)]


def test_autos_exact_ggn_at_11_classes_and_frequency_1_is_warned_about(monkeypatch):
    """The exact GGN's 10 backward passes per batch cost more than one training epoch per estimate, so a run at
    frequency=1 costs more than twice a plain one; "auto" chose it, and it is named with the cheaper settings."""
    monkeypatch.setattr(cost_module, "MIN_SECONDS", 0.0)  # the ratio, not the machine's speed, decides here
    callback, cost = _mlp_fit(classes=11, frequency=1, width=512, n=1024)
    assert callback.estimator == "auto: the exact GGN (10 backward passes per batch, at most 10)"
    assert len(cost) == 1, cost
    assert f"({callback.estimator};" in cost[0]
    assert "mc_samples=1 (one backward pass per batch instead of 10)" in cost[0] and ", or frequency=" in cost[0]
    assert callback._cost.estimate_epochs > 1


def test_the_default_on_a_10_class_mlp_is_not_warned_about():
    callback, cost = _mlp_fit(classes=10, frequency=10, width=16, n=512, epochs=10)
    assert callback.estimator.startswith("auto: the exact GGN (9 backward passes") and not cost
    assert callback._cost.epoch_seconds is not None and callback._cost.estimate_epochs is not None  # measured


# --- the same samples, whatever chose to sample (issue 51 item 3) ---------------------------------


def test_the_engine_draws_the_same_samples_for_auto_and_an_explicit_count():
    net, data = _classification(classes=30)
    auto = LaplaceEvidence.fit(net, data, CategoricalLikelihood(), GaussianPrior(net))
    torch.manual_seed(123)  # the global generator is not what draws them
    explicit = LaplaceEvidence.fit(net, data, CategoricalLikelihood(), GaussianPrior(net), mc_samples=1)
    assert auto.options == explicit.options and auto.log_marglik().item() == explicit.log_marglik().item()


def test_the_callback_learns_the_same_precisions_for_auto_and_an_explicit_count():
    runs = {}
    for mc_samples in ("auto", 1):
        torch.manual_seed(0)
        callback, _ = _fit(classes=30, mc_samples=mc_samples)
        runs[mc_samples] = (callback.options.mc_samples, callback.prior.log_precision.clone())
    assert runs["auto"][0] == runs[1][0] == 1
    assert torch.equal(runs["auto"][1], runs[1][1])
