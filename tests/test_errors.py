"""Clear errors for what a structure cannot handle, and fallbacks that are exact.

* structure='kron' on a parameterized module that is not Linear/Conv2d: ValueError naming it;
  'diag' and 'full' on the same models fall back to torch.func and match the dense reference.
* Bad option strings, MC with the EF, non-(x, y) batches, empty loaders, bad targets.
* Never silently wrong: shared or functionally reused layer weights must raise or be exact.
"""
from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence, map_loss
from tests.reference import Problem, graph_problem, hyper, loader, reference_env, rel_err, setup  # noqa: F401 (reference_env: autouse fixture)

TOL = 1e-8


class Affine(nn.Module):
    """Elementwise scale and shift: raw nn.Parameters outside Linear/Conv2d."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(1 + 0.3 * torch.randn(n))
        self.shift = nn.Parameter(0.3 * torch.randn(n))

    def forward(self, x):
        return x * self.scale + self.shift


class WithAffine(nn.Module):
    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.fc1, self.affine, self.fc2 = nn.Linear(3, 5), Affine(5), nn.Linear(5, n_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.affine(self.fc1(x))))


class WithLayerNorm(nn.Module):
    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, n_out)
        with torch.no_grad():  # away from the default (1, 0) so the norm's parameters matter
            self.norm.weight.add_(0.3 * torch.randn(5))
            self.norm.bias.add_(0.3 * torch.randn(5))

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class TopLevelGain(nn.Module):
    """A raw parameter owned by the top-level module itself."""

    def __init__(self, n_out: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 5), nn.Linear(5, n_out)
        self.gain = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.gain


CUSTOM = {"affine": WithAffine, "norm": WithLayerNorm, "gain": TopLevelGain}


def custom_case(name: str, kind: str, n: int = 24):
    torch.manual_seed(1)
    n_out = 2 if kind == "regression" else 3
    model = CUSTOM[name](n_out).double()
    x = torch.randn(n, 3)
    if kind == "regression":
        with torch.no_grad():
            y = model(x) + 0.5 * torch.randn(n, n_out)
    else:
        y = torch.randint(0, n_out, (n,))
    return model, x, y


@pytest.mark.parametrize("name", list(CUSTOM))
def test_kron_gives_other_modules_exact_diagonal_blocks_and_names_them(name):
    """Issue 9: kron never refuses a network; a parameter outside Linear/Conv/Embedding/norm
    layers takes the exact path (named in a warning) and gets an exact diagonal block."""
    model, x, y = custom_case(name, "regression")
    prior, lik = hyper(model, "regression")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
    msg = " ".join(str(w.message) for w in caught)
    if name == "gain":  # owned by the top-level module
        assert "top-level module" in msg and "TopLevelGain" in msg, msg
    elif name == "affine":
        assert "exact per-example path" in msg and f"'{name}'" in msg, msg
    else:  # LayerNorm: an exact diagonal from its hooks, no slow path
        assert msg == "", msg
    expected = graph_problem(model, x, y, "regression").reference("kron", "ggn").evaluate(prior, lik)
    assert rel_err(ev.log_marglik(), expected["log_marglik"]) <= TOL


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "full"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
@pytest.mark.parametrize("name", list(CUSTOM))
def test_diag_and_full_fall_back_exactly(name, kind, structure, approx):
    model, x, y = custom_case(name, kind)
    prior, lik = hyper(model, kind, "layerwise")
    ev = LaplaceEvidence.fit(model, loader(x, y, 10), lik, prior, structure=structure, approx=approx)
    expected = Problem(model, prior.param_names, x, y, kind).reference(structure, approx).evaluate(prior, lik)
    for piece in ("log_det", "log_marglik", "log_prior", "log_likelihood"):
        assert rel_err(getattr(ev, piece)(), expected[piece]) <= TOL, piece


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("frozen", ["0.bias", "4.bias", "2.weight"])
def test_partially_frozen_layers(frozen, structure):
    """A frozen tensor is outside the prior; the rest must still be exact. A frozen weight with a
    trainable bias has no Kronecker form: kron may refuse it with a ValueError."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    dict(model.named_parameters())[frozen].requires_grad_(False)
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    prior, lik = hyper(model, "classification", "layerwise")
    assert frozen not in prior.param_names
    try:
        ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure=structure)
    except ValueError as err:
        assert structure == "kron" and frozen.endswith("weight") and "'2'" in str(err), err
        return
    expected = Problem(model, prior.param_names, x, y, "classification").reference(structure, "ggn").evaluate(prior, lik)
    assert rel_err(ev.log_marglik(), expected["log_marglik"]) <= TOL
    assert rel_err(ev.log_det(), expected["log_det"]) <= TOL


