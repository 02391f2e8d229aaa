"""Step 2 of the method: train candidate models with ``MargLikCallback`` and rank them by evidence.

From Python::

    results = select_models({"mlp": make_mlp, "cnn": make_cnn}, datamodule=data,
                            callback={"structure": "diag", "approx": "ef"},
                            trainer={"max_epochs": 30}, output_dir="selection")

From the command line, over a YAML file (``class_path``/``init_args`` as in LightningCLI)::

    marglik-select candidates.yaml            # or: python -m lightning_marglik.selection ...
    marglik-select candidates.yaml --trainer.max_epochs=5 --callback.structure=kron --seed=1
    marglik-select candidates.yaml --quick    # 1 epoch of 2 batches each: a smoke test, ranks nothing
    marglik-select candidates.yaml --print_config     # the configuration after all overrides

    seed: 0
    output_dir: selection
    trainer: {max_epochs: 30}
    callback: {structure: diag, approx: ef}
    data: {class_path: mypackage.Data, init_args: {batch_size: 64}}
    candidates:
      mlp: {class_path: mypackage.MLP, init_args: {width: 100}}
      cnn: {class_path: mypackage.CNN, init_args: {channels: 16}}

A candidate class whose ``__init__`` takes ``n_data`` gets the training set size when the YAML
does not set it. A YAML file imports the modules it names (as LightningCLI's do): use only
files from a trusted source. ``data`` must name a ``LightningDataModule`` subclass and every
candidate a ``LightningModule`` subclass; anything else is refused before it is called.

The candidates are ranked by ``rank_by`` (YAML key, ``--rank_by``): by default ``auto``, one
evidence for all of them re-estimated at the final weights, the exact full GGN (``full-ggn``) where
every candidate affords it (:func:`resolve_auto`: small regression networks), else the Kronecker
empirical Fisher (``kron-ef``: image classifiers), or the Kronecker GGN (``kron-ggn``) if the
empirical Fisher's check flags a candidate (one that fits its training set); each result's
``rank_by`` names the choice and ``rank_by_reason`` why. That evidence is of each network with its
BatchNorms folded into the layers before them (``fold_batchnorm``, YAML key and
``--fold_batchnorm``, default true; each result's ``folded`` names them). Candidates with and
without normalization layers are ranked together with a warning naming them (:mod:`.comparability`).

Results are written after every candidate; a re-run with the same settings reuses the
candidates that finished (``--rerun`` trains them all again). The results of candidates a run
does not name are kept; an unreadable ``results.json`` is moved aside with a warning; a second
run into a directory in use is refused, naming the process that holds it (``results.lock``).

Trainer arguments are checked against ``pl.Trainer``'s signature (names and types) before
anything is built. Test metrics read batches as the evidence does (``marglik_batch``) and score
the positions the likelihood counts (classes last in ``(B, ..., C)``, ``ignore_index`` left out);
the first test batch goes through them when training starts, so that a mismatch costs no training.

The package, by job: :mod:`.driver` (:func:`select_models`), :mod:`.prepass` (every candidate built and checked
before the first trains), :mod:`.comparability` (which candidates
their evidence does not compare), :mod:`.metrics` (the test metrics),
:mod:`.results` (the files and their lock), :mod:`.plot` (``evidence.png``), :mod:`.trainer_arguments` (the
``trainer`` arguments checked before anything is built), :mod:`.config` (a YAML configuration checked and run) and
:mod:`.cli` (``marglik-select``).
"""
from __future__ import annotations

# the constants and helpers are imported from here by the examples and tests, too
from .cli import DEFAULT_THREADS, QUICK_OVERRIDES, build_parser, main, plain_text, run_command_line  # noqa: F401
from .config import check_config, instantiate, resolve_class, select_from_config
from .driver import (  # noqa: F401
    AUTO_FULL_MAX_DIRECTIONS, AUTO_FULL_MAX_MEMORY, DEFAULT_RANK_BY, PREDICTIVES, full_ggn_refusal, quiet_lightning,
    rank_by_choices, resolve_auto, select_models,
)
from .metrics import NegativeLogLikelihood, default_metrics
from .plot import label_points
from .results import LOCK_FILE, RESULTS_JSON, CandidateResult, ResultsInUse, load_results, save_results  # noqa: F401
from .trainer_arguments import check_trainer_arguments

__all__ = [
    "CandidateResult",
    "ResultsInUse",
    "NegativeLogLikelihood",
    "default_metrics",
    "select_models",
    "select_from_config",
    "check_config",
    "check_trainer_arguments",
    "resolve_class",
    "instantiate",
    "load_results",
    "save_results",
    "label_points",
    "quiet_lightning",
    "rank_by_choices",
    "resolve_auto",
    "full_ggn_refusal",
    "run_command_line",
    "main",
]
