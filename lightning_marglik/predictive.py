"""The linearized-Laplace posterior predictive (Immer et al. 2021, Eq. 11).

``f_lin(x*) ~ N(f(x*), J(x*) H^-1 J(x*)^T)`` with the posterior precision ``H`` of the evidence
(same structure: full, Kronecker or diagonal) at the current hyperparameters. Call it with the
weights the evidence was fitted at: every predictive here refuses others (:meth:`LaplaceEvidence.fitted_at`).
:func:`predict` is the one call after a Lightning fit (the callback's last estimate, checked against the module),
e.g. in a ``predict_step``.
"""
from __future__ import annotations

import logging
import math
import warnings
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .curvature import eval_mode, locate
from .curvature.batches import batch_size, call_model, move, non_finite_rows
from .curvature.functional import jacobian_rows
from .curvature.hooks import layer_input
from .curvature.statistics import RankOneJacobian
from .curvature.structures import KronStructure
from .evidence import LaplaceEvidence
from .hyperparameters import CategoricalLikelihood, GaussianLikelihood, GaussianPrior
from .validators import choice, integer

__all__ = [
    "RegressionPrediction", "linearized_outputs", "over_confident", "predict", "predict_classification",
    "predict_regression", "training_confidence",
]

log = logging.getLogger(__name__)

CLASSIFICATION_METHODS = ("probit", "tempered", "mc")


class RegressionPrediction(NamedTuple):
    """Gaussian predictive per output: ``mean`` and the variance split into its two parts."""

    mean: Tensor
    model_variance: Tensor  # epistemic: diag of J H^-1 J^T
    noise_variance: Tensor  # aleatoric: sigma^2

    @property
    def variance(self) -> Tensor:
        return self.model_variance + self.noise_variance


def linearized_outputs(evidence: LaplaceEvidence, model: nn.Module, x: Tensor) -> "tuple[Tensor, Tensor]":
    """Mean ``f(x)`` ``(B, C)`` and covariance ``J H^-1 J^T`` ``(B, C, C)`` of the linearized network, detached.

    Args:
        evidence: A fitted evidence (its structure and hyperparameters define ``H``).
        model: The network, at the weights the evidence was fitted at.
        x: Inputs ``(B, ...)`` (a tensor, or a tuple or dict of them as ``forward`` takes them), moved to the
            weights' device and floating dtype.

    Returns:
        The output mean and covariance.

    Raises:
        TypeError: If ``evidence`` is not a :class:`LaplaceEvidence` (e.g. the network passed first).
        ValueError: If the evidence is not finite (weights or curvature with NaN or inf, e.g. after a
            diverged run): there is no posterior to predict with; if the prior's weights or the network's running
            statistics are no longer those the evidence was fitted at (trained further, a checkpoint loaded); if
            the forward fails on ``x``, its outputs are not ``(B, C)`` with ``B >= 1``, or some are not finite.
    """
    _check_evidence(evidence, "linearized_outputs(evidence, model, x)")
    return _linearized(evidence, model, x, "linearized_outputs")


def _check_evidence(evidence: Any, call: str) -> None:
    """Refuse an ``evidence`` that is not one (most often the network, passed first).

    Raises:
        TypeError: If ``evidence`` is not a :class:`LaplaceEvidence`.
    """
    if not isinstance(evidence, LaplaceEvidence):
        raise TypeError(f"{call} got a {type(evidence).__name__} as `evidence`: pass a LaplaceEvidence "
                        "(LaplaceEvidence.fit(...), or a MargLikCallback's callback.evidence), then the network.")


def _require_fitted(evidence: LaplaceEvidence, call: str) -> None:
    """Refuse an evidence whose posterior belongs to other weights than the prior's now (:meth:`~LaplaceEvidence.
    fitted_at`): ``H`` of other weights gives a predictive variance that is silently wrong, not a rough one.

    Args:
        evidence: The evidence to predict with.
        call: The caller's name, which the message starts with.

    Raises:
        ValueError: If the prior's weights are not finite, or they or the network's running statistics
            (BatchNorm's) are not those the evidence was fitted at.
    """
    params = evidence.prior.params
    if evidence.fitted_at(params):
        return
    if not all(bool(torch.isfinite(p).all()) for p in params):  # NaN weights never match a fingerprint
        raise ValueError(f"{call}: the module's weights are not finite: training diverged, or the training data "
                         "hold NaN or inf (MargLikCallback refuses them in its set-up batch only).")
    raise ValueError(
        f"{call}: the module's weights, or its running statistics (BatchNorm's), are not those of the "
        "posterior's estimate (a checkpoint loaded, training went on after it, or forwards in train mode updated "
        "the running statistics): fit one at these weights, evidence = LaplaceEvidence.fit(module, "
        "train_loader, module.likelihood, module.prior), and pass it instead.")


