"""The EF curvature ratio of lightning_marglik.diagnostics against float64 hand computations,
the library's own curvature factors and evidence pass, and its limits (interpolation, calibration)."""
import itertools
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence, collect_statistics
from lightning_marglik.diagnostics import (
    EF_RATIO_THRESHOLD, batch_traces, curvature_traces, ef_curvature_ratio, ef_unreliable_message, ratio_from_traces,
    rescale_empirical_fisher,
)


def loader(x, y, batch_size=7):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def categorical_by_hand(logits, labels, ignore_index=-100):
    """sum ||y - p||^2 / sum (1 - ||p||^2) over the kept positions, the naive float64 formula."""
    logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    keep = labels != ignore_index
    p = logits[keep].double().softmax(1)
    y = nn.functional.one_hot(labels[keep], p.shape[1]).double()
    return ((y - p) ** 2).sum().item() / (1 - (p ** 2).sum(1)).sum().item()


def identity_jacobian_net():
    """f = W 1: each datum's Jacobian is the identity (parameter-space diagonals = output-space traces)."""
    net = nn.Linear(1, 4, bias=False)
    nn.init.normal_(net.weight, std=2.0)
    return net, torch.ones(20, 1), torch.randint(0, 4, (20,))


def test_categorical_equals_hand_computation():
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4))
    x, y = torch.randn(30, 3), torch.randint(0, 4, (30,))
    with torch.no_grad():
        expected = categorical_by_hand(net(x), y)
    assert ef_curvature_ratio(net, loader(x, y), CategoricalLikelihood()) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_categorical_leaves_out_ignored_labels(ignore_index):
    net = nn.Linear(3, 4)
    x, y = torch.randn(30, 3), torch.randint(0, 4, (30,))
    y[::3] = ignore_index
    with torch.no_grad():
        expected = categorical_by_hand(net(x), y, ignore_index)
        everything = categorical_by_hand(net(x), torch.where(y == ignore_index, 0, y), ignore_index=-12345)
    got = ef_curvature_ratio(net, loader(x, y), CategoricalLikelihood(ignore_index=ignore_index))
    assert got == pytest.approx(expected, rel=1e-12)
    assert abs(got - everything) > 1e-3  # the ignored positions would change it


def test_sequence_outputs_count_every_kept_position():
    net = nn.Linear(3, 5)  # (B, T, 3) -> (B, T, 5) logits
    x, y = torch.randn(6, 4, 3), torch.randint(0, 5, (6, 4))
    y[:, -1] = -100  # padding
    y[0] = -100
    with torch.no_grad():
        expected = categorical_by_hand(net(x), y)
    traces = curvature_traces(net, loader(x, y, 4), CategoricalLikelihood())
    assert traces[2].item() == 15  # 5 sequences of 3 kept positions
    assert ratio_from_traces(traces, CategoricalLikelihood()) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("shape", [(40, 2), (8, 5, 3)])
def test_gaussian_is_mean_squared_residual_over_sigma_squared(shape):
    net = nn.Linear(4, shape[-1])
    x, y = torch.randn(*shape[:-1], 4), torch.randn(*shape)
    with torch.no_grad():
        mean_square = ((y - net(x)) ** 2).mean().item()
    got = ef_curvature_ratio(net, loader(x, y), GaussianLikelihood(sigma=0.7))
    assert got == pytest.approx(mean_square / 0.49, rel=1e-12)


@pytest.mark.parametrize("likelihood", [CategoricalLikelihood(temperature=2.0), GaussianLikelihood(sigma=0.6)])
def test_traces_are_the_library_curvature_factors(likelihood):
    """The unit-scale traces are tr(L L^T) of the likelihood's own EF and GGN factors; the ratio
    applies its curvature scales (the temperature cancels, sigma does not)."""
    categorical = isinstance(likelihood, CategoricalLikelihood)
    net = nn.Linear(3, 4)
    x = torch.randn(25, 3)
    y = torch.randint(0, 4, (25,)) if categorical else torch.randn(25, 4)
    with torch.no_grad():
        f = net(x)
    unit = [likelihood.term_hessian_sqrt(f, y, approx, 0, None).pow(2).sum().item() for approx in ("ef", "ggn")]
    values = {k: v.double() for k, v in likelihood.hyperparameters().items()}
    scales = [likelihood.curvature_scale(approx, values).item() for approx in ("ef", "ggn")]
    traces = curvature_traces(net, loader(x, y), likelihood)
    assert traces.tolist() == pytest.approx([*unit, 25], rel=1e-12)
    assert batch_traces(f, y, likelihood).tolist() == pytest.approx(traces.tolist(), rel=1e-12)
    expected = unit[0] * scales[0] / (unit[1] * scales[1])
    assert ratio_from_traces(traces, likelihood) == pytest.approx(expected, rel=1e-12)
    assert (scales[0] / scales[1] == pytest.approx(1.0)) == categorical


