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

import fnmatch
import math
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .validators import choice, number, optional

__all__ = [
    "BIAS_NORMALIZATION",
    "SCALE_INVARIANT",
    "GammaHyperprior",
    "GaussianPrior",
    "Hyperprior",
    "LogNormalHyperprior",
    "no_decay_names",
    "GaussianLikelihood",
    "CategoricalLikelihood",
    "Likelihood",
    "assign_hyperparameters",
    "learnable_values",
    "map_loss",
]

PRIOR_STRUCTURES = ("scalar", "layerwise", "diagonal")
TREATMENTS = ("decoupled", "fixed", "learn")
SCALE_INVARIANT_TREATMENTS = TREATMENTS
# the named reasons of GaussianPrior.treat (any other string names a reason of the user's own)
SCALE_INVARIANT = "scale-invariant"
BIAS_NORMALIZATION = "bias/normalization"


def _log_buffer(value: float, name: str) -> Tensor:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive finite number, got {value}.")
    return torch.tensor(math.log(value))


class Hyperprior:
    """A density over the log prior precision ``rho_g = log delta_g`` of each learned group (type-II MAP).

    With a hyperprior the evidence engine maximizes, and reports, ``log q(D|delta) + sum_g log
    p(rho_g)`` over the groups the evidence learns (MacKay 1992, Tipping 2001). Without one, a
    group whose weights are (near) zero has an evidence that keeps rising as ``delta_g -> inf``
    (the ARD pruning of ``DESIGN.md``); a hyperprior that falls off fast enough makes the maximum
    finite. Subclasses give the density and its first two derivatives, elementwise, in ``rho``.
    """

    def log_density(self, log_precision: Tensor, initial_log_precision: float) -> Tensor:
        """``log p(rho)`` per entry of ``log_precision`` (a density in ``rho``, Jacobian included).

        Args:
            log_precision: ``rho``, any shape.
            initial_log_precision: ``log`` of the prior's constructor ``precision``: the centre of
                a hyperprior whose location is not given.

        Returns:
            Tensor of ``log_precision``'s shape.
        """
        raise NotImplementedError

    def derivatives(self, log_precision: Tensor, initial_log_precision: float) -> Tuple[Tensor, Tensor]:
        """First and second derivative of :meth:`log_density` in ``rho``, elementwise (closed form)."""
        raise NotImplementedError


class LogNormalHyperprior(Hyperprior):
    """``rho = log delta ~ N(loc, scale^2)``: a log-normal hyperprior on the precision.

    Its pull is ``-(rho - loc) / scale^2`` per group: a group may move ``scale`` in ``log delta``
    from ``loc`` at the cost of half a nat. A weak choice is ``scale`` 2 to 3 (a factor ``e^2`` to
    ``e^3`` costs 0.5 nats, ``e^8`` costs 3.5 to 8 nats): large groups (weights, ``P_g`` in the
    hundreds) barely feel it, while a group the data do not determine stays within a few scales of
    ``loc`` instead of running to ``e^20``.

    Args:
        scale: Standard deviation ``s > 0`` of ``log delta``.
        loc: Mean of ``log delta``; ``None``: the log of the prior's initial ``precision``.

    Raises:
        ValueError: On a ``scale`` that is not positive and finite, or a ``loc`` that is not finite.

    Example:
        >>> hyper = LogNormalHyperprior(scale=2.0)
        >>> round(float(hyper.log_density(torch.tensor(2.0), 0.0)), 4)  # -(2/2)^2/2 - log(2 sqrt(2 pi))
        -2.1121
    """

    def __init__(self, scale: float = 2.0, loc: Optional[float] = None) -> None:
        self.scale = number(scale, "scale", what="the standard deviation of log delta, e.g. 2")
        self.loc = optional(number, loc, "loc", low=-math.inf, what="the mean of log delta, or None")

    def _centred(self, log_precision: Tensor, initial_log_precision: float) -> Tensor:
        return (log_precision - (initial_log_precision if self.loc is None else self.loc)) / self.scale

    def log_density(self, log_precision: Tensor, initial_log_precision: float) -> Tensor:
        z = self._centred(log_precision, initial_log_precision)
        return -0.5 * z**2 - math.log(self.scale * math.sqrt(2 * math.pi))

    def derivatives(self, log_precision: Tensor, initial_log_precision: float) -> Tuple[Tensor, Tensor]:
        first = -self._centred(log_precision, initial_log_precision) / self.scale
        return first, torch.full_like(log_precision, -1.0 / self.scale**2)

    def __repr__(self) -> str:
        return f"LogNormalHyperprior(scale={self.scale:g}, loc={self.loc!r})"