# a prediction, not a graph: the Jacobians of a kron layer's bias hold its weight as a constant that requires grad,
# which would hand the caller tensors that require grad (``.numpy()`` refuses them) and whose ``backward`` writes
# ``.grad`` into the network's weights; without the graph the pass is cheaper as well
@torch.no_grad()
def _linearized(evidence: LaplaceEvidence, model: nn.Module, x: Any, call: str) -> "tuple[Tensor, Tensor]":
    """:func:`linearized_outputs`, its refusals named after ``call``."""
    if not torch.isfinite(evidence.log_marglik().detach()):
        raise ValueError(
            "The evidence is not finite at these weights (NaN or inf in the weights or the curvature, e.g. a run "
            "that diverged): the linearized predictive has no posterior to use. Check the weights, or fit the "
            "evidence again at finite ones."
        )
    # after the finite check: an evidence fitted at NaN weights is named as that, not as one of other weights
    _require_fitted(evidence, call)
    mean, blocks = _jacobian_blocks(evidence, model, x)
    return mean, evidence._block_covariance(blocks)


def _jacobian_blocks(evidence: LaplaceEvidence, model: nn.Module, x: Any) -> "tuple[Tensor, List[Any]]":
    """The eval-mode outputs ``(B, C)`` and their Jacobians per prior tensor (float64): ``(B, C, numel)``, or a
    :class:`~.curvature.statistics.RankOneJacobian` for the weight of an ``nn.Linear`` on inputs ``(B, in)``
    (:func:`_rank_one_layers`)."""
    prior = evidence.prior
    candidates = _rank_one_layers(evidence, model)
    inputs: Dict[nn.Module, List[Tensor]] = {module: [] for module in candidates}
    def record(module: nn.Module, args: Any, kwargs: Any, _: Any) -> None:
        given = layer_input(module, args, kwargs)  # a keyword call (self.head(input=h)) too; none: no rank-one form
        if given is not None:
            inputs[module].append(given)

    handles = [module.register_forward_hook(record, with_kwargs=True) for module in candidates]
    try:
        mean, x = _outputs(prior, model, x)
    finally:
        for handle in handles:
            handle.remove()
    # called once, on one row per input (B, in): the weight's Jacobian is g a^T, its g the bias's Jacobian
    b = mean.shape[0]
    rank_one = {candidates[m]: seen[0] for m, seen in inputs.items()
                if len(seen) == 1 and seen[0].dim() == 2 and seen[0].shape[0] == b}
    names, _ = locate(model, prior)
    factored = {weight for weight, _ in rank_one}
    rows = [i for i in range(len(prior.params)) if i not in factored]
    flat = _class_rows(model, [names[i] for i in rows], [prior.params[i] for i in rows], x, mean)
    blocks: List[Any] = [None] * len(prior.params)
    for i, block in zip(rows, flat.to(torch.float64).split([prior.param_sizes[i] for i in rows], 2)):
        blocks[i] = block
    for (weight, bias), a in rank_one.items():
        blocks[weight] = RankOneJacobian(blocks[bias], a.to(torch.float64))
    return mean, blocks


def _rank_one_layers(evidence: LaplaceEvidence, model: nn.Module) -> Dict[nn.Module, Tuple[int, int]]:
    """The ``nn.Linear`` layers of the evidence's ``kron`` structures whose weight and bias are both prior tensors
    (their indices): on inputs ``(B, in)``, row ``b`` input ``b``'s, their weight's Jacobian is the bias's times the
    input."""
    prior, found = evidence.prior, {}
    for structure in evidence.structures:
        if type(structure) is not KronStructure:  # EKFAC's moments take the whole Jacobian
            continue
        for layer, shape in zip(structure.layers, structure.shapes):
            module, roles = layer.module, layer.roles
            if (type(module) is nn.Linear and {"weight", "bias"} <= roles.keys() and shape.groups == 1
                    and not shape.transposed and not shape.diagonal_input
                    and prior.params[roles["weight"]] is module.weight and prior.params[roles["bias"]] is module.bias):
                found[module] = (roles["weight"], roles["bias"])
    return found


