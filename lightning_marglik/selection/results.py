"""Results of a selection run on disk: ``results.json``/``results.csv``, rewritten after every
candidate, and the lock that keeps a second run out of a directory in use."""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from .plot import plot_evidence

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "RESULTS_FILES", "RESULTS_JSON", "CandidateResult", "ResultsInUse", "load_results", "run_lock",
           "save_results", "written_since"]

RESULTS_JSON = "results.json"
#: What :func:`save_results` may write: ``evidence.png`` only with test metrics (and matplotlib)
RESULTS_FILES = (RESULTS_JSON, "results.csv", "evidence.png")
LOCK_FILE = "results.lock"


@dataclass
class CandidateResult:
    """One trained candidate: its evidence, size, cost and test metrics.

    ``settings`` describe how it was trained (trainer, callback, seed, predictive, the ``rank_by``
    asked for and, from a YAML, its ``class_path``/``init_args`` and the data); a re-run reuses the
    result only if they are unchanged. ``metrics_error`` says why the test metrics failed after
    training (the result is kept for its evidence and trained again by the next run).

    ``rank_by`` names the evidence ``marglik`` is: the one asked for, or what ``rank_by="auto"``
    resolved to for all the run's candidates (``"full-ggn"``, ``"kron-ef"`` or ``"kron-ggn"``), and
    ``rank_by_reason`` says why. With ``"auto"``, ``evidences`` holds each of them by name
    (``"full-ggn"`` only where this candidate's exact full GGN is within ``auto``'s limits;
    ``full_ggn_refused`` says why not otherwise), so that a re-run that resolves another way reuses
    the result. ``folded`` names the layers whose BatchNorm was folded into them for that evidence
    (layer -> norm; empty: none, or ``fold_batchnorm=False``). ``normalization`` names the
    normalization layer types of the network (empty: none; ``None`` in files of older versions):
    candidates with and without them are not compared by their evidence (:mod:`.comparability`).
    An evidence that is not finite is ranked last and written as ``null`` in ``results.json`` (JSON has no NaN or
    infinity), read back as NaN, and trained again by a re-run. ``rank_output_layer`` says, in words, that
    ``marglik`` learned the output layer's precision that training held (``select_models(rank_output_layer="learn")``,
    the default); ``None``: ranked as trained.
    """

    name: str
    marglik: float  # log evidence per datum by which the candidates are ranked (higher is better)
    n_params: int
    train_seconds: float
    epochs: int
    hyperparameters: Dict[str, float] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    settings: Dict[str, Any] = field(default_factory=dict)
    metrics_error: Optional[str] = None
    online_marglik: Optional[float] = None  # the callback's final evidence (= marglik with rank_by="online")
    # tr EF / tr GGN at the final weights when the ranking evidence is the empirical Fisher's, and with
    # rank_by="auto" always: the check that decides between kron-ef and kron-ggn (diagnostics)
    ef_curvature_ratio: Optional[float] = None
    rank_by: Optional[str] = None  # the evidence marglik is ("auto" resolved); None in files of older versions
    rank_by_reason: Optional[str] = None  # why that evidence ranks the candidates
    evidences: Dict[str, float] = field(default_factory=dict)  # rank_by="auto": each evidence it may resolve to
    full_ggn_refused: Optional[str] = None  # rank_by="auto": why the exact full GGN is over its limits here
    folded: Dict[str, str] = field(default_factory=dict)  # layer -> the BatchNorm folded into it for marglik
    normalization: Optional[List[str]] = None  # the network's normalization layer types (comparability)
    # what the ranking evidence did with the output layer's precision that training held (select_models'
    # rank_output_layer="learn": learned it, in words); None: ranked as trained
    rank_output_layer: Optional[str] = None


def load_results(output_dir: str) -> Dict[str, CandidateResult]:
    """The results stored in ``output_dir/results.json`` by name (empty if there are none).

    A file that cannot be read as results (truncated by a full disk, edited by hand) is moved
    aside to ``results.json.corrupt-<time>`` with a warning, and its candidates count as not trained.
    """
    path = os.path.join(output_dir, RESULTS_JSON)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise TypeError(f"expected a list of results, got {type(rows).__name__}")
        return {result.name: result for result in map(_result_from_row, rows)}
    except (ValueError, TypeError, UnicodeDecodeError) as error:  # json.JSONDecodeError is a ValueError
        aside = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.replace(path, aside)
        warnings.warn(f"{path} cannot be read ({error}); moved it to {aside}: its candidates will be trained again.",
                      stacklevel=2)
        return {}