def test_kron_with_diagonal_prior_raises():
    model, x, y, _ = setup("mlp_small", "regression")
    with pytest.raises(ValueError, match="[Dd]iagonal"):
        LaplaceEvidence.fit(model, loader(x, y), GaussianLikelihood(), GaussianPrior(model, structure="diagonal"), "kron")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"structure": "dense"},
        {"structure": "kfac"},
        {"structure": None},
        {"approx": "fisher"},
        {"approx": "ef", "mc_samples": 4},  # MC sampling applies to the GGN only
        {"mc_samples": -1},
        {"mc_samples": 1.5},
    ],
)
def test_bad_options_raise_value_error(kwargs):
    model, x, y, _ = setup("mlp_small", "regression")
    with pytest.raises(ValueError):
        LaplaceEvidence.fit(model, loader(x, y), GaussianLikelihood(), GaussianPrior(model), **kwargs)


def test_option_values_are_case_insensitive_and_near_misses_are_named():
    """``structure="Kron"`` and ``approx="GGN"`` are the options they spell (issue 26 item 8); ``"kfac"``
    is refused with the value meant."""
    model, x, y, _ = setup("mlp_small", "regression")
    data, prior = loader(x, y), GaussianPrior(model)
    spelled = LaplaceEvidence.fit(model, data, GaussianLikelihood(), prior, structure="Kron", approx="GGN")
    canonical = LaplaceEvidence.fit(model, data, GaussianLikelihood(), prior, structure="kron", approx="ggn")
    assert spelled.structure == "kron" and spelled.approx == "ggn"
    assert torch.equal(spelled.log_marglik(), canonical.log_marglik())
    with pytest.raises(ValueError, match=r"got 'kfac' \(did you mean 'kron'\?\)"):
        LaplaceEvidence.fit(model, data, GaussianLikelihood(), prior, structure="kfac")


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("batches", ["inputs_only", "triples", "dicts", "bare_tensors"])
def test_non_pair_batches_raise_type_error(batches, structure):
    model, x, y, _ = setup("mlp_small", "regression")
    data = {
        "inputs_only": DataLoader(TensorDataset(x), batch_size=8),
        "triples": DataLoader(TensorDataset(x, y, torch.ones(len(x))), batch_size=8),
        "dicts": [{"x": x[:8], "y": y[:8]}],
        "bare_tensors": [x[:8], x[8:16]],
    }[batches]
    with pytest.raises(TypeError):
        LaplaceEvidence.fit(model, data, GaussianLikelihood(), GaussianPrior(model), structure=structure)


def test_empty_loader_raises():
    model, x, y, _ = setup("mlp_small", "regression")
    with pytest.raises(ValueError):
        LaplaceEvidence.fit(model, [], GaussianLikelihood(), GaussianPrior(model), structure="diag")


@pytest.mark.parametrize(
    "kind,target",
    [
        ("classification", lambda n: torch.zeros(n)),  # float labels
        ("classification", lambda n: torch.zeros(n, 3, dtype=torch.long)),  # one-hot-like shape
        ("regression", lambda n: torch.zeros(n, 3)),  # wrong number of outputs
    ],
)
def test_bad_targets_raise_value_error(kind, target):
    model, x, _, _ = setup("mlp_small", kind)
    lik = GaussianLikelihood() if kind == "regression" else CategoricalLikelihood()
    with pytest.raises(ValueError):
        LaplaceEvidence.fit(model, loader(x, target(len(x))), lik, GaussianPrior(model), structure="diag")