def test_ratio_equals_the_evidence_pass_diagonals_when_the_jacobian_is_the_identity():
    """f = W 1: each datum's Jacobian is the identity, so the exact parameter-space diagonals of the
    diag-EF and diag-GGN evidence passes have the output-space traces."""
    net, x, y = identity_jacobian_net()
    likelihood = CategoricalLikelihood()
    traces = []
    for approx in ("ef", "ggn"):
        evidence = LaplaceEvidence.fit(net, loader(x, y), likelihood, GaussianPrior(net), structure="diag", approx=approx)
        traces.append(sum(s.state("diag").sum().item() for s in evidence.structures))
    assert ef_curvature_ratio(net, loader(x, y), likelihood) == pytest.approx(traces[0] / traces[1], rel=1e-10)


def test_ratio_tends_to_zero_at_interpolation():
    """Labels the net predicts with a margin, fitted ever more confidently (its logits scaled up):
    r -> 0, stably."""
    net = nn.Linear(5, 3)
    x = torch.randn(400, 5)
    with torch.no_grad():
        top2 = net(x).topk(2, 1).values
        x = x[top2[:, 0] - top2[:, 1] > 0.5]  # a margin: a tie stays at ratio ~1 however far it is scaled
        y = net(x).argmax(1)
    likelihood, ratios = CategoricalLikelihood(), []
    for factor in (1.0, 4.0, 16.0, 64.0, 1000.0):
        scaled = nn.Linear(5, 3)
        with torch.no_grad():
            scaled.weight.copy_(factor * net.weight)
            scaled.bias.copy_(factor * net.bias)
        ratios.append(ef_curvature_ratio(scaled, loader(x, y, 50), likelihood))
    assert all(a > b for a, b in itertools.pairwise(ratios)), ratios
    assert ratios[0] < 1  # already more confident than calibrated on labels it predicts
    assert 0 < ratios[-2] < 1e-3 and 0 <= ratios[-1] < 1e-6  # 1 - ||p||^2 underflows naively here: no 0/0


def test_ratio_is_one_for_labels_drawn_from_the_model():
    net = nn.Linear(5, 4)
    x = torch.randn(20000, 5)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        p = (3 * net(x)).softmax(1)
        net.weight.mul_(3)
        net.bias.mul_(3)
    y = torch.multinomial(p, 1, generator=generator).squeeze(1)
    ef_n = ((nn.functional.one_hot(y, 4).double() - p) ** 2).sum(1)
    ggn_n = 1 - (p ** 2).sum(1)
    standard_error = (ef_n - ggn_n).std().item() / math.sqrt(len(y)) / ggn_n.mean().item()
    ratio = ef_curvature_ratio(net, loader(x, y, 5000), CategoricalLikelihood())
    assert abs(ratio - 1) < 4 * standard_error
    assert standard_error < 0.02  # the test can tell a calibrated model from the threshold


def test_gaussian_ratio_is_one_at_the_noise_of_the_data():
    net = nn.Linear(3, 2)
    x = torch.randn(20000, 3)
    with torch.no_grad():
        y = net(x) + 0.3 * torch.randn(20000, 2)
    ratio = ef_curvature_ratio(net, loader(x, y, 5000), GaussianLikelihood(sigma=0.3))
    assert ratio == pytest.approx(1.0, abs=4 * math.sqrt(2 / 40000))  # chi^2: variance 2 per output


def test_eval_mode_inside_and_modes_restored():
    net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    net.train()
    net[2].eval()
    x, y = torch.randn(30, 3), torch.randint(0, 3, (30,))
    first = ef_curvature_ratio(net, loader(x, y), CategoricalLikelihood())
    assert first == ef_curvature_ratio(net, loader(x, y), CategoricalLikelihood())  # no dropout
    with torch.no_grad():
        assert first == pytest.approx(categorical_by_hand(net.eval()(x), y), rel=1e-12)
    net.train()
    net[2].eval()
    assert [m.training for m in net.modules()] == [True, True, True, False]
    assert all(p.grad is None for p in net.parameters())