class GammaHyperprior(Hyperprior):
    """``delta ~ Gamma(concentration a, rate b)``: the conjugate hyperprior of ARD (Tipping 2001).

    In ``rho = log delta`` (Jacobian ``delta`` included) the density is
    ``a rho - b e^rho + a log b - lgamma(a)``, whose maximum is at ``delta = a / b``. Its effect on
    the MacKay fixed point ``delta* = gamma / ||theta||^2`` is pseudo-data:
    ``delta* = (gamma + 2a) / (||theta||^2 + 2b)``, ``gamma`` the group's well-determined
    parameters, so a group the data do not determine (``gamma ~ 0``, ``theta ~ 0``) ends near
    ``a / b`` instead of running away. A weak choice is ``a`` about 1 (two pseudo-parameters),
    small against the size of the groups that matter, with the mode ``a / b`` at the initial
    precision (``rate=None``); the fall-off above the mode is exponential in ``log delta``.

    Args:
        concentration: Shape ``a > 0``.
        rate: Rate ``b > 0``; ``None``: ``a / precision`` with the prior's initial ``precision``
            (the mode in ``log delta`` at the initial precision).

    Raises:
        ValueError: On a ``concentration`` or ``rate`` that is not positive and finite.

    Example:
        >>> hyper = GammaHyperprior(concentration=2.0, rate=1.0)
        >>> round(float(hyper.log_density(torch.tensor(0.0), 0.0)), 4)  # 2*0 - e^0 + 2 log 1 - lgamma(2)
        -1.0
    """

    def __init__(self, concentration: float = 1.0, rate: Optional[float] = None) -> None:
        self.concentration = number(concentration, "concentration", what="the Gamma shape a, e.g. 1")
        self.rate = optional(number, rate, "rate", what="the Gamma rate b, or None for a / precision")

    def _rate(self, initial_log_precision: float) -> float:
        return self.concentration / math.exp(initial_log_precision) if self.rate is None else self.rate

    def log_density(self, log_precision: Tensor, initial_log_precision: float) -> Tensor:
        a, b = self.concentration, self._rate(initial_log_precision)
        return a * log_precision - b * log_precision.exp() + a * math.log(b) - math.lgamma(a)

    def derivatives(self, log_precision: Tensor, initial_log_precision: float) -> Tuple[Tensor, Tensor]:
        b_delta = self._rate(initial_log_precision) * log_precision.exp()
        return self.concentration - b_delta, -b_delta

    def __repr__(self) -> str:
        return f"GammaHyperprior(concentration={self.concentration:g}, rate={self.rate!r})"


