"""Layer-local curvature from module hooks: the fast path of the evidence pass.

One forward pass records each hooked layer's input ``a``; one backward pass per column of the
loss-Hessian factor ``L`` (see ``Likelihood.hessian_sqrt``) yields the gradients ``g`` of the
outputs w.r.t. each layer's output. The exact diagonal and the Kronecker factors follow from
``a`` and ``g`` alone, without per-example Jacobians of the whole network.

What the hook path does with a layer is one :class:`LayerRule` per layer type, in one table keyed
by module type and looked up along the class's MRO. A subclass takes its base's rule only if it
keeps the base's ``forward`` (or the rule sets ``applies_to_subclasses``): a subclass that
transforms its weight in ``forward`` (weight standardisation, a mask) computes another function of
it, and its parameters take the exact path. So do the parameters of a layer with a trainable
parameter its rule does not compute (``LayerRule.roles``): ``weight_g``/``weight_v`` of the old
``torch.nn.utils.weight_norm``, from which the weight is computed.

A layer pruned by ``torch.nn.utils.prune`` keeps its rule (a built-in one): its forward pre-hook
sets ``weight = weight_orig * weight_mask``, so the Jacobian w.r.t. ``weight_orig`` is the
Jacobian w.r.t. ``weight`` times the mask ``M``, elementwise. Its exact diagonal is the un-pruned
one times ``M^2`` (any mask), and its curvature block is ``D_M C D_M`` (``D_M = diag(vec M)``) for
the un-pruned block ``C``. Where ``M`` is an outer product ``r c^T`` in the Kronecker layout (a
mask of ones, whole output units or input features pruned: ``prune.ln_structured``), ``D_M =
D_r (x) D_c`` and the Kronecker block ``kron(G, A)`` becomes ``kron(D_r G D_r, D_c A D_c)``:
the factors are kept, exactly (:func:`kron_masks`); an all-ones mask gives the un-pruned block.
Any other mask (``prune.l1_unstructured``) leaves ``D_M kron(G, A) D_M``, which is no Kronecker
product: such a layer gets exact diagonal blocks under ``kron`` and ``ekfac``, as a layer without
factors does. The rules:

* ``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d`` (any groups, stride, padding, dilation),
  ``nn.Embedding`` and Hugging Face's ``transformers.pytorch_utils.Conv1D`` (a Linear whose weight
  is stored ``(in, out)``; registered when transformers has been imported, never importing it):
  exact diagonal and Kronecker factors.
* ``BatchNorm`` (running statistics), ``LayerNorm``, ``GroupNorm``, ``RMSNorm``: exact diagonal
  of their affine parameters (they have no Kronecker form; under ``kron`` they are exact
  diagonal blocks).
* :class:`~lightning_marglik.FixupBias` and :class:`~lightning_marglik.FixupScale` (the scalars of a
  Fixup network): exact curvature of their one scalar, its own diagonal block under every structure.

:func:`register_layer_rule` adds a user's own layer; :mod:`.rule_checks` holds its output to the
rule's contract once, on the first batch.

Weight sharing (conv positions, sequence positions of a Linear, token positions of an
Embedding) uses the *expand* convention: every row (position) counts as an example for the
Kronecker factors, ``G = sum_{n,k,r} g g^T`` and ``A = mean a a^T`` over the rows that carry a
loss term; the diagonal is exact. A row whose output gradient is zero in every factor column
(an ignored position of a sequence output, a position no loss term depends on) adds nothing to
the exact curvature ``sum_n (sum_r g_nr a_nr^T)^2``, whatever its input, so it stays out of ``A``
and its row count: padding content cannot change the evidence.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple, Type

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from ..modules import FixupBias, FixupScale
from ..private import pruned_tensors
from .rows import contributing_rows, embedding_diagonal, gram, output_factor, unfold

__all__ = [
    "KronShape",
    "KronSums",
    "LayerRule",
    "hook_reason",
    "computed_role",
    "is_kron_layer",
    "kron_masks",
    "layer_diagonal",
    "layer_kron",
    "layer_rule",
    "register_layer_rule",
    "user_rule",
]


# a pruned tensor's scales of the output-side and input-side Kronecker factor (kron_masks)
FactorMasks = Tuple[Optional[Tensor], Optional[Tensor]]


@dataclass(frozen=True)
class KronShape:
    """The Kronecker factors of a layer's weight and how the weight is laid out.

    Attributes:
        out: Size of the output-side factor ``G`` (``out x out``).
        inp: Size of one group's input-side factor ``A`` (``inp x inp``, or ``(inp,)`` if diagonal).
        groups: Diagonal blocks of the weight (conv groups), block ``k`` is ``kron(G_k, A_k)``
            with ``G_k`` the ``k``-th diagonal sub-block of ``G``.
        transposed: The weight is stored ``(in, out)`` (Embedding, HF ``Conv1D``): its block is
            ``kron(A, G)`` in ``weight.flatten()`` order (else ``kron(G, A)``).
        diagonal_input: ``A`` is diagonal (one-hot inputs: token counts), stored as a vector.
    """

    out: int
    inp: int
    groups: int = 1
    transposed: bool = False
    diagonal_input: bool = False


@dataclass
class KronSums:
    """One batch's Kronecker factor sums of one layer.

    Attributes:
        g: ``sum g g^T`` over examples, rows and factor columns, ``(out, out)``; only its diagonal ``(out,)``
            where the output-side factor is held diagonal (:func:`layer_kron`).
        a: ``sum a a^T`` over the rows that carry a loss term, one block per conv group
            ``(groups, d, d)``; for a diagonal input factor the token counts ``(vocabulary,)``.
        rows: Number of ``(example, row)`` pairs summed in ``a`` (0-dim int64 tensor).
    """

    g: Tensor
    a: Tensor
    rows: Tensor


class LayerRule:
    """How the hook path takes one layer type: its exact diagonal, Kronecker sums, and when it cannot.

    A rule sees the layer's recorded input ``a`` (the first positional argument of its forward
    call, or the keyword of ``forward``'s first parameter: ``input=`` of torch's layers; leading
    with the batch) and the gradients ``g`` ``(K, *output.shape)`` of the ``K``
    loss-Hessian factor columns w.r.t. its output. Subclass it for a layer of your own and
    register it with :func:`register_layer_rule`; a rule with only :meth:`diagonal` gives exact
    diagonal blocks under ``kron``, one that also sets ``kron = True`` and implements
    :meth:`kron_shape` and :meth:`kron_sums` gives Kronecker blocks (``structure="diag"`` calls only
    :meth:`diagonal`). ``structure="ekfac"`` needs two methods more of a Kronecker rule:
    ``input_rows(module, a)``, the input-side rows ``(B, R, in)``, and ``grad_rows(module, g)``, the output-side
    rows ``(K, B, R, out)``, ``R`` rows per example (positions, conv patches): their products are the
    per-example gradients its second moments sum.

    Attributes:
        kron: Whether the layer has Kronecker factors (else only an exact diagonal).
        shared_input: Whether an input shared by the whole batch (leading size 1, e.g. position
            indices ``arange(T)[None]``) may be expanded to one copy per example for the pass.
        roles: Names (in the module) of the parameters the rule computes curvature for; a layer
            with another trainable parameter takes the exact path.
        applies_to_subclasses: Whether the rule also holds for subclasses that override the
            registered class's ``forward`` (else they take the exact path, unless registered themselves).
    """

    kron: bool = False
    shared_input: bool = False
    roles: Tuple[str, ...] = ("weight", "bias")
    applies_to_subclasses: bool = False

    def reason(self, module: nn.Module) -> Optional[str]:
        """Why this rule cannot take ``module`` (``None`` if it can)."""
        return None

    def diagonal(self, module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
        """Exact diagonal of ``sum_{n,k} (J_n^T L_nk)^2`` for the layer's own parameters.

        Returns:
            Per role (``"weight"``, ``"bias"``, ...), a tensor shaped like the parameter, with no negative entry
            (a sum of squares).
        """
        raise NotImplementedError

    def kron_shape(self, module: nn.Module) -> KronShape:
        """Sizes and layout of the layer's Kronecker factors (``kron`` rules only)."""
        raise NotImplementedError

    def kron_sums(self, module: nn.Module, a: Tensor, g: Tensor) -> KronSums:
        """One batch's Kronecker factor sums, expand convention (``kron`` rules only)."""
        raise NotImplementedError


