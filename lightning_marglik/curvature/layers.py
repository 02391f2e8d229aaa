"""Layer-local curvature from module hooks: the fast path of the evidence pass.

One forward pass records each hooked layer's input ``a``; one backward pass per column of the
loss-Hessian factor ``L`` (see ``Likelihood.hessian_sqrt``) yields the gradients ``g`` of the
outputs w.r.t. each layer's output. The exact diagonal and the Kronecker factors follow from
``a`` and ``g`` alone, without per-example Jacobians of the whole network.

* ``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d`` (any groups, stride, padding, dilation) and
  ``nn.Embedding``: exact diagonal and Kronecker factors.
* ``BatchNorm`` (running statistics), ``LayerNorm``, ``GroupNorm``, ``RMSNorm``: exact diagonal
  of their affine parameters (they have no Kronecker form; under ``kron`` they are exact
  diagonal blocks).

Weight sharing (conv positions, sequence positions of a Linear, token positions of an
Embedding) uses the *expand* convention: every row (position) counts as an example for the
Kronecker factors, ``G = sum_{n,k,r} g g^T`` and ``A = mean_{n,r} a a^T``; the diagonal is exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

__all__ = ["KRON_LAYERS", "KronSums", "hook_reason", "is_kron_layer", "layer_diagonal", "layer_kron"]

KRON_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_NORMS = _BATCH_NORMS + (nn.LayerNorm, nn.GroupNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
_CONVS = (nn.Conv1d, nn.Conv2d)


def hook_reason(module: nn.Module) -> Optional[str]:
    """Why the hook path cannot take ``module``'s own parameters (``None`` if it can)."""
    if isinstance(module, _CONVS):
        if module.padding_mode != "zeros":
            return f"{type(module).__name__} with padding_mode={module.padding_mode!r}"
        return None
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.scale_grad_by_freq:
            return "Embedding with max_norm or scale_grad_by_freq"
        return None
    if isinstance(module, _BATCH_NORMS) and getattr(module, "running_mean", None) is None:
        return "BatchNorm without running statistics mixes the examples of a batch"
    if isinstance(module, (nn.Linear,) + _NORMS):
        return None
    if isinstance(module, parametrize.ParametrizationList):
        return "a parametrized weight (torch.nn.utils.parametrize): exact diagonal of the tensors it is computed from"
    return f"{type(module).__name__} has no hook rule"


def is_kron_layer(module: nn.Module) -> bool:
    """Whether the layer has Kronecker factors (else only an exact diagonal)."""
    return isinstance(module, KRON_LAYERS)


# --- rows: (examples, shared-weight positions, features) --------------------------------------


def _conv_padding(module: nn.Module, spatial: int) -> List[Tuple[int, int]]:
    """``(before, after)`` zero padding per spatial dimension (``'same'`` pads the extra one after)."""
    if module.padding == "valid":
        return [(0, 0)] * spatial
    if module.padding == "same":
        pads = []
        for k, d in zip(module.kernel_size, module.dilation):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in module.padding]


def _unfold(module: nn.Module, a: Tensor) -> Tensor:
    """Input patches ``(B, R, C_in k)`` of a Conv1d/Conv2d, in ``weight.reshape(out, -1)`` order.

    Built from a strided view of the zero-padded input and one copy, which is about twice as fast
    on CPU as ``F.unfold``'s im2col, and handles Conv1d (as a height-1 Conv2d) and ``'same'``.
    """
    spatial = a.dim() - 2
    pads = _conv_padding(module, spatial)
    if spatial == 1:
        a, pads = a.unsqueeze(2), [(0, 0)] + pads
        kernel, dilation, stride = (1,) + module.kernel_size, (1,) + module.dilation, (1,) + module.stride
    else:
        kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    (ph0, ph1), (pw0, pw1) = pads
    padded = (F.pad(a, (pw0, pw1, ph0, ph1)) if ph0 or ph1 or pw0 or pw1 else a).contiguous()
    b, c, h, w = padded.shape
    (kh, kw), (dh, dw), (sh, sw) = kernel, dilation, stride
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    s_b, s_c, s_h, s_w = padded.stride()
    view = padded.as_strided((b, c, kh, kw, oh, ow), (s_b, s_c, dh * s_h, dw * s_w, sh * s_h, sw * s_w))
    return view.reshape(b, c * kh * kw, oh * ow).transpose(1, 2)


