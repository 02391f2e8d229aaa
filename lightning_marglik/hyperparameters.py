"""Prior and likelihood objects that own the log-parameterised hyperparameters.

Every hyperparameter is a *buffer* (never an ``nn.Parameter``): it moves with ``.to()``, is saved
in checkpoints and ignored by DDP, and the user's optimizer never sees it. The evidence engine
optimizes copies of these tensors and writes the results back.

Conventions (one everywhere: MAP loss, evidence, docs):

* Prior ``N(0, 1/delta_g I)`` per group ``g``.
* Tempered likelihood ``p(y|f)^(1/T)``: the log-likelihood *and* the curvature (GGN or EF) are
  divided by the temperature ``T``.
* Gaussian likelihood: the GGN scales with ``1/sigma^2``, the empirical Fisher (outer product of
  the score ``J^T (y - f) / sigma^2``) with ``1/sigma^4``.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

__all__ = ["GaussianPrior", "GaussianLikelihood", "CategoricalLikelihood", "Likelihood", "map_loss"]

PRIOR_STRUCTURES = ("scalar", "layerwise", "diagonal")
APPROXIMATIONS = ("ggn", "ef")


def _log_buffer(value: float, name: str) -> Tensor:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive finite number, got {value}.")
    return torch.tensor(math.log(value))


class GaussianPrior(nn.Module):
    """Isotropic Gaussian prior ``N(0, 1/delta_g I)`` over groups of a network's parameters.

    The prior covers every parameter of ``model`` that requires grad at construction. It keeps a
    plain (unregistered) reference to ``model``, so adding the prior to a ``LightningModule``
    does not duplicate the network's parameters or expose the precision to the user's optimizer.

    Args:
        model: The network whose parameters the prior covers.
        precision: Initial prior precision ``delta`` (same for every group).
        structure: ``"scalar"`` (one precision), ``"layerwise"`` (one per parameter tensor: a
            layer's weight and bias are separate groups) or ``"diagonal"`` (one per scalar).
        learn: Whether the marginal likelihood optimizes the precision.

    Raises:
        ValueError: On an unknown structure, a non-positive precision or a model without
            trainable parameters.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> prior = GaussianPrior(net, precision=1.0, structure="layerwise")
        >>> prior.precision.shape
        torch.Size([4])
    """

    log_precision: Tensor

    def __init__(
        self, model: nn.Module, precision: float = 1.0, structure: str = "layerwise", learn: bool = True
    ) -> None:
        super().__init__()
        if structure not in PRIOR_STRUCTURES:
            raise ValueError(f"`structure` must be one of {PRIOR_STRUCTURES}, got {structure!r}.")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("GaussianPrior: the model has no parameters that require grad.")
        object.__setattr__(self, "model", model)  # a plain reference: not a submodule
        self.structure = structure
        self.learn = bool(learn)
        self.param_names: List[str] = [n for n, _ in named]
        self.param_sizes: List[int] = [p.numel() for _, p in named]
        n_groups = {"scalar": 1, "layerwise": len(named), "diagonal": sum(self.param_sizes)}[structure]
        log_prec = _log_buffer(precision, "precision").repeat(n_groups)
        self.register_buffer("log_precision", log_prec)

    @property
    def params(self) -> List[Tensor]:
        """The covered parameter tensors, in ``param_names`` order."""
        found = dict(self.model.named_parameters())
        missing = [n for n in self.param_names if n not in found]
        if missing:
            raise RuntimeError(f"GaussianPrior: parameters {missing} are no longer in the model.")
        return [found[n] for n in self.param_names]

    @property
    def n_params(self) -> int:
        return sum(self.param_sizes)

    @property
    def precision(self) -> Tensor:
        return self.log_precision.exp()

    def group_sizes(self) -> Tensor:
        """Number of scalar parameters ``P_g`` in each group, shape ``(G,)``."""
        sizes = torch.tensor(self.param_sizes, dtype=self.log_precision.dtype, device=self.log_precision.device)
        if self.structure == "scalar":
            return sizes.sum().reshape(1)
        if self.structure == "layerwise":
            return sizes
        return torch.ones_like(self.log_precision)

    def group_sq_norms(self, params: Optional[List[Tensor]] = None) -> Tensor:
        """Squared norms ``||theta_g||^2`` per group, shape ``(G,)``."""
        params = self.params if params is None else params
        if self.structure == "diagonal":
            return torch.cat([p.reshape(-1) for p in params]).pow(2)
        norms = torch.stack([p.pow(2).sum() for p in params])
        return norms.sum().reshape(1) if self.structure == "scalar" else norms

    def per_tensor(self, log_precision: Tensor) -> Tensor:
        """Log precision of each parameter tensor, shape ``(n_tensors,)``.

        Raises:
            ValueError: For the diagonal structure, which has no per-tensor precision.
        """
        if self.structure == "diagonal":
            raise ValueError(
                "A diagonal prior has one precision per scalar parameter and cannot be combined with "
                "Kronecker curvature; use structure='diag' or 'full', or a 'layerwise' prior."
            )
        return log_precision.expand(len(self.param_sizes)) if self.structure == "scalar" else log_precision

    def per_parameter(self, log_precision: Tensor) -> Tensor:
        """Log precision of each scalar parameter, flattened in ``param_names`` order, shape ``(P,)``."""
        if self.structure == "diagonal":
            return log_precision
        sizes = torch.tensor(self.param_sizes, device=log_precision.device)
        return self.per_tensor(log_precision).repeat_interleave(sizes)

    def penalty(self) -> Tensor:
        """``1/2 sum_g delta_g ||theta_g||^2`` at the current precision (the MAP loss term)."""
        return 0.5 * (self.precision.detach() * self.group_sq_norms()).sum()

    def extra_repr(self) -> str:
        return f"structure={self.structure!r}, groups={self.log_precision.numel()}, learn={self.learn}"


class Likelihood(nn.Module):
    """Base class of the likelihoods: a tempered ``p(y|f)^(1/T)`` with a learnable temperature.

    Subclasses define the per-datum negative log-likelihood, the sufficient statistics of the
    data term, and a square root of the loss Hessian used by the curvature pass.
    """

    log_temperature: Tensor

    def __init__(self, temperature: float = 1.0, learn_temperature: bool = False) -> None:
        super().__init__()
        self.register_buffer("log_temperature", _log_buffer(temperature, "temperature"))
        self.learn_temperature = bool(learn_temperature)

    @property
    def temperature(self) -> Tensor:
        return self.log_temperature.exp()

    def hyperparameters(self) -> Dict[str, Tensor]:
        """The log hyperparameter buffers by name."""
        return {"log_temperature": self.log_temperature}

    def learnable(self) -> List[str]:
        """Names of the log hyperparameters the evidence optimizes."""
        return ["log_temperature"] if self.learn_temperature else []

    def check_target(self, output: Tensor, target: Tensor) -> Tensor:
        """Validate a batch and return the target in the shape the likelihood works with."""
        raise NotImplementedError

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Untempered negative log-likelihood per datum at the current hyperparameters, shape ``(B,)``."""
        raise NotImplementedError

    def statistics(self, output: Tensor, target: Tensor) -> Dict[str, Tensor]:
        """Sum-reduced sufficient statistics of the data term for one batch."""
        raise NotImplementedError

    def log_likelihood(self, stats: Dict[str, Tensor], log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
        """Tempered log-likelihood ``log p(D|theta) / T`` from the summed statistics."""
        raise NotImplementedError

    def hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        """Factor ``L_n`` (shape ``(B, C, k)``) with ``L_n L_n^T`` the per-datum curvature in ``f``.

        Taken at unit noise and temperature; :meth:`curvature_scale` restores both.
        """
        raise NotImplementedError

    def curvature_scale(self, approx: str, log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
        """The factor ``s`` of ``H = s C + diag(delta)`` for the unit-scale curvature ``C``."""
        raise NotImplementedError


class GaussianLikelihood(Likelihood):
    """Gaussian likelihood ``N(y | f, sigma^2 I)`` for regression, with learnable noise.

    Args:
        sigma: Initial observation noise standard deviation.
        temperature: Likelihood temperature ``T`` (``p^(1/T)``; ``T < 1`` up-weights the data).
        learn_sigma: Whether the marginal likelihood optimizes ``sigma``.
        learn_temperature: Whether the marginal likelihood optimizes ``T``.

    Example:
        >>> lik = GaussianLikelihood(sigma=0.5)
        >>> round(float(lik.sigma), 3)
        0.5
    """

    log_sigma: Tensor

    def __init__(
        self, sigma: float = 1.0, temperature: float = 1.0, learn_sigma: bool = True, learn_temperature: bool = False
    ) -> None:
        super().__init__(temperature, learn_temperature)
        self.register_buffer("log_sigma", _log_buffer(sigma, "sigma"))
        self.learn_sigma = bool(learn_sigma)

    @property
    def sigma(self) -> Tensor:
        return self.log_sigma.exp()

    def hyperparameters(self) -> Dict[str, Tensor]:
        return {**super().hyperparameters(), "log_sigma": self.log_sigma}

    def learnable(self) -> List[str]:
        return super().learnable() + (["log_sigma"] if self.learn_sigma else [])

    def check_target(self, output: Tensor, target: Tensor) -> Tensor:
        if output.dim() != 2:
            raise ValueError(f"GaussianLikelihood expects outputs of shape (batch, outputs), got {tuple(output.shape)}.")
        if target.dim() == 1 and output.shape[1] == 1:
            target = target.unsqueeze(1)
        if target.shape != output.shape:
            raise ValueError(
                f"GaussianLikelihood: target shape {tuple(target.shape)} does not match output shape "
                f"{tuple(output.shape)}."
            )
        return target.to(output.dtype)

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        target = self.check_target(output, target)
        sigma2 = self.sigma.detach() ** 2
        c = output.shape[1]
        return 0.5 * ((target - output) ** 2).sum(1) / sigma2 + 0.5 * c * torch.log(2 * math.pi * sigma2)

    def statistics(self, output: Tensor, target: Tensor) -> Dict[str, Tensor]:
        target = self.check_target(output, target)
        return {"sse": ((target - output) ** 2).sum(), "n_outputs": torch.tensor(float(target.numel()))}

    def log_likelihood(self, stats: Dict[str, Tensor], log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
        assert log_sigma is not None
        loglik = -0.5 * stats["n_outputs"] * (math.log(2 * math.pi) + 2 * log_sigma) - 0.5 * stats["sse"] * torch.exp(
            -2 * log_sigma
        )
        return loglik * torch.exp(-log_temperature)

    def hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        b, c = output.shape
        if approx == "ef":
            return (self.check_target(output, target) - output).unsqueeze(2)
        if mc_samples:
            noise = torch.randn(b, c, mc_samples, dtype=output.dtype, generator=generator).to(output.device)
            return noise / math.sqrt(mc_samples)
        return torch.eye(c, dtype=output.dtype, device=output.device).expand(b, c, c)

    def curvature_scale(self, approx: str, log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
        assert log_sigma is not None
        power = 4 if approx == "ef" else 2  # the score carries 1/sigma^2, its outer product 1/sigma^4
        return torch.exp(-power * log_sigma - log_temperature)

    def extra_repr(self) -> str:
        return f"learn_sigma={self.learn_sigma}, learn_temperature={self.learn_temperature}"


class CategoricalLikelihood(Likelihood):
    """Categorical likelihood ``softmax(f)`` over class logits for classification.

    Args:
        temperature: Likelihood temperature ``T`` (``p^(1/T)``; ``T < 1`` up-weights the data).
        learn_temperature: Whether the marginal likelihood optimizes ``T``.

    Example:
        >>> lik = CategoricalLikelihood()
        >>> lik.nll(torch.zeros(2, 4), torch.tensor([0, 3])).tolist() == [math.log(4)] * 2
        True
    """

    def check_target(self, output: Tensor, target: Tensor) -> Tensor:
        if output.dim() != 2:
            raise ValueError(f"CategoricalLikelihood expects logits of shape (batch, classes), got {tuple(output.shape)}.")
        if target.dim() != 1 or target.shape[0] != output.shape[0] or target.dtype.is_floating_point:
            raise ValueError(
                f"CategoricalLikelihood expects integer class labels of shape ({output.shape[0]},), got "
                f"{tuple(target.shape)} of {target.dtype}."
            )
        return target

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output, self.check_target(output, target), reduction="none")

    def statistics(self, output: Tensor, target: Tensor) -> Dict[str, Tensor]:
        return {"log_lik": -self.nll(output, target).sum()}

    def log_likelihood(self, stats: Dict[str, Tensor], log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
        return stats["log_lik"] * torch.exp(-log_temperature)

    def hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        probs = output.softmax(1)
        if approx == "ef":
            onehot = nn.functional.one_hot(self.check_target(output, target), output.shape[1]).to(output.dtype)
            return (onehot - probs).unsqueeze(2)
        if mc_samples:
            draws = torch.multinomial(probs.detach().cpu().double(), mc_samples, replacement=True, generator=generator)
            onehot = nn.functional.one_hot(draws.to(output.device), output.shape[1]).to(output.dtype)
            return (onehot - probs.unsqueeze(1)).transpose(1, 2) / math.sqrt(mc_samples)
        # diag(p) - p p^T = (diag(sqrt p) - p sqrt(p)^T)(diag(sqrt p) - p sqrt(p)^T)^T
        sqrt_p = probs.sqrt()
        return torch.diag_embed(sqrt_p) - probs.unsqueeze(2) * sqrt_p.unsqueeze(1)

    def curvature_scale(self, approx: str, log_sigma: Optional[Tensor], log_temperature: Tensor) -> Tensor:
        return torch.exp(-log_temperature)


def map_loss(
    output: Tensor, target: Tensor, likelihood: Likelihood, prior: GaussianPrior, n_data: int
) -> Tensor:
    """The MAP training loss that matches the evidence: ``mean_n -log p(y_n|f_n) / T + penalty / N``.

    The hyperparameters enter detached: only the network's weights receive gradients. Do not add
    weight decay in the optimizer as well: the prior term already is the weight decay.

    Args:
        output: Network outputs of the batch, shape ``(B, C)``.
        target: Targets of the batch.
        likelihood: The likelihood whose temperature (and noise) the loss uses.
        prior: The prior whose precisions the loss uses.
        n_data: Number of training examples ``N`` (the whole data set, not the batch).

    Returns:
        The scalar loss.

    Raises:
        ValueError: If ``n_data`` is not positive.
    """
    if n_data <= 0:
        raise ValueError(f"`n_data` must be the positive training set size, got {n_data}.")
    data_term = likelihood.nll(output, target).mean() / likelihood.temperature.detach()
    return data_term + prior.penalty() / n_data