def test_batch_fn_and_inputs_moved_to_the_model_dtype():
    net = nn.Linear(3, 4).double()
    x, y = torch.randn(12, 3, dtype=torch.float32), torch.randint(0, 4, (12,))
    batches = [{"pixels": x[i:i + 4], "label": y[i:i + 4]} for i in range(0, 12, 4)]
    got = ef_curvature_ratio(net, batches, CategoricalLikelihood(), batch_fn=lambda b: (b["pixels"], b["label"]))
    with torch.no_grad():
        assert got == pytest.approx(categorical_by_hand(net(x.double()), y), rel=1e-12)


def test_bad_input_refused():
    net = nn.Linear(3, 4)
    data = loader(torch.randn(8, 3), torch.randint(0, 4, (8,)))
    with pytest.raises(TypeError, match="`model` must be a torch.nn.Module, got function"):
        ef_curvature_ratio(lambda x: x, data, CategoricalLikelihood())
    with pytest.raises(TypeError, match="`likelihood` must be a CategoricalLikelihood or GaussianLikelihood, got str"):
        ef_curvature_ratio(net, data, "categorical")
    with pytest.raises(TypeError, match="`batch_fn` must map a batch"):
        ef_curvature_ratio(net, data, CategoricalLikelihood(), batch_fn=3)
    with pytest.raises(ValueError, match="yielded no batch"):
        ef_curvature_ratio(net, [], CategoricalLikelihood())
    with pytest.raises(ValueError, match="labels must lie in"):
        ef_curvature_ratio(net, loader(torch.randn(8, 3), torch.full((8,), 7)), CategoricalLikelihood())
    with pytest.raises(ValueError, match="every label equals ignore_index=-100"):
        ef_curvature_ratio(net, loader(torch.randn(8, 3), torch.full((8,), -100)), CategoricalLikelihood())
    with pytest.raises(TypeError, match="not an \\(inputs, targets\\) pair"):
        ef_curvature_ratio(net, [torch.randn(4, 3)], CategoricalLikelihood())
    with pytest.raises(ValueError, match="must be the tensor \\[tr EF, tr GGN, n_data\\].*got shape \\(2,\\)"):
        ratio_from_traces(torch.ones(2), CategoricalLikelihood())
    with pytest.raises(TypeError, match="must be the tensor .* got list"):
        ratio_from_traces([1.0, 2.0, 3.0], CategoricalLikelihood())
    with pytest.raises(TypeError, match="got NoneType"):
        ratio_from_traces(torch.ones(3), None)
    with pytest.raises(TypeError, match="got str"):
        batch_traces(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), "categorical")


def test_both_traces_zero_is_ratio_zero():
    assert ratio_from_traces(torch.tensor([0.0, 0.0, 5.0]), CategoricalLikelihood()) == 0.0
    assert ratio_from_traces(torch.tensor([1.0, 4.0, 5.0]), CategoricalLikelihood()) == 0.25


def test_message_names_every_model_below_the_threshold_and_the_fix():
    ratios = {"mlp": 0.01, "cnn": 0.9, "deep": 0.2, "broken": math.nan}
    message = ef_unreliable_message(ratios)
    assert "'mlp' (ratio 0.01), 'deep' (ratio 0.2) are unreliable" in message
    assert "'cnn'" not in message and "'broken'" not in message
    assert f"below {EF_RATIO_THRESHOLD:g}" in message and 'rank_by="kron-ggn"' in message
    one = ef_unreliable_message([("mlp", 0.01)], where="callback")
    assert "'mlp' (ratio 0.01) is unreliable" in one and 'approx="ggn"' in one
    assert ef_unreliable_message({"cnn": 0.9}) == ""
    assert ef_unreliable_message({"cnn": 0.9}, threshold=0.95) != ""


def test_message_bad_input_refused():
    with pytest.raises(ValueError, match="`threshold` must be a finite number in \\(0, 1\\], got 2"):
        ef_unreliable_message({"a": 0.1}, threshold=2)
    with pytest.raises(ValueError, match="`where` must be one of \\('select_models', 'callback'\\), got 'trainer'"):
        ef_unreliable_message({"a": 0.1}, where="trainer")
    with pytest.raises(ValueError, match="curvature ratio of 'a' must be a number, got '0.1'"):
        ef_unreliable_message({"a": "0.1"})


