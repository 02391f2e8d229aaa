"""Keyword arguments the callbacks do not take, answered with the public class and the option meant.

Python's own ``TypeError`` names the class that defines ``__init__`` (``MargLikCallbackCore``, shared by
both Lightning packages) and nothing else. :class:`KnownKeywords` checks the keywords first, in
``__new__``, against the public class's signature: a near miss gets a "did you mean", and a name
users bring from Lightning's own callbacks (``every_n_epochs``, ``monitor``) or from laplace-torch gets
the option that does that job here, or why there is none.
"""
from __future__ import annotations

import inspect
from typing import Any, ClassVar, Mapping

from ..validators import suggestion

__all__ = ["CALLBACK_KEYWORDS", "BOUND_KEYWORDS", "CHECKPOINT_KEYWORDS", "STOPPING_KEYWORDS", "KnownKeywords"]

_SCHEDULE = "use frequency= (an estimate after every frequency-th epoch)"
_PRIOR = ("the prior and the likelihood are modules of your LightningModule (GaussianPrior, GaussianLikelihood or "
          "CategoricalLikelihood), which the callback finds there")
_EVIDENCE = "evidence (marglik, log evidence per datum, higher is better)"
# the options of the other callbacks, given to the wrong one
_STOPPING = "an option of MargLikEarlyStopping (patience counted in estimates), a callback of its own next to this one"
_CHECKPOINT = "an option of MargLikCheckpoint (keeps the best-evidence models), a callback of its own next to this one"
_OTHERS = {"patience": _STOPPING, "min_delta": _STOPPING, "save_top_k": _CHECKPOINT, "save_last": _CHECKPOINT,
           "dirpath": _CHECKPOINT, "filename": _CHECKPOINT}

# other libraries' names (Lightning's callbacks and Trainer, laplace-torch's marglik_training) -> what to do here
CALLBACK_KEYWORDS: Mapping[str, str] = {
    **_OTHERS,
    "every_n_epochs": _SCHEDULE,
    "check_val_every_n_epoch": _SCHEDULE,
    "marglik_frequency": _SCHEDULE,
    "n_epochs_burnin": "use burnin= (epochs before the first estimate)",
    "warmup_epochs": "use burnin= (epochs before the first estimate)",
    "n_hypersteps": "use steps= (hyperparameter steps per estimate)",
    "lr_hyp": "use lr= (the learning rate of the hyperparameter steps)",
    "hessian_structure": "use structure= (the curvature structure: 'kron', 'ekfac', 'diag' or 'full')",
    "prior_structure": "the prior's structure is GaussianPrior(structure=...), on your LightningModule",
    "prior_precision": _PRIOR,
    "likelihood": _PRIOR,
    "prior": _PRIOR,
    "monitor": "MargLikCallback logs marglik; MargLikCheckpoint and MargLikEarlyStopping act on it",
}
BOUND_KEYWORDS: Mapping[str, str] = {
    **CALLBACK_KEYWORDS,
    "frequency": "use every_k_batches= (a hyperparameter step after every k-th training batch)",
    "every_n_epochs": "use every_k_batches= (a hyperparameter step after every k-th training batch)",
    "every_n_train_steps": "use every_k_batches= (a hyperparameter step after every k-th training batch)",
}
_SAVES = "MargLikCheckpoint saves after the epochs with an estimate: MargLikCallback(frequency=...) sets how often"
CHECKPOINT_KEYWORDS: Mapping[str, str] = {
    "patience": _STOPPING,
    "min_delta": _STOPPING,
    "monitor": f"MargLikCheckpoint always monitors the {_EVIDENCE}; for another metric use Lightning's ModelCheckpoint",
    "mode": f"MargLikCheckpoint always keeps the models of highest {_EVIDENCE}",
    "every_n_epochs": _SAVES,
    "every_n_train_steps": _SAVES,
    "train_time_interval": _SAVES,
    "save_on_train_epoch_end": _SAVES,
}
STOPPING_KEYWORDS: Mapping[str, str] = {
    "save_top_k": _CHECKPOINT,
    "save_last": _CHECKPOINT,
    "dirpath": _CHECKPOINT,
    "filename": _CHECKPOINT,
    "monitor": f"MargLikEarlyStopping always watches the {_EVIDENCE}; for another metric use Lightning's EarlyStopping",
    "mode": f"MargLikEarlyStopping always waits for a higher {_EVIDENCE}",
    "check_finite": "MargLikEarlyStopping always stops on a non-finite evidence",
    "check_on_train_epoch_end": "MargLikEarlyStopping checks after the epochs with an estimate, never on validation",
}


class KnownKeywords:
    """Refuse keyword arguments the class does not take before ``__init__`` runs, naming the public class.

    Subclasses set ``_foreign_keywords``: names of other libraries, each with what to do here.

    Raises:
        TypeError: As Python's own, naming the public class, each unknown keyword and what was meant.
    """

    _foreign_keywords: ClassVar[Mapping[str, str]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> "KnownKeywords":
        accepted = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
        unknown = [key for key in kwargs if key not in accepted]
        if unknown:
            which = "an unexpected keyword argument" if len(unknown) == 1 else "unexpected keyword arguments"
            meant = "; ".join(f"{key!r}: {cls._meant(key, accepted)}" for key in unknown)
            raise TypeError(f"{cls.__name__}() got {which} {meant} ({cls.__name__} takes {', '.join(accepted)})")
        return super().__new__(cls)

    @classmethod
    def _meant(cls, key: str, accepted: list) -> str:
        """What ``key`` means here: the mapped advice, else the nearest accepted name."""
        if key in cls._foreign_keywords:
            return cls._foreign_keywords[key]
        return suggestion(key, accepted).strip(" ()") or "not an option of this callback"
