"""Dense brute-force references for the Laplace evidence, written from first principles.

Nothing here calls into ``lightning_marglik`` except to *read* the public hyperparameter
objects' buffers (``prior.log_precision``, ``likelihood.log_sigma``, ...) and the prior's
``param_names``/``structure``. Every curvature quantity is built from explicit per-datum
Jacobians (``torch.func.jacrev``), explicit loss Hessians and dense
``torch.logdet``.

Conventions (DESIGN.md):

    log q = loglik/T - 1/2 sum_p delta_p theta_p^2 + 1/2 sum_p log delta_p - 1/2 log|H|
    H     = s C + diag(delta)           (delta expanded to one value per scalar parameter)
    C     = sum_n J_n^T Lambda_n J_n    (GGN)   or   sum_n J_n^T r_n r_n^T J_n   (EF)

    Gaussian:    Lambda = I,              r = y - f,          s = 1/(sigma^2 T) (GGN), 1/(sigma^4 T) (EF)
    Categorical: Lambda = diag(p) - pp^T, r = onehot(y) - p,  s = 1/T
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap
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
    """
    offsets = _param_offsets(model, names)
    blocks: List[KronBlock] = []
    for i, layer, a, jac in layers:
        n, c_out = jac.shape[:2]
        if isinstance(layer, nn.Conv2d):
            jb = jac.reshape(n, c_out, layer.out_channels, -1)  # (N, C, out_ch, R)
            g_sum = torch.einsum("ncor,ncd,ndqr->oq", jb, lam, jb)
            cols = F.unfold(a, layer.kernel_size, layer.dilation, layer.padding, layer.stride)  # (N, in*k*k, R)
            a_sum = torch.einsum("nkr,nlr->kl", cols, cols)  # summed over data and positions
            a_count = n * cols.shape[2]
        else:
            g_sum = torch.einsum("nco,ncd,ndq->oq", jac, lam, jac)
            a_sum = a.T @ a
            a_count = n
        a_mean = a_sum / a_count
        if id(layer.weight) in offsets:  # (a frozen tensor is not in the prior: no block)
            lo, hi = offsets[id(layer.weight)]
            blocks.append(KronBlock(torch.arange(lo, hi), torch.kron(g_sum, a_mean), f"{i}.weight", (g_sum, a_mean)))
        if layer.bias is not None and id(layer.bias) in offsets:
            lo, hi = offsets[id(layer.bias)]
            blocks.append(KronBlock(torch.arange(lo, hi), g_sum.clone(), f"{i}.bias", (g_sum,)))
    return blocks


# --------------------------------------------------------------------------------------------
# the reference evidence
# --------------------------------------------------------------------------------------------


class Problem:
    """Hyperparameter- and structure-independent quantities of (model, data): f, J, layer Jacobians."""

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
        self.stats = unit_log_likelihood(problem.f, problem.y, kind)
        lam = loss_hessians(problem.f, problem.y, kind, approx)
        self.full = torch.einsum("ncp,ncd,ndq->pq", problem.jac, lam, problem.jac)  # dense unit-scale curvature
        if structure == "kron":
            self.blocks = kron_blocks(problem.model, problem.names, problem.layers, lam)
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
