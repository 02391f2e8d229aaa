"""What a user asks ``MargLikCallback`` about the trained module after the fit: the evidence with another
curvature approximation (:meth:`~TrainedModuleQueries.evidence_with`), a copy with its BatchNorms folded
(:meth:`~TrainedModuleQueries.fold_batchnorm`) and the model inputs of one evidence batch
(:meth:`~TrainedModuleQueries.example_inputs`).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..curvature import CurvatureOptions
from ..curvature.batches import move, split_batch
from ..folding import Folded, fold_batchnorm
from .package import LightningModule, Trainer
from .sharding import whole_parameters

__all__ = ["TrainedModuleQueries"]


class TrainedModuleQueries:
    """``MargLikCallback``'s questions about the trained module; mixed into :class:`~.core.MargLikCallbackCore`,
    whose prior, likelihood, options, evidence data and evidence (``_evidence``) they read."""

    def evidence_with(
        self, trainer: Trainer, pl_module: LightningModule, structure: str, approx: str,
        folded: Optional[Folded] = None,
    ) -> float:
        """The log evidence per datum at the current weights with another curvature approximation.

        One evidence pass over the callback's evidence data with ``structure`` and ``approx``
        (exact, no Monte-Carlo), then the learnable hyperparameters re-optimised on that curvature
        by Newton from their current values, as after training for ranking models
        (:func:`lightning_marglik.select_models`, ``rank_by``). Nothing is written: the
        hyperparameters and the callback's state stay as they are.

        Args:
            trainer: The trainer that trained ``pl_module`` (its data and strategy).
            pl_module: The trained module.
            structure: ``"kron"``, ``"ekfac"``, ``"diag"`` or ``"full"``.
            approx: ``"ggn"`` or ``"ef"``.
            folded: :meth:`fold_batchnorm` of ``pl_module``: the evidence of that copy under its prior
                (its hyperparameters re-optimised; the likelihood's are the callback's).

        Returns:
            The re-optimised log evidence per datum (NaN if the evidence is not finite).

        Raises:
            ValueError: On an unknown ``structure`` or ``approx``, or a ``folded`` that is not a
                :class:`~lightning_marglik.folding.Folded` with a prior.
            RuntimeError: If the callback has not been set up by a fit (no prior or likelihood yet).
        """
        options = CurvatureOptions(structure, approx, 0, backend=self.options.backend)
        self._require_fit("evidence_with")
        if folded is not None and not isinstance(folded, Folded):
            raise ValueError(f"MargLikCallback.evidence_with(folded=...) takes what MargLikCallback.fold_batchnorm "
                             f"returns, got {type(folded).__name__}.")
        if folded is not None and folded.prior is None:
            raise ValueError("MargLikCallback.evidence_with(folded=...) needs the folded copy's prior: make it with "
                             "MargLikCallback.fold_batchnorm(trainer, module), not fold_batchnorm(model, inputs).")
        evidence = self._evidence(trainer, pl_module, options, None, folded)
        if not torch.isfinite(evidence.log_marglik().detach()):
            return math.nan
        solution = evidence.optimize(solver="newton", max_evaluations=50)
        return solution.value.item() / evidence.n_data

    def fold_batchnorm(self, trainer: Trainer, pl_module: LightningModule) -> Folded:
        """A copy of the trained ``pl_module`` with its BatchNorms folded into the layers before them.

        :func:`lightning_marglik.folding.fold_batchnorm` on one evidence batch, the callback's prior carried over
        to the copy: pass the result to :meth:`evidence_with` for the evidence of the test-time function as a
        network without normalization (what ``select_models`` ranks by). ``pl_module`` is left as it is.

        Args:
            trainer: The trainer that trained ``pl_module`` (its data).
            pl_module: The trained module.

        Returns:
            The folded copy, its prior and what was folded (nothing for a network without BatchNorm).

        Raises:
            RuntimeError: If the callback has not been set up by a fit, or folding changed the
                eval-mode outputs (a ``forward`` that uses a norm other than as its layer's only consumer).
            ValueError: If the network's eval-mode outputs on the evidence batch are not finite.
            MargLikConfigurationError: Under FSDP2, whose modules cannot be copied.
        """
        self._require_fit("fold_batchnorm")
        with whole_parameters(trainer, copy_for="fold_batchnorm"):  # under FSDP: the copy takes whole weights
            return fold_batchnorm(pl_module, self.example_inputs(trainer, pl_module), prior=self.prior)

    def example_inputs(self, trainer: Trainer, pl_module: LightningModule) -> Any:
        """The model inputs of one evidence batch (split by ``marglik_batch``), on the prior's device and dtype.

        Raises:
            RuntimeError: If the callback has not been set up by a fit.
            MargLikConfigurationError: If the evidence data yield no batch.
        """
        self._require_fit("example_inputs")
        prior, _ = self._hyperparameters()
        inputs, _ = split_batch(self._first_batch(trainer, pl_module), self._batch_fn(pl_module))
        return move(inputs, prior.params[0].device, prior.params[0].dtype)

    def _require_fit(self, method: str) -> None:
        """Refuse a call that reads the prior and likelihood before a fit has found them."""
        if self.prior is None or self.likelihood is None:
            raise RuntimeError(
                f"MargLikCallback.{method} reads the prior and likelihood the callback found when training "
                "started: call it after trainer.fit(module) with this callback."
            )