def test_prior_of_another_model_or_partial_prior_raises():
    model, x, y, _ = setup("mlp_small", "regression")
    other = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    with pytest.raises(ValueError):
        LaplaceEvidence.fit(model, loader(x, y), GaussianLikelihood(), GaussianPrior(other), structure="diag")
    partial = GaussianPrior(model[0])  # covers the first layer only; the last still requires grad
    with pytest.raises(ValueError):
        LaplaceEvidence.fit(model, loader(x, y), GaussianLikelihood(), partial, structure="diag")


# --- never silently wrong ----------------------------------------------------------------------


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


class FunctionalReuse(nn.Module):
    """fc1.weight is used by its layer AND functionally (weight tying): a forward hook on fc1
    sees only the first use."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h) + F.linear(h, self.fc1.weight)[:, :2]


class FunctionalOnly(nn.Module):
    """fc2 is an nn.Linear whose parameters are used only through F.linear: its hook never fires."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x):
        return F.linear(torch.tanh(self.fc1(x)), self.fc2.weight, self.fc2.bias)


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("cls", [CalledTwice, FunctionalReuse, FunctionalOnly])
def test_reused_weights_are_exact(cls, structure):
    """Hooks cannot see every use of a weight: such a parameter takes the exact path (an exact
    diagonal block under kron), found from the autograd graph."""
    torch.manual_seed(2)
    model = cls().double()
    x = torch.randn(12, 3)
    with torch.no_grad():
        y = model(x) + 0.5 * torch.randn(12, model(x).shape[1])
    prior, lik = hyper(model, "regression", "layerwise")
    data = loader(x, y, 5)
    ev = LaplaceEvidence.fit(model, data, lik, prior, structure=structure)
    expected = graph_problem(model, x, y, "regression").reference(structure, "ggn").evaluate(prior, lik)
    assert rel_err(ev.log_det(), expected["log_det"]) <= TOL


def test_float32_rounding_is_not_taken_for_a_reused_weight():
    """The reuse check compares two float32 gradient sums over many conv positions: rounding only."""
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )
    data = [(torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,)))]
    ev = LaplaceEvidence.fit(net, data, CategoricalLikelihood(), GaussianPrior(net), "kron", "ef")
    assert torch.isfinite(ev.log_marglik())


# --- issue 17 items 2, 6, 7: one N for the MAP loss and the evidence; no datum; label dtypes ------


