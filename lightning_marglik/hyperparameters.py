"""The prior, its treatments and the MAP loss; with :mod:`.likelihoods` and :mod:`.hyperpriors`, the
objects that own the log-parameterised hyperparameters (their classes are importable from here too).

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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .hyperpriors import GammaHyperprior, Hyperprior, LogNormalHyperprior
from .likelihoods import (
    LOG_LIMIT, CategoricalLikelihood, GaussianLikelihood, HyperparameterModule, Likelihood, log_buffer,
)
from .private import WRAPPER_PREFIXES, strip_wrapper_prefixes, unknown_wrappers
from .structure_options import PRIOR_STRUCTURES, curvature_elsewhere
from .validators import choice, flag, integer

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
    "check_likelihood_and_prior",
    "learnable_values",
    "map_loss",
]

TREATMENTS = ("decoupled", "fixed", "learn")
SCALE_INVARIANT_TREATMENTS = TREATMENTS
# the named reasons of GaussianPrior.treat (any other string names a reason of the user's own)
SCALE_INVARIANT = "scale-invariant"
BIAS_NORMALIZATION = "bias/normalization"

class GaussianPrior(HyperparameterModule):
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
        TypeError: If ``model`` is not an ``nn.Module`` (e.g. its ``parameters()``).
        ValueError: On an unknown structure, a precision that is not one positive finite number, a ``learn``
            that is not a bool, a model without trainable parameters, a ``fixed`` pattern that matches no parameter or meets a scalar
            prior, or a ``hyperprior`` that is not a :class:`Hyperprior`.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> prior = GaussianPrior(net, precision=1.0, structure="layerwise")
        >>> prior.precision.shape
        torch.Size([4])
    """

    log_precision: Tensor
    n_data: Tensor
    # the autograd nodes of the penalties returned while a callback checks that the training loss carries the
    # prior (lightning_marglik.callbacks.prior_in_loss); None: not watched
    _penalty_nodes: Optional[List[object]] = None

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
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"GaussianPrior covers a module's parameters: pass the nn.Module (e.g. GaussianPrior(net)), got "
                f"{type(model).__name__}."
            )
        if hyperprior is not None and not isinstance(hyperprior, Hyperprior):
            raise ValueError(
                f"`hyperprior` must be None or a Hyperprior (e.g. LogNormalHyperprior(scale=2.0)), got {hyperprior!r}."
            )
        self.hyperprior = hyperprior
        structure = choice(structure, PRIOR_STRUCTURES, "structure", elsewhere=curvature_elsewhere())
        named = [(strip_wrapper_prefixes(n), p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("GaussianPrior: the model has no parameters that require grad.")
        object.__setattr__(self, "model", model)  # a plain reference: not a submodule
        self.structure = structure
        self.learn = flag(learn, "learn", what="whether the evidence learns the precisions")
        self.param_names: List[str] = [n for n, _ in named]
        self.param_sizes: List[int] = [p.numel() for _, p in named]
        n_groups = {"scalar": 1, "layerwise": len(named), "diagonal": sum(self.param_sizes)}[structure]
        log_prec = log_buffer(precision, "precision").repeat(n_groups)
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
        ``param_names`` order (those of ``fixed`` excluded; none learned or decoupled where ``learn=False``)."""
        if not self.learn and treatment != "fixed":  # no precision is learned: nothing to feed back or keep apart
            return []
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
        treatment = choice(treatment, SCALE_INVARIANT_TREATMENTS, "scale_invariant")
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
        """The covered parameter tensors, in ``param_names`` order (also once FSDP or activation checkpointing
        has wrapped some of the model's layers, which puts their wrappers' names into the parameters')."""
        found = {strip_wrapper_prefixes(n): p for n, p in self.model.named_parameters()}
        missing = [n for n in self.param_names if n not in found]
        if missing:
            renamed = unknown_wrappers(missing, list(found))  # a wrapper's name that torch renamed, say
            if any(".base_layer." in name for name in renamed):
                raise RuntimeError(
                    f"GaussianPrior: parameters {missing} are no longer in the model; it has {sorted(renamed)[:4]} "
                    "instead: peft wrapped its layers after the prior was built. Build the GaussianPrior after "
                    "get_peft_model(...), so that it covers the trainable adapter tensors and not the frozen base.")
            raise RuntimeError(f"GaussianPrior: parameters {missing} are no longer in the model" + (
                f"; it has {sorted(renamed)} instead: a wrapper's name that lightning_marglik does not strip "
                f"(it strips {', '.join(WRAPPER_PREFIXES)}; lightning_marglik.private.strip_wrapper_prefixes)."
                if renamed else "."))
        return [found[n] for n in self.param_names]

    @property
    def n_params(self) -> int:
        return sum(self.param_sizes)

    @property
    def precision(self) -> Tensor:
        """The precision ``delta`` per group, as the evidence learned it (:attr:`applied_precision`: as training uses it)."""
        return self.log_precision.exp()

    @property
    def applied_precision(self) -> Tensor:
        """The precision per group that :func:`map_loss` applies, a weight decay of ``delta/N``: :attr:`precision`,
        except for the tensors under the ``"decoupled"`` treatment (:meth:`treat`; ``MargLikCallback``'s default for
        biases and normalization parameters), which keep the declared ``precision`` whatever the evidence learned."""
        return self.weight_decay_log_precision().exp()

    def group_sizes(self) -> Tensor:
        """Number of scalar parameters ``P_g`` in each group, shape ``(G,)``."""
        sizes = torch.tensor(self.param_sizes, dtype=self.log_precision.dtype, device=self.log_precision.device)
        if self.structure == "scalar":
            return sizes.sum().reshape(1)
        if self.structure == "layerwise":
            return sizes
        return torch.ones_like(self.log_precision)

    def group_sq_norms(self, params: Optional[List[Tensor]] = None, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Squared norms ``||theta_g||^2`` per group, shape ``(G,)``, those of the whole tensors also where
        FSDP2 holds a tensor as a sharded DTensor (:func:`_sq_norm`); in ``dtype`` if given, each tensor
        converted on its own (one float64 copy at a time, not the model's)."""
        params = self.params if params is None else params
        convert = (lambda p: p) if dtype is None else (lambda p: p.to(dtype))
        if self.structure == "diagonal":
            return torch.cat([convert(_whole(p)).reshape(-1) for p in params]).pow(2)
        norms = torch.stack([_sq_norm(convert(p)) for p in params])
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

    def tensor_log_precisions(self, log_precision: Tensor) -> List[Tensor]:
        """Log precision of every parameter tensor as the curvature structures take it: 0-dim, or one per
        scalar (``(numel,)``) for a diagonal prior."""
        if self.structure == "diagonal":
            return list(torch.split(log_precision, self.param_sizes))
        return list(self.per_tensor(log_precision).unbind())

    def per_parameter(self, log_precision: Tensor) -> Tensor:
        """Log precision of each scalar parameter, flattened in ``param_names`` order, shape ``(P,)``."""
        if self.structure == "diagonal":
            return log_precision
        sizes = torch.tensor(self.param_sizes, device=log_precision.device)
        return self.per_tensor(log_precision).repeat_interleave(sizes)

    def penalty(self) -> Tensor:
        """``1/2 sum_g delta_g ||theta_g||^2`` at the current precision (the MAP loss term).

        Tensors under the ``"decoupled"`` treatment use the constructor's ``precision`` here,
        whatever the evidence learned for them (:meth:`treat`). ``MargLikCallback`` finds this term
        in the loss of the first training batch (else it warns, naming :func:`map_loss`).
        """
        log_precision, params = self.weight_decay_log_precision(), self.params
        if self.structure == "diagonal" and any(hasattr(p, "full_tensor") for p in params):
            # FSDP2: each rank weighs its own shards (the whole tensors would gather the model in every step)
            precisions = (t.exp() for t in self.tensor_log_precisions(log_precision))
            value = 0.5 * torch.stack([_sq_norm(p, d.reshape(p.shape)) for p, d in zip(params, precisions)]).sum()
        else:
            value = 0.5 * (log_precision.exp() * self.group_sq_norms(params)).sum()
        if self._penalty_nodes is not None and value.grad_fn is not None:
            self._penalty_nodes.append(value.grad_fn)
        return value

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
        decoupled = self.treated("decoupled")
        # their printed precision is not their weight decay: say which is applied
        applied = f", decoupled={decoupled} (weight decay at precision={self.initial_precision:g})" if decoupled else ""
        return (
            f"structure={self.structure!r}, groups={self.log_precision.numel()}, learn={self.learn}, "
            f"fixed={self.fixed}{applied}{hyper}"
        )


def _sq_norm(param: Tensor, weights: Optional[Tensor] = None) -> Tensor:
    """``||theta||^2`` (or ``sum_i w_i theta_i^2``, ``weights`` of ``param``'s shape) of the whole tensor, on every
    rank. Outside its forward, FSDP2 (``fully_shard``) holds a parameter as a DTensor sharded across ranks, whose
    squared sum is a partial (per-shard) value and cannot meet plain tensors: the weights are cut as the parameter
    is (every rank takes its part, no communication), ``full_tensor()`` sums the shards' values (an all-reduce),
    and its backward hands each rank the gradient of its own shard, to which FSDP2 adds the reduced gradient of
    the data term."""
    if not hasattr(param, "full_tensor"):
        return param.pow(2).sum() if weights is None else (weights * param.pow(2)).sum()
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    # on the local shards: a rank may hold an empty one (a 1-row weight over 2 ranks), which DTensor's own
    # reduction hands back to FSDP2 as a gradient of the wrong shape
    squared = param.to_local().pow(2)
    if weights is not None:
        squared = distribute_tensor(weights, param.device_mesh, param.placements, src_data_rank=None).to_local() * squared
    placements = [Partial() if placement.is_shard() else Replicate() for placement in param.placements]
    return DTensor.from_local(squared.sum(), param.device_mesh, placements).full_tensor()


def _whole(param: Tensor) -> Tensor:
    """The whole tensor of a DTensor (an all-gather; backward: each rank its shard's gradient), else ``param``."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


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

    Raises:
        TypeError: If ``prior`` is not a :class:`GaussianPrior` (e.g. the network itself).

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1))
        >>> no_decay_names(GaussianPrior(net))
        ['0.bias', '1.weight', '1.bias', '2.bias']
    """
    if not isinstance(prior, GaussianPrior):
        raise TypeError(f"no_decay_names(prior) takes a GaussianPrior, got {type(prior).__name__}: pass "
                        "GaussianPrior(net) (or the module's prior), not the network.")
    return [n for n, p in zip(prior.param_names, prior.params) if p.ndim <= 1 or n.endswith(".bias")]


def check_likelihood_and_prior(likelihood: Any, prior: Any, call: str) -> None:
    """Refuse a ``likelihood`` or ``prior`` that is not one (most often the two passed in the other order).

    Args:
        likelihood: What ``call`` got as its likelihood.
        prior: What ``call`` got as its prior.
        call: The call's signature, as the message shows it, e.g. ``"map_loss(output, target, likelihood, prior)"``;
            the message names the two in its order.

    Raises:
        TypeError: If ``likelihood`` is not a :class:`Likelihood` or ``prior`` not a :class:`GaussianPrior`.
    """
    if not isinstance(likelihood, Likelihood) or not isinstance(prior, GaussianPrior):
        order = ("a GaussianPrior, then a Likelihood" if call.find("prior") < call.find("likelihood")
                 else "a Likelihood, then a GaussianPrior")
        raise TypeError(f"{call} got a {type(likelihood).__name__} as `likelihood` and a {type(prior).__name__} as "
                        f"`prior`: pass {order}.")


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
        TypeError: If ``likelihood`` or ``prior`` is not one (e.g. the two passed in the other order).
        ValueError: If ``n_data`` is not a positive int, is smaller than the batch's own count of data, or is
            not given while ``N`` is not counted yet (a training loop without ``MargLikCallback`` before
            ``LaplaceEvidence.fit``).
    """
    check_likelihood_and_prior(likelihood, prior, "map_loss(output, target, likelihood, prior)")
    counted = prior._n_data
    nll = likelihood.nll(output, target)
    if n_data is None:
        if counted == 0:
            raise ValueError(
                "map_loss needs the number of training data N, which is not counted yet: train with "
                "MargLikCallback (it counts N when training starts), or pass `n_data=` (the training set size; "
                "LaplaceEvidence.fit stores it as well)."
            )
        n_data = counted
    else:
        if isinstance(n_data, Tensor) and n_data.numel() == 1 and not n_data.is_floating_point():
            n_data = int(n_data)  # e.g. the prior's own count, its buffer ``prior.n_data``
        n_data = integer(n_data, "n_data", minimum=1, what="the training set size N")
        if nll.numel() > n_data:  # N counts the whole training set (its kept positions): at least one batch's
            raise ValueError(
                f"map_loss(n_data={n_data}), but this batch alone holds {nll.numel()} data (kept positions for "
                "(B, ..., C) outputs): pass the training set size N, not the batch size or the number of sequences."
            )
        if counted and n_data != counted and not prior._warned_n_data:
            prior._warned_n_data = True
            warnings.warn(
                f"map_loss(n_data={n_data}), but the evidence counts N={counted} data: the prior in the MAP loss is "
                f"{counted / n_data:.3g}x as strong as in the evidence. Leave out `n_data` to use the evidence's N "
                "(prior.n_data), or pass the training set size N (not the batch size).",
                stacklevel=2,
            )
    # a batch whose every label is ignored holds no datum: no data term (a mean of none would be NaN)
    data_term = (nll.mean() if nll.numel() else nll.sum()) / likelihood.temperature.detach().to(output.dtype)
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
        TypeError: If ``prior`` is not a :class:`GaussianPrior` or ``likelihood`` not a :class:`Likelihood` (e.g. the
            two in the other order).
        ValueError: On an unknown name, a value that is not a tensor, a shape mismatch, or a value that is not
            finite or lies beyond :data:`.likelihoods.LOG_LIMIT` in the buffer's dtype (nothing is written then).
    """
    check_likelihood_and_prior(likelihood, prior, "assign_hyperparameters(prior, likelihood, values)")
    buffers = {"log_precision": prior.log_precision, **likelihood.hyperparameters()}
    converted = {}
    for name, value in values.items():
        if name not in buffers:
            raise ValueError(f"Unknown hyperparameter {name!r}; expected one of {sorted(buffers)}.")
        buffer = buffers[name]
        if not isinstance(value, Tensor):
            raise ValueError(f"Hyperparameter {name!r} must be a tensor of shape {tuple(buffer.shape)} (log values, "
                             f"e.g. evidence.optimize().values[{name!r}]), got {type(value).__name__} {value!r}.")
        if value.shape != buffer.shape:
            raise ValueError(f"Hyperparameter {name!r} has shape {tuple(buffer.shape)}, got {tuple(value.shape)}.")
        cast = value.detach().to(buffer.device, buffer.dtype)
        if not torch.isfinite(cast).all():
            raise ValueError(f"Refusing to write a non-finite {name!r} (in {buffer.dtype}); the buffers are unchanged.")
        limit = LOG_LIMIT[buffer.dtype]
        if bool((cast.abs() > limit).any()):  # e.g. sigma = e^-76: sigma^2 is 0 in float32, the loss NaN
            raise ValueError(f"Refusing to write {name!r} = {cast.tolist()}: beyond +-{limit:.1f}, where its square or "
                             f"inverse square leaves {buffer.dtype}; the buffers are unchanged.")
        converted[name] = cast
    with torch.no_grad():
        for name, cast in converted.items():
            buffers[name].copy_(cast)
