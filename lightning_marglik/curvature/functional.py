"""Per-example rows ``L_nk^T J_n`` with torch.func, for the parameters the hook path cannot take.

Only the given parameters are differentiated (the rest of the network enters as constants), so
the cost is ``K`` vector-Jacobian products per example down to the earliest of them. Where
``vmap`` refuses the forward (data-dependent control flow such as Hugging Face's attention-mask
helpers, ``.item()``, activation checkpointing), the same rows come from plain autograd, one
example at a time. A batch is normalized once (:func:`.batches.model_batch`: the call form, the size,
which inputs lead with the batch dimension); every example is then taken from it here.
"""
from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from .batches import Inputs, ModelBatch, model_batch, not_a_tensor

__all__ = ["ExactPath", "jacobian_rows"]

# activation checkpointing: saved-tensor hooks (use_reentrant=False) or an autograd.Function without
# setup_context (use_reentrant=True) cannot run inside torch.func transforms. The loop is then the
# documented way checkpointed networks run, so it is not warned about.
_CHECKPOINTING = ("saved tensor hooks", "setup_context")


def _unsqueeze(inputs: Any, dims: Any) -> Any:
    if isinstance(inputs, Tensor):
        return inputs.unsqueeze(0) if dims == 0 else inputs
    if isinstance(inputs, tuple):
        return tuple(_unsqueeze(v, d) for v, d in zip(inputs, dims))
    if isinstance(inputs, dict):
        return {k: _unsqueeze(v, dims[k]) for k, v in inputs.items()}
    return inputs


class ExactPath:
    """The exact per-example rows of some parameters, over the batches of one evidence pass.

    Rows come from ``vmap`` over examples of a ``vjp`` through ``functional_call``. If ``vmap``
    refuses the forward, they come from plain autograd, one example at a time (each example's
    forward as a batch of one, as ``vmap`` sees it): the same numbers, one forward per example and
    one backward per factor column. The switch is made once per pass and, unless the refusal is
    activation checkpointing, named in one warning.

    Args:
        model: The network, called as in :func:`.batches.call_model`.
        names: Names (in ``model``) of the parameters to differentiate.
        params: The parameter tensors themselves, in ``names`` order.
        modules: The modules that own them, named in the warning.
        fix: Where ``modules`` is empty (every parameter), the warning's other way to the fast path (``""``: none,
            where no structure was asked, as for the predictive's Jacobians).
    """

    def __init__(self, model: nn.Module, names: List[str], params: List[Tensor], modules: Sequence[str] = (),
                 fix: str = "use structure='kron' or 'diag' (only modules without a hook rule then take the exact path)"
                 ) -> None:
        self.model, self.names, self.params, self.modules, self.fix = model, names, params, list(modules), fix
        self.refusal: Optional[str] = None  # why vmap cannot run this forward, once seen

    def rows(self, inputs: Inputs, factor: Tensor) -> Tensor:
        """Rows ``L_n[:, j]^T J_n`` of every example ``n`` and factor column ``j``.

        Args:
            inputs: Input batch (tensor, tuple or dict), split and moved.
            factor: Loss-Hessian factor ``(B, M, K)`` over the flattened outputs.

        Returns:
            Tensor ``(B * K, P)`` with ``P`` the total size of the parameters, flattened in order.

        Raises:
            TypeError: If ``forward`` does not return a tensor.
            ValueError: If a BatchNorm without running statistics sees one example without spatial positions,
                which has no statistics to normalize by, or one example's output does not hold the values of
                ``factor``'s rows (inputs that do not lead with the batch).
        """
        try:
            return self._rows(model_batch(inputs, factor.shape[0]), factor)
        except ValueError as error:
            if "Expected more than 1 value per channel" not in str(error):
                raise
            raise ValueError(
                "A BatchNorm without running statistics (track_running_stats=False) on features without spatial "
                "positions, e.g. BatchNorm1d on (batch, features), normalizes by the batch: one example alone has no "
                "statistics, so its per-example curvature (the exact path such a BatchNorm takes) cannot be computed. "
                f"Keep running statistics (track_running_stats=True, the default), or use a LayerNorm. ({error})"
            ) from error

    def _rows(self, batch: ModelBatch, factor: Tensor) -> Tensor:
        if self.refusal is None:
            try:
                return self._rows_by_vmap(batch, factor)
            except (RuntimeError, NotImplementedError) as error:
                # anything else the forward gets wrong fails again, with its own message, in the loop
                rows = _rows_by_autograd(self.model, self.params, batch, factor)
                message = str(error)
                self.refusal = f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"
                if not any(marker in message for marker in _CHECKPOINTING):
                    self._warn(factor)
                return rows
        return _rows_by_autograd(self.model, self.params, batch, factor)

    def _rows_by_vmap(self, batch: ModelBatch, factor: Tensor) -> Tensor:
        detached = tuple(p.detach() for p in self.params)

        def single_output(theta: tuple, args: tuple, kwargs: dict) -> Tensor:
            args, kwargs = _unsqueeze(args, batch.arg_dims), _unsqueeze(kwargs, batch.kwarg_dims)
            return _example_output(functional_call(self.model, dict(zip(self.names, theta)), args, kwargs), factor)

        def single_rows(theta: tuple, args: tuple, kwargs: dict, li: Tensor) -> tuple:
            _, pullback = vjp(lambda t: single_output(t, args, kwargs), theta)
            return vmap(pullback)(li.T)[0]

        in_dims = (None, batch.arg_dims, batch.kwarg_dims, 0)
        rows = vmap(single_rows, in_dims=in_dims)(detached, batch.args, batch.kwargs, factor)
        b, k = factor.shape[0], factor.shape[2]
        return torch.cat([r.reshape(b, k, -1) for r in rows], dim=2).reshape(b * k, -1)

    def _warn(self, factor: Tensor) -> None:
        if self.modules:
            listed = ", ".join(f"'{name or '<top-level module>'}'" for name in self.modules)
            fix = "let the layer hooks take these modules (see why they take the exact path)"
        else:  # structure="full", or the predictive's and the kernel bound's Jacobians, where no structure is asked
            listed = "every parameter"
            fix = self.fix
        refusal = self.refusal if len(self.refusal or "") <= 200 else f"{(self.refusal or '')[:200]}..."
        warnings.warn(
            f"torch.func.vmap cannot run the forward for the exact per-example rows of {listed} ({refusal}); "
            f"computing them with plain autograd instead, one example at a time: the same numbers, but one forward "
            f"per example and {factor.shape[2]} backward(s) per example. For the fast path, {fix + ', ' if fix else ''}"
            "write the forward without Python control flow on tensor values or .item() (e.g. torch.where), or freeze "
            "these parameters (requires_grad=False).",
            stacklevel=4,
        )


