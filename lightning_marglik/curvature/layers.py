"""Layer-local curvature for ``nn.Linear`` and ``nn.Conv2d`` from module hooks.

One forward pass records each layer's input ``a``; one batched backward pass of the ``k`` columns
of the loss-Hessian factor ``L`` (see ``Likelihood.hessian_sqrt``) yields the gradients ``g`` of
the outputs w.r.t. each layer's pre-activations. The diagonal and the Kronecker factors follow from
``a`` and ``g`` alone, without per-example Jacobians of the whole network.

Weight sharing (conv positions, extra Linear input dims) uses the *expand* convention: every
output position counts as an example for the Kronecker factors,
``G = sum_{n,k,r} g g^T`` and ``A = mean_{n,r} a a^T``; the diagonal is exact.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

SUPPORTED = (nn.Linear, nn.Conv2d)


def unsupported_reason(module: nn.Module) -> Optional[str]:
    """Why the hook backend cannot handle ``module`` (``None`` if it can)."""
    if not isinstance(module, SUPPORTED):
        return f"{type(module).__name__} is not nn.Linear or nn.Conv2d"
    if isinstance(module, nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"):
        return "grouped or non-zero-padded Conv2d"
    if isinstance(module, nn.Conv2d) and isinstance(module.padding, str):
        return "Conv2d with string padding"
    return None


def _inputs_as_rows(module: nn.Module, a: Tensor) -> Tensor:
    """Layer input as ``(B, R, in)``: ``R`` shared-weight positions per example."""
    if isinstance(module, nn.Conv2d):
        cols = F.unfold(a, module.kernel_size, module.dilation, module.padding, module.stride)
        return cols.transpose(1, 2)
    return a.reshape(a.shape[0], -1, a.shape[-1])


def _grads_as_rows(module: nn.Module, g: Tensor) -> Tensor:
    """Pre-activation gradients ``(k, B, ...)`` as ``(k, B, R, out)``."""
    k, b = g.shape[:2]
    if isinstance(module, nn.Conv2d):
        return g.reshape(k, b, g.shape[2], -1).transpose(2, 3)
    return g.reshape(k, b, -1, g.shape[-1])


class LayerHooks:
    """Records inputs and outputs of the hooked layers during one forward pass.

    Use as a context manager; the hooks are removed on exit, also on error.
    """

    def __init__(self, modules: Dict[str, nn.Module]) -> None:
        self.modules = modules
        self.inputs: Dict[str, Tensor] = {}
        self.outputs: Dict[str, Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "LayerHooks":
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> None:
            if name in self.outputs:
                raise ValueError(
                    f"Module '{name}' is called more than once per forward pass (shared weights); the "
                    "layer-wise curvature would be wrong. Use structure='full'."
                )
            self.inputs[name] = inputs[0].detach()
            self.outputs[name] = output

        return hook

    def clear(self) -> None:
        self.inputs.clear()
        self.outputs.clear()

    def backprop(self, output: Tensor, factor: Tensor) -> Dict[str, Tensor]:
        """Gradients of ``sum_n L_n[:, j]^T f_n`` w.r.t. every layer output, batched over ``j``.

        Args:
            output: Network output ``(B, C)`` of the recorded forward pass.
            factor: Loss-Hessian factor ``(B, C, k)``.

        Returns:
            Per layer name, a tensor ``(k, *layer_output.shape)``.
        """
        names = list(self.outputs)
        grads = torch.autograd.grad(
            output,
            [self.outputs[n] for n in names],
            grad_outputs=factor.permute(2, 0, 1).contiguous(),
            is_grads_batched=True,
            allow_unused=True,
        )
        k = factor.shape[2]
        return {
            n: torch.zeros((k,) + self.outputs[n].shape, dtype=output.dtype, device=output.device) if g is None else g
            for n, g in zip(names, grads)
        }


def layer_diagonal(module: nn.Module, a: Tensor, g: Tensor) -> List[Tensor]:
    """Exact diagonal of ``sum_{n,k} (J_n^T L_nk)^2`` for the layer's weight (and bias).

    Args:
        module: The layer.
        a: Its recorded input.
        g: Gradients w.r.t. its output, ``(k, *output.shape)``.

    Returns:
        ``[weight_diag]`` or ``[weight_diag, bias_diag]`` shaped like the parameters.
    """
    a_rows = _inputs_as_rows(module, a)
    g_rows = _grads_as_rows(module, g)
    if a_rows.shape[1] == 1:  # no weight sharing: the per-example gradient is an outer product
        weight = torch.einsum("kbo,bi->oi", g_rows[:, :, 0].pow(2), a_rows[:, 0].pow(2))
    else:
        weight = torch.einsum("kbro,bri->kboi", g_rows, a_rows).pow(2).sum((0, 1))
    out = [weight.reshape(module.weight.shape)]
    if module.bias is not None:
        out.append(g_rows.sum(2).pow(2).sum((0, 1)))
    return out


def layer_kron(module: nn.Module, a: Tensor, g: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Kronecker factor sums of one layer for one batch (expand convention).

    Returns:
        ``G = sum g g^T`` (out x out), ``A = sum a a^T`` (in x in) and the number of rows in ``A``.
    """
    a_rows = _inputs_as_rows(module, a).flatten(0, 1)
    g_rows = _grads_as_rows(module, g).flatten(0, 2)
    count = torch.tensor(float(a_rows.shape[0]), dtype=a_rows.dtype, device=a_rows.device)
    return g_rows.T @ g_rows, a_rows.T @ a_rows, count
