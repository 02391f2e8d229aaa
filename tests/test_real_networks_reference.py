"""The evidence on real module graphs against the general-graph dense reference (tests/reference.py).

Library vs reference (relative error <= 1e-8 on log|H|, the log marglik and its gradients in the
log hyperparameters, plus ``n_data``), on the networks of tests/real_networks.py: BatchNorm/residual
CNN, LayerNorm MLP, token models (Embedding + GroupNorm/LayerNorm), Conv1d, grouped/strided/dilated
Conv2d, sequence outputs (B, T, C) with ignored positions, dict inputs, frozen backbones, LoRA,
tied/reused weights; every structure (kron = hybrid Kronecker + exact diagonal blocks, diag, full)
x approximation (ggn, ef) x likelihood (Gaussian, categorical). Also:

* frozen backbone == the head alone on the backbone's features;
* sequence outputs: ignored positions count nowhere (n_data = kept positions), any ignore_index;
* dict inputs == tuple inputs == ``batch_fn`` on HF-style dict batches == the tensor-input twin.

Self-checks of the reference itself (no library): the general-graph Kronecker blocks equal the
Sequential ones, hand-derived factors of small Linear/Embedding networks, single-row layers whose
Kronecker block is the exact dense block (Linear, padded/strided Conv1d, grouped/dilated Conv2d,
Embedding), the module eligibility rules, and sequence-output curvature from per-position autograd.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev
from torch.nn import functional as F

from tests.real_networks import IGNORE, N_OUT, NETWORKS, batches, make_case
from tests.test_errors import FunctionalOnly, FunctionalReuse
from tests.reference import (  # noqa: F401 (reference_env: autouse fixture)
    GraphProblem,
    _depends_outside_call,
    graph_problem,
    hyper,
    kron,
    kron_eligible,
    reference_env,
    rel_err,
    setup,
)

TOL = 1e-8
N = 20
BATCH = 8  # 20 = 8 + 8 + 4: unequal batches
_CASES: dict = {}


def case(name: str, kind: str):
    """(model, inputs, targets, GraphProblem), cached (the reference does not depend on the structure).
    The cached model is shared between tests: do not modify it."""
    key = (name, kind)
    if key not in _CASES:
        model, inputs, y = make_case(name, kind, N)
        _CASES[key] = (model, inputs, y, graph_problem(model, inputs, y, kind))
    return _CASES[key]


def hyperparameters(model, kind: str, sequence: bool = False, ignore_index: int = IGNORE):
    """``hyper`` (sigma != 1, T != 1, distinct per-tensor precisions, all learnable); for sequence
    classification a likelihood with ``ignore_index``."""
    prior, lik = hyper(model, kind, learn=True)
    if sequence and kind == "classification":
        from lightning_marglik import CategoricalLikelihood

        lik = CategoricalLikelihood(temperature=0.8, ignore_index=ignore_index, learn_temperature=True)
    return prior, lik


def fit(model, data, lik, prior, structure, approx="ggn", **kw):
    from lightning_marglik import LaplaceEvidence

    return LaplaceEvidence.fit(model, data, lik, prior, structure=structure, approx=approx, mc_samples=0, **kw)


def check_against_reference(ev, ref, prior, lik):
    expected = ref.evaluate(prior, lik)
    assert ev.n_data == ref.n_data
    assert rel_err(ev.log_det(), expected["log_det"]) <= TOL, (float(ev.log_det()), float(expected["log_det"]))
    assert rel_err(ev.log_marglik(), expected["log_marglik"]) <= TOL
    lib, want = ev.gradient(), ref.gradient(prior, lik)
    assert set(lib) == set(want), (set(lib), set(want))
    for name in want:
        assert rel_err(lib[name], want[name]) <= TOL, name


def check_same_evidence(a, b):
    assert a.n_data == b.n_data
    assert rel_err(a.log_det(), b.log_det()) <= TOL
    assert rel_err(a.log_marglik(), b.log_marglik()) <= TOL
    ga, gb = a.gradient(), b.gradient()
    assert set(ga) == set(gb)
    for name in ga:
        assert rel_err(ga[name], gb[name]) <= TOL, name


# ==============================================================================================
# the library against the reference
# ==============================================================================================


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
@pytest.mark.parametrize("name", list(NETWORKS))
def test_real_network_matches_reference(name, kind, structure, approx):
    model, inputs, y, problem = case(name, kind)
    prior, lik = hyperparameters(model, kind, NETWORKS[name].sequence)
    assert prior.param_names == problem.names
    ev = fit(model, batches(inputs, y, BATCH), lik, prior, structure, approx)
    check_against_reference(ev, problem.reference(structure, approx), prior, lik)


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_frozen_backbone_equals_head_on_features(kind, structure, approx):
    model, x, y, _ = case("frozen_head", kind)
    with torch.no_grad():
        features = model.backbone(x)
    head = nn.Linear(model.head.in_features, model.head.out_features).double()
    head.load_state_dict(model.head.state_dict())
    prior, lik = hyperparameters(model, kind)
    prior_h, lik_h = hyperparameters(head, kind)
    assert prior.param_names == ["head.weight", "head.bias"] and prior_h.param_names == ["weight", "bias"]
    assert torch.equal(prior.log_precision, prior_h.log_precision)
    ev = fit(model, batches(x, y, BATCH), lik, prior, structure, approx)
    ev_head = fit(head, batches(features, y, BATCH), lik_h, prior_h, structure, approx)
    check_same_evidence(ev, ev_head)
    ref = graph_problem(head, features, y, kind).reference(structure, approx)
    check_against_reference(ev_head, ref, prior_h, lik_h)


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_sequence_outputs_with_ignored_positions(structure, approx):
    """(B, T, C) logits, (B, T) targets with IGNORE at padded and random positions: each kept
    position is one datum; ignored ones count nowhere; another ignore_index gives the same."""
    model, ids, y, problem = case("seq_out", "classification")
    kept = y != IGNORE
    assert kept.any() and (~kept).any() and (ids[~kept] != 0).any()  # ignored positions with real tokens too
    prior, lik = hyperparameters(model, "classification", sequence=True)
    ev = fit(model, batches(ids, y, BATCH), lik, prior, structure, approx)
    assert ev.n_data == int(kept.sum())
    check_against_reference(ev, problem.reference(structure, approx), prior, lik)
    y_other = torch.where(kept, y, torch.full_like(y, -1))
    prior2, lik2 = hyperparameters(model, "classification", sequence=True, ignore_index=-1)
    check_same_evidence(ev, fit(model, batches(ids, y_other, BATCH), lik2, prior2, structure, approx))


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_dict_inputs_equal_tensor_twin(kind, structure):
    model, inputs, y, problem = case("tokens_dict", kind)
    twin, stacked, y_twin, _ = case("tokens_twin", kind)
    assert torch.equal(stacked, torch.stack([inputs["input_ids"], inputs["attention_mask"]], 1))
    assert torch.equal(y, y_twin)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    prior, lik = hyperparameters(model, kind)
    ev_dict = fit(model, batches(inputs, y, BATCH), lik, prior, structure)
    check_against_reference(ev_dict, problem.reference(structure, "ggn"), prior, lik)

    prior_t, lik_t = hyperparameters(twin, kind)
    check_same_evidence(ev_dict, fit(twin, batches(stacked, y, BATCH), lik_t, prior_t, structure))
    # tuple inputs: forward(*x)
    tuples = [((b["input_ids"], b["attention_mask"]), t) for b, t in batches(inputs, y, BATCH)]
    check_same_evidence(ev_dict, fit(model, tuples, lik, prior, structure))
    # HF-style dict batches through batch_fn
    hf = [{**b, "labels": t} for b, t in batches(inputs, y, BATCH)]

    def batch_fn(batch):
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, batch["labels"]

    check_same_evidence(ev_dict, fit(model, hf, lik, prior, structure, batch_fn=batch_fn))


# ==============================================================================================
# self-checks of the reference (no library)
# ==============================================================================================


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
@pytest.mark.parametrize("model_name", ["mlp_small", "mlp_deep", "cnn"])
def test_graph_reference_equals_sequential_reference(model_name, kind, approx):
    model, x, y, seq = setup(model_name, kind)
    graph = GraphProblem(model, seq.names, x, y, kind)
    r_seq, r_graph = seq.reference("kron", approx), graph.reference("kron", approx)
    assert torch.allclose(r_seq.full, r_graph.full, rtol=1e-12, atol=1e-14)
    assert all(torch.allclose(r_seq.stats[k], r_graph.stats[k], rtol=1e-13) for k in r_seq.stats)
    assert r_seq.n_data == r_graph.n_data
    assert [b.name for b in r_seq.blocks] == [b.name for b in r_graph.blocks]
    assert all(b.kind == "kron" for b in r_graph.blocks)
    for a, b in zip(r_seq.blocks, r_graph.blocks):
        assert torch.equal(a.index, b.index)
        assert torch.allclose(a.matrix, b.matrix, rtol=1e-12, atol=1e-14), a.name


class OneHidden(nn.Module):
    """f = W2 pool_t tanh(W1 x_t + b1) + b2 on (B, in) (no positions) or (B, T, in) (sum-pool)."""

    def __init__(self, d_in: int, d_h: int, d_out: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_h), nn.Linear(d_h, d_out)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h.sum(1) if h.dim() == 3 else h)


class EmbedMean(nn.Module):
    """f = W mean_t E[idx_t] + b."""

    def __init__(self, vocab: int, dim: int, d_out: int) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(vocab, dim, padding_idx=0), nn.Linear(dim, d_out)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


def _unit_lambda(f, y, kind, approx):
    """Lambda_n by hand: I or diag(p) - pp^T (GGN), r r^T (EF)."""
    if approx == "ef":
        r = y - f if kind == "regression" else F.one_hot(y, f.shape[1]).double() - f.softmax(1)
        return r[:, :, None] * r[:, None, :]
    if kind == "regression":
        return torch.eye(f.shape[1]).expand(f.shape[0], -1, -1)
    p = f.softmax(1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
@pytest.mark.parametrize("positions", [False, True])
def test_hand_derived_one_hidden_layer(positions, kind, approx):
    """G, A of a one-hidden-layer network by hand: B_2 = I, B_1 = W2 diag(1 - h^2) per row."""
    torch.manual_seed(4)
    n, t, d_in, d_h, d_out = 7, 3, 3, 4, N_OUT[kind]
    model = OneHidden(d_in, d_h, d_out).double()
    x = torch.randn(n, t, d_in) if positions else torch.randn(n, d_in)
    with torch.no_grad():
        f = model(x)
    y = f + torch.randn(f.shape) if kind == "regression" else torch.randint(0, d_out, (n,))
    lam = _unit_lambda(f, y, kind, approx)
    w2 = model.fc2.weight.detach()
    with torch.no_grad():
        h = torch.tanh(model.fc1(x))
    rows_x = x.reshape(n, -1, d_in)  # (n, R, in)
    rows_h = h.reshape(n, -1, d_h)
    pooled = h.sum(1) if positions else h
    b1 = torch.einsum("oh,nrh->nroh", w2, 1 - rows_h**2)  # d f_n / d z1_{n,r}
    g1 = torch.einsum("nroh,nop,nrpk->hk", b1, lam, b1)
    a1 = torch.einsum("nri,nrj->ij", rows_x, rows_x) / (n * rows_x.shape[1])
    g2 = lam.sum(0)
    a2 = pooled.T @ pooled / n
    expected = {"fc1.weight": kron(g1, a1), "fc1.bias": g1, "fc2.weight": kron(g2, a2), "fc2.bias": g2}
    ref = graph_problem(model, x, y, kind).reference("kron", approx)
    assert sorted(b.name for b in ref.blocks) == sorted(expected)
    for block in ref.blocks:
        assert block.kind == "kron"
        assert torch.allclose(block.matrix, expected[block.name], rtol=1e-12, atol=1e-14), block.name


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_hand_derived_embedding(kind, approx):
    """Embedding rows r = index positions: B_{n,r} = W / T, G = sum_{n,r} B^T Lambda_n B,
    A = diag(counts without padding_idx) / (N T), block kron(A, G)."""
    torch.manual_seed(5)
    n, t, vocab, dim, d_out = 6, 4, 5, 3, N_OUT[kind]
    model = EmbedMean(vocab, dim, d_out).double()
    idx = torch.randint(0, vocab, (n, t))
    idx[0, 0], idx[1, 2] = 0, 0  # padding rows: counted in R_total only
    with torch.no_grad():
        f = model(idx)
    y = f + torch.randn(f.shape) if kind == "regression" else torch.randint(0, d_out, (n,))
    lam = _unit_lambda(f, y, kind, approx)
    w = model.fc.weight.detach()
    g = t * (w / t).T @ lam.sum(0) @ (w / t)
    counts = torch.tensor([float(((idx == i) & (idx != 0)).sum()) for i in range(vocab)])
    a = torch.diag(counts) / (n * t)
    ref = graph_problem(model, idx, y, kind).reference("kron", approx)
    block = next(b for b in ref.blocks if b.name == "emb.weight")
    assert torch.allclose(block.matrix, kron(a, g), rtol=1e-12, atol=1e-14)
    assert torch.all(block.matrix[:dim, :dim] == 0)  # the padding row


class SingleRow(nn.Module):
    """Every layer sees ONE row per example: Embedding (one index) -> Linear -> Conv1d (padding 1,
    stride 3: one output position) -> grouped, dilated Conv2d (one output position) -> Linear."""

    def __init__(self, d_out: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4, padding_idx=0)
        self.fc = nn.Linear(4, 6)
        self.conv1 = nn.Conv1d(2, 6, 3, padding=1, stride=3)
        self.conv2 = nn.Conv2d(2, 4, (1, 2), dilation=(1, 2), groups=2)
        self.head = nn.Linear(4, d_out)

    def forward(self, idx):
        h = torch.tanh(self.fc(self.emb(idx)))  # (B, 1, 6)
        h = torch.tanh(self.conv1(h.reshape(-1, 2, 3)))  # (B, 6, 1)
        h = torch.tanh(self.conv2(h.reshape(-1, 2, 1, 3)))  # (B, 4, 1, 1)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_single_row_kron_blocks_are_exact(kind, approx):
    """One datum, one row per layer: Kronecker block == dense GGN/EF block (within a conv group),
    which pins the index conventions (row-major, unfold order, padding, dilation, groups)."""
    torch.manual_seed(6)
    model = SingleRow(N_OUT[kind]).double()
    idx = torch.tensor([[3]])
    with torch.no_grad():
        f = model(idx)
    y = f + torch.randn(f.shape) if kind == "regression" else torch.tensor([1])
    ref = graph_problem(model, idx, y, kind).reference("kron", approx)
    assert all(b.kind == "kron" for b in ref.blocks) and len(ref.blocks) == 9
    for block in ref.blocks:
        dense = ref.full[block.index][:, block.index]
        scale = dense.abs().max()
        assert scale > 1e-8, block.name  # not trivially zero
        if block.name == "conv2.weight":  # 2 groups of 2 outputs x (1 channel x 2 taps): per-group exact
            for gi in range(2):
                sl = slice(4 * gi, 4 * gi + 4)
                assert (block.matrix[sl, sl] - dense[sl, sl]).abs().max() <= 1e-12 * scale
            assert torch.all(block.matrix[:4, 4:] == 0) and (dense[:4, 4:].abs().max() > 1e-3 * scale)
        else:
            assert (block.matrix - dense).abs().max() <= 1e-12 * scale, block.name


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


class ShapeReader(nn.Module):
    """Reads fc1.weight's metadata outside its call: not a use."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        assert self.fc1.weight.shape[1] == x.shape[1] and self.fc1.weight.dtype == x.dtype
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize(
    "cls,kron_modules,outside",
    [
        (CalledTwice, {"out"}, set()),  # fc: called twice
        (FunctionalReuse, {"fc2"}, {"fc1"}),  # fc1.weight also used by F.linear
        (FunctionalOnly, {"fc1"}, {"fc2"}),  # fc2: never called, its parameters used by F.linear
        (ShapeReader, {"fc1", "fc2"}, set()),
    ],
)
def test_eligibility_rules(cls, kron_modules, outside):
    torch.manual_seed(7)
    model = cls().double()
    x = torch.randn(5, 3)
    names = [n for n, _ in model.named_parameters()]
    assert set(kron_eligible(model, names, x)) == kron_modules
    for mod_name, module in model.named_children():  # the numerical detector alone
        own = [f"{mod_name}.{n}" for n, _ in module.named_parameters()]
        assert _depends_outside_call(model, x, module, own) == (mod_name in outside), mod_name
    with torch.no_grad():
        y = model(x) + 0.3 * torch.randn(5, 2)
    ref = graph_problem(model, x, y, "regression").reference("kron", "ggn")
    for block in ref.blocks:
        module = block.name.rsplit(".", 1)[0]
        assert block.kind == ("kron" if module in kron_modules else "diag"), block.name
        if block.kind == "diag":
            assert torch.allclose(torch.diagonal(block.matrix), torch.diagonal(ref.full)[block.index], rtol=1e-13, atol=0)