def output_jacobians(prior: GaussianPrior, model: nn.Module, x: Any) -> "tuple[Tensor, Tensor]":
    """The eval-mode outputs ``f(x)`` ``(B, C)`` and their Jacobians ``(B, C, P)`` in the prior's tensors (its order).

    Raises:
        ValueError: If the forward fails on ``x``, its outputs are not ``(B, C)`` with ``B >= 1``, or some are not
            finite (a NaN or inf input).
    """
    names, _ = locate(model, prior)  # any graph: the Jacobian comes from torch.func
    mean, x = _outputs(prior, model, x)
    return mean, _class_rows(model, names, prior.params, x, mean)


def _class_rows(model: nn.Module, names: List[str], params: List[Tensor], x: Any, mean: Tensor) -> Tensor:
    """The Jacobians ``(B, C, P)`` of the eval-mode outputs ``mean`` in ``params`` (flattened in order)."""
    b, c = mean.shape
    identity = torch.eye(c, dtype=mean.dtype, device=mean.device).expand(b, c, c)
    with eval_mode(model):
        return jacobian_rows(model, names, params, x, identity).reshape(b, c, -1)


def _outputs(prior: GaussianPrior, model: nn.Module, x: Any) -> "tuple[Tensor, Any]":
    """The eval-mode outputs ``f(x)`` ``(B, C)``, checked, and ``x`` on the weights' device and dtype.

    Raises:
        ValueError: As :func:`output_jacobians`.
    """
    params = prior.params
    x = move(x, params[0].device, params[0].dtype)
    try:
        with eval_mode(model), torch.no_grad():
            mean = call_model(model, x)
    except Exception as err:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"The network's forward failed on inputs {shape} ({type(err).__name__}: {err}): pass a "
                         "batch of inputs as training's forward took them.") from err
    if mean.dim() > 2 and mean.shape[0] == batch_size(x):
        raise ValueError(f"The network's outputs have shape {tuple(mean.shape)}: one output per position of each "
                         "input (e.g. a token classifier or a language model), where predict gives one predictive "
                         "per input, of (batch, outputs). The evidence takes such outputs; the predictive has no "
                         "per-position form: call predict on a network that returns (batch, outputs).")
    if mean.dim() != 2 or mean.shape[0] != batch_size(x) or mean.shape[0] == 0:
        raise ValueError(f"The network's outputs have shape {tuple(mean.shape)}, where predict needs one output "
                         f"vector per input, (batch, outputs) with batch {batch_size(x)} (the inputs' first "
                         "dimension): pass a batch of at least one input (x[None] for one input), to a forward that "
                         "returns one output vector per input.")
    bad = non_finite_rows(mean)
    if bad:
        raise ValueError(f"The network's outputs are not finite for {len(bad)} of {mean.shape[0]} inputs (rows "
                         f"{bad[:5]}{', ...' if len(bad) > 5 else ''}): check those inputs for NaN or inf.")
    return mean, x


