"""What the callbacks know of the two Lightning packages, and the error they raise.

``pytorch_lightning`` and ``lightning.pytorch`` (``import lightning``) define separate
``Callback``, ``ModelCheckpoint`` and ``EarlyStopping`` classes, and a Trainer recognises only
its own package's: as its checkpoint callback (``ckpt_path="best"``), as its early-stopping
callback, in its LightningCLI. The cores of this package hold every behaviour of the callbacks
and use the trainer only through its attributes; ``lightning_marglik.callbacks``
(``pytorch_lightning``) and ``lightning_marglik.lightning`` (``lightning.pytorch``) combine each
core with one package's base class and describe that package in a :class:`LightningPackage`.
No module of the cores imports either package.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from ..hyperparameters import GaussianPrior, Likelihood

__all__ = ["LightningPackage", "MargLikConfigurationError", "check_package", "find_hyperparameters"]

MONITOR = "marglik"

# A Trainer or LightningModule of either package (the cores use their attributes only).
Trainer = Any
LightningModule = Any

# Lightning package -> the module whose callbacks that package's Trainer recognises
CALLBACK_MODULES = {"pytorch_lightning": "lightning_marglik", "lightning.pytorch": "lightning_marglik.lightning"}


class MargLikConfigurationError(MisconfigurationException, ValueError):
    """A set-up problem found before the first training step; the message names it and the fix.

    A ``MisconfigurationException`` as Lightning raises for set-up problems, and a ``ValueError``
    as the engine raises for the same problems outside Lightning: catch either. The callbacks of
    both Lightning packages raise this one class.
    """


@dataclass(frozen=True)
class LightningPackage:
    """What the callbacks need to know of one Lightning package.

    Attributes:
        name: ``"pytorch_lightning"`` or ``"lightning.pytorch"``.
        trainer: The package's ``Trainer`` class.
        lightning_module: The package's ``LightningModule`` class.
        tqdm_bar: Its ``TQDMProgressBar`` class.
        tqdm: The ``tqdm`` class its progress bar draws with.
        rich_bar: Its ``RichProgressBar`` class.
        stopping_reason: Its ``EarlyStoppingReason`` enum.
    """

    name: str
    trainer: type
    lightning_module: type
    tqdm_bar: type
    tqdm: type
    rich_bar: type
    stopping_reason: Any


def check_package(callback: Any, trainer: Trainer) -> None:
    """Refuse a Trainer of the other Lightning package than ``callback``'s.

    Such a Trainer runs the callback's hooks but does not take it for its checkpoint or
    early-stopping callback: it adds a ``ModelCheckpoint`` of its own, and ``ckpt_path="best"``
    would load that one's model instead of the best-evidence one.

    Raises:
        MargLikConfigurationError: Naming the module to import the callbacks from.
    """
    package: LightningPackage = callback._package
    if isinstance(trainer, package.trainer):
        return
    modules = [cls.__module__ for cls in type(trainer).__mro__]
    other = next((name for name in CALLBACK_MODULES for m in modules if m.split(".")[0] == name.split(".")[0]), None)
    if other is None:
        kind, fix = f"{type(trainer).__module__}.{type(trainer).__name__}", f"use a {package.name}.Trainer"
    else:
        kind = f"{other}.Trainer"
        fix = (
            f"import the callbacks for {other}: `from {CALLBACK_MODULES[other]} import MargLikCallback, "
            "MargLikCheckpoint, MargLikEarlyStopping`"
        )
    raise MargLikConfigurationError(
        f"{type(callback).__name__} from {CALLBACK_MODULES[package.name]} is a {package.name} callback, but the "
        f"Trainer is a {kind}, which would run it without taking it for its checkpoint or early-stopping callback "
        f"(ckpt_path='best' would load another model): {fix}."
    )


def find_hyperparameters(pl_module: nn.Module) -> "tuple[GaussianPrior, Likelihood]":
    """The one ``GaussianPrior`` and one ``Likelihood`` registered on ``pl_module``.

    Raises:
        MargLikConfigurationError: If there is not exactly one of each: where one is missing, saying what to
            add; where there are several, naming their attributes and saying to keep one.
    """
    priors = [(name, m) for name, m in pl_module.named_modules() if isinstance(m, GaussianPrior)]
    likelihoods = [(name, m) for name, m in pl_module.named_modules() if isinstance(m, Likelihood)]
    for found, kind, fix in (
        (priors, "GaussianPrior", "keep one prior over the whole network, e.g. `self.prior = GaussianPrior(self.net)` "
                                  "(its `structure` and `fixed` set precisions per group)"),
        (likelihoods, "Likelihood", "keep one likelihood of the network's outputs"),
    ):
        if len(found) > 1:
            raise MargLikConfigurationError(
                f"MargLikCallback needs exactly one {kind} on the LightningModule, found {len(found)} "
                f"({', '.join(name for name, _ in found)}): {fix}."
            )
    if not priors or not likelihoods:
        raise MargLikConfigurationError(
            f"MargLikCallback needs exactly one GaussianPrior and one Likelihood on the LightningModule, found "
            f"{len(priors)} and {len(likelihoods)}: add e.g. `self.prior = GaussianPrior(self.net)` and "
            "`self.likelihood = CategoricalLikelihood()` in __init__ and use map_loss in training_step."
        )
    return priors[0][1], likelihoods[0][1]
