"""The engine under real conditions: precision, reuse detection, divergence, memory, training tricks.

Each test names the issue item it guards (issue 8: reliability; issue 13: training tricks).
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence
from tests.test_errors import FunctionalReuse
from tests.reference import Problem, graph_problem, hyper, loader, reference_env, rel_err, setup  # noqa: F401 (reference_env: autouse fixture)

STRUCTURES = ["diag", "kron", "full"]


def regression_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 2))


# --- issue 8.4: statistics in float64, counts as integers ----------------------------------------


@pytest.mark.parametrize("structure", STRUCTURES)
def test_float32_evidence_equals_float64_at_50k_examples(structure):
    torch.manual_seed(0)
    net64 = regression_net()
    x = torch.randn(50_000, 4)
    with torch.no_grad():
        y = net64(x) + 0.1 * torch.randn(50_000, 2)
    values = {}
    for dtype in (torch.float64, torch.float32):
        net = copy.deepcopy(net64).to(dtype)
        data = DataLoader(TensorDataset(x.to(dtype), y.to(dtype)), batch_size=1000)
        # sigma = 0.1: a sharply peaked likelihood where float32 sums lose digits
        ev = LaplaceEvidence.fit(net, data, GaussianLikelihood(sigma=0.1), GaussianPrior(net), structure=structure)
        assert ev.n_data == 50_000
        values[dtype] = ev.log_marglik()
    assert values[torch.float32].dtype == torch.float64
    assert rel_err(values[torch.float32], values[torch.float64]) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_counts_every_example(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)
    x, y = torch.randn(5000, 3).to(dtype), torch.randint(0, 3, (5000,))
    ev = LaplaceEvidence.fit(net, DataLoader(TensorDataset(x, y), batch_size=500), CategoricalLikelihood(), GaussianPrior(net), "diag", "ef")
    assert ev.n_data == 5000  # bf16 would count 4864, fp16 stops at 2048
    assert torch.isfinite(ev.log_marglik())


# --- issue 8.6: a weight used outside its layer is found from the graph, not from values ------


def test_reuse_detection_does_not_depend_on_data_values():
    """EF with a first batch whose residuals are exactly zero: a value-based check sees nothing there."""
    torch.manual_seed(2)
    model = FunctionalReuse()
    x = torch.randn(16, 3)
    with torch.no_grad():
        y = model(x) + 0.5 * torch.randn(16, 2)
        y[:8] = model(x[:8])  # zero residual on the first batch
    prior, lik = hyper(model, "regression", "layerwise")
    expected = Problem(model, prior.param_names, x, y, "regression").reference("diag", "ef").evaluate(prior, lik)
    for order in (torch.arange(16), torch.arange(16).flip(0)):
        ev = LaplaceEvidence.fit(model, loader(x[order], y[order], 8), lik, prior, structure="diag", approx="ef")
        assert rel_err(ev.log_det(), expected["log_det"]) <= 1e-8
        assert "fc1" in ev.slow and "outside its forward call" in ev.slow["fc1"]


# --- issue 8.9: divergence gives a NaN estimate under every structure, never a LinAlgError ----


@pytest.mark.parametrize("structure", STRUCTURES)
def test_non_finite_curvature_gives_nan_not_an_error(structure):
    net = regression_net()
    x, y = torch.randn(20, 4), torch.randn(20, 2)
    with torch.no_grad():
        next(net.parameters())[0, 1] = float("nan")  # weights a diverged training left (NaN data are named instead)
    with pytest.warns(UserWarning, match="not finite at the model's current weights"):
        ev = LaplaceEvidence.fit(net, loader(x, y, 8), GaussianLikelihood(), GaussianPrior(net), structure=structure)
    assert math.isnan(ev.log_marglik().item())
    solution = ev.optimize(steps=5)
    assert all(torch.equal(v, ev.hyperparameters()[k].double()) for k, v in solution.values.items())


@pytest.mark.parametrize("n", [10, 80])  # fewer rows than parameters (determinant lemma), and more (Gram)
@pytest.mark.parametrize("prior_structure", ["scalar", "layerwise", "diagonal"])
def test_failed_factorisation_at_extreme_hyperparameters_is_nan(prior_structure, n):
    """full: precisions of 1e-300 and a curvature scale of 1e300 break the factorisation: NaN, not a raise (values
    beyond what the constructors and set_hyperparameters take, written into the buffers)."""
    net = regression_net()
    x, y = torch.randn(n, 4), torch.randn(n, 2)
    prior, likelihood = GaussianPrior(net, structure=prior_structure), GaussianLikelihood()
    with torch.no_grad():
        prior.log_precision.fill_(math.log(1e-300))
        likelihood.log_sigma.fill_(math.log(1e-150))
    ev = LaplaceEvidence.fit(net, loader(x, y, 8), likelihood, prior, structure="full")
    assert (ev.structures[0].gram is None) == (2 * n < prior.n_params)
    value = ev.log_marglik().item()  # never an exception
    if prior_structure == "scalar" and ev.structures[0].gram is not None:
        assert value < -1e300  # eigenvalues of the Gram matrix: no factorisation to fail
    else:
        assert not math.isfinite(value)


# --- issue 8.11: the full structure refuses before allocating what it cannot hold ------------------


def test_full_structure_refuses_above_its_memory_limit():
    net = nn.Sequential(nn.Linear(1000, 2000), nn.Tanh(), nn.Linear(2000, 10)).float()  # P ~ 2M
    data = [(torch.randn(4, 1000), torch.randint(0, 10, (4,)))]
    with pytest.raises(ValueError, match=r"structure='full' needs about .* GiB for P=2,022,010 .*'kron' or 'diag'"):
        LaplaceEvidence.fit(net, data, CategoricalLikelihood(), GaussianPrior(net), structure="full")


# --- issue 10.3: the exact softmax GGN needs C - 1 columns -----------------------------------


def test_exact_categorical_factor_has_c_minus_one_columns():
    logits = 3 * torch.randn(7, 5)
    factor = CategoricalLikelihood().hessian_sqrt(logits, torch.zeros(7, dtype=torch.long), "ggn", 0, None)
    probs = logits.softmax(1)
    assert factor.shape == (7, 5, 4)
    lam = torch.diag_embed(probs) - probs.unsqueeze(2) * probs.unsqueeze(1)
    assert (factor @ factor.transpose(1, 2) - lam).abs().max() < 1e-14


# --- issue 54: a vocabulary's logits are not copied to drop ignored positions ----------------------


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("ignored", [(4, 7), (0, 2, 4, 5, 7, 9)], ids=["padding", "masked prompts"])
@pytest.mark.parametrize("approx, mc_samples", [("ggn", 0), ("ggn", 2), ("ef", 0)])
def test_ignored_positions_never_reach_the_likelihoods_sums_whatever_their_outputs(approx, mc_samples, ignored, layout):
    """With few ignored rows the statistics and the NLL are computed row by row and the ignored rows dropped after
    (no copy of the outputs), with many on the kept rows' copy; the factor's ignored rows are zeroed in place. Either
    way, and whether the outputs' rows are contiguous or strided (a network whose last op transposes), the kept rows'
    values must be those of the kept rows alone, bit for bit, and an ignored row's outputs (here inf and nan, as
    padding may give) must not reach a sum, a factor column or a gradient."""
    lik = CategoricalLikelihood()
    logits = 3 * torch.randn(10, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (10,))
    labels[list(ignored)] = -100
    logits[ignored[0], 2], logits[ignored[1]] = math.inf, math.nan
    if layout == "transposed":  # strided rows: computed in place of the copy's contiguous ones
        logits = logits.T.contiguous().T
    kept = labels != -100

    stats, alone = lik.statistics(logits, labels), lik.statistics(logits[kept], labels[kept])
    assert stats.keys() == alone.keys() and all(torch.equal(stats[k], alone[k]) for k in stats)
    assert torch.equal(lik.nll(logits, labels), lik.nll(logits[kept], labels[kept]))

    factor = lik.hessian_sqrt(logits, labels, approx, mc_samples, torch.Generator().manual_seed(0))
    rows = lik.term_hessian_sqrt(logits, labels.clamp(min=0), approx, mc_samples, torch.Generator().manual_seed(0))
    assert torch.equal(factor[~kept], torch.zeros_like(factor[~kept])) and torch.equal(factor[kept], rows[kept])

    with_grad = logits.clone().requires_grad_()
    loss = lik.nll(with_grad, labels).sum()
    loss.backward()
    assert torch.equal(loss.detach(), lik.nll(logits[kept], labels[kept]).sum()) and torch.isfinite(with_grad.grad).all()


# --- issue 13: torch.compile, activation checkpointing, parametrized weights ---------------------


class Blocks(nn.Module):
    def __init__(self, use_checkpoint: bool = False, reentrant: bool = False) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh())
        self.head = nn.Linear(8, 2)
        self.use_checkpoint, self.reentrant = use_checkpoint, reentrant

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=self.reentrant) if self.use_checkpoint else self.block(x)
        return self.head(h)


class Wrapped(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


def _evidence(model, structure, data):
    prior, lik = hyper(model, "regression", "layerwise")
    return LaplaceEvidence.fit(model, data, lik, prior, structure=structure).log_marglik()


@pytest.mark.parametrize("structure", STRUCTURES)
def test_compiled_and_checkpointed_networks_give_the_plain_evidence(structure):
    torch.manual_seed(0)
    plain = Blocks()
    x, y = torch.randn(20, 4), torch.randn(20, 2)
    data = loader(x, y, 8)
    checkpointed = Blocks(use_checkpoint=True)
    checkpointed.load_state_dict(plain.state_dict())
    inner = Blocks()
    inner.load_state_dict(plain.state_dict())
    compiled = Wrapped(torch.compile(inner, backend="eager"))
    compiled(x)  # compiled once, as training would
    expected = _evidence(Wrapped(plain), structure, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slow path, no "used outside its forward call"
        for model in (Wrapped(checkpointed), compiled):
            assert rel_err(_evidence(model, structure, data), expected) <= 1e-8


@pytest.mark.parametrize("structure", STRUCTURES)
def test_reentrant_checkpointing_is_refused_with_the_fix(structure):
    """use_reentrant=True runs the block without gradients: zeros would be silently wrong, so refuse."""
    model = Blocks(use_checkpoint=True, reentrant=True)
    x, y = torch.randn(12, 4), torch.randn(12, 2)
    with pytest.raises(ValueError, match=r"use_reentrant=False"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own note that no input requires grad
        _evidence(model, structure, loader(x, y, 6))


class Scaled(nn.Module):
    """A parametrization that is the identity up to a constant: the tensor it is computed from is the weight / 2."""

    def forward(self, weight):
        return 2 * weight


@pytest.mark.parametrize("structure", STRUCTURES)
def test_parametrized_weights_take_the_exact_path_with_a_warning(structure):
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    x, y = torch.randn(20, 4), torch.randn(20, 2)
    model = Blocks()
    parametrize.register_parametrization(model.head, "weight", Scaled())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prior, lik = hyper(model, "regression", "layerwise")
        ev = LaplaceEvidence.fit(model, loader(x, y, 8), lik, prior, structure=structure)
    expected = Problem(model, prior.param_names, x, y, "regression")
    if structure != "kron":
        assert rel_err(ev.log_marglik(), expected.reference(structure, "ggn").evaluate(prior, lik)["log_marglik"]) <= 1e-8
    messages = " ".join(str(w.message) for w in caught)
    if structure != "full":
        assert "head.parametrizations.weight" in messages and "parametrized weight" in messages
    assert torch.isfinite(ev.log_marglik())


# --- found by the examples: the exact path next to hooked layers, broadcast embeddings ------------


class GainBetweenLayers(nn.Module):
    """A raw parameter on the exact path between two hooked layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 5), nn.Linear(5, 2)
        self.gain = nn.Parameter(torch.ones(5) + 0.1 * torch.randn(5))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)) * self.gain)