def test_traces_of_shards_sum_to_the_traces_of_the_data():
    """What an all-reduce over processes relies on: the sums of disjoint shards add up."""
    net = nn.Linear(3, 4)
    x, y = torch.randn(30, 3), torch.randint(0, 4, (30,))
    likelihood = CategoricalLikelihood()
    shards = curvature_traces(net, loader(x[:11], y[:11]), likelihood) + curvature_traces(net, loader(x[11:], y[11:]), likelihood)
    assert shards.tolist() == pytest.approx(curvature_traces(net, loader(x, y), likelihood).tolist(), rel=1e-12)
    assert ratio_from_traces(shards, likelihood) == pytest.approx(ef_curvature_ratio(net, loader(x, y), likelihood))


def test_rescaled_ef_has_the_ggn_trace():
    net, x, y = identity_jacobian_net()
    likelihood, prior = CategoricalLikelihood(), GaussianPrior(net)
    traces = curvature_traces(net, loader(x, y), likelihood)
    stats = {approx: collect_statistics(net, loader(x, y), likelihood, prior, structure="diag", approx=approx)
             for approx in ("ef", "ggn")}
    assert rescale_empirical_fisher(stats["ef"], traces, likelihood) is stats["ef"]
    ef, ggn = (stats[a].structures[0].state("diag").sum().item() for a in ("ef", "ggn"))
    assert ef == pytest.approx(ggn, rel=1e-10)


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_rescaled_ef_evidence_is_closer_to_the_ggn_at_interpolation(structure):
    net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(600, 5)
    with torch.no_grad():
        top2 = net(x).topk(2, 1).values
        x = x[top2[:, 0] - top2[:, 1] > 0.3]  # a margin (a tie is never fitted confidently)
        net[2].weight.mul_(6)
        net[2].bias.mul_(6)
        y = net(x).argmax(1)  # labels it predicts, fitted confidently
    likelihood, data = CategoricalLikelihood(), loader(x, y, 100)
    traces = curvature_traces(net, data, likelihood)
    assert ratio_from_traces(traces, likelihood) < 0.2

    def evidence(approx, rescale=False):
        prior = GaussianPrior(net)
        stats = collect_statistics(net, data, likelihood, prior, structure=structure, approx=approx)
        if rescale:
            rescale_empirical_fisher(stats, traces, likelihood)
        return LaplaceEvidence.from_statistics(stats, likelihood, prior).optimize(solver="newton").value.item() / len(x)

    ggn, ef, rescaled = evidence("ggn"), evidence("ef"), evidence("ef", rescale=True)
    assert ef - ggn > 0.1  # the EF over-rates the confident fit
    assert abs(rescaled - ggn) < 0.1 * (ef - ggn)


def test_rescale_refuses_what_it_cannot_correct():
    net, x, y = identity_jacobian_net()
    likelihood, prior = CategoricalLikelihood(), GaussianPrior(net)
    traces = curvature_traces(net, loader(x, y), likelihood)

    def stats(structure, approx):
        return collect_statistics(net, loader(x, y), likelihood, prior, structure=structure, approx=approx)

    with pytest.raises(ValueError, match="rescales an empirical Fisher, got approx='ggn'"):
        rescale_empirical_fisher(stats("diag", "ggn"), traces, likelihood)
    full = stats("full", "ef")
    before = [v.clone() for s in full.structures for v in s.states().values()]
    with pytest.raises(ValueError, match="structure='full' cannot rescale its sums"):
        rescale_empirical_fisher(full, traces, likelihood)
    assert all(torch.equal(a, b) for a, b in zip(before, [v for s in full.structures for v in s.states().values()]))
    with pytest.raises(ValueError, match="the curvature ratio tr EF / tr GGN` must be a finite number in \\(0, inf\\)"):
        rescale_empirical_fisher(stats("diag", "ef"), torch.tensor([0.0, 0.0, 20.0]), likelihood)
    with pytest.raises(TypeError, match="takes a CategoricalLikelihood, got GaussianLikelihood"):
        rescale_empirical_fisher(stats("diag", "ef"), traces, GaussianLikelihood())
