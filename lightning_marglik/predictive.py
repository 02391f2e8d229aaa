"""The linearized-Laplace posterior predictive (Immer et al. 2021, Eq. 11).

``f_lin(x*) ~ N(f(x*), J(x*) H^-1 J(x*)^T)`` with the posterior precision ``H`` of the evidence
(same structure: full, Kronecker or diagonal) at the current hyperparameters. Call it with the
weights the evidence was fitted at.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from .curvature import eval_mode, locate
from .curvature.functional import jacobian_rows
from .evidence import LaplaceEvidence
from .hyperparameters import CategoricalLikelihood, GaussianLikelihood
from .validators import choice

__all__ = ["RegressionPrediction", "linearized_outputs", "predict_regression", "predict_classification"]

CLASSIFICATION_METHODS = ("probit", "mc")


class RegressionPrediction(NamedTuple):
    """Gaussian predictive per output: ``mean`` and the variance split into its two parts."""

    mean: Tensor
    model_variance: Tensor  # epistemic: diag of J H^-1 J^T
    noise_variance: Tensor  # aleatoric: sigma^2

    @property
    def variance(self) -> Tensor:
        return self.model_variance + self.noise_variance


def linearized_outputs(evidence: LaplaceEvidence, model: nn.Module, x: Tensor) -> "tuple[Tensor, Tensor]":
    """Mean ``f(x)`` ``(B, C)`` and covariance ``J H^-1 J^T`` ``(B, C, C)`` of the linearized network.

    Args:
        evidence: A fitted evidence (its structure and hyperparameters define ``H``).
        model: The network, at the weights the evidence was fitted at.
        x: Inputs ``(B, ...)``.

    Returns:
        The output mean and covariance.

    Raises:
        ValueError: If the evidence is not finite (weights or curvature with NaN or inf, e.g. after a
            diverged run): there is no posterior to predict with.
    """
    if not torch.isfinite(evidence.log_marglik().detach()):
        raise ValueError(
            "The evidence is not finite at these weights (NaN or inf in the weights or the curvature, e.g. a run "
            "that diverged): the linearized predictive has no posterior to use. Check the weights, or fit the "
            "evidence again at finite ones."
        )
    prior = evidence.prior
    names, _ = locate(model, prior)  # any graph: the Jacobian comes from torch.func
    params = prior.params
    x = x.to(params[0].device)
    with eval_mode(model), torch.no_grad():
        mean = model(x)
    b, c = mean.shape
    identity = torch.eye(c, dtype=mean.dtype, device=mean.device).expand(b, c, c)
    with eval_mode(model):
        jacobians = jacobian_rows(model, names, params, x, identity).reshape(b, c, -1)
    return mean, evidence.jacobian_covariance(jacobians)


def predict_regression(evidence: LaplaceEvidence, model: nn.Module, x: Tensor) -> RegressionPrediction:
    """Closed-form Gaussian predictive for a ``GaussianLikelihood``.

    Raises:
        TypeError: If the evidence's likelihood is not Gaussian.
    """
    if not isinstance(evidence.likelihood, GaussianLikelihood):
        raise TypeError("predict_regression needs a GaussianLikelihood; use predict_classification.")
    mean, cov = linearized_outputs(evidence, model, x)
    noise = (evidence.likelihood.sigma.detach() ** 2).to(mean).expand_as(mean)
    return RegressionPrediction(mean, torch.diagonal(cov, dim1=1, dim2=2).to(mean), noise)


def predict_classification(
    evidence: LaplaceEvidence,
    model: nn.Module,
    x: Tensor,
    method: str = "probit",
    samples: int = 100,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Class probabilities ``(B, C)`` under the linearized posterior.

    Args:
        evidence: A fitted evidence with a ``CategoricalLikelihood``.
        model: The network at the fitted weights.
        x: Inputs.
        method: ``"probit"`` (deterministic: ``softmax(f / sqrt(1 + pi/8 var))``) or ``"mc"``
            (average softmax over ``samples`` draws of the linearized outputs).
        samples: Monte-Carlo draws for ``method="mc"``.
        generator: Random generator for the draws.

    Returns:
        Predictive class probabilities.

    Raises:
        TypeError: If the likelihood is not categorical.
        ValueError: On an unknown method or ``samples < 1``.
    """
    if not isinstance(evidence.likelihood, CategoricalLikelihood):
        raise TypeError("predict_classification needs a CategoricalLikelihood; use predict_regression.")
    method = choice(method, CLASSIFICATION_METHODS, "method")
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"`samples` must be an int >= 1, got {samples!r}.")
    mean, cov = linearized_outputs(evidence, model, x)
    cov = cov.to(mean)
    if method == "probit":
        variance = torch.diagonal(cov, dim1=1, dim2=2)
        return torch.softmax(mean / torch.sqrt(1 + math.pi / 8 * variance), dim=1)
    # a small jitter keeps the Cholesky factor of a rank-deficient covariance defined
    jitter = 1e-10 * torch.eye(cov.shape[1], dtype=cov.dtype, device=cov.device)
    chol = torch.linalg.cholesky(cov + jitter)
    noise = torch.randn(samples, *mean.shape, dtype=mean.dtype, generator=generator).to(mean.device)
    draws = mean + torch.einsum("bcd,sbd->sbc", chol, noise)
    return torch.softmax(draws, dim=2).mean(0)
