"""Lightning's weight-averaging callbacks next to an estimating callback.

``WeightAveraging`` (``EMAWeightAveraging``) keeps an averaged copy of the whole LightningModule,
buffers included by default, and writes it into the module for validation and when training
ends; ``StochasticWeightAveraging`` averages the parameters and writes them into the module at
the end of its averaging. The hyperparameters are buffers of the module (the prior's learned log
precisions, the likelihood's log sigma and temperature, ``N``): averaged with the weights they would
come back as a mixture of past estimates' values, and ``final_marglik`` would be the evidence of
weights the fit does not return.

:class:`WeightAveragingFollower` keeps both owed properties:

- the hyperparameters are never averaged: after every averaging update (the averaging callbacks
  run before the estimating callback) and every estimate, the averaged copy's hyperparameter
  buffers are set to the learned values, so that an average of identical values leaves them as
  they are, and what the averaging callback writes back is the learned values;
- the end-of-training estimate is the evidence of the weights the fit returns: it is made after
  the averaging callback has written them (the order is checked at set-up).

What cannot be made correct without a second evidence pass per estimate is refused at set-up: a
checkpoint that monitors ``marglik`` next to ``WeightAveraging``, whose checkpoints hold the
averaged weights while the estimates during training are those of the trained weights.
"""
from __future__ import annotations

from typing import Any, List

import torch
from torch import nn

from ..hyperparameters import GaussianPrior, Likelihood
from ..private import averaged_module
from .package import MONITOR, MargLikConfigurationError, Trainer

__all__ = ["WeightAveragingFollower", "averaging_callbacks"]

# Lightning's averaging callbacks, by class name: each package has its own classes of these names
_AVERAGING = ("WeightAveraging", "StochasticWeightAveraging")


def _class_names(callback: Any) -> List[str]:
    return [cls.__name__ for cls in type(callback).__mro__]


def averaging_callbacks(trainer: Trainer) -> List[Any]:
    """The trainer's weight-averaging callbacks (``EMAWeightAveraging`` and other ``WeightAveraging``
    subclasses, ``StochasticWeightAveraging``), of either Lightning package."""
    return [c for c in trainer.callbacks if any(name in _AVERAGING for name in _class_names(c))]


class WeightAveragingFollower:
    """Keeps the hyperparameters out of the trainer's weight averages, for one estimating callback."""

    def __init__(self) -> None:
        self.callbacks: List[Any] = []

    def setup(self, trainer: Trainer, estimator: Any) -> None:
        """Find the averaging callbacks; refuse an order or a checkpoint that would report the evidence of
        other weights than those reported with.

        Raises:
            MargLikConfigurationError: If an averaging callback is listed after ``estimator`` in the
                Trainer's callbacks, or ``WeightAveraging`` meets a checkpoint that monitors ``marglik``.
            PrivateAPIError: If the installed Lightning's averaging callbacks keep their average elsewhere
                (:func:`~lightning_marglik.private.averaged_module`).
        """
        callbacks = list(trainer.callbacks)
        self.callbacks = averaging_callbacks(trainer)
        who = type(estimator).__name__
        for callback in self.callbacks:
            averaged_module(callback)  # Lightning's private name, read now: if it is gone, fail before training
            name = type(callback).__name__
            if callbacks.index(callback) > callbacks.index(estimator):
                raise MargLikConfigurationError(
                    f"{name} is listed after {who} in the Trainer's callbacks: list it before, e.g. "
                    f"callbacks=[{name}(...), {who}(...), ...]. It writes the averaged weights into the module when "
                    f"training ends, and {who}'s final estimate (final_marglik) must be the evidence of those weights, "
                    "the ones the fit returns."
                )
            if "WeightAveraging" not in _class_names(callback):
                continue  # StochasticWeightAveraging checkpoints the trained weights, which the estimates are of
            for checkpoint in trainer.callbacks:
                if "ModelCheckpoint" in _class_names(checkpoint) and checkpoint.monitor == MONITOR:
                    raise MargLikConfigurationError(
                        f"{type(checkpoint).__name__}(monitor={MONITOR!r}) next to {name}: {name} saves the averaged "
                        f"weights in every checkpoint, but the estimates during training are the evidence of the trained "
                        f"weights, so a checkpoint's {MONITOR} would not be the evidence of the weights it holds. Keep "
                        f"{name} without a {MONITOR} checkpoint ({who}.final_marglik is the evidence of the averaged "
                        "weights the fit returns; trainer.save_checkpoint after the fit stores them together), or use "
                        f"MargLikCheckpoint with StochasticWeightAveraging, or without weight averaging."
                    )

    @property
    def active(self) -> bool:
        """Whether the trainer averages weights (the end-of-training estimate is then always made)."""
        return bool(self.callbacks)

    def sync(self, pl_module: nn.Module) -> None:
        """Set the hyperparameter buffers of every averaged copy to the module's (the learned values)."""
        if not self.callbacks:
            return
        hyperparameters = [(name, module) for name, module in pl_module.named_modules()
                           if isinstance(module, (GaussianPrior, Likelihood))]
        for callback in self.callbacks:
            average = averaged_module(callback)
            if average is None:
                continue
            with torch.no_grad():
                for name, module in hyperparameters:
                    target = average.get_submodule(name)
                    for key, value in module.named_buffers(recurse=False):
                        copy = getattr(target, key)
                        if copy.shape == value.shape:
                            copy.copy_(value.to(copy.device))
                        else:  # a treatment declared since the copy was made resized the buffer
                            setattr(target, key, value.detach().clone().to(copy.device))
