"""Dense brute-force references for the Laplace evidence, written from first principles.

Nothing here calls into ``lightning_marglik`` except to *read* the public hyperparameter
objects' buffers (``prior.log_precision``, ``likelihood.log_sigma``, ...) and the prior's
``param_names``/``structure``. Every curvature quantity is built from explicit per-datum
Jacobians (``torch.func.jacrev``), explicit loss Hessians and dense
``torch.logdet``.

Conventions (those of ``lightning_marglik.hyperparameters``):

    log q = loglik/T - 1/2 sum_p delta_p theta_p^2 + 1/2 sum_p log delta_p - 1/2 log|H|
    H     = s C + diag(delta)           (delta expanded to one value per scalar parameter)
    C     = sum_n J_n^T Lambda_n J_n    (GGN)   or   sum_n J_n^T r_n r_n^T J_n   (EF)

    Gaussian:    Lambda = I,              r = y - f,          s = 1/(sigma^2 T) (GGN), 1/(sigma^4 T) (EF)
    Categorical: Lambda = diag(p) - pp^T, r = onehot(y) - p,  s = 1/T
    EF:          Lambda_n = r_n r_n^T (per datum), unit scale as above

Two problem classes: :class:`Problem` (``nn.Sequential`` models, outputs (N, C), the original
Sequential-only Kronecker blocks :func:`kron_blocks`) and :class:`GraphProblem` (ANY module graph,
tensor / tuple / dict inputs, sequence outputs, the hybrid Kronecker structure). Both feed
:class:`Reference` (structures "full", "diag", "kron").

Sequence outputs (GraphProblem): outputs (N, T, C); categorical targets (N, T) with
``ignore_index`` (default -100), Gaussian targets (N, T, D). Every kept position (n, t) is one
datum: loglik = sum over kept positions; C = sum_{(n,t) kept} J_nt^T Lambda_nt J_nt, i.e. per
example Lambda_n = block-diag_t(kept_nt Lambda_nt) over the flattened (T*C) outputs (the EF too:
block-diag_t of r_nt r_nt^T, not r_n r_n^T); ignored positions contribute nothing (Lambda = 0).
n_data = number of kept positions. Outputs (N, C) are the special case T = 1.

structure="kron" on any graph is HYBRID: log|H| = sum over blocks of log|s C_b + diag(delta_b)|.

* Kronecker blocks (expand convention) for every nn.Linear / nn.Conv1d / nn.Conv2d / nn.Embedding
  that is called exactly once per forward pass and whose parameters are used only inside that
  call (:func:`kron_eligible`). With z_n the layer output of example n and
  B_n = d f_n / d z_n (jacrev through a forward hook that replaces the layer output by z), and
  r the layer's "rows" (weight-sharing positions):
    G = sum_n sum_r B_{n,:,r}^T Lambda_n B_{n,:,r}     (sums over ALL output columns, kept ones
                                                        only through Lambda)
    A = (1/R_kept) sum_{(n,r) kept} a_{n,r} a_{n,r}^T  (a mean over the rows that carry a loss
                                                        term: (n, r) is kept iff its G term
                                                        B_{n,:,r}^T Lambda_n B_{n,:,r} is non-zero;
                                                        ignored positions' inputs never enter;
                                                        no kept row: G = 0, the block is 0, A := 0)
  Linear, input (N, ..., in): every index between batch and features is a row;
    weight (out, in): kron(G, A) in weight.flatten() order; bias: G.
  Conv1d / Conv2d (any stride, zero padding incl. 'same'/'valid', dilation, groups): rows =
    output positions, a_{n,r} = the unfolded input patch (F.unfold order = weight.reshape(out, -1)
    order); per group g: G_g = the (out/groups)^2 diagonal sub-block of G, A_g = mean of group g's
    patches; weight: block-diag_g kron(G_g, A_g) (a group's weight rows are contiguous); bias: the
    full G (out x out).
  HF Conv1D (y = a W + b, W (in, out)): rows as a Linear; weight: kron(A, G) in W.flatten() order.
  Embedding (num, dim), indices (N, ...): rows = index positions; G (dim x dim) as above;
    indices shared by the batch ((1, T) positions broadcast onto (N, T, D)): B_n = d f_n / d z of
    the one shared output, the indices count once per example;
    A = diag(c) / R_kept with c_i = number of kept rows with index i (rows with index ==
    padding_idx count in R_kept, not in c); weight (num, dim): kron(A, G).
  A layer pruned by torch.nn.utils.prune (parameter <t>_orig, t = <t>_orig * <t>_mask): the
  Jacobian w.r.t. <t>_orig is the one w.r.t. t times the mask m = vec(<t>_mask), so each of its
  blocks above becomes D_m (block) D_m. It is eligible only if its weight's mask, as the
  (out, in) matrix, has rank <= 1 (r c^T: then D_m = D_r (x) D_c and the block stays a Kronecker
  product), and never for an Embedding.
* Exact DIAGONAL blocks for every other covered parameter (norm affine parameters, raw
  nn.Parameters, parameters of a module called more than once or used outside its call):
  log det = sum_p log(s C_pp + delta_p) with C_pp the diagonal of the dense C.
* Frozen parameters (requires_grad=False) are not in the prior: no block. A frozen weight with a
  trainable bias still gives the bias its block G.

Everything runs in eval mode (BatchNorm on running statistics); the layer Jacobians are taken for
the whole batch and their per-example diagonal blocks extracted, asserting that the off-diagonal
blocks (example n's output w.r.t. example m's layer output) are exactly zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

LOG_2PI = math.log(2 * math.pi)


# --------------------------------------------------------------------------------------------
# models and data
# --------------------------------------------------------------------------------------------


def mlp_small(out: int = 2) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, out))


def mlp_deep(out: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, out))


def cnn(out: int = 3) -> nn.Sequential:
    # 1x6x6 -> 2x4x4 -> 3x2x2 (stride 2, padding 1) -> 12 -> out
    return nn.Sequential(
        nn.Conv2d(1, 2, 3),
        nn.ReLU(),
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(12, out),
    )


def input_shape(model: nn.Module) -> Tuple[int, ...]:
    first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))
    if isinstance(first, nn.Conv2d):
        return (first.in_channels, 6, 6)
    return (first.in_features,)


def make_data(model: nn.Module, n: int, kind: str, n_out: int, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """Inputs and targets. Regression targets are noisy model outputs (so residuals are O(1))."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n,) + input_shape(model), generator=gen)
    if kind == "regression":
        with torch.no_grad():
            f = _eval(model, x)
        y = f + 0.8 * torch.randn(n, n_out, generator=gen)
        return x, y
    y = torch.randint(0, n_out, (n,), generator=gen)
    return x, y


