"""A user's layer rule held to its contract (:class:`~.layers.LayerRule`), before its results are summed.

A registered rule's diagonal and Kronecker sums are checked once, on the first batch (:func:`check_rule`), and a
Kronecker rule's layout before a structure is built from it (:func:`check_kron_rule`): a transposed, misnamed or
negative result would otherwise be summed into the wrong scalars, give a NaN or a plausible wrong evidence, or fail
deep in a structure. The library's own rules are proven against the dense reference in the test suite and not
re-checked.
"""
from __future__ import annotations

from typing import Dict

from torch import Tensor, nn

from .layers import LayerRule, user_rule

__all__ = ["check_kron_rule", "check_rule"]


def _label(rule: LayerRule, name: str, module: nn.Module) -> str:
    """How the messages name a registered rule and its layer."""
    return f"Layer rule {type(rule).__name__} for module '{name}' ({type(module).__name__})"


def check_kron_rule(name: str, module: nn.Module) -> None:
    """Refuse a registered rule that sets ``kron = True`` without ``kron_shape``, before a structure that sums
    Kronecker factors (``kron``, ``ekfac``) is built from it: :class:`LayerRule`'s own has nothing to return. One
    without ``kron_sums`` alone is refused by :func:`check_rule` on the first batch, after its layout is checked.

    Args:
        name: The layer's module name (for the message).
        module: The layer.

    Raises:
        ValueError: Naming the rule, the layer, the missing method(s) and the fix.
    """
    rule = user_rule(module)
    if rule is not None:
        _require_kron(_label(rule, name, module), rule, "kron_shape")


def _require_kron(label: str, rule: LayerRule, method: str) -> None:
    """Refuse a ``kron`` rule that does not implement ``method`` (``kron_shape`` or ``kron_sums``), naming every
    Kronecker method it lacks."""
    missing = [f"{m}()" for m in ("kron_shape", "kron_sums") if getattr(type(rule), m) is getattr(LayerRule, m)]
    if f"{method}()" in missing:
        raise ValueError(
            f"{label}: kron = True, but the rule does not implement {' or '.join(missing)}, which the Kronecker "
            "blocks of structure='kron' and 'ekfac' need; implement them, or set kron = False (an exact diagonal "
            "block from diagonal()), or use structure='diag'."
        )


def check_rule(name: str, module: nn.Module, a: Tensor, g: Tensor, kron: bool = True) -> None:
    """Hold a registered rule's output on one batch to its contract (the library's own rules are
    proven against the dense reference in the test suite and not re-checked).

    The diagonal must hold one tensor shaped like each trainable parameter, keyed by its name in
    the module, and nothing else, with no negative entry (it sums squares); where the pass sums the layer's
    Kronecker factors, a Kronecker layout must multiply out to the weight's size and the
    Kronecker sums must have its factors' shapes. A transposed or misnamed result would otherwise be
    summed into the wrong scalars, or fail deep in a structure.

    Args:
        name: The layer's module name (for the message).
        module: The layer.
        a: Its recorded input on the batch.
        g: Gradients w.r.t. its output, ``(K, *output.shape)``.
        kron: Whether the pass's structure sums Kronecker factors (``kron``, ``ekfac``): else a ``kron`` rule's
            Kronecker methods are not called, and not checked.

    Raises:
        ValueError: Naming the rule, the layer, what it returned and the fix.
    """
    rule = user_rule(module)
    if rule is None:
        return
    label = _label(rule, name, module)
    params = dict(module.named_parameters(recurse=False))
    diagonal = rule.diagonal(module, a, g)
    if not isinstance(diagonal, dict):
        raise ValueError(f"{label}: diagonal() returned {type(diagonal).__name__}; return a dict of tensors by role.")
    unknown = [role for role in diagonal if role not in params]
    missing = [role for role, p in params.items() if p.requires_grad and role not in diagonal]
    if unknown or missing:
        raise ValueError(
            f"{label}: diagonal() returned the role(s) {', '.join(map(repr, diagonal))}, the layer's parameters are "
            f"{', '.join(map(repr, params))}; key each tensor by its parameter's name in the module, one for every "
            "trainable parameter (and set the rule's `roles` to those names if they are not 'weight' and 'bias')."
        )
    for role, value in diagonal.items():
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        if shape != tuple(params[role].shape):
            raise ValueError(
                f"{label}: diagonal() returned {role!r} of shape {shape}, the parameter {role!r} is "
                f"{tuple(params[role].shape)}; return, per role, a tensor shaped like the parameter (in its own "
                "layout: not transposed or flattened)."
            )
        # a sum of squares: a negative entry (a difference, or a missing square) makes H indefinite, the evidence
        # NaN or a plausible wrong value
        if bool((value < 0).any()):
            raise ValueError(
                f"{label}: diagonal() returned {role!r} with negative entries (min {float(value.min()):.3g}); the GGN "
                "diagonal sums squares, sum_{n,k} (J_n^T L_nk)^2 >= 0: square each per-example gradient, then sum."
            )
    if kron and rule.kron:
        _check_kron(label, rule, module, params, a, g)


def _check_kron(
    label: str, rule: LayerRule, module: nn.Module, params: Dict[str, Tensor], a: Tensor, g: Tensor
) -> None:
    """The Kronecker half of :func:`check_rule`."""
    _require_kron(label, rule, "kron_shape")
    shape = rule.kron_shape(module)
    weight, bias = params.get("weight"), params.get("bias")
    if weight is not None and shape.out * shape.inp != weight.numel():
        raise ValueError(
            f"{label}: kron_shape() gives factors {shape.out} x {shape.inp} (out x inp) for a weight of "
            f"{weight.numel()} scalars {tuple(weight.shape)}; out * inp must be the weight's size (inp per conv group)."
        )
    if bias is not None and bias.numel() != shape.out:
        raise ValueError(
            f"{label}: kron_shape() gives out={shape.out} for a bias of {bias.numel()} scalars; out must be its size."
        )
    _require_kron(label, rule, "kron_sums")
    sums = rule.kron_sums(module, a, g)
    want = {
        "g": (shape.out, shape.out),
        "a": (shape.inp,) if shape.diagonal_input else (shape.groups, shape.inp, shape.inp),
        "rows": (),
    }
    for field, expected in want.items():
        got = tuple(getattr(sums, field).shape)
        if got != expected:
            raise ValueError(
                f"{label}: kron_sums() returned {field} of shape {got}, its kron_shape() {shape} needs {expected} "
                "(KronSums: g is out x out, a one inp x inp block per group or the inp counts, rows a 0-dim count)."
            )