class GaussianPrior(nn.Module):
    """Isotropic Gaussian prior ``N(0, 1/delta_g I)`` over groups of a network's parameters.

    The prior covers every parameter of ``model`` that requires grad at construction. It keeps a
    plain (unregistered) reference to ``model``, so adding the prior to a ``LightningModule``
    does not duplicate the network's parameters or expose the precision to the user's optimizer.
    Its buffer ``n_data`` (int64, 0 until counted) holds the number of data the evidence counted,
    the ``N`` of :func:`map_loss`; it is saved in checkpoints with the precisions.

    Args:
        model: The network whose parameters the prior covers.
        precision: Initial prior precision ``delta`` (same for every group).
        structure: ``"scalar"`` (one precision), ``"layerwise"`` (one per parameter tensor: a
            layer's weight and bias are separate groups) or ``"diagonal"`` (one per scalar).
        learn: Whether the marginal likelihood optimizes the precision.
        fixed: Names of parameters (``fnmatch`` patterns, e.g. ``"*.conv*.weight"``) whose
            precision stays at ``precision`` while the others are learned, e.g. weights followed by
            BatchNorm: their scale does not change the fit, so a learned precision grows without
            bound (``examples/results/resnet_bn.md``). ``MargLikCallback`` finds such tensors itself
            and treats them (``scale_invariant=``, see :meth:`treat_scale_invariant`); ``fixed`` wins
            for the tensors it names.
        hyperprior: A density over the learned log precisions (:class:`LogNormalHyperprior`,
            :class:`GammaHyperprior`), whose log is added to the objective the evidence maximizes
            and to the evidence it reports (type-II MAP); ``None``: none (maximum likelihood type II).

    Raises:
        ValueError: On an unknown structure, a non-positive precision, a model without trainable
            parameters, a ``fixed`` pattern that matches no parameter or meets a scalar prior, or a
            ``hyperprior`` that is not a :class:`Hyperprior`.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> prior = GaussianPrior(net, precision=1.0, structure="layerwise")
        >>> prior.precision.shape
        torch.Size([4])
    """

    log_precision: Tensor
    n_data: Tensor

    def __init__(
        self,
        model: nn.Module,
        precision: float = 1.0,
        structure: str = "layerwise",
        learn: bool = True,
        fixed: Optional[Sequence[str]] = None,
        hyperprior: Optional[Hyperprior] = None,
    ) -> None:
        super().__init__()
        if hyperprior is not None and not isinstance(hyperprior, Hyperprior):
            raise ValueError(
                f"`hyperprior` must be None or a Hyperprior (e.g. LogNormalHyperprior(scale=2.0)), got {hyperprior!r}."
            )
        self.hyperprior = hyperprior
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
        fixed = [fixed] if isinstance(fixed, str) else list(fixed or ())
        if not all(isinstance(pattern, str) for pattern in fixed):
            raise ValueError(f"`fixed` must be parameter names or fnmatch patterns (strings), got {fixed!r}.")
        unmatched = [pattern for pattern in fixed if not fnmatch.filter(self.param_names, pattern)]
        if unmatched:
            raise ValueError(f"`fixed` patterns {unmatched} match no trainable parameter of the model.")
        if fixed and structure == "scalar":
            raise ValueError("`fixed` needs one precision per group: use structure='layerwise' (or learn=False).")
        self.fixed: List[str] = [n for n in self.param_names if any(fnmatch.fnmatchcase(n, p) for p in fixed)]
        # N of the MAP loss: the evidence's count, 0 until counted (a buffer: it travels with checkpoints)
        self.register_buffer("n_data", torch.zeros((), dtype=torch.int64))
        self._n_data = 0  # its value as an int: map_loss reads it every step without a device sync
        self._warned_n_data = False  # map_loss warns once about an explicit n_data that differs from it
        self.initial_precision = float(precision)
        # reason -> (names, treatment), declared by ``treat`` (MargLikCallback: from the structural analysis)
        self.treatments: Dict[str, Tuple[List[str], str]] = {}

    def treat(self, names: Sequence[str], treatment: str, reason: str) -> None:
        """Declare a set of tensors whose precision is treated apart, and why; replaces an earlier
        declaration of the same ``reason``.

        ``"fixed"``: the evidence keeps their precision (like ``fixed=``). ``"decoupled"``: the
        evidence learns its own precision for them (``log_precision``), but the MAP loss
        (:meth:`penalty`) keeps the constructor's ``precision`` for them, so the learned value is
        never fed back as weight decay. ``"learn"``: no special treatment. A tensor named under
        several reasons takes the strongest treatment (``"fixed"``, then ``"decoupled"``); tensors in
        ``fixed`` keep that treatment whatever ``treatment`` says.

        Args:
            names: Names of covered parameters (``param_names``).
            treatment: One of ``"decoupled"``, ``"fixed"``, ``"learn"``.
            reason: Why: ``"scale-invariant"`` (:meth:`treat_scale_invariant`), ``"bias/normalization"``
                (:func:`no_decay_names`) or a reason of the caller's own.

        Raises:
            ValueError: On an unknown treatment or name, an empty reason, or a scalar prior with a
                treatment other than ``"learn"`` (one precision cannot treat some tensors apart).
        """
        treatment = choice(treatment, TREATMENTS, "treatment")
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"`reason` must be a non-empty string (e.g. {BIAS_NORMALIZATION!r}), got {reason!r}.")
        unknown = [n for n in names if n not in self.param_names]
        if unknown:
            raise ValueError(f"treat({reason!r}): {unknown} are not parameters the prior covers.")
        if names and treatment != "learn" and self.structure == "scalar":
            raise ValueError(
                f"treatment={treatment!r} of the {reason} tensors needs one precision per tensor, the prior is scalar: "
                "use GaussianPrior(structure='layerwise') or treatment='learn'."
            )
        chosen = set(names)
        self.treatments[reason] = ([n for n in self.param_names if n in chosen and n not in self.fixed], treatment)

    def treated(self, treatment: str) -> List[str]:
        """The tensors whose strongest declared treatment (:meth:`treat`) is ``treatment``, in
        ``param_names`` order (those of ``fixed`` excluded)."""
        rank = {"learn": 0, "decoupled": 1, "fixed": 2}
        strongest: Dict[str, str] = {}
        for names, declared in self.treatments.values():
            for name in names:
                if rank[declared] > rank[strongest.get(name, "learn")]:
                    strongest[name] = declared
        return [n for n in self.param_names if strongest.get(n, "learn") == treatment and n not in self.fixed]

    @property
    def scale_invariant(self) -> List[str]:
        """The tensors declared scale-invariant (:meth:`treat_scale_invariant`)."""
        return list(self.treatments.get(SCALE_INVARIANT, ([], "learn"))[0])

    @property
    def scale_invariant_treatment(self) -> str:
        """Their treatment (``"learn"`` until declared)."""
        return self.treatments.get(SCALE_INVARIANT, ([], "learn"))[1]

    def treat_scale_invariant(self, names: Sequence[str], treatment: str) -> None:
        """Declare the tensors the training loss is scale-invariant in, and how their precision is treated.

        ``"fixed"``: the evidence keeps their precision (like ``fixed=``). ``"decoupled"``: the
        evidence learns its own precision for them (``log_precision``), but the MAP loss
        (:meth:`penalty`) keeps the constructor's ``precision`` for them, so the learned value is
        never fed back as weight decay. ``"learn"``: no special treatment. Tensors in ``fixed``
        keep that treatment whatever ``treatment`` says.

        Args:
            names: Names of covered parameters (``param_names``).
            treatment: One of ``"decoupled"``, ``"fixed"``, ``"learn"``.

        Raises:
            ValueError: On an unknown treatment or name, or a scalar prior with a treatment other
                than ``"learn"`` (one precision cannot treat some tensors apart).
        """
        if treatment not in SCALE_INVARIANT_TREATMENTS:
            raise ValueError(f"`scale_invariant` must be one of {SCALE_INVARIANT_TREATMENTS}, got {treatment!r}.")
        if names and treatment != "learn" and self.structure == "scalar":
            raise ValueError(
                f"scale_invariant={treatment!r} needs one precision per tensor, the prior is scalar: use "
                "GaussianPrior(structure='layerwise') or scale_invariant='learn'."
            )
        self.treat(names, treatment, SCALE_INVARIANT)

    def _group_mask(self, names: Sequence[str]) -> Tensor:
        """Boolean mask over ``log_precision``: the groups of the tensors ``names`` (not for a scalar prior)."""
        chosen = set(names)
        per_tensor = torch.tensor([n in chosen for n in self.param_names], device=self.log_precision.device)
        if self.structure == "diagonal":
            return per_tensor.repeat_interleave(torch.tensor(self.param_sizes, device=per_tensor.device))
        return per_tensor

    def record_n_data(self, n_data: int) -> None:
        """Store the number of data ``N`` the evidence counted: the ``N`` of :func:`map_loss`.

        Written by ``MargLikCallback`` (when training starts and after every estimate) and by
        ``LaplaceEvidence.fit``.

        Raises:
            ValueError: If ``n_data`` is not a positive int.
        """
        if isinstance(n_data, bool) or not isinstance(n_data, int) or n_data <= 0:
            raise ValueError(f"`n_data` must be a positive int, got {n_data!r}.")
        self.n_data.fill_(n_data)
        self._n_data = n_data

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object, **kwargs: object) -> None:
        # checkpoints from before N was stored lack it: such a prior has not counted N yet
        state_dict.setdefault(prefix + "n_data", torch.zeros((), dtype=torch.int64))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._n_data = int(self.n_data)

    def learned_groups(self) -> Tensor:
        """Boolean mask over ``log_precision``: which groups the evidence learns."""
        if self.structure == "scalar":
            return torch.full((1,), self.learn, device=self.log_precision.device)
        if not self.learn:
            return torch.zeros_like(self.log_precision, dtype=torch.bool)
        return ~self._group_mask(self.fixed_names())

    def fixed_names(self) -> List[str]:
        """The tensors whose precision stays at the declared ``precision``: those of ``fixed`` and those
        declared ``"fixed"`` by :meth:`treat` (e.g. the scale-invariant ones)."""
        return self.fixed + self.treated("fixed")

    def learned_names(self) -> List[str]:
        """The tensors whose precision the evidence learns, in ``param_names`` order."""
        if not self.learn:
            return []
        held = set(self.fixed_names())
        return [name for name in self.param_names if name not in held]

    def declared_log_precision(self, names: Sequence[str]) -> Tensor:
        """``log_precision`` with the groups of the tensors ``names`` at the declared ``precision`` (a copy).

        Raises:
            ValueError: For a scalar prior (its one group belongs to every tensor).
        """
        if self.structure == "scalar":
            raise ValueError("A scalar prior has one precision for every tensor; it has no groups to reset.")
        values = self.log_precision.detach().clone()
        values[self._group_mask(names)] = math.log(self.initial_precision)
        return values

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
        """``1/2 sum_g delta_g ||theta_g||^2`` at the current precision (the MAP loss term).

        Tensors under the ``"decoupled"`` treatment use the constructor's ``precision`` here,
        whatever the evidence learned for them (:meth:`treat`).
        """
        return 0.5 * (self.weight_decay_log_precision().exp() * self.group_sq_norms()).sum()

    def weight_decay_log_precision(self) -> Tensor:
        """Log precision per group that the MAP loss uses (detached): ``log_precision``, except for
        tensors under the ``"decoupled"`` treatment (:meth:`treat`), which keep the initial precision."""
        log_precision = self.log_precision.detach()
        decoupled = self.treated("decoupled")
        if decoupled:
            initial = torch.full_like(log_precision, math.log(self.initial_precision))
            log_precision = torch.where(self._group_mask(decoupled), initial, log_precision)
        return log_precision

    def log_hyperprior(self, log_precision: Tensor) -> Tensor:
        """``sum_g log p(rho_g)`` over the learned groups (:meth:`learned_groups`); 0 without a hyperprior.

        Args:
            log_precision: Log precisions of every group, shape ``(G,)``.

        Returns:
            A 0-dim tensor in ``log_precision``'s dtype, differentiable in it.
        """
        if self.hyperprior is None:
            return log_precision.new_zeros(())
        learned = self.learned_groups().to(log_precision.device)
        density = self.hyperprior.log_density(log_precision, math.log(self.initial_precision))
        return torch.where(learned, density, torch.zeros_like(density)).sum()

    def log_hyperprior_derivatives(self, log_precision: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """:meth:`log_hyperprior` with its gradient and its (diagonal) Hessian per group, shape ``(G,)``
        each, zero at the groups the evidence does not learn (closed form)."""
        if self.hyperprior is None:
            zeros = torch.zeros_like(log_precision)
            return log_precision.new_zeros(()), zeros, zeros
        learned = self.learned_groups().to(log_precision.device)
        first, second = self.hyperprior.derivatives(log_precision, math.log(self.initial_precision))
        zeros = torch.zeros_like(log_precision)
        return self.log_hyperprior(log_precision), torch.where(learned, first, zeros), torch.where(learned, second, zeros)

    def extra_repr(self) -> str:
        hyper = "" if self.hyperprior is None else f", hyperprior={self.hyperprior!r}"
        return (
            f"structure={self.structure!r}, groups={self.log_precision.numel()}, learn={self.learn}, "
            f"fixed={self.fixed}{hyper}"
        )


def no_decay_names(prior: GaussianPrior) -> List[str]:
    """The tensors practice trains without weight decay: biases and normalization parameters.

    Found structurally as timm's ``param_groups_weight_decay`` does: every covered parameter with
    at most one dimension (biases, BatchNorm/LayerNorm/GroupNorm scales and shifts, Fixup scalars)
    or whose name ends in ``.bias``. Declare their treatment with
    ``prior.treat(no_decay_names(prior), "decoupled", BIAS_NORMALIZATION)``.

    Args:
        prior: The prior whose covered parameters are searched.

    Returns:
        Their names, in ``param_names`` order.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))
        >>> no_decay_names(GaussianPrior(net))
        ['0.bias', '1.weight', '1.bias', '2.bias']
    """
    return [n for n, p in zip(prior.param_names, prior.params) if p.ndim <= 1 or n.endswith(".bias")]


class Likelihood(nn.Module):
    """Base class of the likelihoods: a tempered ``p(y|f)^(1/T)`` with a learnable temperature.

    Outputs are ``(B, ..., C)``: every position ``(b, ...)`` is one *term* (datum) of the
    log-likelihood and one row of the curvature. Subclasses define the per-term negative
    log-likelihood, the sufficient statistics of the data term, a square root of the loss Hessian
    per term, and their own hyperparameters (log-parameterised buffers) with how they enter the
    log-likelihood and the curvature scale.
    """

    log_temperature: Tensor

    def __init__(self, temperature: float = 1.0, learn_temperature: bool = False) -> None:
        super().__init__()
        self.register_buffer("log_temperature", _log_buffer(temperature, "temperature"))
        self.learn_temperature = bool(learn_temperature)
        if self.learn_temperature:
            warnings.warn(
                "learn_temperature=True: p(y|f)^(1/T) is not normalized in y, so the evidence can grow towards "
                "T -> infinity with the prior precision -> 0 (measured: no finite optimum on classification "
                "problems). Fix T (e.g. from the augmentation factor) unless you check the learned value.",
                stacklevel=3,
            )

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

    def terms(self, output: Tensor, target: Tensor) -> "tuple[Tensor, Tensor, Tensor]":
        """Outputs ``(n, C)``, targets and a boolean mask ``(n,)`` of the kept terms, one row per position."""
        raise NotImplementedError

    def term_nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Untempered negative log-likelihood of each row of :meth:`terms`, shape ``(n,)``."""
        raise NotImplementedError

    def term_hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        """Factor ``L`` ``(n, C, k)`` of each term's curvature in ``f`` (unit noise and temperature)."""
        raise NotImplementedError

    def term_statistics(self, output: Tensor, target: Tensor, mask: Tensor) -> Dict[str, Tensor]:
        """Sum-reduced sufficient statistics of the kept terms (integer counts as int64 tensors)."""
        raise NotImplementedError

    def log_likelihood(self, stats: Dict[str, Tensor], values: Dict[str, Tensor]) -> Tensor:
        """Tempered log-likelihood ``log p(D|theta) / T`` from summed statistics at log hyperparameters ``values``."""
        raise NotImplementedError

    def curvature_scale(self, approx: str, values: Dict[str, Tensor]) -> Tensor:
        """The factor ``s`` of ``H = s C + diag(delta)`` for the unit-scale curvature ``C``."""
        raise NotImplementedError

    # --- shared by every likelihood: positions as terms -------------------------------------

    def nll(self, output: Tensor, target: Tensor) -> Tensor:
        """Untempered negative log-likelihood of every kept term at the current hyperparameters, ``(n_kept,)``."""
        flat, flat_target, mask = self.terms(output, target)
        return self.term_nll(flat[mask], flat_target[mask])

    def count(self, output: Tensor, target: Tensor) -> int:
        """Number of kept terms (data) in the batch: what ``n_data`` counts."""
        return int(self.terms(output, target)[2].sum())

    def count_targets(self, target: Tensor, like: Tensor) -> int:
        """What :meth:`count` gives for a batch's targets alone, without a forward pass.

        The same checks and mask as :meth:`count`, on a zero-stride stand-in for the batch's
        outputs (no memory): the leading sizes from ``target``, the number of outputs from ``like``
        (the outputs of another batch of the same data).
        """
        leading = target.shape if target.dim() < like.dim() else target.shape[:-1]
        stand_in = torch.zeros((), dtype=like.dtype, device=target.device).expand(*leading, like.shape[-1])
        return self.count(stand_in, target)

    def statistics(self, output: Tensor, target: Tensor) -> Dict[str, Tensor]:
        """Sum-reduced statistics of the batch, computed in float64 whatever the output dtype."""
        flat, flat_target, mask = self.terms(output.double(), target)
        stats = self.term_statistics(flat[mask], flat_target[mask], mask)
        stats["n_data"] = mask.sum()
        return stats

    def hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        """Factor ``L_n`` ``(B, M, K)`` of each example's curvature in its flattened output (``M`` values).

        For ``(B, C)`` outputs, ``K`` is the per-term ``k``. For ``(B, T, C)`` outputs the terms of
        one example must stay separate (the curvature is block-diagonal over positions): ``K = T k``
        columns, each supported on one position, except for the Monte-Carlo GGN, whose ``k``
        samples may sum over positions (independent draws: the same GGN in expectation). Ignored
        positions have zero columns. Computed in float64, returned in the output's dtype.
        """
        flat, flat_target, mask = self.terms(output.detach().double(), target)
        factor = self.term_hessian_sqrt(flat, flat_target, approx, mc_samples, generator) * mask.reshape(-1, 1, 1)
        b, c, k = output.shape[0], output.shape[-1], factor.shape[2]
        if output.dim() == 2:
            return factor.to(output.dtype)
        positions = flat.shape[0] // b
        factor = factor.reshape(b, positions, c, k)
        if approx == "ggn" and mc_samples:
            return factor.reshape(b, positions * c, k).to(output.dtype)
        eye = torch.eye(positions, dtype=factor.dtype, device=factor.device)
        return torch.einsum("btck,ts->btcsk", factor, eye).reshape(b, positions * c, positions * k).to(output.dtype)


class GaussianLikelihood(Likelihood):
    """Gaussian likelihood ``N(y | f, sigma^2 I)`` for regression, with learnable noise.

    Outputs ``(B, ..., D)``: each position is one datum with ``D`` outputs.

    Args:
        sigma: Initial observation noise standard deviation.
        temperature: Likelihood temperature ``T`` (``p^(1/T)``; ``T < 1`` up-weights the data).
        learn_sigma: Whether the marginal likelihood optimizes ``sigma``.
        learn_temperature: Whether the marginal likelihood optimizes ``T`` (warns: the tempered
            evidence may have no finite optimum in ``T``; see the README).

    Raises:
        ValueError: On a non-positive or non-finite ``sigma`` or ``temperature``.

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
        if output.dim() < 2:
            raise ValueError(
                f"GaussianLikelihood expects outputs of shape (batch, ..., outputs), got {tuple(output.shape)}; "
                "return (batch, 1) for a single output."
            )
        if target.shape == output.shape[:-1] and output.shape[-1] == 1:
            target = target.unsqueeze(-1)
        if target.shape != output.shape:
            raise ValueError(
                f"GaussianLikelihood: target shape {tuple(target.shape)} does not match output shape "
                f"{tuple(output.shape)}."
            )
        if not target.is_floating_point():
            raise ValueError(f"GaussianLikelihood expects floating-point targets, got {target.dtype}.")
        return target.to(output.dtype)

    def terms(self, output: Tensor, target: Tensor) -> "tuple[Tensor, Tensor, Tensor]":
        target = self.check_target(output, target)
        d = output.shape[-1]
        flat = output.reshape(-1, d)
        return flat, target.reshape(-1, d), torch.ones(flat.shape[0], dtype=torch.bool, device=output.device)

    def term_nll(self, output: Tensor, target: Tensor) -> Tensor:
        sigma2 = self.sigma.detach().to(output.dtype) ** 2
        return 0.5 * ((target - output) ** 2).sum(1) / sigma2 + 0.5 * output.shape[1] * torch.log(2 * math.pi * sigma2)

    def term_statistics(self, output: Tensor, target: Tensor, mask: Tensor) -> Dict[str, Tensor]:
        return {"sse": ((target - output) ** 2).sum(), "n_outputs": torch.tensor(target.numel())}

    def log_likelihood(self, stats: Dict[str, Tensor], values: Dict[str, Tensor]) -> Tensor:
        log_sigma = values["log_sigma"]
        n_outputs = stats["n_outputs"].to(log_sigma.dtype)
        loglik = -0.5 * n_outputs * (math.log(2 * math.pi) + 2 * log_sigma) - 0.5 * stats["sse"] * torch.exp(-2 * log_sigma)
        return loglik * torch.exp(-values["log_temperature"])

    def term_hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        n, c = output.shape
        if approx == "ef":
            return (target - output).unsqueeze(2)
        if mc_samples:
            noise = torch.randn(n, c, mc_samples, dtype=output.dtype, generator=generator).to(output.device)
            return noise / math.sqrt(mc_samples)
        return torch.eye(c, dtype=output.dtype, device=output.device).expand(n, c, c)

    def curvature_scale(self, approx: str, values: Dict[str, Tensor]) -> Tensor:
        power = 4 if approx == "ef" else 2  # the score carries 1/sigma^2, its outer product 1/sigma^4
        return torch.exp(-power * values["log_sigma"] - values["log_temperature"])

    def extra_repr(self) -> str:
        return f"learn_sigma={self.learn_sigma}, learn_temperature={self.learn_temperature}"


class CategoricalLikelihood(Likelihood):
    """Categorical likelihood ``softmax(f)`` over class logits for classification.

    Logits ``(B, C)`` with labels ``(B,)``, or ``(B, ..., C)`` with labels ``(B, ...)`` (token or
    pixel classification): every position whose label is not ``ignore_index`` is one datum.
    Labels of every integer dtype (``int8`` ... ``int64``, ``uint8``) are taken as ``int64``.

    Args:
        temperature: Likelihood temperature ``T`` (``p^(1/T)``; ``T < 1`` up-weights the data).
        learn_temperature: Whether the marginal likelihood optimizes ``T`` (warns: the tempered
            evidence may have no finite optimum in ``T``; see the README).
        ignore_index: Label of positions that are not data (padding), as in ``F.cross_entropy``.

    Raises:
        ValueError: On a non-positive or non-finite ``temperature``.

    Example:
        >>> lik = CategoricalLikelihood()
        >>> torch.allclose(lik.nll(torch.zeros(2, 4), torch.tensor([0, 3])), torch.tensor(math.log(4)))
        True
        >>> tokens = CategoricalLikelihood(ignore_index=-100)  # (batch, positions, classes) logits
        >>> tokens.count(torch.zeros(2, 3, 4), torch.tensor([[0, 1, -100], [2, -100, -100]]))
        3
    """

    def __init__(self, temperature: float = 1.0, learn_temperature: bool = False, ignore_index: int = -100) -> None:
        super().__init__(temperature, learn_temperature)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ValueError(f"`ignore_index` must be an int label (e.g. -100), got {ignore_index!r}.")
        self.ignore_index = ignore_index

    def check_target(self, output: Tensor, target: Tensor) -> Tensor:
        if output.dim() < 2:
            raise ValueError(f"CategoricalLikelihood expects logits of shape (batch, ..., classes), got {tuple(output.shape)}.")
        if target.shape != output.shape[:-1] or target.dtype.is_floating_point or target.dtype == torch.bool:
            raise ValueError(
                f"CategoricalLikelihood expects integer class labels of shape {tuple(output.shape[:-1])}, got "
                f"{tuple(target.shape)} of {target.dtype}."
            )
        target = target.long()  # every integer dtype: cross_entropy and one_hot take int64 labels
        kept = target[target != self.ignore_index]
        if kept.numel() and (kept.min() < 0 or kept.max() >= output.shape[-1]):
            raise ValueError(
                f"CategoricalLikelihood: labels must lie in [0, {output.shape[-1]}) or equal ignore_index="
                f"{self.ignore_index}, got values in [{int(kept.min())}, {int(kept.max())}]."
            )
        return target

    def terms(self, output: Tensor, target: Tensor) -> "tuple[Tensor, Tensor, Tensor]":
        target = self.check_target(output, target).reshape(-1)
        mask = target != self.ignore_index
        return output.reshape(-1, output.shape[-1]), torch.where(mask, target, 0), mask

    def term_nll(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output, target, reduction="none")

    def term_statistics(self, output: Tensor, target: Tensor, mask: Tensor) -> Dict[str, Tensor]:
        return {"log_lik": -self.term_nll(output, target).sum()}

    def log_likelihood(self, stats: Dict[str, Tensor], values: Dict[str, Tensor]) -> Tensor:
        return stats["log_lik"] * torch.exp(-values["log_temperature"])

    def term_hessian_sqrt(
        self, output: Tensor, target: Tensor, approx: str, mc_samples: int, generator: Optional[torch.Generator]
    ) -> Tensor:
        probs = output.softmax(1)
        if approx == "ef":
            onehot = nn.functional.one_hot(target, output.shape[1]).to(output.dtype)
            return (onehot - probs).unsqueeze(2)
        if mc_samples:
            draws = torch.multinomial(probs.cpu(), mc_samples, replacement=True, generator=generator)
            onehot = nn.functional.one_hot(draws.to(output.device), output.shape[1]).to(output.dtype)
            return (onehot - probs.unsqueeze(1)).transpose(1, 2) / math.sqrt(mc_samples)
        # diag(p) - p p^T = D^1/2 (I - s s^T) D^1/2 with s = sqrt(p), |s| = 1, has rank C - 1 (s spans
        # its null space): C - 1 columns suffice, one backward pass fewer. The Householder reflection
        # H = I - 2 v v^T / v^T v with v = s + e_C maps s to -e_C, so its first C - 1 columns are an
        # orthonormal basis of s's complement; v^T v = 2 + 2 s_C >= 2 keeps it stable.
        sqrt_p = probs.sqrt()
        v = sqrt_p.clone()
        v[:, -1] += 1
        reflection = torch.eye(output.shape[1], dtype=output.dtype, device=output.device) - 2 * v.unsqueeze(
            2
        ) * v.unsqueeze(1) / (v * v).sum(1).reshape(-1, 1, 1)
        return sqrt_p.unsqueeze(2) * reflection[:, :, :-1]

    def curvature_scale(self, approx: str, values: Dict[str, Tensor]) -> Tensor:
        return torch.exp(-values["log_temperature"])

    def extra_repr(self) -> str:
        return f"learn_temperature={self.learn_temperature}, ignore_index={self.ignore_index}"


def map_loss(
    output: Tensor, target: Tensor, likelihood: Likelihood, prior: GaussianPrior, n_data: Optional[int] = None
) -> Tensor:
    """The MAP training loss that matches the evidence: ``mean_n -log p(y_n|f_n) / T + penalty / N``.

    The hyperparameters enter detached: only the network's weights receive gradients. Do not add
    weight decay in the optimizer as well: the prior term already is the weight decay.

    ``N`` is the evidence's count of the data (``prior.n_data``), stored by ``MargLikCallback``
    when training starts and by ``LaplaceEvidence.fit``, so that the MAP objective and the
    evidence use one ``N``. An explicit ``n_data`` that differs from that count is used, with a
    warning (once per prior).

    Args:
        output: Network outputs of the batch, shape ``(B, ..., C)``.
        target: Targets of the batch.
        likelihood: The likelihood whose temperature (and noise) the loss uses.
        prior: The prior whose precisions (and counted ``N``) the loss uses.
        n_data: Number of data ``N`` of the whole training set, not of the batch (what the
            evidence counts: kept positions for ``(B, ..., C)`` outputs). Default: ``prior.n_data``.

    Returns:
        The scalar loss.

    Raises:
        ValueError: If ``n_data`` is not positive, or is not given while ``N`` is not counted yet
            (a training loop without ``MargLikCallback`` before ``LaplaceEvidence.fit``).
    """
    counted = prior._n_data
    if n_data is None:
        if counted == 0:
            raise ValueError(
                "map_loss needs the number of training data N, which is not counted yet: train with "
                "MargLikCallback (it counts N when training starts), or pass `n_data=` (the training set size; "
                "LaplaceEvidence.fit stores it as well)."
            )
        n_data = counted
    elif n_data <= 0:
        raise ValueError(f"`n_data` must be the positive training set size, got {n_data}.")
    elif counted and n_data != counted and not prior._warned_n_data:
        prior._warned_n_data = True
        warnings.warn(
            f"map_loss(n_data={n_data}), but the evidence counts N={counted} data: the prior in the MAP loss is "
            f"{counted / n_data:.3g}x as strong as in the evidence. Leave out `n_data` to use the evidence's N "
            "(prior.n_data), or pass the training set size N (not the batch size).",
            stacklevel=2,
        )
    data_term = likelihood.nll(output, target).mean() / likelihood.temperature.detach().to(output.dtype)
    return data_term + prior.penalty() / n_data


def learnable_values(prior: GaussianPrior, likelihood: Likelihood) -> Dict[str, Tensor]:
    """The variables the evidence optimizes, by buffer name (detached): every learnable buffer, the
    prior's restricted to its learned groups (see ``GaussianPrior(fixed=...)``)."""
    learned = prior.learned_groups()
    values = {"log_precision": prior.log_precision.detach()[learned]} if learned.any() else {}
    values.update({n: likelihood.hyperparameters()[n].detach() for n in likelihood.learnable()})
    return values


def assign_hyperparameters(prior: GaussianPrior, likelihood: Likelihood, values: Dict[str, Tensor]) -> None:
    """Write log hyperparameters into the prior's and the likelihood's buffers: the one writer.

    Args:
        prior: Owner of ``log_precision``.
        likelihood: Owner of its own hyperparameters (e.g. ``log_sigma``, ``log_temperature``).
        values: Log values by buffer name; names not given stay as they are.

    Raises:
        ValueError: On an unknown name, a shape mismatch, or a value that is not finite in the
            buffer's dtype (nothing is written then).
    """
    buffers = {"log_precision": prior.log_precision, **likelihood.hyperparameters()}
    converted = {}
    for name, value in values.items():
        if name not in buffers:
            raise ValueError(f"Unknown hyperparameter {name!r}; expected one of {sorted(buffers)}.")
        buffer = buffers[name]
        if value.shape != buffer.shape:
            raise ValueError(f"Hyperparameter {name!r} has shape {tuple(buffer.shape)}, got {tuple(value.shape)}.")
        cast = value.detach().to(buffer.device, buffer.dtype)
        if not torch.isfinite(cast).all() or not torch.isfinite(cast.exp()).all():
            raise ValueError(f"Refusing to write a non-finite {name!r} (in {buffer.dtype}); the buffers are unchanged.")
        converted[name] = cast
    with torch.no_grad():
        for name, cast in converted.items():
            buffers[name].copy_(cast)