def _classification(n: int = 24, seq: int = 0, seed: int = 0):
    """A small classifier and its data: (B, C) logits, or (B, T, C) with a quarter of the labels -100."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4))
    x = torch.randn((n, seq, 3) if seq else (n, 3), generator=g)
    y = torch.randint(0, 4, x.shape[:-1], generator=g)
    if seq:
        y[torch.rand(y.shape, generator=g) < 0.25] = -100
    return net, x, y


def test_map_loss_takes_n_from_the_evidence_and_warns_once_on_another():
    net, x, y = _classification()
    prior, lik = GaussianPrior(net, precision=2.0), CategoricalLikelihood()
    with pytest.raises(ValueError, match=r"not counted yet: train with MargLikCallback.*pass `n_data=`"):
        map_loss(net(x), y, lik, prior)
    explicit = map_loss(net(x), y, lik, prior, 24)  # a plain loop before the first evidence: its own N
    LaplaceEvidence.fit(net, loader(x, y, 8), lik, prior, structure="diag")
    assert int(prior.n_data) == 24
    assert torch.equal(map_loss(net(x), y, lik, prior), explicit)
    with pytest.warns(UserWarning, match=r"map_loss\(n_data=48\), but the evidence counts N=24 data.*0.5x as strong"):
        wrong = map_loss(net(x), y, lik, prior, 48)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(map_loss(net(x), y, lik, prior, 48), wrong)  # once per prior
    assert wrong < explicit  # the explicit value is used


@pytest.mark.parametrize("seq", [0, 5])
def test_map_loss_names_a_count_of_data_that_cannot_be_the_training_sets(seq):
    """``n_data`` must be an int (NumPy's, or a one-element integer tensor, too) of at least the batch's own count of
    data (its kept positions)."""
    net, x, y = _classification(seq=seq)
    prior, lik = GaussianPrior(net), CategoricalLikelihood()
    kept = int((y != -100).sum())
    expected = map_loss(net(x), y, lik, prior, kept)
    for same in (np.int64(kept), torch.tensor(kept)):  # NumPy's int; a one-element tensor, as the prior's n_data
        assert torch.equal(map_loss(net(x), y, lik, prior, same), expected)
    for bad in ("24", 24.0, 2.5, 0, True, torch.tensor(24.0)):
        refused = r"`n_data` must be an int >= 1 \(the training set size N\), got " + re.escape(repr(bad))
        with pytest.raises(ValueError, match=refused):
            map_loss(net(x), y, lik, prior, bad)
    with pytest.raises(ValueError, match=rf"map_loss\(n_data={kept - 1}\), but this batch alone holds {kept} data"):
        map_loss(net(x), y, lik, prior, kept - 1)  # e.g. the number of sequences where N counts positions


def test_map_loss_and_the_prior_name_arguments_given_in_the_wrong_place():
    net, x, y = _classification()
    prior, lik = GaussianPrior(net), CategoricalLikelihood()
    with pytest.raises(TypeError, match=r"got a GaussianPrior as `likelihood` and a CategoricalLikelihood as `prior`"):
        map_loss(net(x), y, prior, lik, 24)
    with pytest.raises(TypeError, match=r"pass the nn.Module \(e.g. GaussianPrior\(net\)\), got generator"):
        GaussianPrior(net.parameters())
    for precision in ([1.0, 2.0], torch.ones(4), "1", math.nan, 0.0):
        with pytest.raises(ValueError, match=r"`precision` must be a finite number in \(0, inf\)"):
            GaussianPrior(net, precision=precision)
    for precision in (np.float32(2.0), torch.tensor(2.0)):  # one number, of NumPy or torch
        assert GaussianPrior(net, precision=precision).precision.tolist() == [2.0] * 4


def test_a_single_logit_is_refused_by_the_categorical_likelihood():
    """A softmax over one logit is 1 whatever the weights: the loss would be 0 and nothing learned."""
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1))
    x, y = torch.randn(24, 3), torch.zeros(24, dtype=torch.long)
    prior, lik = GaussianPrior(net), CategoricalLikelihood()
    with pytest.raises(ValueError, match=r"needs at least 2 classes, got logits of shape \(24, 1\).*return 2 logits"):
        map_loss(net(x), y, lik, prior, 24)
    with pytest.raises(ValueError, match=r"needs at least 2 classes"):
        LaplaceEvidence.fit(net, loader(x, y, 8), lik, prior)
    with pytest.raises(ValueError, match=r"regression targets: .*GaussianLikelihood.*For binary classification return 2"):
        map_loss(net(x), y.float(), lik, prior, 24)  # a sigmoid's 0./1. targets


@pytest.mark.parametrize("backend", ["hooks", "backpack"])
def test_data_that_are_not_batches_are_named_with_the_fix(backend):
    if backend == "backpack":
        pytest.importorskip("backpack")
    net, x, y = _classification()
    prior, lik = GaussianPrior(net), CategoricalLikelihood()
    with pytest.raises(TypeError, match=r"The data are a TensorDataset, .*DataLoader\(dataset, batch_size=256\)"):
        LaplaceEvidence.fit(net, TensorDataset(x, y), lik, prior, backend=backend)
    for pair in ((x, y), [x, y]):
        with pytest.raises(TypeError, match=r"one \(inputs, targets\) pair of tensors.*pass \[\(x, y\)\]"):
            LaplaceEvidence.fit(net, pair, lik, prior, backend=backend)
    single = LaplaceEvidence.fit(net, [(x, y)], lik, prior, backend=backend)  # what the message asks for
    assert torch.isfinite(single.log_marglik())


def test_prior_count_of_data_is_saved_and_old_state_dicts_load():
    net, x, y = _classification(seq=5)
    prior = GaussianPrior(net)
    evidence = LaplaceEvidence.fit(net, loader(x, y, 8), CategoricalLikelihood(), prior, structure="diag")
    assert int(prior.n_data) == evidence.n_data == int((y != -100).sum())
    state = prior.state_dict()
    fresh, lik = GaussianPrior(net), CategoricalLikelihood()
    fresh.load_state_dict(state)
    assert int(fresh.n_data) == evidence.n_data
    assert torch.equal(map_loss(net(x), y, lik, fresh), map_loss(net(x), y, lik, prior, evidence.n_data))
    old = {k: v for k, v in state.items() if k != "n_data"}  # saved before N was stored
    fresh.load_state_dict(old)
    assert int(fresh.n_data) == 0
    with pytest.raises(ValueError, match="not counted yet"):
        map_loss(net(x), y, lik, fresh)


def test_evidence_of_data_without_a_datum_raises():
    net, x, y = _classification(seq=5)
    with pytest.raises(ValueError, match=r"no datum \(n_data = 0\): every label equals ignore_index=-100"):
        LaplaceEvidence.fit(net, loader(x, torch.full_like(y, -100), 8), CategoricalLikelihood(), GaussianPrior(net), "diag")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
@pytest.mark.parametrize("structure,approx", [("kron", "ggn"), ("diag", "ef"), ("full", "ggn")])
def test_every_integer_label_dtype_gives_the_int64_results(dtype, structure, approx):
    """Labels of any integer dtype are int64 labels: the same evidence and MAP loss, bit for bit."""
    net, x, y = _classification(seq=0 if dtype == torch.uint8 else 5)  # uint8 cannot hold -100
    results = {}
    for labels in (y, y.to(dtype)):
        prior, lik = GaussianPrior(net, precision=0.5), CategoricalLikelihood()
        evidence = LaplaceEvidence.fit(net, loader(x, labels, 8), lik, prior, structure=structure, approx=approx)
        results[labels.dtype] = (evidence.log_marglik(), evidence.n_data, map_loss(net(x), labels, lik, prior, evidence.n_data))
    assert results[dtype][1] == results[torch.int64][1]
    assert torch.equal(results[dtype][0], results[torch.int64][0])
    assert torch.equal(results[dtype][2], results[torch.int64][2])


@pytest.mark.parametrize(
    "kind,output_shape,target_shape",
    [
        ("gaussian", (6, 1), (6,)),
        ("gaussian", (6, 1), (6, 1)),
        ("gaussian", (6, 4, 3), (6, 4, 3)),
        ("gaussian", (6, 4, 1), (6, 4)),
        ("categorical", (6, 5), (6,)),
        ("categorical", (6, 4, 5), (6, 4)),
    ],
)
def test_count_from_the_targets_alone_equals_the_count_with_the_outputs(kind, output_shape, target_shape):
    """The callback counts N at set-up from targets only, with the outputs of another batch (other
    leading sizes) for the number of outputs: the count (and the checks) of the evidence pass."""
    if kind == "gaussian":
        lik, target = GaussianLikelihood(), torch.randn(target_shape)
    else:
        lik = CategoricalLikelihood()
        target = torch.randint(0, output_shape[-1], target_shape, dtype=torch.int32)
        target[torch.rand(target_shape) < 0.3] = -100
    other_batch = torch.randn(2, *[s + 1 for s in output_shape[1:-1]], output_shape[-1])
    assert lik.count_targets(target, other_batch) == lik.count(torch.randn(output_shape), target)
    with pytest.raises(ValueError):  # a target that does not fit is refused as in the evidence pass
        lik.count_targets(target.unsqueeze(-1).expand(*target.shape, 2).double(), other_batch)
