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
        return _unfold(a, module).transpose(1, 2)
    return a.reshape(a.shape[0], -1, a.shape[-1])


def _unfold(a: Tensor, module: nn.Conv2d) -> Tensor:
    """``F.unfold`` for the layer: ``(B, C kh kw, R)``, the very same values.

    Built from a strided view of the zero-padded input and one copy, which is about twice as
    fast on CPU as ``F.unfold``'s im2col.
    """
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = module.kernel_size, module.dilation, module.padding, module.stride
    if a.dim() != 4:
        return F.unfold(a, module.kernel_size, module.dilation, module.padding, module.stride)
    padded = (F.pad(a, (pw, pw, ph, ph)) if ph or pw else a).contiguous()
    b, c, h, w = padded.shape
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    s_b, s_c, s_h, s_w = padded.stride()
    view = padded.as_strided((b, c, kh, kw, oh, ow), (s_b, s_c, dh * s_h, dw * s_w, sh * s_h, sw * s_w))
    return view.reshape(b, c * kh * kw, oh * ow)


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
        """Gradients of ``sum_n L_n[:, j]^T f_n`` w.r.t. every layer output, for every column ``j``.

        One plain backward pass per column ``j`` (the graph is kept until the last one). This is
        faster than ``is_grads_batched`` (vmap), which has no batching rule for some backward
        ops (e.g. max-pooling) and falls back to slow per-column loops with extra copies.

        Args:
            output: Network output ``(B, C)`` of the recorded forward pass.
            factor: Loss-Hessian factor ``(B, C, k)``.

        Returns:
            Per layer name, a tensor ``(k, *layer_output.shape)``.
        """
        names = list(self.outputs)
        outs = [self.outputs[n] for n in names]
        k = factor.shape[2]
        stacked: List[Optional[Tensor]] = [None] * len(names)
        for j in range(k):
            grads = torch.autograd.grad(
                output, outs, grad_outputs=factor[:, :, j], retain_graph=j < k - 1, allow_unused=True
            )
            for i, g in enumerate(grads):
                if g is None:
                    continue
                if k == 1:
                    stacked[i] = g.unsqueeze(0)
                    continue
                if stacked[i] is None:
                    stacked[i] = g.new_empty((k,) + g.shape)
                stacked[i][j] = g
        return {
            n: torch.zeros((k,) + o.shape, dtype=output.dtype, device=output.device) if g is None else g
            for n, o, g in zip(names, outs, stacked)
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
        g_sq = g_rows[:, :, 0].pow(2)  # (k, B, out), squared once for the weight and the bias
        weight = g_sq.sum(0).T @ a_rows[:, 0].pow(2)
        out = [weight.reshape(module.weight.shape)]
        if module.bias is not None:
            out.append(g_sq.sum((0, 1)))
        return out
    # weight sharing: per-example gradients (B, out, in), one column of the factor at a time, so
    # that at most B x out x in values are alive (not k x B x out x in)
    weight = None
    for g_col in g_rows:  # (B, R, out); for Conv2d a transposed view of the contiguous (B, out, R)
        square = torch.bmm(g_col.transpose(1, 2), a_rows).pow_(2).sum(0)
        weight = square if weight is None else weight.add_(square)
    out = [weight.reshape(module.weight.shape)]
    if module.bias is not None:
        out.append(g_rows.sum(2).pow(2).sum((0, 1)))
    return out


def _gram(rows: Tensor) -> Tensor:
    """``sum_{n,r} x_nr x_nr^T`` of ``rows`` ``(n, R, d)``.

    A batched product summed over ``n`` when ``1 < R`` and ``d <= R`` (reads ``rows`` in place,
    whatever its strides; the ``(n, d, d)`` intermediate is no larger than ``rows``), else one
    ``(d, nR)`` product on the flattened rows (a copy only if ``rows`` is not contiguous).
    """
    if 1 < rows.shape[1] and rows.shape[2] <= rows.shape[1]:
        return torch.bmm(rows.transpose(1, 2), rows).sum(0)
    flat = rows.flatten(0, 1)
    return flat.T @ flat


def layer_kron(module: nn.Module, a: Tensor, g: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Kronecker factor sums of one layer for one batch (expand convention).

    Returns:
        ``G = sum g g^T`` (out x out), ``A = sum a a^T`` (in x in) and the number of rows in ``A``.
    """
    a_rows = _inputs_as_rows(module, a)  # (B, R, in)
    g_rows = _grads_as_rows(module, g).flatten(0, 1)  # (k B, R, out)
    count = torch.tensor(float(a_rows.shape[0] * a_rows.shape[1]), dtype=a_rows.dtype, device=a_rows.device)
    return _gram(g_rows), _gram(a_rows), count


def layer_gradient(module: nn.Module, a: Tensor, g: Tensor) -> List[Tensor]:
    """Gradient of ``sum_n g_n . z_n`` w.r.t. the layer's weight (and bias) from its hooks alone.

    Equals the autograd gradient only if the layer's parameters act through this one call: the
    check that the hook backend sees every use of them.

    Args:
        module: The layer.
        a: Its recorded input.
        g: Gradient w.r.t. its output, shaped like the output.
    """
    a_rows = _inputs_as_rows(module, a)
    g_rows = _grads_as_rows(module, g.unsqueeze(0))[0]
    weight = torch.einsum("bro,bri->oi", g_rows, a_rows).reshape(module.weight.shape)
    return [weight] if module.bias is None else [weight, g_rows.sum((0, 1))]