def test_eligibility_on_real_networks():
    expected_diag = {
        "cnn_bn_res": {"bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias"},
        "mlp_ln": {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"},
        "tokens_gn": {"norm.weight", "norm.bias"},
        "seq_out": {"norm.weight", "norm.bias"},
        "conv2d_grouped": set(),
        "lora": {"norm.weight", "norm.bias"},
        "shared": {"emb.weight", "mix.weight", "mix.bias", "gain"},
        "frozen_head": set(),
    }
    for name, diag in expected_diag.items():
        model, _, _, problem = case(name, "classification")
        blocks = problem.reference("kron", "ggn").blocks
        assert {b.name for b in blocks if b.kind == "diag"} == diag, name
        assert {b.name for b in blocks} == {n for n, p in model.named_parameters() if p.requires_grad}, name
    _, _, _, lora = case("lora", "classification")
    assert set(lora.eligible) == {"l1.lora_a", "l1.lora_b", "l2.lora_a", "l2.lora_b"}  # frozen base: no block


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_sequence_reference_from_per_position_autograd(kind, approx):
    """The sequence-output reference against per-position quantities built separately: the loss
    Hessian by torch.func.hessian of the per-position loss, the EF from per-position autograd
    scores, the log-likelihood from F.cross_entropy / the SSE."""
    model, ids, y, problem = case("seq_out", kind)
    names = problem.names
    params = dict(model.named_parameters())
    theta = {n: params[n].detach() for n in names}
    ref = problem.reference("full", approx)
    with torch.no_grad():
        f = model(ids)  # (N, T, C)
    n, t, c = f.shape
    if kind == "classification":
        nll = F.cross_entropy(f.reshape(-1, c), y.reshape(-1), ignore_index=IGNORE, reduction="sum")
        assert rel_err(ref.stats["loglik"], -nll) <= 1e-13
        kept = [(i, j) for i in range(n) for j in range(t) if y[i, j] != IGNORE]
    else:
        assert rel_err(ref.stats["sse"], ((y - f) ** 2).sum()) <= 1e-13
        kept = [(i, j) for i in range(n) for j in range(t)]
    assert ref.n_data == len(kept)

    def loss(fi, target):  # unit-scale negative log-likelihood of one position
        if kind == "classification":
            return -torch.log_softmax(fi, 0)[target]
        return 0.5 * ((target - fi) ** 2).sum()

    curvature = torch.zeros(ref.n_params, ref.n_params)
    jacs = {}
    for i, j in kept:
        if i not in jacs:  # d f_{i, t, c} / d theta of example i alone: (T, C, P)
            jac = jacrev(lambda th: functional_call(model, th, (ids[i:i + 1],))[0])(theta)
            jacs[i] = torch.cat([jac[k].reshape(t, c, -1) for k in names], 2)
        jac = jacs[i][j]  # (C, P)
        if approx == "ggn":
            lam = hessian(loss)(f[i, j], y[i, j])
            curvature += jac.T @ lam @ jac
        else:
            g = jac.T @ torch.func.grad(loss)(f[i, j], y[i, j])
            curvature += torch.outer(g, g)
    assert torch.allclose(ref.full, curvature, rtol=1e-10, atol=1e-12)
