"""Whether the training loss carries the prior: the learned precisions reach the weights only through it.

The callbacks learn the prior precisions; :func:`~lightning_marglik.map_loss` (through
:meth:`GaussianPrior.penalty <lightning_marglik.GaussianPrior.penalty>`) is what makes them the
weight decay of training. A ``training_step`` that returns another loss (``F.mse_loss``,
``F.cross_entropy``) trains without the prior, and every estimate is then taken at weights that are
no MAP of it: the evidence is wrong without any error.

The check is structural, not numerical: while it watches, the prior records the autograd node of
every penalty it returns, and every loss Lightning backpropagates (``on_before_backward``: automatic
optimization, ``manual_backward``, each process under DDP, either Lightning package) is searched for
one of them. Extra terms added to ``map_loss`` keep the node in the graph; a penalty computed but
not backpropagated does not count. The first training batch with a backward decides, once per fit.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..hyperparameters import GaussianPrior

__all__ = ["PriorInLossCheck", "carries"]


def carries(loss: Tensor, nodes: list) -> bool:
    """Whether the autograd graph of ``loss`` contains one of ``nodes`` (autograd nodes kept alive by the list).

    Example:
        >>> import torch
        >>> w = torch.ones(2, requires_grad=True)
        >>> penalty = w.pow(2).sum()
        >>> carries(3.0 * w.sum() + penalty / 10, [penalty.grad_fn]), carries(w.sum(), [penalty.grad_fn])
        (True, False)
    """
    wanted = {id(node) for node in nodes}
    if loss.grad_fn is None or not wanted:
        return False
    seen, stack = {loss.grad_fn}, [loss.grad_fn]
    while stack:
        node = stack.pop()
        if id(node) in wanted:
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return False


class PriorInLossCheck:
    """Watches the training batches of one fit until one with a backward shows whether its loss carries the prior.

    Args:
        who: The callback's name, for the message.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.reset()

    def reset(self) -> None:
        """A new fit: not decided yet."""
        self.decided = False
        self._prior: Optional[GaussianPrior] = None
        self._backwards = 0
        self._carried = False

    def batch_start(self, prior: GaussianPrior) -> None:
        """Watch this training batch (until decided)."""
        if self.decided:
            return
        self._prior, self._backwards, self._carried = prior, 0, False
        prior._penalty_nodes = []

    def before_backward(self, loss: Tensor) -> None:
        """A loss about to be backpropagated in the watched batch."""
        if self._prior is None or self._prior._penalty_nodes is None:
            return
        self._backwards += 1
        self._carried = self._carried or carries(loss, self._prior._penalty_nodes)

    def batch_end(self) -> Optional[str]:
        """Decide after a batch with a backward; returns the warning if no loss carried the prior."""
        if self.decided or self._prior is None or not self._backwards:
            return None  # e.g. a step the module skipped: the next batch decides
        self.decided = True
        carried = self._carried
        self.stop()
        if carried:
            return None
        return (
            f"{self.who}: the training loss does not carry the prior: no loss backpropagated in the first training "
            "batch contains the GaussianPrior's term (prior.penalty(), which map_loss adds), so the learned prior "
            "precisions never reach the weights and every estimate is taken at weights that are no MAP of that prior. "
            "Return map_loss(output, target, self.likelihood, self.prior) from training_step (extra terms may be "
            "added to it), or add self.prior.penalty() / N to your own loss."
        )

    def stop(self) -> None:
        """Stop watching (the decision, or the end of the fit)."""
        if self._prior is not None:
            self._prior._penalty_nodes = None
        self._prior = None