def loader(x: Tensor, y: Tensor, batch_size: int = 16) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def _eval(model: nn.Module, x: Tensor) -> Tensor:
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        return model(x)
    finally:
        for m, flag in flags:
            m.training = flag


# --------------------------------------------------------------------------------------------
# hyperparameters (read from the public buffers)
# --------------------------------------------------------------------------------------------


def param_list(model: nn.Module, names: Sequence[str]) -> List[Tensor]:
    found = dict(model.named_parameters())
    return [found[n] for n in names]


def flat_theta(model: nn.Module, names: Sequence[str]) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in param_list(model, names)])


def expand_log_precision(log_precision: Tensor, structure: str, sizes: Sequence[int]) -> Tensor:
    """Per-scalar log precision (P,) from the group values, by the prior's structure."""
    total = sum(sizes)
    if structure == "scalar":
        assert log_precision.numel() == 1
        return log_precision.reshape(1).expand(total)
    if structure == "layerwise":
        assert log_precision.numel() == len(sizes)
        return torch.cat([log_precision[i].expand(s) for i, s in enumerate(sizes)])
    assert structure == "diagonal" and log_precision.numel() == total
    return log_precision


# --------------------------------------------------------------------------------------------
# per-datum Jacobians, loss Hessians
# --------------------------------------------------------------------------------------------


def jacobians(model: nn.Module, names: Sequence[str], x: Tensor) -> Tuple[Tensor, Tensor]:
    """Outputs f (N, C) and per-datum Jacobians J (N, C, P) (torch.func.jacrev, vmapped over data)."""
    theta0 = tuple(p.detach().clone() for p in param_list(model, names))
    flags = [(m, m.training) for m in model.modules()]
    model.eval()

    def f(theta: Tuple[Tensor, ...], xi: Tensor) -> Tensor:
        return functional_call(model, dict(zip(names, theta)), (xi.unsqueeze(0),)).squeeze(0)

    try:
        with torch.no_grad():
            out = model(x)
        jac = vmap(jacrev(f), in_dims=(None, 0))(theta0, x)
    finally:
        for m, flag in flags:
            m.training = flag
    return out.detach(), torch.cat([j.reshape(j.shape[0], j.shape[1], -1) for j in jac], dim=2)


def residuals(f: Tensor, y: Tensor, kind: str) -> Tensor:
    if kind == "regression":
        return y.reshape(f.shape) - f
    return F.one_hot(y, f.shape[1]).to(f.dtype) - f.softmax(1)


def loss_hessians(f: Tensor, y: Tensor, kind: str, approx: str) -> Tensor:
    """Lambda_n (N, C, C) at unit noise and temperature."""
    n, c = f.shape
    if approx == "ef":
        r = residuals(f, y, kind)
        return r.unsqueeze(2) * r.unsqueeze(1)
    if kind == "regression":
        return torch.eye(c).expand(n, c, c).clone()
    p = f.softmax(1)
    return torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)


def unit_log_likelihood(f: Tensor, y: Tensor, kind: str) -> Dict[str, Tensor]:
    if kind == "regression":
        return {"sse": ((y.reshape(f.shape) - f) ** 2).sum(), "n_outputs": torch.tensor(float(f.numel()))}
    return {"loglik": torch.log_softmax(f, 1).gather(1, y.unsqueeze(1)).sum()}


