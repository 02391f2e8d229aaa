"""Per-example rows ``L_nk^T J_n`` with torch.func, for the parameters the hook path cannot take.

Only the given parameters are differentiated (the rest of the network enters as constants), so
the cost is ``K`` vector-Jacobian products per example down to the earliest of them.
"""
from __future__ import annotations

from typing import Any, List

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from .batches import Inputs, batch_size, call_model

__all__ = ["jacobian_rows"]


def _in_dims(inputs: Any, b: int) -> Any:
    """vmap dimensions: 0 for tensors with the batch dimension, ``None`` for everything else."""
    if isinstance(inputs, Tensor):
        return 0 if inputs.dim() > 0 and inputs.shape[0] == b else None
    if isinstance(inputs, tuple):
        return tuple(_in_dims(v, b) for v in inputs)
    if isinstance(inputs, dict):
        return {k: _in_dims(v, b) for k, v in inputs.items()}
    return None


def _unsqueeze(inputs: Any, dims: Any) -> Any:
    if isinstance(inputs, Tensor):
        return inputs.unsqueeze(0) if dims == 0 else inputs
    if isinstance(inputs, tuple):
        return tuple(_unsqueeze(v, d) for v, d in zip(inputs, dims))
    if isinstance(inputs, dict):
        return {k: _unsqueeze(v, dims[k]) for k, v in inputs.items()}
    return inputs


def jacobian_rows(model: nn.Module, names: List[str], params: List[Tensor], inputs: Inputs, factor: Tensor) -> Tensor:
    """Rows ``L_n[:, j]^T J_n`` of every example ``n`` and factor column ``j``.

    Args:
        model: The network, called as in :func:`call_model`.
        names: Names (in ``model``) of the parameters to differentiate.
        params: The parameter tensors themselves, in ``names`` order.
        inputs: Input batch (tensor, tuple or dict).
        factor: Loss-Hessian factor ``(B, M, K)`` over the flattened outputs.

    Returns:
        Tensor ``(B * K, P)`` with ``P`` the total size of ``params``, flattened in order.
    """
    detached = tuple(p.detach() for p in params)
    b = batch_size(inputs)
    dims = _in_dims(inputs, b)

    def single_output(theta: tuple, xi: Any) -> Tensor:
        return call_model_functional(model, dict(zip(names, theta)), _unsqueeze(xi, dims)).reshape(-1)

    def single_rows(theta: tuple, xi: Any, li: Tensor) -> tuple:
        _, pullback = vjp(lambda t: single_output(t, xi), theta)
        return vmap(pullback)(li.T)[0]

    try:
        rows = vmap(single_rows, in_dims=(None, dims, 0))(detached, inputs, factor)
    except RuntimeError as error:
        # activation checkpointing: saved-tensor hooks (use_reentrant=False) or an autograd.Function
        # without setup_context (use_reentrant=True) cannot run inside torch.func transforms
        if "saved tensor hooks" not in str(error) and "setup_context" not in str(error):
            raise
        return _rows_by_autograd(model, params, inputs, dims, factor)
    k = factor.shape[2]
    return torch.cat([r.reshape(b, k, -1) for r in rows], dim=2).reshape(b * k, -1)


def _example(inputs: Any, dims: Any, n: int) -> Any:
    """Example ``n`` of ``inputs`` as a batch of one."""
    if isinstance(inputs, Tensor):
        return inputs[n : n + 1] if dims == 0 else inputs
    if isinstance(inputs, tuple):
        return tuple(_example(v, d, n) for v, d in zip(inputs, dims))
    if isinstance(inputs, dict):
        return {k: _example(v, dims[k], n) for k, v in inputs.items()}
    return inputs


def _rows_by_autograd(model: nn.Module, params: List[Tensor], inputs: Inputs, dims: Any, factor: Tensor) -> Tensor:
    """The same rows with plain autograd, one example at a time.

    torch.func cannot run a forward that uses ``torch.utils.checkpoint``; plain autograd can, at
    the cost of a forward per example and a backward per factor column.
    """
    rows = []
    with torch.enable_grad():
        for n in range(factor.shape[0]):
            output = call_model(model, _example(inputs, dims, n)).reshape(-1)
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


def call_model_functional(model: nn.Module, params: dict, inputs: Inputs) -> Tensor:
    """:func:`call_model` with some parameters replaced (``torch.func.functional_call``)."""
    args: tuple
    kwargs: dict = {}
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
    elif isinstance(inputs, tuple):
        args = inputs
    else:
        args = (inputs,)
    output = functional_call(model, params, args, kwargs)
    if not isinstance(output, Tensor):
        return call_model(model, inputs)  # raises the clear error
    return output