def _result_from_row(row: Any) -> CandidateResult:
    """A ``CandidateResult`` from one row of ``results.json``; TypeError on a field of the wrong type."""
    required = {"name": str, "marglik": (int, float, type(None)), "n_params": int, "train_seconds": (int, float),
                "epochs": int}
    types = {**required, "hyperparameters": dict, "metrics": dict, "settings": dict, "metrics_error": (str, type(None)),
             "online_marglik": (int, float, type(None)), "ef_curvature_ratio": (int, float, type(None)),
             "rank_by": (str, type(None)), "rank_by_reason": (str, type(None)), "evidences": dict,
             "full_ggn_refused": (str, type(None)), "folded": dict, "normalization": (list, type(None)),
             "rank_output_layer": (str, type(None))}
    if not isinstance(row, dict) or not all(k in row for k in required):
        raise TypeError(f"a result must be an object with {', '.join(required)}, got {row!r:.200}")
    for key, expected in types.items():
        if key in row and (not isinstance(row[key], expected) or isinstance(row[key], bool)):
            raise TypeError(f"result {row.get('name')!r}: {key} has the wrong type ({type(row[key]).__name__})")
    numbers = (int, float, type(None))  # null: a number that was not finite (save_results)
    if not all(isinstance(v, numbers) and not isinstance(v, bool) for v in row.get("evidences", {}).values()):
        raise TypeError(f"result {row.get('name')!r}: evidences must map names to numbers")
    row = {**row, **{key: {k: math.nan if v is None else v for k, v in row[key].items()}
                     for key in ("evidences", "metrics", "hyperparameters") if key in row}}
    return CandidateResult(**{**{k: v for k, v in row.items() if k in types},
                              "marglik": math.nan if row["marglik"] is None else row["marglik"]})


def save_results(
    results: Sequence[CandidateResult],
    output_dir: str,
    plot: bool = True,
    higher_is_better: Optional[Mapping[str, bool]] = None,
) -> None:
    """Write ``results.json``, ``results.csv`` and, with ``plot`` and matplotlib, ``evidence.png``.

    The files are replaced atomically, so a run killed while writing leaves the previous ones.

    Args:
        results: The results, best first.
        output_dir: Directory (created if missing).
        plot: Whether to draw ``evidence.png`` (evidence against the first test metric).
        higher_is_better: Direction of each metric, for the plot's axis label.
    """
    os.makedirs(output_dir, exist_ok=True)
    nested = ("metrics", "hyperparameters", "settings", "metrics_error", "evidences", "full_ggn_refused",
              "rank_by_reason", "rank_output_layer")
    rows = [{**{k: v for k, v in asdict(r).items() if k not in nested},
             **{f"marglik_{name}": value for name, value in r.evidences.items()}, **r.metrics} for r in results]
    _write_atomic(os.path.join(output_dir, RESULTS_JSON),
                  lambda f: json.dump([_json_numbers(asdict(r)) for r in results], f, indent=2, allow_nan=False))

    def write_csv(f: Any) -> None:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)

    _write_atomic(os.path.join(output_dir, "results.csv"), write_csv)
    if plot and results[0].metrics:
        plot_evidence(results, os.path.join(output_dir, "evidence.png"), higher_is_better or {})


def _json_numbers(value: Any) -> Any:
    """``value`` with every float that is not finite as ``None``: JSON has no NaN or infinity (Python would write
    ``NaN``, which other readers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_numbers(v) for v in value]
    return value


def written_since(output_dir: str, since: float) -> List[str]:
    """The :data:`RESULTS_FILES` in ``output_dir`` that were written at or after ``since`` (a ``time.time()``): what a
    run wrote, not what an earlier one left."""
    paths = ((name, os.path.join(output_dir, name)) for name in RESULTS_FILES)
    return [name for name, path in paths if os.path.exists(path) and os.path.getmtime(path) >= since]


def _write_atomic(path: str, write: Callable[[Any], None]) -> None:
    partial = f"{path}.{os.getpid()}.partial"  # never another process's temporary file
    with open(partial, "w", newline="") as f:
        write(f)
    os.replace(partial, path)


class ResultsInUse(RuntimeError):
    """Another model-selection run holds the output directory (:func:`run_lock`)."""


@contextlib.contextmanager
def run_lock(output_dir: Optional[str]) -> Iterator[None]:
    """Hold ``output_dir/results.lock`` (created with the directory) for one run.

    A second run into the same directory is refused with an error naming the process that holds
    it. The lock is the system's ``flock``, which ends with its process: a run that was killed
    leaves no stale lock. Without ``fcntl`` (Windows) runs are not locked against each other.
    """
    if output_dir is None:
        yield
        return
    os.makedirs(output_dir, exist_ok=True)
    if fcntl is None:
        yield
        return
    path = os.path.join(output_dir, LOCK_FILE)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held by another process (other OSErrors are raised as they are)
            owner = os.read(fd, 4096).decode(errors="replace").strip() or "a process that is just starting"
            os.close(fd)
            raise ResultsInUse(
                f"{output_dir} is in use by another model-selection run ({owner}). Wait for it to finish, or "
                "write to another directory (--output_dir); two runs into one directory would overwrite each "
                "other's results."
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # a finishing run removed the file we opened: lock the current one
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                 f"{' '.join(sys.argv)}".encode())
    try:
        yield
    finally:
        os.unlink(path)  # before unlocking: a run that opened this file sees it is gone and retries
        os.close(fd)