def jacobian_rows(model: nn.Module, names: List[str], params: List[Tensor], inputs: Inputs, factor: Tensor,
                  fix: str = "") -> Tensor:
    """Rows ``L_n[:, j]^T J_n`` of every example ``n`` and factor column ``j`` (one batch's :class:`ExactPath`).

    Args:
        model: The network, called as in :func:`.batches.call_model`.
        names: Names (in ``model``) of the parameters to differentiate.
        params: The parameter tensors themselves, in ``names`` order.
        inputs: Input batch (tensor, tuple or dict).
        factor: Loss-Hessian factor ``(B, M, K)`` over the flattened outputs.
        fix: A way to the fast path beside the forward's form, for the warning where ``vmap`` refuses it.

    Returns:
        Tensor ``(B * K, P)`` with ``P`` the total size of ``params``, flattened in order.
    """
    return ExactPath(model, names, params, fix=fix).rows(inputs, factor)


def _example(inputs: Any, dims: Any, n: int) -> Any:
    """Example ``n`` of ``inputs`` as a batch of one."""
    if isinstance(inputs, Tensor):
        return inputs[n : n + 1] if dims == 0 else inputs
    if isinstance(inputs, tuple):
        return tuple(_example(v, d, n) for v, d in zip(inputs, dims))
    if isinstance(inputs, dict):
        return {k: _example(v, dims[k], n) for k, v in inputs.items()}
    return inputs


def _example_output(output: Any, factor: Tensor) -> Tensor:
    """One example's network ``output``, flattened, checked to hold as many values as ``factor`` has rows per
    example (an example's output from inputs that do not carry the batch has the batch's values or more).

    Raises:
        TypeError: If ``output`` is not a tensor.
        ValueError: If it holds another number of values, naming both and the fix.
    """
    if not isinstance(output, Tensor):
        raise not_a_tensor(output)
    if output.numel() != factor.shape[1]:
        raise ValueError(
            f"One example's output has {output.numel()} values, the batch's output {factor.shape[1]} per example: the "
            "output does not follow the inputs' first dimension, which the evidence takes as the batch's (a "
            "sequence-first (T, B, ...) input?). Pass inputs batch-first: transpose it inside forward or give its "
            "layer batch_first=True."
        )
    return output.reshape(-1)


def _rows_by_autograd(model: nn.Module, params: List[Tensor], batch: ModelBatch, factor: Tensor) -> Tensor:
    """The same rows with plain autograd, one example at a time.

    For forwards torch.func cannot run (``torch.utils.checkpoint``, control flow on tensor values);
    plain autograd can, at the cost of a forward per example and a backward per factor column.
    """
    rows = []
    with torch.enable_grad():
        for n in range(factor.shape[0]):
            args, kwargs = _example(batch.args, batch.arg_dims, n), _example(batch.kwargs, batch.kwarg_dims, n)
            output = _example_output(model(*args, **kwargs), factor)
            for j in range(factor.shape[2]):
                grads = torch.autograd.grad(
                    output, params, grad_outputs=factor[n, :, j], retain_graph=j < factor.shape[2] - 1, allow_unused=True
                )
                if any(g is None for g in grads):  # zeros would be a silently wrong curvature
                    raise ValueError(
                        "Some trainable parameters get no gradient through torch.autograd.grad (reentrant activation "
                        "checkpointing supports only .backward()); use torch.utils.checkpoint(..., use_reentrant=False)."
                    )
                rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)
