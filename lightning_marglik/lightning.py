"""The callbacks for ``lightning.pytorch`` (``import lightning as L``).

``lightning.pytorch`` and ``pytorch_lightning`` are separate packages with separate ``Callback``
classes: a ``lightning.pytorch.Trainer`` takes only these for its checkpoint and early-stopping
callbacks (``trainer.test(ckpt_path="best")``, ``trainer.early_stopping_callback``), and only
these pass ``lightning.pytorch.cli.LightningCLI``. They take the same arguments and behave as
``lightning_marglik.MargLikCallback``, ``lightning_marglik.MargLikCheckpoint`` and
``lightning_marglik.MargLikEarlyStopping`` (one shared implementation, the
package ``lightning_marglik.callbacks``); everything else (prior, likelihoods, ``map_loss``, the
engine) is imported from ``lightning_marglik`` for either package. Importing this module needs
``lightning`` installed; ``import lightning_marglik`` does not.

Example:
    >>> import lightning as L
    >>> from lightning_marglik.lightning import MargLikCallback, MargLikCheckpoint, MargLikEarlyStopping
    >>> trainer = L.Trainer(max_epochs=1, logger=False,
    ...                     callbacks=[MargLikCallback(), MargLikCheckpoint(), MargLikEarlyStopping()])
    >>> type(trainer.checkpoint_callback).__name__, type(trainer.early_stopping_callback).__name__
    ('MargLikCheckpoint', 'MargLikEarlyStopping')
"""
from __future__ import annotations

try:
    import lightning.pytorch as pl
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_marglik.lightning holds the callbacks for `lightning.pytorch` (pip install lightning); with "
        "pytorch_lightning, import them from lightning_marglik."
    ) from err
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from .callbacks.bound import MargLikBoundCallbackCore
from .callbacks.core import MargLikCallbackCore
from .callbacks.followers import CheckpointCore, EarlyStoppingCore
from .callbacks.package import LightningPackage, MargLikConfigurationError

__all__ = ["MargLikBoundCallback", "MargLikCallback", "MargLikCheckpoint", "MargLikConfigurationError", "MargLikEarlyStopping"]

PACKAGE = LightningPackage(
    name="lightning.pytorch",
    trainer=pl.Trainer,
    lightning_module=pl.LightningModule,
    tqdm_bar=TQDMProgressBar,
    tqdm=Tqdm,
    rich_bar=RichProgressBar,
    stopping_reason=EarlyStoppingReason,
)


class MargLikCallback(MargLikCallbackCore, Callback):
    """``lightning_marglik.MargLikCallback`` for ``lightning.pytorch``: the same arguments and behaviour."""

    _package = PACKAGE


class MargLikBoundCallback(MargLikBoundCallbackCore, Callback):
    """``lightning_marglik.MargLikBoundCallback`` for ``lightning.pytorch``: the same arguments and behaviour."""

    _package = PACKAGE


class MargLikCheckpoint(CheckpointCore, ModelCheckpoint):
    """``lightning_marglik.MargLikCheckpoint`` for ``lightning.pytorch``: the same arguments and behaviour."""

    _package = PACKAGE


class MargLikEarlyStopping(EarlyStoppingCore, EarlyStopping):
    """``lightning_marglik.MargLikEarlyStopping`` for ``lightning.pytorch``: the same arguments and behaviour."""

    _package = PACKAGE