@pytest.mark.parametrize("solver", ["adam", "newton"])
@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_exact_path_statistics_carry_no_graph_into_the_steps(structure, solver):
    torch.manual_seed(0)
    model = GainBetweenLayers()
    x, y = torch.randn(16, 3), torch.randn(16, 2)
    prior, lik = hyper(model, "regression", learn=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-path note for `gain`
        ev = LaplaceEvidence.fit(model, loader(x, y, 8), lik, prior, structure=structure)
    assert not any(t.requires_grad for s in ev.structures for t in s.states().values())
    solution = ev.optimize(steps=3, solver=solver)  # used to backpropagate into the network
    assert solution.value >= ev.log_marglik()


class PositionalTokens(nn.Module):
    """Token plus positional embedding; the positions are ``arange(T)`` broadcast over the batch
    (``broadcast=True``) or an explicit ``(B, T)`` index (the same function)."""

    def __init__(self, broadcast: bool) -> None:
        super().__init__()
        self.tokens, self.positions, self.head = nn.Embedding(7, 4), nn.Embedding(5, 4), nn.Linear(4, 3)
        self.broadcast = broadcast

    def forward(self, ids):
        steps = torch.arange(ids.shape[1])
        positions = self.positions(steps if self.broadcast else steps.expand_as(ids))
        return self.head(torch.tanh(self.tokens(ids) + positions).mean(1))


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_embedding_broadcast_over_the_batch_takes_the_exact_path(structure):
    torch.manual_seed(0)
    explicit = PositionalTokens(broadcast=False)
    broadcast = PositionalTokens(broadcast=True)
    broadcast.load_state_dict(explicit.state_dict())
    ids, y = torch.randint(0, 7, (20, 5)), torch.randint(0, 3, (20,))
    reference = graph_problem(explicit, ids, y, "classification")
    values = []
    for model in (explicit, broadcast):
        prior, lik = hyper(model, "classification")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ev = LaplaceEvidence.fit(model, loader(ids, y, 8), lik, prior, structure=structure)
        values.append(ev.log_marglik())
    assert "does not lead with the batch dimension" in " ".join(str(w.message) for w in caught)
    if structure == "diag":  # exact either way: the same evidence
        expected = reference.reference("diag", "ggn").evaluate(*hyper(explicit, "classification"))["log_marglik"]
        assert rel_err(values[0], expected) <= 1e-8 and rel_err(values[1], expected) <= 1e-8


def test_learned_temperature_has_no_finite_optimum_and_warns():
    """The tempered likelihood is not normalized: the best evidence at a fixed T keeps rising with T."""
    model, x, y, _ = setup("mlp_small", "classification")
    best = []
    for log_t in (0.0, 5.0, 10.0):
        prior = GaussianPrior(model, structure="scalar")
        lik = CategoricalLikelihood(temperature=math.exp(log_t))
        ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
        best.append(ev.optimize(solver="newton").value.item())
    assert best[0] < best[1] < best[2] < 0
    with pytest.warns(UserWarning, match="no finite optimum"):
        CategoricalLikelihood(learn_temperature=True)


# --- fixed precision groups (the BatchNorm runaway of the ResNet example and the ranking study) -----


@pytest.mark.parametrize("prior_structure", ["layerwise", "diagonal"])
@pytest.mark.parametrize("solver", ["adam", "newton"])
def test_fixed_groups_keep_their_precision_and_the_rest_is_optimized(prior_structure, solver):
    model, x, y, _ = setup("mlp_deep", "classification")
    lik = CategoricalLikelihood()
    free = GaussianPrior(model, precision=0.5, structure=prior_structure)
    fixed = GaussianPrior(model, precision=0.5, structure=prior_structure, fixed=["0.*", "4.bias"])
    assert fixed.fixed == ["0.weight", "0.bias", "4.bias"]
    mask = fixed.learned_groups()
    assert int((~mask).sum()) == (3 if prior_structure == "layerwise" else 4 * 6 + 6 + 3)
    ev_free = LaplaceEvidence.fit(model, loader(x, y), lik, free, "kron" if prior_structure == "layerwise" else "diag")
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, fixed, "kron" if prior_structure == "layerwise" else "diag")
    # the gradient of the learned groups is the free prior's gradient there
    assert torch.allclose(ev.gradient()["log_precision"], ev_free.gradient()["log_precision"][mask], rtol=1e-12)
    solution = ev.optimize(steps=50, solver=solver)
    ev.set_hyperparameters(solution.values)
    assert torch.equal(fixed.log_precision[~mask], torch.full_like(fixed.log_precision[~mask], math.log(0.5)))
    assert (fixed.log_precision[mask] != math.log(0.5)).all()
    assert solution.value >= ev_free.log_marglik()  # the start was the same point


