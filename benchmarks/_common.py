"""Shared helpers of the benchmark scripts: timing, machine description, and result files that
carry their own raw data (so a script can be run model by model and still write one table).

A results file ends with an HTML comment ``<!-- benchmark-data {json} -->`` holding the raw
measurements of every part measured so far; a run of some parts replaces those parts and keeps
the others (each part records its own date, command and load).
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import re
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Dict, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
_DATA = re.compile(r"<!-- benchmark-data (\{.*\}) -->", re.S)


def timed(fn: Callable[[], Any]) -> Tuple[float, float, Any]:
    """(CPU seconds of this process, wall seconds, result) of ``fn()``."""
    gc.collect()  # cheap once start-up objects are frozen (see ``freeze_startup``)
    c0, w0 = time.process_time(), time.perf_counter()
    result = fn()
    return time.process_time() - c0, time.perf_counter() - w0, result


def freeze_startup() -> None:
    """Freeze what exists now (Lightning's large object graphs) so a collection inside a timed
    section stays cheap (a full collection would otherwise take ~0.5 s)."""
    gc.collect()
    gc.freeze()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def now() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def load_avg() -> float:
    return os.getloadavg()[0]


def rss_mib(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last :func:`reset_peak_rss`) of this process, MiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS


def read_data(path: Path) -> Dict[str, Any]:
    """The raw data embedded in a results file (empty if none)."""
    if not path.exists():
        return {}
    found = _DATA.search(path.read_text())
    return json.loads(found.group(1)) if found else {}


# results files keep what follows this line (a hand-written reading) when their script rewrites them
HAND_WRITTEN = "<!-- hand-written below: kept when the script rewrites the file -->"


def hand_written(path: Path) -> str:
    """The hand-written part of an earlier ``path`` (from ``HAND_WRITTEN`` to its data), else the bare marker."""
    before = path.read_text() if path.exists() else ""
    if HAND_WRITTEN not in before:
        return HAND_WRITTEN
    return before[before.index(HAND_WRITTEN):].split("<!-- benchmark-data", 1)[0].rstrip()


def write_with_data(path: Path, text: str, data: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = json.dumps(data, separators=(",", ":"), allow_nan=True)
    path.write_text(text.rstrip() + "\n\n<!-- benchmark-data " + blob + " -->\n")


def write_sections(path: Path, title: str, order: Sequence[str], computed: Dict[str, Dict[str, Any]]) -> str:
    """Write a results page of named sections, each ``{"text": ..., ...}``, in ``order``: the ``computed`` ones and
    the page's others as they are on disk now (read last: a command that wrote another section meanwhile keeps
    it), the hand-written part kept. Returns the page's text."""
    data: Dict[str, Any] = {key: None for key in order}
    data.update(read_data(path))
    data.update(computed)
    text = "\n\n".join([title, *(data[key]["text"] for key in order if data.get(key)), hand_written(path)])
    write_with_data(path, text, data)
    return text
