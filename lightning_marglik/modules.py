"""Layers the library ships with hook-path curvature rules: the scalars of Fixup networks.

A Fixup residual network (Zhang et al., "Fixup Initialization: Residual Learning Without
Normalization", ICLR 2019) replaces normalization by a learnable scalar bias before each
convolution, linear layer and activation, and a learnable scalar multiplier per residual branch.
:class:`FixupBias` and :class:`FixupScale` are those scalars as modules: the evidence pass takes
them on the hook path (their exact curvature, :mod:`lightning_marglik.curvature.layers`) instead
of the slower per-example path a bare ``nn.Parameter`` used in a ``forward`` needs.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["FixupBias", "FixupScale"]


class FixupBias(nn.Module):
    """One learnable scalar added to the input: ``y = x + bias`` (Fixup's scalar bias).

    Attributes:
        bias: The scalar, a 0-dim parameter initialised to 0.

    Example:
        >>> import torch
        >>> from lightning_marglik import FixupBias
        >>> shift = FixupBias()
        >>> shift(torch.ones(2, 3)).shape, shift.bias.shape
        (torch.Size([2, 3]), torch.Size([]))
        >>> with torch.no_grad():
        ...     _ = shift.bias.fill_(0.5)
        >>> shift(torch.zeros(1, 2))
        tensor([[0.5000, 0.5000]], grad_fn=<AddBackward0>)
    """

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        """``x + bias``, any shape."""
        return x + self.bias


class FixupScale(nn.Module):
    """One learnable scalar multiplying the input: ``y = x * weight`` (Fixup's residual-branch multiplier).

    Attributes:
        weight: The scalar, a 0-dim parameter initialised to 1.

    Example:
        >>> import torch
        >>> from lightning_marglik import FixupScale
        >>> scale = FixupScale()
        >>> scale(torch.ones(2, 3)).shape, scale.weight.shape
        (torch.Size([2, 3]), torch.Size([]))
        >>> with torch.no_grad():
        ...     _ = scale.weight.fill_(2.0)
        >>> scale(torch.ones(1, 2))
        tensor([[2., 2.]], grad_fn=<MulBackward0>)
    """

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        """``x * weight``, any shape."""
        return x * self.weight