def _input_rows(module: nn.Module, a: Tensor) -> Tensor:
    """Layer input as rows ``(B, R, in)`` (Embedding: token indices ``(B, R)``)."""
    if isinstance(module, _CONVS):
        return _unfold(module, a)
    if isinstance(module, nn.Embedding):
        return a.reshape(a.shape[0], -1)
    return a.reshape(a.shape[0], -1, a.shape[-1])


def _grad_rows(module: nn.Module, g: Tensor) -> Tensor:
    """Output gradients ``(K, B, *out)`` as rows ``(K, B, R, out)``."""
    k, b = g.shape[:2]
    if isinstance(module, _CONVS):
        return g.reshape(k, b, g.shape[2], -1).transpose(2, 3)
    return g.reshape(k, b, -1, g.shape[-1])


def _groups(module: nn.Module) -> int:
    return module.groups if isinstance(module, _CONVS) else 1


# --- per-example gradients and the exact diagonal --------------------------------------------


def _norm_input(module: nn.Module, a: Tensor) -> Tensor:
    """The normalized input ``x_hat`` the affine parameters multiply."""
    if isinstance(module, _BATCH_NORMS):
        shape = (1, -1) + (1,) * (a.dim() - 2)
        return (a - module.running_mean.reshape(shape)) * torch.rsqrt(module.running_var.reshape(shape) + module.eps)
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(a, module.num_groups, None, None, module.eps)
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(a, module.normalized_shape, None, None, module.eps)
    return F.rms_norm(a, module.normalized_shape, None, module.eps)


def _norm_example_grads(module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """Per-example, per-column gradients ``(K, B, *param.shape)`` of a norm layer's affine parameters."""
    k, b = g.shape[:2]
    if isinstance(module, (nn.LayerNorm,) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())):
        shape = tuple(module.normalized_shape)
        flat = lambda t: t.reshape(k, b, -1, *shape).sum(2)  # noqa: E731 - sum over leading positions
    else:  # channels on dim 1 of the activation
        flat = lambda t: t.reshape(k, b, t.shape[2], -1).sum(3)  # noqa: E731
    out = {}
    if module.weight is not None:
        out["weight"] = flat(g * _norm_input(module, a))
    if getattr(module, "bias", None) is not None:
        out["bias"] = flat(g)
    return out


def _embedding_diagonal(module: nn.Embedding, idx: Tensor, g_rows: Tensor) -> Tensor:
    """``sum_{k,n} (sum_{r: idx_nr = i} g_knr)^2`` for every token ``i``: the exact diagonal.

    Repeated tokens within one example add up before squaring; pairs (example, token) are made
    unique first so that memory stays ``K x pairs x dim``, not ``K x B x vocabulary x dim``.
    """
    k, b, r, dim = g_rows.shape
    example = torch.arange(b, device=idx.device).unsqueeze(1).expand(b, r)
    pairs, inverse = torch.unique(example * module.num_embeddings + idx, return_inverse=True)
    summed = g_rows.new_zeros(k, pairs.numel(), dim).index_add_(1, inverse.reshape(-1), g_rows.reshape(k, -1, dim))
    diag = g_rows.new_zeros(module.num_embeddings, dim)
    diag.index_add_(0, pairs % module.num_embeddings, summed.pow(2).sum(0))
    if module.padding_idx is not None:  # its gradient is zero by definition
        diag[module.padding_idx] = 0
    return diag


