"""Any number of outputs at a bounded cost (issue 39): the GGN estimator chosen from the output size,
batches taken in parts where an exact factor is large, and the warning before an explicit setting
breaks the cost bound."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_marglik.curvature as curvature
from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence
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


def _fit(classes: int, **options):
    from lightning_marglik import MargLikCallback

    module = Classifier(n_data=40, classes=classes)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(40, 2, generator=g), torch.randint(0, classes, (40,), generator=g)),
                      batch_size=20)
    callback = MargLikCallback(frequency=1, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], max_epochs=1).fit(module, data)
    return callback, [str(w.message) for w in caught if "training epochs" in str(w.message)]


def test_the_callback_samples_the_ggn_for_many_classes_and_says_why():
    callback, cost = _fit(classes=200)
    assert callback.options.mc_samples == 1 and callback.mc_samples == "auto"
    assert "199 backward passes" in callback.estimator
    assert not cost


def test_an_explicit_exact_ggn_over_many_classes_is_warned_about_with_its_cost():
    callback, cost = _fit(classes=200, mc_samples=0)
    assert callback.options.mc_samples == 0 and callback.estimator == "as set: the exact GGN"
    assert len(cost) == 1
    assert "199 backward passes" in cost[0] and "mc_samples='auto'" in cost[0]
    epochs = float(cost[0].split("costs about ")[1].split(" training epochs")[0])
    assert epochs > 1  # frequency=1


def test_an_exact_ggn_over_few_classes_is_not_warned_about():
    callback, cost = _fit(classes=3, mc_samples=0)
    assert callback.options.mc_samples == 0 and not cost