def predict_regression(evidence: LaplaceEvidence, model: nn.Module, x: Tensor) -> RegressionPrediction:
    """Closed-form Gaussian predictive for a ``GaussianLikelihood``.

    Raises:
        TypeError: If ``evidence`` is not a :class:`LaplaceEvidence`, or its likelihood is not Gaussian.
        ValueError: As :func:`linearized_outputs` (weights other than the evidence's included).
    """
    _check_evidence(evidence, "predict_regression(evidence, model, x)")
    if not isinstance(evidence.likelihood, GaussianLikelihood):
        raise TypeError("predict_regression needs a GaussianLikelihood; use predict_classification.")
    mean, cov = _linearized(evidence, model, x, "predict_regression")
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
        method: ``"probit"`` (deterministic: ``softmax(f / sqrt(1 + pi/8 var))``, laplace-torch's),
            ``"tempered"`` (the logits divided by one probit scale per input, :func:`class_probabilities`)
            or ``"mc"`` (average softmax over ``samples`` draws of the linearized outputs).
        samples: Monte-Carlo draws for ``method="mc"``.
        generator: Random generator for the draws.

    Returns:
        Predictive class probabilities.

    Raises:
        TypeError: If ``evidence`` is not a :class:`LaplaceEvidence`, or its likelihood is not categorical.
        ValueError: On an unknown method or ``samples < 1``; as :func:`linearized_outputs` (weights other than the
            evidence's included).
    """
    _check_evidence(evidence, "predict_classification(evidence, model, x)")
    if not isinstance(evidence.likelihood, CategoricalLikelihood):
        raise TypeError("predict_classification needs a CategoricalLikelihood; use predict_regression.")
    method = choice(method, CLASSIFICATION_METHODS, "method")
    return _classification(evidence, model, x, method, samples, generator)[1]


def _classification(evidence: LaplaceEvidence, model: nn.Module, x: Tensor, method: str, samples: int,
                    generator: Optional[torch.Generator]) -> "tuple[Tensor, Tensor]":
    """The network's outputs ``(B, C)`` and :func:`predict_classification`'s probabilities."""
    integer(samples, "samples", minimum=1)
    mean, cov = _linearized(evidence, model, x, "predict_classification")
    return mean, class_probabilities(mean, cov, method, samples, generator)


def _near_uniform_message(network: Tensor, predictive: Tensor) -> Optional[str]:
    """Why a predictive near uniform where the network is confident is worth a warning, or ``None``.

    Near uniform: the mean top probability of ``predictive`` ``(B, C)`` is within a tenth of the way from ``1/C``
    to 1. Confident: that of ``network`` (its softmax) is past half of it.

    Example:
        >>> confident = torch.tensor([[0.97, 0.01, 0.01, 0.01]])
        >>> _near_uniform_message(confident, torch.full((1, 4), 0.25)) is not None
        True
        >>> _near_uniform_message(confident, torch.tensor([[0.6, 0.2, 0.1, 0.1]])) is None
        True
    """
    uniform = 1.0 / predictive.shape[1]
    ours, own = (float(p.max(1).values.mean()) for p in (predictive, network))
    if ours - uniform >= 0.1 * (1 - uniform) or own - uniform < 0.5 * (1 - uniform):
        return None
    return (f"predict: the predictive is near uniform on this batch (mean top probability {ours:.3f}; uniform "
            f"{uniform:.3f}) where the network's own softmax is confident ({own:.3f}): the posterior's logit variance "
            "swamps the logits. A network that fits its training data leaves the posterior close to the prior in "
            "most directions (on the 100-class MLPs of benchmarks/results/predictive.md: NLL 3.8 against the "
            "network's 0.011). On out-of-distribution inputs this is the point; for probabilities of "
            "in-distribution inputs, the network's own softmax did better in 20 of the 21 cells measured there, "
            "and predict's default (method='auto') returns it unless the network is over-confident on its "
            "training data.")


def class_probabilities(mean: Tensor, cov: Tensor, method: str = "probit", samples: int = 100,
                        generator: Optional[torch.Generator] = None) -> Tensor:
    """Class probabilities ``(B, C)`` of Gaussian logits ``N(mean, cov)`` (``(B, C)``, ``(B, C, C)``): the probit
    approximation ``softmax(mean / sqrt(1 + pi/8 diag(cov)))``, the tempered one, or the average softmax of
    ``samples`` draws.

    ``"tempered"`` is ``softmax(mean / sqrt(1 + pi/8 v))`` with one ``v`` per input: the mean variance of the
    logits centred over the classes, ``f - mean_c(f)``. The softmax ignores a shift common to all logits, so the
    variance the logits share (a last layer's feature uncertainty moves them together) is left out, which the
    probit's per-class scales count; and one scale per input keeps the network's predicted class. On the
    predictive study's cells its NLL is below MC's and the probit's in every run, its accuracy the network's
    (``benchmarks/results/predictive.md``).

    Example:
        >>> mean = torch.tensor([[2.0, 0.0]])
        >>> shared = torch.full((1, 2, 2), 50.0)  # the two logits move together: their difference is certain
        >>> class_probabilities(mean, shared, "tempered").allclose(mean.softmax(1))
        True
        >>> plain = class_probabilities(mean, shared, "probit")  # flattened by the variance the logits share
        >>> round(float(mean.softmax(1)[0, 0]), 2), round(float(plain[0, 0]), 2)
        (0.88, 0.61)
    """
    if method == "mc":
        noise = torch.randn(samples, *mean.shape, dtype=mean.dtype, generator=generator).to(mean.device)
        draws = mean + torch.einsum("bcd,sbd->sbc", covariance_root(cov.to(mean.device), mean.dtype), noise)
        return torch.softmax(draws, dim=2).mean(0)
    cov = cov.to(mean)
    if method == "tempered":
        row_means = cov.mean(2)  # the centred logits' variances: diag(cov) - 2 row means + the grand mean
        centred = torch.diagonal(cov, dim1=1, dim2=2) - 2 * row_means + row_means.mean(1, keepdim=True)
        return torch.softmax(mean / torch.sqrt(1 + math.pi / 8 * centred.mean(1, keepdim=True).clamp(min=0)), dim=1)
    variance = torch.diagonal(cov, dim1=1, dim2=2)
    return torch.softmax(mean / torch.sqrt(1 + math.pi / 8 * variance), dim=1)


def covariance_root(cov: Tensor, dtype: torch.dtype) -> Tensor:
    """A factor ``L`` ``(B, C, C)`` in ``dtype`` with ``L L^T = cov`` for positive semi-definite ``cov`` ``(B, C, C)``,
    singular ones included: the Cholesky factor of ``cov + 1e-10 I`` in ``dtype``, or, for a covariance where that
    fails (round-off makes a rank-deficient one indefinite, e.g. the logits of a frozen head in float32),
    ``V sqrt(max(lambda, 0))`` of its float64 eigendecomposition.

    Example:
        >>> singular = torch.ones(1, 2, 2)  # two logits that move together: rank one
        >>> root = covariance_root(singular, torch.float32)
        >>> torch.allclose(root @ root.mT, singular)
        True
    """
    # Cholesky where it succeeds: cheaper than eigh, and seeded draws keep the values they had with it alone
    eye = torch.eye(cov.shape[1], dtype=dtype, device=cov.device)
    chol, info = torch.linalg.cholesky_ex(cov.to(dtype) + 1e-10 * eye)
    failed = info != 0
    if failed.any():
        values, vectors = torch.linalg.eigh(cov[failed].to(torch.float64))
        chol[failed] = (vectors * values.clamp(min=0).sqrt().unsqueeze(1)).to(chol)
    return chol


Source = Any  # a MargLikCallback (its last estimate) or a LaplaceEvidence
_described: "weakref.WeakSet[LaplaceEvidence]" = weakref.WeakSet()  # evidences whose predictive was stated
_checked: "weakref.WeakSet[LaplaceEvidence]" = weakref.WeakSet()  # and whose first batch was checked


def predict(
    source: Source,
    module: nn.Module,
    x: Any,
    method: Optional[str] = None,
    samples: int = 100,
    generator: Optional[torch.Generator] = None,
) -> Union[Tensor, RegressionPrediction]:
    """The predictive of a batch in one call, e.g. in a LightningModule's ``predict_step``.

    Used: the posterior of ``source``: a ``MargLikCallback`` after ``trainer.fit`` (``callback.evidence``: the
    curvature of its last estimate, of the callback's ``structure`` and ``approx``, every tensor of the prior),
    or a :class:`LaplaceEvidence`; the prior's current precisions (learned, or held at the declared ``precision``
    as the output layer by default) and the likelihood's ``sigma`` and temperature. A Gaussian likelihood gives
    the linearized-Laplace mean and variance (:func:`predict_regression`). A categorical one gives class
    probabilities ``(B, C)``; by default (``method="auto"``) the linearized-Laplace predictive, tempered, only where
    the network is over-confident on its training data (its mean top probability there above its accuracy, both
    summed in the estimate's own pass), and the network's own softmax elsewhere. Every posterior predictive
    lowers the network's confidence, which can only help where it is too high: at the posterior the callback
    learns, the network's softmax was better calibrated in 20 of the 21 cells of
    ``benchmarks/results/predictive.md``.
    :func:`describe` says which, with the two figures; the first call for an evidence logs it on logger
    ``lightning_marglik.predictive`` at info level. A posterior predictive's first batch warns where its
    probabilities are near uniform while the network's own softmax is confident (mean top probabilities within a
    tenth of the way from ``1/C`` to 1, and past half of it).

    Works under ``torch.inference_mode`` (Lightning's ``predict_step``): the Jacobians come from ``torch.func``,
    which neither needs the autograd graph nor writes ``.grad``. The module's training flags, its parameters'
    ``.grad`` and ``requires_grad`` are left as they were (the forward runs in eval mode).

    Args:
        source: The ``MargLikCallback`` of the fit, or an evidence fitted at the module's weights.
        module: The trained network or LightningModule, at the weights of that estimate: its ``forward(x)``
            gives outputs ``(B, C)``.
        x: A batch of inputs (a tensor, or a tuple or dict as ``forward`` takes them), not a ``(inputs,
            targets)`` batch.
        method: Classification only: ``"auto"`` (the default, above), or always the posterior predictive:
            ``"tempered"`` (the logits divided by one probit scale per input, which keeps the network's predicted
            class; measured closer to the network's NLL than the others), ``"probit"`` (laplace-torch's,
            :func:`predict_classification`'s default) or ``"mc"``.
        samples: Monte-Carlo draws for ``method="mc"``.
        generator: Random generator for the draws.

    Returns:
        Class probabilities ``(B, C)``, or a :class:`RegressionPrediction` (mean, model and noise variance).

    Raises:
        RuntimeError: If the callback has no estimate yet (called before ``trainer.fit``).
        ValueError: If ``module`` is not the network of the posterior, or its weights or running statistics are
            not the estimate's (a checkpoint loaded, training continued, forwards in train mode), on a list batch,
            on outputs that are not ``(B, C)`` with ``B >= 1`` or not finite (a NaN input), on any ``method`` for
            regression, on ``"auto"`` with an evidence whose likelihood statistics lack the confidence and correct
            count, on ``samples`` that is not an int of at least 1, or on a forward that fails on ``x``.
        TypeError: If ``source`` is neither a callback nor an evidence.
    """
    evidence = _evidence_of(source)
    prior = evidence.prior
    params = prior.params
    if not {id(p) for p in params} <= {id(p) for p in module.parameters()}:
        raise ValueError("predict: `module` is not the network of this posterior (the prior's parameters are not "
                         "its own): pass the module the callback was fitted on.")
    _require_fitted(evidence, "predict")
    if isinstance(x, list):
        raise ValueError(f"predict: got a list of {len(x)} (a DataLoader's (inputs, targets) batch?): pass the "
                         "inputs, e.g. batch[0].")
    classification = isinstance(evidence.likelihood, CategoricalLikelihood)
    if not classification and method is not None:
        raise ValueError(f"predict: method={method!r} is for classification; a Gaussian likelihood's predictive "
                         "is closed-form (leave method out).")
    if classification:
        method = choice("auto" if method is None else method, ("auto", *CLASSIFICATION_METHODS), "method")
        integer(samples, "samples", minimum=1)  # before "auto" decides, which may not draw at all
    if evidence not in _described:
        _described.add(evidence)
        log.info(describe(source, method if classification else "closed form"))
    # Lightning's mixed precision runs predict_step under autocast: the predictive would come back in bfloat16
    with torch.autocast(next(module.parameters()).device.type, enabled=False):
        if not classification:
            return predict_regression(evidence, module, x)
        if method == "auto":
            method = _auto(evidence)
            if method is None:
                return _outputs(prior, module, x)[0].softmax(1)
        mean, probs = _classification(evidence, module, x, method, samples, generator)
    if evidence not in _checked:  # the first batch an evidence predicts
        _checked.add(evidence)
        message = _near_uniform_message(mean.softmax(1), probs)
        if message:
            warnings.warn(message, stacklevel=2)
    return probs


def training_confidence(evidence: LaplaceEvidence) -> Tuple[float, float]:
    """The network's mean top-class probability and its accuracy on the evidence's data, at its weights.

    Raises:
        ValueError: If the evidence's likelihood statistics lack them (a likelihood whose ``term_statistics``
            does not sum ``confidence`` and ``correct``).
    """
    stats = evidence.likelihood_statistics
    if not {"confidence", "correct"} <= stats.keys():
        raise ValueError(
            "predict: method='auto' reads the network's confidence and accuracy on its training data from the "
            f"evidence's likelihood statistics, which have only {sorted(stats)} (a likelihood whose term_statistics "
            "does not sum 'confidence' and 'correct'): pass method='tempered', 'probit' or 'mc'.")
    n_data = float(stats["n_data"])
    return float(stats["confidence"]) / n_data, float(stats["correct"]) / n_data


def over_confident(evidence: LaplaceEvidence) -> bool:
    """Whether ``method="auto"`` applies the posterior: the network's mean top probability on its training data
    exceeds its accuracy there.

    Example:
        >>> from torch import nn
        >>> from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence
        >>> net = nn.Linear(3, 4)
        >>> with torch.no_grad():
        ...     _ = net.weight.mul_(100)  # large logits: near-certain predictions of random labels
        >>> data = [(torch.randn(64, 3), torch.randint(0, 4, (64,)))]
        >>> evidence = LaplaceEvidence.fit(net, data, CategoricalLikelihood(), GaussianPrior(net))
        >>> over_confident(evidence)
        True
    """
    confidence, accuracy = training_confidence(evidence)
    return confidence > accuracy


def _auto(evidence: LaplaceEvidence) -> Optional[str]:
    """The method ``"auto"`` stands for with ``evidence``: the tempered posterior where the network is over-confident
    on its training data, ``None`` (the network's own softmax) elsewhere."""
    return "tempered" if over_confident(evidence) else None


def describe(source: Source, method: str = "probit") -> str:
    """What :func:`predict` uses with ``source`` (a ``MargLikCallback`` or an evidence), in one line."""
    evidence = _evidence_of(source)
    prior = evidence.prior
    epoch = getattr(source, "last_estimate_epoch", None)
    where = f"the callback's last estimate (epoch {epoch + 1})" if epoch is not None else "this evidence"
    chose = ""
    if method == "auto":
        confidence, accuracy = training_confidence(evidence)
        figures = (f"on its {evidence.n_data} training data at {where}, mean top probability {confidence:.4f}, "
                   f"accuracy {accuracy:.4f}")
        method = _auto(evidence)
        if method is None:
            return ("lightning_marglik.predict: the network's own softmax (method='auto': the network is not "
                    f"over-confident on its training data ({figures}), and a posterior predictive can only lower "
                    "its confidence; method='tempered' applies the posterior all the same).")
        chose = f" (method='auto': the network is over-confident on its training data, {figures})"
    learned = set(prior.learned_names())
    held = [n for n in prior.param_names if n not in learned]
    precisions = (f"{len(learned)} learned, {len(held)} held at their declared value ({', '.join(held)})" if held
                  else f"all {len(learned)} learned")
    how = {"probit": "probit (softmax(f / sqrt(1 + pi/8 var)))",
           "tempered": "tempered (softmax(f / sqrt(1 + pi/8 v)), v: the centred logits' mean variance)",
           "mc": "Monte Carlo over the linearized outputs"}.get(method, method)
    return (f"lightning_marglik.predict: linearized-Laplace (GLM) predictive, {how}{chose}; posterior: "
            f"{evidence.structure}-{evidence.approx} curvature of {where} over all {len(prior.param_names)} tensors "
            f"of the prior; precisions: the prior's ({precisions}).")


def _evidence_of(source: Source) -> LaplaceEvidence:
    """The evidence of a callback's last estimate, or ``source`` itself."""
    if isinstance(source, LaplaceEvidence):
        return source
    if not hasattr(source, "evidence"):
        raise TypeError(f"predict takes a MargLikCallback or a LaplaceEvidence, got {type(source).__name__}.")
    if source.evidence is None:
        raise RuntimeError("predict: the callback has no estimate yet (callback.evidence is None): call it after "
                           "trainer.fit(module) with this callback, which estimates at the end of training.")
    return source.evidence