def curvature_scale(kind: str, approx: str, log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
    if kind == "regression":
        power = 4 if approx == "ef" else 2
        return torch.exp(-power * log_sigma - log_temperature)
    return torch.exp(-log_temperature)


def tempered_log_likelihood(stats: Dict[str, Tensor], kind: str, log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
    temperature = torch.exp(log_temperature)
    if kind == "regression":
        sigma2 = torch.exp(2 * log_sigma)
        loglik = -0.5 * stats["n_outputs"] * torch.log(2 * math.pi * sigma2) - stats["sse"] / (2 * sigma2)
        return loglik / temperature
    return stats["loglik"] / temperature


# --------------------------------------------------------------------------------------------
# Kronecker factors from first principles (nn.Sequential models)
# --------------------------------------------------------------------------------------------


@dataclass
class KronBlock:
    """Unit-scale curvature block over the parameter indices ``index``."""

    index: Tensor
    matrix: Tensor
    name: str = ""
    factors: Tuple[Tensor, ...] = field(default_factory=tuple)
    kind: str = "kron"  # "kron" (Kronecker-factored) or "diag" (exact diagonal of the dense C)


def kron(a: Tensor, b: Tensor) -> Tensor:
    """``torch.kron`` on contiguous copies: torch 2.14's kron raises "view size is not compatible"
    on non-contiguous inputs such as einsum results."""
    return torch.kron(a.contiguous(), b.contiguous())


def kept_mean(total: Tensor, count) -> Tensor:
    """``total / count``: the input factor A as the mean over the kept rows, ``total`` their sum.

    With no kept row (every G term zero: upstream of a layer whose ReLUs are all off on the batch, or of a
    zero head), G = 0 and the block ``kron(G, A)`` is 0 whatever A is; the empty mean is then taken as 0
    rather than 0/0 = NaN.
    """
    return total / count if float(count) > 0 else torch.zeros_like(total)


def _param_offsets(model: nn.Module, names: Sequence[str]) -> Dict[int, Tuple[int, int]]:
    offsets, start = {}, 0
    for p in param_list(model, names):
        offsets[id(p)] = (start, start + p.numel())
        start += p.numel()
    return offsets


def layer_jacobians(model: nn.Sequential, x: Tensor) -> List[Tuple[int, nn.Module, Tensor, Tensor]]:
    """Per Linear/Conv2d layer i of a Sequential: (i, layer, inputs a (N, ...), B (N, C, *z_n.shape)).

    B_n = d f_n / d z_n is an explicit jacobian (jacrev) of the rest of the network w.r.t. the
    layer's pre-activation output z_n.
    """
    assert isinstance(model, nn.Sequential)
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    out = []
    try:
        for i, layer in enumerate(model):
            if not isinstance(layer, (nn.Linear, nn.Conv2d)):
                continue
            head, tail = model[:i], model[i + 1:]
            with torch.no_grad():
                a = head(x)
                z = layer(a)
            jac = vmap(jacrev(lambda zi: tail(zi.unsqueeze(0)).squeeze(0)))(z).detach()
            out.append((i, layer, a, jac))
    finally:
        for m, flag in flags:
            m.training = flag
    return out


def kron_blocks(
    model: nn.Sequential, names: Sequence[str], layers: List[Tuple[int, nn.Module, Tensor, Tensor]], lam: Tensor
) -> List[KronBlock]:
    """Expand-convention KFAC blocks of every Linear/Conv2d of a Sequential model.

    For layer l with input a_n and B_n = d f_n / d z_n (see :func:`layer_jacobians`):
    Linear: G = sum_n B_n^T Lambda_n B_n, A = mean_n a_n a_n^T.
    Conv2d: with r the spatial positions of z (out_channels-dim gradients),
    G = sum_{n,r} B_{n,:,:,r}^T Lambda_n B_{n,:,:,r}, A = mean over (n, r) of the unfolded patches
    (F.unfold order = weight.reshape(out, -1) order). Weight block kron(G, A), bias block G.
    A's mean is over the kept rows only: those whose G term is non-zero (a dead ReLU position
    carries no loss term; see the module docstring).
    """
    offsets = _param_offsets(model, names)
    blocks: List[KronBlock] = []
    for i, layer, a, jac in layers:
        n, c_out = jac.shape[:2]
        if isinstance(layer, nn.Conv2d):
            jb = jac.reshape(n, c_out, layer.out_channels, -1)  # (N, C, out_ch, R)
            g_sum = torch.einsum("ncor,ncd,ndqr->oq", jb, lam, jb)
            cols = F.unfold(a, layer.kernel_size, layer.dilation, layer.padding, layer.stride)  # (N, in*k*k, R)
            kept = (torch.einsum("ncor,ncd,ndor->nr", jb, lam, jb) != 0).to(cols.dtype)
            a_sum = torch.einsum("nkr,nr,nlr->kl", cols, kept, cols)  # summed over kept data and positions
            a_count = kept.sum()
        else:
            g_sum = torch.einsum("nco,ncd,ndq->oq", jac, lam, jac)
            kept = torch.einsum("nco,ncd,ndo->n", jac, lam, jac) != 0
            a_sum = a[kept].T @ a[kept]
            a_count = kept.sum()
        a_mean = kept_mean(a_sum, a_count)
        if id(layer.weight) in offsets:  # (a frozen tensor is not in the prior: no block)
            lo, hi = offsets[id(layer.weight)]
            blocks.append(KronBlock(torch.arange(lo, hi), kron(g_sum, a_mean), f"{i}.weight", (g_sum, a_mean)))
        if layer.bias is not None and id(layer.bias) in offsets:
            lo, hi = offsets[id(layer.bias)]
            blocks.append(KronBlock(torch.arange(lo, hi), g_sum.clone(), f"{i}.bias", (g_sum,)))
    return blocks


# --------------------------------------------------------------------------------------------
# the reference evidence
# --------------------------------------------------------------------------------------------


class Problem:
    """Hyperparameter- and structure-independent quantities of (model, data): f, J, layer Jacobians.

    ``nn.Sequential``-only Kronecker blocks (:func:`kron_blocks`); outputs ``(N, C)``. See
    :class:`GraphProblem` for any module graph, dict/tuple inputs and sequence outputs.
    """

    def __init__(self, model: nn.Module, names: Sequence[str], x: Tensor, y: Tensor, kind: str):
        self.model, self.names, self.x, self.y, self.kind = model, list(names), x, y, kind
        self.sizes = [p.numel() for p in param_list(model, names)]
        self.theta = flat_theta(model, names)
        self.f, self.jac = jacobians(model, names, x)
        self._layers = None

    @property
    def layers(self):
        if self._layers is None:
            self._layers = layer_jacobians(self.model, self.x)
        return self._layers

    @property
    def n_data(self) -> int:
        return self.f.shape[0]

    def unit_stats(self) -> Dict[str, Tensor]:
        return unit_log_likelihood(self.f, self.y, self.kind)

    def lambdas(self, approx: str) -> Tensor:
        """Lambda_n (N, O, O) over the flattened outputs of each example."""
        return loss_hessians(self.f, self.y, self.kind, approx)

    def curvature_blocks(self, lam: Tensor) -> List[KronBlock]:
        return kron_blocks(self.model, self.names, self.layers, lam)

    def reference(self, structure: str, approx: str) -> "Reference":
        return Reference(self, structure, approx)


class Reference:
    """The dense reference evidence for one structure x approx; evaluate at any (differentiable)
    log hyperparameters."""

    def __init__(self, problem: Problem, structure: str, approx: str):
        kind = problem.kind
        self.kind, self.structure, self.approx = kind, structure, approx
        self.names, self.sizes, self.theta = problem.names, problem.sizes, problem.theta
        self.n_params = self.theta.numel()
        self.n_data = problem.n_data
        self.stats = problem.unit_stats()
        lam = problem.lambdas(approx)
        self.full = torch.einsum("ncp,ncd,ndq->pq", problem.jac, lam, problem.jac)  # dense unit-scale curvature
        if structure == "kron":
            self.blocks = problem.curvature_blocks(lam)
            covered = torch.cat([b.index for b in self.blocks]).sort().values
            assert torch.equal(covered, torch.arange(self.n_params)), "kron blocks must tile the parameters"

    def log_det(self, log_delta: Tensor, log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
        scale = curvature_scale(self.kind, self.approx, log_sigma, log_temperature)
        return self.log_det_at_scale(scale, torch.exp(log_delta))

    def log_det_at_scale(self, scale: Tensor, delta: Tensor) -> Tensor:
        """log|scale * C + diag(delta)| for this structure."""
        if self.structure == "full":
            return torch.logdet(scale * self.full + torch.diag(delta))
        if self.structure == "diag":
            return torch.log(scale * torch.diagonal(self.full) + delta).sum()
        total = delta.new_zeros(())
        for block in self.blocks:
            total = total + torch.logdet(scale * block.matrix + torch.diag(delta[block.index]))
        return total

    def log_prior(self, log_delta: Tensor) -> Tensor:
        return 0.5 * log_delta.sum() - 0.5 * (torch.exp(log_delta) * self.theta**2).sum() - 0.5 * self.n_params * LOG_2PI

    def log_likelihood(self, log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
        return tempered_log_likelihood(self.stats, self.kind, log_sigma, log_temperature)

    def log_marglik(self, log_delta: Tensor, log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
        return (
            self.log_likelihood(log_sigma, log_temperature)
            - 0.5 * (torch.exp(log_delta) * self.theta**2).sum()
            + 0.5 * log_delta.sum()
            - 0.5 * self.log_det(log_delta, log_sigma, log_temperature)
        )

    # convenience: evaluate at the buffers of the library's public objects
    def hyper_from(self, prior, likelihood) -> Tuple[Tensor, Optional[Tensor], Tensor]:
        log_delta = expand_log_precision(prior.log_precision.detach(), prior.structure, self.sizes)
        log_sigma = likelihood.log_sigma.detach() if self.kind == "regression" else None
        return log_delta, log_sigma, likelihood.log_temperature.detach()

    def evaluate(self, prior, likelihood) -> Dict[str, Tensor]:
        h = self.hyper_from(prior, likelihood)
        return {
            "log_det": self.log_det(*h),
            "log_marglik": self.log_marglik(*h),
            "log_prior": self.log_prior(h[0]),
            "log_likelihood": self.log_likelihood(h[1], h[2]),
        }

    def gradient(self, prior, likelihood) -> Dict[str, Tensor]:
        """Autograd gradient of the reference in the group log precisions, log sigma, log T."""
        group = prior.log_precision.detach().clone().requires_grad_(True)
        log_t = likelihood.log_temperature.detach().clone().requires_grad_(True)
        inputs = [group, log_t]
        log_sigma = None
        if self.kind == "regression":
            log_sigma = likelihood.log_sigma.detach().clone().requires_grad_(True)
            inputs.append(log_sigma)
        value = self.log_marglik(expand_log_precision(group, prior.structure, self.sizes), log_sigma, log_t)
        grads = torch.autograd.grad(value, inputs)
        out = {"log_precision": grads[0], "log_temperature": grads[1]}
        if self.kind == "regression":
            out["log_sigma"] = grads[2]
        return out


# --------------------------------------------------------------------------------------------
# any module graph: inputs, sequence outputs, the hybrid Kronecker structure
# --------------------------------------------------------------------------------------------

try:  # Hugging Face's Conv1D: a Linear with its weight stored (in, out)
    from transformers.pytorch_utils import Conv1D as HFConv1D
except ImportError:  # pragma: no cover - transformers is an optional test dependency
    HFConv1D = None
KRON_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding) + ((HFConv1D,) if HFConv1D is not None else ())

def call(model: nn.Module, inputs) -> Tensor:
    """``model(x)``, ``model(*x)`` or ``model(**x)``."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _args_kwargs(inputs) -> Tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def n_examples(inputs) -> int:
    if isinstance(inputs, Tensor):
        return inputs.shape[0]
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    return next(v.shape[0] for v in values if isinstance(v, Tensor))


class eval_mode:
    """Every module in eval mode (BatchNorm on running statistics, no dropout); modes restored."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.flags = [(m, m.training) for m in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc):
        for m, flag in self.flags:
            m.training = flag


def graph_jacobians(model: nn.Module, names: Sequence[str], inputs) -> Tuple[Tensor, Tensor]:
    """Outputs f (N, *out) and J (N, O, P) with O = prod(out): d f_n / d theta by ``jacrev`` of the
    WHOLE batch's output (row n of the batch Jacobian is example n's Jacobian; no independence
    assumption needed)."""
    args, kwargs = _args_kwargs(inputs)
    theta0 = tuple(p.detach().clone() for p in param_list(model, names))
    n = n_examples(inputs)

    def f(*theta: Tensor) -> Tensor:
        return functional_call(model, dict(zip(names, theta)), args, kwargs)

    with eval_mode(model):
        with torch.no_grad():
            out = call(model, inputs).detach()
        jac = jacrev(f, argnums=tuple(range(len(theta0))))(*theta0)
    o = out[0].numel()
    return out, torch.cat([j.reshape(n, o, -1) for j in jac], dim=2).detach()


_METADATA = {
    "shape", "dtype", "device", "requires_grad", "is_cuda", "ndim", "layout", "is_leaf", "grad_fn", "names",
    "size", "dim", "numel", "ndimension", "nelement", "stride", "is_floating_point", "is_complex",
    "element_size", "data_ptr", "is_contiguous", "__len__", "__hash__", "__format__", "__repr__",
}


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class _UseTracker(TorchFunctionMode):
    """Records, for every use of a tracked parameter as an operand of a torch operation (metadata
    reads such as ``.shape`` excluded), the set of candidate modules whose call is in progress."""

    def __init__(self, params: Dict[int, str], active: List[int]):
        super().__init__()
        self.params, self.active = params, active
        self.uses: Dict[str, List[frozenset]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _func_name(func) not in _METADATA:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, Tensor) and id(leaf) in self.params:
                    self.uses.setdefault(self.params[id(leaf)], []).append(frozenset(self.active))
        return func(*args, **kwargs)


def kron_eligible(model: nn.Module, names: Sequence[str], inputs) -> Dict[str, nn.Module]:
    """The modules that get Kronecker blocks in the hybrid structure, by module name.

    A Linear / Conv1d / Conv2d / Embedding module with at least one parameter in ``names`` is
    eligible iff, in one forward pass over ``inputs`` (eval mode):
      * it is called exactly once, and
      * every use of each of its own parameters in ``names`` happens inside that call (traced
        with a TorchFunctionMode over the module call stack), and
      * numerically: with the module's output replaced by a constant (a forward hook returning it),
        the network output does not depend on those parameters (their jacrev is exactly 0).
    """
    found = {id(p): n for n, p in model.named_parameters() if n in set(names)}
    candidates = {}
    for mod_name, m in model.named_modules():
        if isinstance(m, KRON_MODULES):
            own = [found[id(p)] for _, p in m.named_parameters(recurse=False) if id(p) in found]
            if own:
                candidates[mod_name] = (m, own)
    calls = {name: 0 for name in candidates}
    active: List[int] = []
    handles = []
    for mod_name, (m, _) in candidates.items():

        def pre(mod, args, mod_name=mod_name):
            calls[mod_name] += 1
            active.append(id(mod))

        def post(mod, args, output):
            active.pop()

        handles.append(m.register_forward_pre_hook(pre, prepend=True))  # before pruning's hook computes the weight
        handles.append(m.register_forward_hook(post, always_call=True))
    tracker = _UseTracker(found, active)
    try:
        with eval_mode(model), torch.no_grad(), tracker:
            call(model, inputs)
    finally:
        for h in handles:
            h.remove()
    eligible = {}
    for mod_name, (m, own) in candidates.items():
        if calls[mod_name] != 1:
            continue
        if "weight" in pruned_masks(m) and (isinstance(m, nn.Embedding) or not outer_product(pruned_masks(m)["weight"])):
            continue  # D_M kron(G, A) D_M is no Kronecker product: exact diagonal blocks
        if any(id(m) not in ctx for p in own for ctx in tracker.uses.get(p, [])):
            continue
        if _depends_outside_call(model, inputs, m, own):
            continue
        eligible[mod_name] = m
    return eligible


def pruned_masks(module: nn.Module) -> Dict[str, Tensor]:
    """The masks of the tensors ``torch.nn.utils.prune`` computes in ``module``: ``<name> = <name>_orig *
    <name>_mask``, the parameter being ``<name>_orig``."""
    own = dict(module.named_parameters(recurse=False))
    return {name[: -len("_orig")]: getattr(module, name[: -len("_orig")] + "_mask").detach()
            for name in own if name.endswith("_orig") and hasattr(module, name[: -len("_orig")] + "_mask")}


def outer_product(mask: Tensor) -> bool:
    """Whether a weight's mask, as its ``(out, in)`` matrix, has rank at most one (``r c^T``)."""
    return int(torch.linalg.matrix_rank(mask.reshape(mask.shape[0], -1).double())) <= 1


def _depends_outside_call(model: nn.Module, inputs, module: nn.Module, own: Sequence[str]) -> bool:
    """Whether f depends on ``own`` parameters when ``module``'s output is a constant."""
    args, kwargs = _args_kwargs(inputs)
    found = dict(model.named_parameters())
    theta0 = tuple(found[n].detach().clone() for n in own)
    with eval_mode(model), torch.no_grad():
        record = {}
        h = module.register_forward_hook(lambda m, i, o: record.setdefault("z", o.detach().clone()))
        try:
            call(model, inputs)
        finally:
            h.remove()
    z = record.get("z")  # None: the module is never called

    def f(*theta):
        handle = module.register_forward_hook(lambda m, i, o: z) if z is not None else None
        try:
            return functional_call(model, dict(zip(own, theta)), args, kwargs)
        finally:
            if handle is not None:
                handle.remove()

    with eval_mode(model):
        jac = jacrev(f, argnums=tuple(range(len(theta0))))(*theta0)
    return any(bool((j != 0).any()) for j in jac)


@dataclass
class LayerRecord:
    """One eligible module: its input ``a`` and output ``z`` over the batch, and
    B (N, O, *z.shape[1:]) = d f_n / d z_n (per-example diagonal blocks of the batch Jacobian)."""

    name: str
    module: nn.Module
    a: Tensor
    z: Tensor
    jac: Tensor


def layer_records(model: nn.Module, inputs, modules: Dict[str, nn.Module]) -> List[LayerRecord]:
    """Input/output of every module in ``modules`` and d f_n / d z_n by ``jacrev`` through a forward
    hook that REPLACES the module's output by the differentiated tensor z."""
    n = n_examples(inputs)
    records = []
    for name, module in modules.items():
        seen = {}

        def rec(m, args, output):
            seen["a"], seen["z"] = args[0].detach().clone(), output.detach().clone()

        with eval_mode(model), torch.no_grad():
            handle = module.register_forward_hook(rec)
            try:
                call(model, inputs)
            finally:
                handle.remove()
        a, z = seen["a"], seen["z"]

        def f(zz: Tensor, module=module) -> Tensor:
            handle = module.register_forward_hook(lambda m, i, o: zz)
            try:
                return call(model, inputs).reshape(n, -1)
            finally:
                handle.remove()

        if a.shape[0] == 1 and z.shape[0] == 1 and n > 1 and isinstance(module, nn.Embedding):
            # indices shared by the batch (positions (1, T)): every example's rows are the one
            # broadcast output; B_n = d f_n / d z, the input expanded to one copy per example
            with eval_mode(model):
                shared = jacrev(f)(z).detach()  # (N, O, 1, *z.shape[1:])
            records.append(LayerRecord(name, module, a.expand(n, *a.shape[1:]), z.expand(n, *z.shape[1:]), shared.squeeze(2)))
            continue
        assert a.shape[0] == n and z.shape[0] == n, (name, a.shape, z.shape)

        with eval_mode(model):
            full = jacrev(f)(z).detach()  # (N, O, N, *z.shape[1:])
        o = full.shape[1]
        full = full.reshape(n, o, n, -1)
        diag = torch.stack([full[i, :, i] for i in range(n)])  # (N, O, Z)
        off = full.clone()
        for i in range(n):
            off[i, :, i] = 0
        assert bool((off == 0).all()), f"examples are not independent through '{name}'"
        records.append(LayerRecord(name, module, a, z, diag.reshape((n, o) + tuple(z.shape[1:]))))
    return records


def conv_padding(layer: nn.Module) -> List[Tuple[int, int]]:
    """(left, right) zero padding per spatial dim of a Conv1d/Conv2d (ints, 'valid' or 'same')."""
    k, dil = layer.kernel_size, layer.dilation
    if isinstance(layer.padding, str):
        if layer.padding == "valid":
            return [(0, 0)] * len(k)
        total = [d * (kk - 1) for d, kk in zip(dil, k)]  # 'same' (stride 1)
        return [(t // 2, t - t // 2) for t in total]
    return [(p, p) for p in layer.padding]


def conv_patches(layer: nn.Module, a: Tensor) -> Tensor:
    """Unfolded input patches (N, in * prod(kernel), R) of a Conv1d/Conv2d, F.unfold order
    (channel-major, then kernel positions) = weight.reshape(out, -1) order within a group."""
    k, s, dil = tuple(layer.kernel_size), tuple(layer.stride), tuple(layer.dilation)
    pads = conv_padding(layer)
    flat = [v for lr in reversed(pads) for v in lr]  # F.pad: last dim first
    if any(flat):
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        a = F.pad(a, flat, mode=mode)
    if a.dim() == 3:  # Conv1d as a 1 x L image
        a, k, s, dil = a.unsqueeze(2), (1,) + k, (1,) + s, (1,) + dil
    return F.unfold(a, k, dilation=dil, padding=0, stride=s)


def _g_factor(jac_rows: Tensor, lam: Tensor) -> Tensor:
    """G = sum_{n,r} B_{n,:,r}^T Lambda_n B_{n,:,r} from B (N, O, R, d)."""
    return torch.einsum("nori,nop,nprj->ij", jac_rows, lam, jac_rows)


def kept_rows(jac_rows: Tensor, lam: Tensor) -> Tensor:
    """(N, R): rows whose G term B_{n,:,r}^T Lambda_n B_{n,:,r} (PSD) is non-zero, from B (N, O, R, d)."""
    return torch.einsum("nori,nop,npri->nr", jac_rows, lam, jac_rows) != 0


def hybrid_module_blocks(record: LayerRecord, lam: Tensor, offsets: Dict[int, Tuple[int, int]], prefix: str) -> List[KronBlock]:
    """The Kronecker blocks of one eligible module (expand convention; see the module docstring)."""
    layer, a, z, jac = record.module, record.a, record.z, record.jac
    n, o = jac.shape[:2]
    blocks = []

    masks = pruned_masks(layer)

    def add(role, matrix, factors):
        # a pruned tensor's parameter is <role>_orig: its Jacobian is the one w.r.t. <role> times the mask
        param = getattr(layer, f"{role}_orig") if role in masks else getattr(layer, role, None)
        if param is not None and id(param) in offsets:  # frozen: not in the prior, no block
            lo, hi = offsets[id(param)]
            if role in masks:
                m = masks[role].reshape(-1).to(matrix)
                matrix = m[:, None] * matrix * m[None, :]
            assert matrix.shape == (hi - lo, hi - lo), (prefix, role, matrix.shape)
            name = f"{role}_orig" if role in masks else role
            blocks.append(KronBlock(torch.arange(lo, hi), matrix, prefix + name, factors, "kron"))

    if isinstance(layer, nn.Linear):
        rows = a.reshape(n, -1, layer.in_features)  # every leading index beyond the batch is a row
        r = rows.shape[1]
        g = _g_factor(jac.reshape(n, o, r, layer.out_features), lam)
        kept = rows[kept_rows(jac.reshape(n, o, r, layer.out_features), lam)]
        a_mean = kept_mean(kept.T @ kept, kept.shape[0])
        check = rows @ layer.weight.detach().T + (0 if layer.bias is None else layer.bias.detach())
        assert torch.allclose(check, z.reshape(check.shape), atol=1e-10), prefix
        add("weight", kron(g, a_mean), (g, a_mean))
        add("bias", g.clone(), (g,))
    elif HFConv1D is not None and isinstance(layer, HFConv1D):  # y = a W + b, W (in, out): kron(A, G)
        rows = a.reshape(n, -1, layer.nx)
        r = rows.shape[1]
        jac_rows = jac.reshape(n, o, r, layer.nf)
        g = _g_factor(jac_rows, lam)
        kept = rows[kept_rows(jac_rows, lam)]
        a_mean = kept_mean(kept.T @ kept, kept.shape[0])
        check = rows @ layer.weight.detach() + layer.bias.detach()
        assert torch.allclose(check, z.reshape(check.shape), atol=1e-10), prefix
        add("weight", kron(a_mean, g), (a_mean, g))
        add("bias", g.clone(), (g,))
    elif isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        cols = conv_patches(layer, a)  # (N, in*K, R)
        r, groups, out = cols.shape[2], layer.groups, layer.out_channels
        assert r == z[0, 0].numel(), (prefix, r, z.shape)
        g = _g_factor(jac.reshape(n, o, out, r).transpose(2, 3), lam)  # (out, out)
        kept = kept_rows(jac.reshape(n, o, out, r).transpose(2, 3), lam).to(cols.dtype)  # (N, R)
        cols_g = cols.reshape(n, groups, -1, r)  # (N, groups, in/groups*K, R)
        w = layer.weight.detach().reshape(groups, out // groups, -1)
        check = torch.einsum("gok,ngkr->ngor", w, cols_g).reshape(n, out, r)
        if layer.bias is not None:
            check = check + layer.bias.detach()[:, None]
        assert torch.allclose(check, z.reshape(n, out, r), atol=1e-10), prefix  # patch order = weight order
        og = out // groups
        g_blocks = [g[i * og:(i + 1) * og, i * og:(i + 1) * og] for i in range(groups)]
        a_blocks = [kept_mean(torch.einsum("nkr,nr,nlr->kl", cols_g[:, i], kept, cols_g[:, i]), kept.sum())
                    for i in range(groups)]
        weight = torch.block_diag(*[kron(gb, ab) for gb, ab in zip(g_blocks, a_blocks)])
        add("weight", weight, tuple(x for pair in zip(g_blocks, a_blocks) for x in pair))
        add("bias", g.clone(), (g,))
    elif isinstance(layer, nn.Embedding):
        idx = a.reshape(n, -1)
        r, num, dim = idx.shape[1], layer.num_embeddings, layer.embedding_dim
        assert torch.equal(z.reshape(n, r, dim), layer.weight.detach()[idx]), prefix
        g = _g_factor(jac.reshape(n, o, r, dim), lam)
        kept = kept_rows(jac.reshape(n, o, r, dim), lam)
        keep = idx[kept]
        if layer.padding_idx is not None:
            keep = keep[keep != layer.padding_idx]  # counted in R_kept, not in c
        counts = torch.bincount(keep, minlength=num).to(g.dtype)
        a_diag = kept_mean(torch.diag(counts), kept.sum())
        add("weight", kron(a_diag, g), (a_diag, g))
    else:  # pragma: no cover
        raise AssertionError(type(layer))
    return blocks


def hybrid_blocks(
    model: nn.Module, names: Sequence[str], inputs, lam: Tensor, dense_diag: Tensor, records: List[LayerRecord]
) -> List[KronBlock]:
    """The hybrid structure: Kronecker blocks for the eligible modules (``records``), an exact
    diagonal block (``dense_diag``, the diagonal of the dense C) for every other covered tensor."""
    offsets = _param_offsets(model, names)
    blocks: List[KronBlock] = []
    for record in records:
        blocks.extend(hybrid_module_blocks(record, lam, offsets, record.name + "." if record.name else ""))
    done = {b.name for b in blocks}
    for name, p in zip(names, param_list(model, names)):
        if name in done:
            continue
        lo, hi = offsets[id(p)]
        blocks.append(KronBlock(torch.arange(lo, hi), torch.diag(dense_diag[lo:hi]), name, (), "diag"))
    return blocks


def output_units(module: nn.Module) -> int:
    """The outputs of a Kronecker layer: the size of its output-side factor G."""
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    if HFConv1D is not None and isinstance(module, HFConv1D):
        return module.nf
    return module.out_channels if isinstance(module, (nn.Conv1d, nn.Conv2d)) else module.out_features


def diagonal_output_blocks(model: nn.Module, blocks: List[KronBlock], limit: int) -> List[KronBlock]:
    """``blocks`` with G held as its diagonal in every layer with more than ``limit`` outputs.

    A Kronecker block's entry between two scalars is ``G[i, k]`` times an input-side entry, with ``i``, ``k``
    their output units (``kron(G, A)``: the weight's rows (out, in) or per conv group; ``kron(A, G)`` of an
    Embedding's (num, dim) or an HF Conv1D's (in, out) weight: its columns; a bias block is ``G``). Zeroing
    the entries between different output units leaves ``kron(diag(G), A)`` and ``diag(G)``.
    """
    out = []
    for block in blocks:
        module_name, _, role = block.name.rpartition(".")
        module = model.get_submodule(module_name) if block.kind == "kron" else None
        if module is None or output_units(module) <= limit:
            out.append(block)
            continue
        units, n = output_units(module), len(block.index)
        position = torch.arange(n)
        if role.startswith("bias"):
            unit = position
        elif isinstance(module, nn.Embedding) or (HFConv1D is not None and isinstance(module, HFConv1D)):
            unit = position % units  # stored (rows, out): the output unit is the column
        else:
            unit = position // (n // units)  # stored (out, ...): the output unit is the row
        same = (unit[:, None] == unit[None, :]).to(block.matrix.dtype)
        out.append(KronBlock(block.index, block.matrix * same, block.name, (), block.kind))
    return out


class GraphProblem(Problem):
    """(model, data) on ANY module graph: tensor / tuple / dict inputs, outputs (N, C) or sequence
    outputs (N, T, C) (categorical targets (N, T) with ``ignore_index``; Gaussian targets (N, T, D)).

    Every output position (n, t) whose target is not ``ignore_index`` is one datum; ignored positions
    contribute nothing to the log-likelihood or the curvature (their Lambda is 0) but the layers
    still see their inputs. ``n_data`` = number of kept positions.
    """

    def __init__(self, model: nn.Module, names: Sequence[str], inputs, y: Tensor, kind: str, ignore_index: int = -100):
        self.model, self.names, self.inputs, self.x, self.y, self.kind = model, list(names), inputs, inputs, y, kind
        self.ignore_index = ignore_index
        self.sizes = [p.numel() for p in param_list(model, names)]
        self.theta = flat_theta(model, names)
        self.f, self.jac = graph_jacobians(model, names, inputs)
        self._eligible: Optional[Dict[str, nn.Module]] = None
        self._records: Optional[List[LayerRecord]] = None

    # ----- data positions
    def positions(self) -> Tuple[Tensor, Tensor, Tensor]:
        """f (N, Q, C), targets (N, Q) or (N, Q, D) with ignored ones replaced by 0, kept (N, Q)."""
        n, f = self.f.shape[0], self.f
        if self.kind == "regression":
            f_pos = f.reshape(n, 1, 1) if f.dim() == 1 else f.reshape(n, -1, f.shape[-1])
            y_pos = self.y.reshape(f_pos.shape)
            return f_pos, y_pos, torch.ones(f_pos.shape[:2], dtype=torch.bool)
        c = f.shape[-1]
        f_pos, y_pos = f.reshape(n, -1, c), self.y.reshape(n, -1)
        assert f_pos.shape[1] == y_pos.shape[1], (f.shape, self.y.shape)
        kept = y_pos != self.ignore_index
        return f_pos, torch.where(kept, y_pos, torch.zeros_like(y_pos)), kept

    @property
    def n_data(self) -> int:
        return int(self.positions()[2].sum())

    def unit_stats(self) -> Dict[str, Tensor]:
        f_pos, y_pos, kept = self.positions()
        if self.kind == "regression":
            return {"sse": ((y_pos - f_pos) ** 2).sum(), "n_outputs": torch.tensor(float(f_pos.numel()))}
        logp = torch.log_softmax(f_pos, -1).gather(-1, y_pos.unsqueeze(-1)).squeeze(-1)
        return {"loglik": (logp * kept).sum()}

    def lambdas(self, approx: str) -> Tensor:
        """Lambda_n (N, Q*C, Q*C) = block-diag over positions q of kept_q * Lambda_{n,q}."""
        f_pos, y_pos, kept = self.positions()
        n, q, c = f_pos.shape
        flat_y = y_pos.reshape(n * q, -1) if self.kind == "regression" else y_pos.reshape(n * q)
        lam = loss_hessians(f_pos.reshape(n * q, c), flat_y, self.kind, approx).reshape(n, q, c, c)
        lam = lam * kept[:, :, None, None].to(lam.dtype)
        return torch.einsum("nqcd,qr->nqcrd", lam, torch.eye(q, dtype=lam.dtype)).reshape(n, q * c, q * c)

    # ----- the hybrid Kronecker structure
    @property
    def eligible(self) -> Dict[str, nn.Module]:
        if self._eligible is None:
            self._eligible = kron_eligible(self.model, self.names, self.inputs)
        return self._eligible

    @property
    def records(self) -> List[LayerRecord]:
        if self._records is None:
            self._records = layer_records(self.model, self.inputs, self.eligible)
        return self._records

    def curvature_blocks(self, lam: Tensor) -> List[KronBlock]:
        dense_diag = torch.einsum("ncp,ncd,ndp->p", self.jac, lam, self.jac)
        return hybrid_blocks(self.model, self.names, self.inputs, lam, dense_diag, self.records)


def graph_problem(model: nn.Module, inputs, y: Tensor, kind: str, ignore_index: int = -100) -> GraphProblem:
    """A :class:`GraphProblem` over the parameters the library's prior covers (requires_grad)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return GraphProblem(model, names, inputs, y, kind, ignore_index)


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


# --------------------------------------------------------------------------------------------
# shared test cases
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def reference_env():
    """float64, a fixed seed and ONE intra-op thread (tiny ops: threads only add overhead).

    Import it into a test module to make it autouse there.
    """
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)


# --------------------------------------------------------------------------------------------
# models and data used by several test modules
# --------------------------------------------------------------------------------------------

BUILDERS = {"mlp_small": mlp_small, "mlp_deep": mlp_deep, "cnn": cnn}
N_OUT = {"regression": 2, "classification": 3}
_CACHE: dict = {}


def setup(model_name: str, kind: str, n: int = 40, n_out: Optional[int] = None, seed: int = 0):
    """(model, x, y, Problem), cached: the dense Jacobians do not depend on the structure.

    The cached model is shared between tests: do not modify it.
    """
    n_out = N_OUT[kind] if n_out is None else n_out
    key = (model_name, kind, n, n_out, seed)
    if key not in _CACHE:
        torch.manual_seed(seed)
        model = BUILDERS[model_name](n_out).double()
        x, y = make_data(model, n, kind, n_out, seed=seed + 1)
        if kind == "regression" and n_out == 1:
            y = y.reshape(-1)  # (B,) targets for a single output
        names = [name for name, _ in model.named_parameters()]
        _CACHE[key] = (model, x, y, Problem(model, names, x, y, kind))
    return _CACHE[key]


def hyper(
    model: nn.Module,
    kind: str,
    prior_structure: str = "layerwise",
    sigma: float = 0.7,
    temperature: Optional[float] = None,
    learn: bool = False,
):
    """The library's public prior and likelihood at non-trivial values (sigma != 1, T != 1, and
    distinct precisions per group, so that a mixed-up group mapping shows)."""
    from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior

    prior = GaussianPrior(model, precision=1.0, structure=prior_structure, learn=learn)
    g = prior.log_precision.numel()
    with torch.no_grad():
        if prior_structure == "diagonal":
            prior.log_precision.copy_(torch.randn(g, generator=torch.Generator().manual_seed(3)))
        else:
            prior.log_precision.copy_(torch.linspace(-1.0, 1.5, g) if g > 1 else torch.tensor([0.3]))
    if kind == "regression":
        lik = GaussianLikelihood(
            sigma=sigma, temperature=1.3 if temperature is None else temperature, learn_sigma=learn, learn_temperature=learn
        )
    else:
        lik = CategoricalLikelihood(temperature=0.8 if temperature is None else temperature, learn_temperature=learn)
    return prior, lik