def layer_diagonal(module: nn.Module, a: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """Exact diagonal of ``sum_{n,k} (J_n^T L_nk)^2`` for the layer's own parameters.

    Args:
        module: The layer.
        a: Its recorded input.
        g: Gradients w.r.t. its output, ``(K, *output.shape)``.

    Returns:
        Per role (``"weight"``, ``"bias"``), a tensor shaped like the parameter.
    """
    if not is_kron_layer(module):
        return {role: t.pow(2).sum((0, 1)) for role, t in _norm_example_grads(module, a, g).items()}
    a_rows, g_rows = _input_rows(module, a), _grad_rows(module, g)
    if isinstance(module, nn.Embedding):
        return {"weight": _embedding_diagonal(module, a_rows, g_rows)}
    out = {}
    if a_rows.shape[1] == 1:  # no weight sharing: the per-example gradient is an outer product
        g_sq = g_rows[:, :, 0].pow(2)  # (K, B, out), squared once for the weight and the bias
        out["weight"] = (g_sq.sum(0).T @ a_rows[:, 0].pow(2)).reshape(module.weight.shape)
        if module.bias is not None:
            out["bias"] = g_sq.sum((0, 1))
        return out
    # weight sharing: per-example gradients (B, out, in), one factor column at a time, so that at
    # most B x out x in values are alive (not K x B x out x in); one block per conv group
    groups = _groups(module)
    weight = None
    for g_col in g_rows:  # (B, R, out)
        blocks = [
            torch.bmm(gg.transpose(1, 2), aa).pow_(2).sum(0)
            for gg, aa in zip(g_col.chunk(groups, dim=2), a_rows.chunk(groups, dim=2))
        ]
        square = torch.cat(blocks) if groups > 1 else blocks[0]
        weight = square if weight is None else weight.add_(square)
    out["weight"] = weight.reshape(module.weight.shape)
    if module.bias is not None:
        out["bias"] = g_rows.sum(2).pow(2).sum((0, 1))
    return out


# --- Kronecker factors ------------------------------------------------------------------------


@dataclass
class KronSums:
    """One batch's Kronecker factor sums of one layer.

    Attributes:
        g: ``sum g g^T`` over examples, rows and factor columns, ``(out, out)``.
        a: ``sum a a^T`` over examples and rows, one block per conv group ``(groups, d, d)``; for
            an Embedding the token counts ``(vocabulary,)`` (its input factor is diagonal).
        rows: Number of ``(example, row)`` pairs summed in ``a``.
    """

    g: Tensor
    a: Tensor
    rows: int


def _gram(rows: Tensor) -> Tensor:
    """``sum_{n,r} x_nr x_nr^T`` of ``rows`` ``(n, R, d)``.

    Without weight sharing one ``(d, n)`` product on the rows as they are. With few features and
    many positions (e.g. a first conv's patches) a batched product summed over ``n`` reads the rows
    in place; otherwise one copy into a ``(d, nR)`` matrix and a single product, which is 1.1-2.5x
    faster than the batched one on conv shapes (measured on CPU, one thread).
    """
    n, r, d = rows.shape
    if r == 1:
        flat = rows.reshape(n, d)
        return flat.T @ flat
    if d <= 16:
        return torch.bmm(rows.transpose(1, 2), rows).sum(0)
    flat = rows.permute(2, 0, 1).reshape(d, n * r)
    return flat @ flat.T


def layer_kron(module: nn.Module, a: Tensor, g: Tensor) -> KronSums:
    """Kronecker factor sums of one layer for one batch (expand convention)."""
    a_rows = _input_rows(module, a)
    g_rows = _grad_rows(module, g).flatten(0, 1)  # (K B, R, out)
    rows = a_rows.shape[0] * a_rows.shape[1]
    if isinstance(module, nn.Embedding):
        counts = torch.bincount(a_rows.reshape(-1), minlength=module.num_embeddings).to(g_rows.dtype)
        if module.padding_idx is not None:
            counts[module.padding_idx] = 0
        return KronSums(_gram(g_rows), counts, rows)
    groups = _groups(module)
    if groups == 1:
        return KronSums(_gram(g_rows), _gram(a_rows).unsqueeze(0), rows)
    return KronSums(_gram(g_rows), torch.stack([_gram(block) for block in a_rows.chunk(groups, dim=2)]), rows)

