"""The linearized network's outputs, ``f(theta)`` and ``J(theta) v``, by one forward-mode product."""
from __future__ import annotations

import warnings
from typing import Sequence, Tuple

from torch import Tensor, nn
from torch.func import functional_call, jvp

from .batches import Inputs, model_batch

__all__ = ["output_and_change"]

# torch loads its forward-mode decompositions at the first dual tensor of a process, scripting them with
# torch.jit.script, whose deprecation it then warns of: a FutureWarning about torch's own code, nothing a user can act on
_TORCH_SCRIPT_DEPRECATED = r"`torch\.jit\.script` is deprecated"
# only the process's first product is filtered: every change of the warning filters makes Python forget which
# warnings it has shown once, so filtering every product would repeat the user's own once-per-place warnings
_first_product = True


def output_and_change(model: nn.Module, names: Sequence[str], primals: Sequence[Tensor], tangents: Sequence[Tensor],
                      inputs: Inputs) -> Tuple[Tensor, Tensor]:
    """A batch's outputs with the parameters ``names`` at ``primals``, and their derivative along ``tangents``
    (``torch.func.jvp`` over ``functional_call``; differentiable in the tangents where autograd records).

    Args:
        model: The network whose parameters ``names`` are replaced.
        names: The replaced parameters' names in ``model``.
        primals: Their values ``theta``.
        tangents: The direction ``v``, one tensor per name.
        inputs: The batch's model inputs (tensor, tuple or dict, as ``forward`` takes them).

    Returns:
        ``f(theta)`` and ``J(theta) v``.

    Raises:
        ValueError: If ``names``, ``primals`` and ``tangents`` are not as many.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1, bias=False)
        >>> x = torch.ones(3, 2)
        >>> output, change = output_and_change(net, ["weight"], [torch.ones(1, 2)], [torch.ones(1, 2)], x)
        >>> output.flatten().tolist(), change.flatten().tolist()
        ([2.0, 2.0, 2.0], [2.0, 2.0, 2.0])
    """
    global _first_product
    if not len(names) == len(primals) == len(tangents):
        raise ValueError(f"output_and_change: one primal and one tangent per name, got {len(names)} names, "
                         f"{len(primals)} primals and {len(tangents)} tangents.")
    batch = model_batch(inputs)

    def forward(*values: Tensor) -> Tensor:
        return functional_call(model, dict(zip(names, values)), batch.args, batch.kwargs)

    if not _first_product:
        return jvp(forward, tuple(primals), tuple(tangents))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_SCRIPT_DEPRECATED, category=FutureWarning)
        result = jvp(forward, tuple(primals), tuple(tangents))
    _first_product = False
    return result