class _Refused(LayerRule):
    """A module type the hook path must never take, with the reason."""

    applies_to_subclasses = True

    def __init__(self, why: str) -> None:
        self.why = why

    def reason(self, module: nn.Module) -> Optional[str]:
        return self.why


_RULES: Dict[type, LayerRule] = {}
_OPTIONAL: Dict[str, Tuple[str, str]] = {"transformers.pytorch_utils": ("Conv1D", "_TransposedLinearRule")}


def register_layer_rule(module_type: Type[nn.Module], rule: LayerRule) -> None:
    """Take ``module_type`` (and its subclasses that keep its ``forward``) on the hook path with ``rule``.

    The rule's output is checked once, on the first batch of every evidence pass (:func:`.rule_checks.check_rule`).
    A subclass that overrides ``forward`` takes the exact path unless registered itself: if its
    forward computes its base's function, ``register_layer_rule(MyLinear, layer_rule(nn.Linear(1, 1)))``
    (:func:`layer_rule` from ``lightning_marglik.curvature.layers``) gives it the base's rule.

    Args:
        module_type: The layer class, e.g. ``MyLinear``.
        rule: Its :class:`LayerRule`; replaces a rule registered before for the same class.

    Raises:
        TypeError: If ``module_type`` is not an ``nn.Module`` subclass or ``rule`` not a ``LayerRule``.

    Example:
        >>> import torch
        >>> from lightning_marglik import LayerRule, register_layer_rule
        >>> class Scale(torch.nn.Module):  # y = w * x, elementwise
        ...     def __init__(self, n): super().__init__(); self.weight = torch.nn.Parameter(torch.ones(n))
        ...     def forward(self, x): return self.weight * x
        >>> class ScaleRule(LayerRule):
        ...     def diagonal(self, module, a, g):  # per-example gradient g * a, squared and summed
        ...         return {"weight": (g * a).reshape(g.shape[0], g.shape[1], -1, a.shape[-1]).sum(2).pow(2).sum((0, 1))}
        >>> register_layer_rule(Scale, ScaleRule())
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"`module_type` must be an nn.Module subclass, got {module_type!r}.")
    if not isinstance(rule, LayerRule):
        raise TypeError(f"`rule` must be a LayerRule instance, got {type(rule).__name__}.")
    _RULES[module_type] = rule


def _register_optional() -> None:
    """Rules for layers of optional packages, once the package is imported (never importing it)."""
    for package in [p for p in _OPTIONAL if p in sys.modules]:
        class_name, rule_name = _OPTIONAL.pop(package)
        module_type = getattr(sys.modules[package], class_name, None)
        if module_type is not None:
            _RULES.setdefault(module_type, globals()[rule_name]())  # a user's own rule wins


def layer_rule(module: nn.Module) -> Optional[LayerRule]:
    """The rule of ``module``'s class or of its nearest base class with one (``None``: no rule).

    A base class's rule holds for a subclass that keeps the base's ``forward``; for one that
    overrides it (unless the rule sets ``applies_to_subclasses``) the result is a refusal naming why.
    """
    if _OPTIONAL:
        _register_optional()
    cls_ = type(module)
    for base in cls_.__mro__:
        rule = _RULES.get(base)
        if rule is None:
            continue
        if base is cls_ or rule.applies_to_subclasses or cls_.forward is base.forward:
            pruned = pruned_tensors(module)
            return _PrunedRule(rule, module, pruned) if pruned and type(rule) in _BUILT_IN else rule
        return _Refused(
            f"{cls_.__name__} overrides the forward of {base.__name__}, whose hook rule it would inherit, and may "
            f"compute another function of its weights (register_layer_rule({cls_.__name__}, rule) takes it on the "
            "hook path)"
        )
    return None


def hook_reason(module: nn.Module, roles: Iterable[str] = ()) -> Optional[str]:
    """Why the hook path cannot take ``module``'s own parameters (``None`` if it can).

    Args:
        module: The layer.
        roles: Names (in ``module``) of its parameters the curvature covers; one the rule does not
            compute (``weight_orig`` of a pruned layer) rules the hook path out.
    """
    rule = layer_rule(module)
    if rule is None:
        return f"{type(module).__name__} has no hook rule (lightning_marglik.register_layer_rule adds one)"
    reason = rule.reason(module)
    foreign = [role for role in roles if role not in rule.roles]
    if reason is None and foreign:
        return (
            f"its parameter(s) {', '.join(map(repr, foreign))} are not among those its layer rule computes "
            f"({', '.join(map(repr, rule.roles))}), e.g. the tensors the old torch.nn.utils.weight_norm computes "
            "the weight from, or those torch.nn.utils.prune multiplies by a mask in a layer of a registered rule"
        )
    return reason


def computed_role(module: nn.Module, role: str) -> str:
    """The role a layer rule computes for ``module``'s parameter ``role``: ``"weight"`` for the
    ``"weight_orig"`` that ``torch.nn.utils.prune`` multiplies by ``weight_mask``; else ``role``."""
    return {orig: name for name, orig in pruned_tensors(module).items()}.get(role, role)


def _outer_factors(mask: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """``(r, c)`` with ``mask == outer(r, c)`` exactly, or ``None`` if ``mask`` (2-D) is no outer product."""
    if not bool(mask.any()):
        return mask.new_zeros(mask.shape[0]), mask.new_zeros(mask.shape[1])
    i, j = divmod(int(mask.abs().argmax()), mask.shape[1])
    r, c = mask[:, j], mask[i] / mask[i, j]
    return (r, c) if torch.equal(torch.outer(r, c), mask) else None


def _factor_masks(base: LayerRule, module: nn.Module, pruned: Dict[str, str]) -> Optional[Dict[str, FactorMasks]]:
    """What :func:`kron_masks` returns for a pruned layer of the Kronecker rule ``base``; ``None`` where its
    weight's mask is no outer product in the ``(out, in)`` layout of its factors, or its input factor is
    diagonal (an Embedding's token counts)."""
    out: Dict[str, FactorMasks] = {}
    for name in pruned:
        mask = getattr(module, f"{name}_mask").detach()
        if name != "weight":  # a bias: its block is G alone
            out[name] = (mask.reshape(-1), None)
            continue
        shape = base.kron_shape(module)
        matrix = mask.T if shape.transposed else mask.reshape(shape.out, -1)  # the (out, in) layout of kron(G, A)
        factors = None if shape.diagonal_input else _outer_factors(matrix)
        if factors is None:
            return None
        out[name] = factors
    return out


def kron_masks(module: nn.Module) -> Dict[str, FactorMasks]:
    """How ``torch.nn.utils.prune``'s masks scale a Kronecker layer's factors, by role.

    ``(r, c)`` for a weight whose mask is ``outer(r, c)`` in its ``(out, in)`` layout: its block
    ``kron(G, A)`` becomes ``kron(D_r G D_r, D_c A D_c)``; ``(m, None)`` for a pruned bias, whose
    block ``G`` becomes ``D_m G D_m``. Tensors that are not pruned, and layers without pruning or
    without Kronecker factors (:func:`is_kron_layer`), have no entry.
    """
    rule = layer_rule(module)
    return dict(rule.masks or {}) if isinstance(rule, _PrunedRule) else {}


class _PrunedRule(LayerRule):
    """A built-in rule on a layer ``torch.nn.utils.prune`` reparametrises: the base rule's rows and
    (un-masked) Kronecker sums, its diagonal times the masks squared, and Kronecker factors only where
    :func:`kron_masks` can scale them."""

    def __init__(self, base: LayerRule, module: nn.Module, pruned: Dict[str, str]) -> None:
        self.base, self.pruned = base, pruned
        self.shared_input = base.shared_input
        self.roles = tuple(pruned.get(role, role) for role in base.roles)
        self.masks = _factor_masks(base, module, pruned) if base.kron else None
        self.kron = self.masks is not None

    def reason(self, module: nn.Module) -> Optional[str]:
        return self.base.reason(module)

    def diagonal(self, module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
        diagonal = self.base.diagonal(module, a, g)
        for name in self.pruned:  # the Jacobian w.r.t. <name>_orig is the one w.r.t. <name> times the mask
            if name in diagonal:
                diagonal[name] = diagonal[name] * getattr(module, f"{name}_mask").detach().pow(2)
        return diagonal

    def kron_shape(self, module: nn.Module) -> KronShape:
        return self.base.kron_shape(module)

    def kron_sums(self, module: nn.Module, a: Tensor, g: Tensor, diagonal_output: bool = False) -> KronSums:
        return self.base.kron_sums(module, a, g, diagonal_output)  # type: ignore[call-arg]

    def input_rows(self, module: nn.Module, a: Tensor) -> Tensor:  # EKFAC's second moments (un-masked rows)
        return self.base.input_rows(module, a)  # type: ignore[attr-defined]

    def grad_rows(self, module: nn.Module, g: Tensor) -> Tensor:
        return self.base.grad_rows(module, g)  # type: ignore[attr-defined]


def is_kron_layer(module: nn.Module) -> bool:
    """Whether the layer has Kronecker factors (else only an exact diagonal)."""
    rule = layer_rule(module)
    return rule is not None and rule.kron


def layer_diagonal(module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """Exact diagonal of ``sum_{n,k} (J_n^T L_nk)^2`` for the layer's own parameters.

    Args:
        module: The layer (it has a rule: :func:`hook_reason` is ``None``).
        a: Its recorded input.
        g: Gradients w.r.t. its output, ``(K, *output.shape)``.

    Returns:
        Per role (``"weight"``, ``"bias"``), a tensor shaped like the parameter.
    """
    return layer_rule(module).diagonal(module, a, g)


def layer_kron(module: nn.Module, a: Tensor, g: Tensor, diagonal_output: bool = False) -> KronSums:
    """Kronecker factor sums of one layer for one batch (expand convention).

    Args:
        module: The layer (it has a Kronecker rule: :func:`is_kron_layer`).
        a: Its recorded input.
        g: Gradients w.r.t. its output, ``(K, *output.shape)``.
        diagonal_output: Sum only the diagonal of the output-side factor ``G`` (``KronSums.g`` is then
            ``(out,)``). The built-in rules never form ``G``; a registered rule's whole ``G`` is reduced to it.
    """
    rule = layer_rule(module)
    if not diagonal_output:
        return rule.kron_sums(module, a, g)
    if type(rule) in _BUILT_IN:
        return rule.kron_sums(module, a, g, diagonal_output=True)  # type: ignore[call-arg]
    sums = rule.kron_sums(module, a, g)
    return KronSums(torch.diagonal(sums.g).clone(), sums.a, sums.rows)


# --- the rules --------------------------------------------------------------------------------


class _AffineRule(LayerRule):
    """``y = W a + b`` over the last dimension (``nn.Linear``); every leading index after the batch is a row."""

    kron = True

    def input_rows(self, module: nn.Module, a: Tensor) -> Tensor:
        """Layer input as rows ``(B, R, in)``."""
        return a.reshape(a.shape[0], -1, a.shape[-1])

    def grad_rows(self, module: nn.Module, g: Tensor) -> Tensor:
        """Output gradients ``(K, B, *out)`` as rows ``(K, B, R, out)``."""
        return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])

    def groups(self, module: nn.Module) -> int:
        return 1

    def as_weight(self, module: nn.Module, value: Tensor) -> Tensor:
        """A per-scalar quantity ``(out, in)`` in the layout of ``module.weight``."""
        return value.reshape(module.weight.shape)

    def kron_shape(self, module: nn.Module) -> KronShape:
        return KronShape(module.weight.shape[0], module.weight[0].numel(), self.groups(module))

    def diagonal(self, module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
        a_rows, g_rows = self.input_rows(module, a), self.grad_rows(module, g)
        out = {}
        if a_rows.shape[1] == 1:  # no weight sharing: the per-example gradient is an outer product
            g_sq = g_rows[:, :, 0].pow(2)  # (K, B, out), squared once for the weight and the bias
            out["weight"] = self.as_weight(module, g_sq.sum(0).T @ a_rows[:, 0].pow(2))
            if module.bias is not None:
                out["bias"] = g_sq.sum((0, 1))
            return out
        # weight sharing: per-example gradients (B, out, in), one factor column at a time, so that at
        # most B x out x in values are alive (not K x B x out x in); one block per conv group
        groups = self.groups(module)
        weight = None
        for g_col in g_rows:  # (B, R, out)
            blocks = [
                torch.bmm(gg.transpose(1, 2), aa).pow_(2).sum(0)
                for gg, aa in zip(g_col.chunk(groups, dim=2), a_rows.chunk(groups, dim=2))
            ]
            square = torch.cat(blocks) if groups > 1 else blocks[0]
            weight = square if weight is None else weight.add_(square)
        out["weight"] = self.as_weight(module, weight)
        if module.bias is not None:
            out["bias"] = g_rows.sum(2).pow(2).sum((0, 1))
        return out

    def kron_sums(self, module: nn.Module, a: Tensor, g: Tensor, diagonal_output: bool = False) -> KronSums:
        a_rows, g_rows = self.input_rows(module, a), self.grad_rows(module, g)
        keep = contributing_rows(g_rows)
        if not bool(keep.all()):  # rows without a loss term (ignored positions) stay out of A
            a_rows = a_rows[keep].unsqueeze(1)
        groups = self.groups(module)
        if groups == 1:
            a_sum = gram(a_rows).unsqueeze(0)
        else:
            a_sum = torch.stack([gram(block) for block in a_rows.chunk(groups, dim=2)])
        return KronSums(output_factor(g_rows.flatten(0, 1), diagonal_output), a_sum, keep.sum())


class _TransposedLinearRule(_AffineRule):
    """``y = a W + b`` with ``W`` stored ``(in, out)``: Hugging Face's ``transformers.pytorch_utils.Conv1D``."""

    def as_weight(self, module: nn.Module, value: Tensor) -> Tensor:
        return value.T

    def kron_shape(self, module: nn.Module) -> KronShape:
        return KronShape(module.weight.shape[1], module.weight.shape[0], transposed=True)


class _ConvRule(_AffineRule):
    """``nn.Conv1d``/``nn.Conv2d``: rows are output positions, inputs the unfolded patches."""

    def reason(self, module: nn.Module) -> Optional[str]:
        if module.padding_mode != "zeros":
            return f"{type(module).__name__} with padding_mode={module.padding_mode!r}"
        return None

    def input_rows(self, module: nn.Module, a: Tensor) -> Tensor:
        return unfold(module, a)

    def grad_rows(self, module: nn.Module, g: Tensor) -> Tensor:
        k, b = g.shape[:2]
        return g.reshape(k, b, g.shape[2], -1).transpose(2, 3)

    def groups(self, module: nn.Module) -> int:
        return module.groups


class _EmbeddingRule(LayerRule):
    """``nn.Embedding``: rows are index positions; the input factor is diagonal (token counts)."""

    kron = True
    shared_input = True

    def reason(self, module: nn.Module) -> Optional[str]:
        # scale_grad_by_freq is not: it scales the weight's gradient in backward, which the rule never runs
        if module.max_norm is not None:
            return "Embedding with max_norm"
        return None

    @staticmethod
    def _rows(a: Tensor, g: Tensor) -> Tuple[Tensor, Tensor]:
        return a.reshape(a.shape[0], -1), g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])

    def diagonal(self, module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
        return {"weight": embedding_diagonal(module, *self._rows(a, g))}

    def kron_shape(self, module: nn.Module) -> KronShape:
        return KronShape(module.embedding_dim, module.num_embeddings, transposed=True, diagonal_input=True)

    def kron_sums(self, module: nn.Module, a: Tensor, g: Tensor, diagonal_output: bool = False) -> KronSums:
        idx, g_rows = self._rows(a, g)
        keep = contributing_rows(g_rows)
        counts = torch.bincount(idx[keep], minlength=module.num_embeddings).to(g_rows.dtype)
        if module.padding_idx is not None:  # its row has no gradient: counted in the rows, not in A
            counts[module.padding_idx] = 0
        return KronSums(output_factor(g_rows.flatten(0, 1), diagonal_output), counts, keep.sum())


class _NormRule(LayerRule):
    """Affine parameters of a normalization layer, ``y = x_hat * weight + bias``: exact diagonal only."""

    trailing = False  # parameters over the trailing normalized_shape (else: channels on dim 1)

    def normalized(self, module: nn.Module, a: Tensor) -> Tensor:
        """The normalized input ``x_hat`` the weight multiplies."""
        raise NotImplementedError

    def diagonal(self, module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
        k, b = g.shape[:2]
        if self.trailing:
            shape = tuple(module.normalized_shape)
            per_example = lambda t: t.reshape(k, b, -1, *shape).sum(2)  # noqa: E731 - sum over leading positions
        else:
            per_example = lambda t: t.reshape(k, b, t.shape[2], -1).sum(3)  # noqa: E731
        out = {}
        if module.weight is not None:
            out["weight"] = per_example(g * self.normalized(module, a)).pow(2).sum((0, 1))
        if getattr(module, "bias", None) is not None:
            out["bias"] = per_example(g).pow(2).sum((0, 1))
        return out


class _BatchNormRule(_NormRule):
    def reason(self, module: nn.Module) -> Optional[str]:
        if getattr(module, "running_mean", None) is None:
            return "BatchNorm without running statistics mixes the examples of a batch"
        return None

    def normalized(self, module: nn.Module, a: Tensor) -> Tensor:
        shape = (1, -1) + (1,) * (a.dim() - 2)
        return (a - module.running_mean.reshape(shape)) * torch.rsqrt(module.running_var.reshape(shape) + module.eps)


class _GroupNormRule(_NormRule):
    def normalized(self, module: nn.Module, a: Tensor) -> Tensor:
        return F.group_norm(a, module.num_groups, None, None, module.eps)


class _LayerNormRule(_NormRule):
    trailing = True

    def normalized(self, module: nn.Module, a: Tensor) -> Tensor:
        return F.layer_norm(a, module.normalized_shape, None, None, module.eps)


class _RMSNormRule(_NormRule):
    trailing = True

    def normalized(self, module: nn.Module, a: Tensor) -> Tensor:
        return F.rms_norm(a, module.normalized_shape, None, module.eps)


class _FixupBiasRule(LayerRule):
    """``y = x + bias``, one scalar: the per-example gradient sums ``g`` over the example's outputs."""

    roles = ("bias",)

    def diagonal(self, module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
        return {"bias": g.reshape(g.shape[0], g.shape[1], -1).sum(2).pow(2).sum((0, 1))}


class _FixupScaleRule(LayerRule):
    """``y = x * weight``, one scalar: the per-example gradient sums ``g * x`` over the example's outputs."""

    roles = ("weight",)

    def diagonal(self, module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
        per_example = (g * a).reshape(g.shape[0], g.shape[1], -1).sum(2)
        return {"weight": per_example.pow(2).sum((0, 1))}


register_layer_rule(nn.Linear, _AffineRule())
register_layer_rule(nn.Conv1d, _ConvRule())
register_layer_rule(nn.Conv2d, _ConvRule())
register_layer_rule(nn.Embedding, _EmbeddingRule())
for _norm in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
    register_layer_rule(_norm, _BatchNormRule())
register_layer_rule(nn.GroupNorm, _GroupNormRule())
register_layer_rule(nn.LayerNorm, _LayerNormRule())
if hasattr(nn, "RMSNorm"):
    register_layer_rule(nn.RMSNorm, _RMSNormRule())
register_layer_rule(FixupBias, _FixupBiasRule())
register_layer_rule(FixupScale, _FixupScaleRule())
register_layer_rule(
    parametrize.ParametrizationList,
    _Refused("a parametrized weight (torch.nn.utils.parametrize): exact diagonal of the tensors it is computed from"),
)
_BUILT_IN = {type(rule) for rule in _RULES.values()} | {_TransposedLinearRule, _PrunedRule}


def user_rule(module: nn.Module) -> Optional[LayerRule]:
    """The rule of ``module`` where it is a user's (:func:`register_layer_rule`), ``None`` for the library's own
    (proven against the dense reference in the test suite) or none."""
    rule = layer_rule(module)
    return None if rule is None or type(rule) in _BUILT_IN else rule