def test_fixed_patterns_are_checked():
    model, *_ = setup("mlp_deep", "classification")
    with pytest.raises(ValueError, match=r"`fixed` patterns \['conv\*'\] match no trainable parameter"):
        GaussianPrior(model, fixed=["conv*"])
    with pytest.raises(ValueError, match="structure='layerwise'"):
        GaussianPrior(model, structure="scalar", fixed=["0.weight"])


# --- what a hurried user passes to the new API ------------------------------------------------------


def test_hurried_inputs_to_the_new_api_get_clear_errors():
    model, x, y, _ = setup("mlp_small", "classification")
    prior, lik = GaussianPrior(model), CategoricalLikelihood()
    with pytest.raises(TypeError, match="`batch_fn` must map a batch"):
        LaplaceEvidence.fit(model, loader(x, y), lik, prior, batch_fn="marglik_batch")
    with pytest.raises(ValueError, match="`ignore_index` must be an int"):
        CategoricalLikelihood(ignore_index=-100.0)
    with pytest.raises(ValueError, match="`fixed` must be parameter names"):
        GaussianPrior(model, fixed=[0])
    assert GaussianPrior(model, fixed=None).fixed == [] and GaussianPrior(model, fixed="0.bias").fixed == ["0.bias"]
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\) or equal ignore_index=-100, got values in \[0, 7\]"):
        LaplaceEvidence.fit(model, loader(x, torch.where(y == 1, 7, y)), lik, prior, structure="diag")
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
    before = prior.log_precision.clone()
    with pytest.raises(ValueError, match=r"'log_precision' has shape \(4,\), got \(3,\)"):
        ev.set_hyperparameters({"log_precision": torch.zeros(3)})
    with pytest.raises(ValueError, match="Unknown hyperparameter 'log_sigma'"):
        ev.set_hyperparameters({"log_sigma": torch.zeros(())})
    assert torch.equal(prior.log_precision, before)  # nothing written
