"""The README's Lightning quick-start, run as a new user runs it (issue 23, item 5).

Executes the README's first ```python block unchanged (200 epochs of the 1-D regression network,
``MargLikCallback(frequency=5)`` at its defaults, ``MargLikCheckpoint``, ``MargLikEarlyStopping``) in a
temporary directory, once per seed of ``--seeds`` (the seed replaces the README's ``torch.manual_seed(0)``,
so seed 0 is the README's run and the others draw other data and initial weights), and records: the epochs trained and the estimates made (the settle epoch), the learned precision of
every tensor and its log rise above the declared 1, the learned sigma (true 0.1), the test RMSE of the
best-evidence checkpoint, and the library's warnings.

Usage::

    python benchmarks/quickstart.py              # writes benchmarks/results/quickstart.md
    python benchmarks/quickstart.py --seeds 0    # one seed
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RESULTS, ROOT, hand_written, now, write_with_data  # noqa: E402

NAME = "quickstart"


def readme_example() -> str:
    """The README's first ```python block: the Lightning quick-start."""
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)[0]


def run(seed: int) -> Dict[str, Any]:
    """One run of the quick-start; what a user reads off it, and what the library warned."""
    from lightning_marglik.runaway import RUNAWAY_LOG_RISE
    from lightning_marglik.selection import quiet_lightning

    code = readme_example().replace("torch.manual_seed(0)", f"torch.manual_seed({seed})")
    namespace: Dict[str, Any] = {"__name__": "readme_example"}
    cwd = os.getcwd()
    start = time.process_time()
    with tempfile.TemporaryDirectory() as folder, quiet_lightning(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        os.chdir(folder)
        try:
            exec(compile(code, "README.md (With Lightning)", "exec"), namespace)
        finally:
            os.chdir(cwd)
    module, trainer = namespace["module"], namespace["trainer"]
    callback = next(c for c in trainer.callbacks if type(c).__name__ == "MargLikCallback")
    rises = (module.prior.log_precision - math.log(module.prior.initial_precision)).tolist()
    return {
        "seed": seed, "epochs": trainer.current_epoch, "cpu_seconds": time.process_time() - start,
        "settled_epoch": getattr(callback.schedule, "settled_epoch", None),
        "estimates": [row["epoch"] for row in callback.history],
        "precisions": dict(zip(module.prior.param_names, module.prior.precision.tolist())),
        "rises": dict(zip(module.prior.param_names, rises)),
        "above": [n for n, r in zip(module.prior.param_names, rises) if r > RUNAWAY_LOG_RISE],
        "sigma": module.likelihood.sigma.item(),
        "test_rmse": float(trainer.callback_metrics["test_rmse"]),
        "warnings": sorted({str(w.message) for w in caught if "MargLik" in str(w.message)}),
    }


def markdown(runs: List[Dict[str, Any]], command: str) -> str:
    from common import library_state  # examples/common.py

    names = list(runs[0]["precisions"])
    lines = [
        "# The README quick-start, run as written (issue 23, item 5)", "",
        f"Date: {now()}. Library: {library_state()}. Command: `{command}`. The README's Lightning block, unchanged "
        "but for the seed of its `torch.manual_seed` line; one CPU thread.", "",
        "| seed | epochs | settled at epoch | estimates (epochs) | " + " | ".join(f"delta {n} (log rise)" for n in names)
        + " | sigma (true 0.1) | test RMSE | tensors above e^8 | CPU s |",
        "|---|---:|---:|---|" + "---:|" * len(names) + "---:|---:|---|---:|",
    ]
    for r in runs:
        cells = " | ".join(f"{r['precisions'][n]:.3g} ({r['rises'][n]:+.1f})" for n in names)
        lines.append(f"| {r['seed']} | {r['epochs']} | {r['settled_epoch']} | {', '.join(map(str, r['estimates']))} | "
                     f"{cells} | {r['sigma']:.4f} | {r['test_rmse']:.4f} | {', '.join(r['above']) or '-'} | "
                     f"{r['cpu_seconds']:.0f} |")
    warned = sorted({w for r in runs for w in r["warnings"]})
    lines += ["", "Warnings the library gave (any seed):", ""] + [f"- {w}" for w in warned or ["none"]] + [""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples"))
    runs = [run(seed) for seed in args.seeds]
    command = "python benchmarks/quickstart.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(runs, command.strip())
    print(text)
    path = RESULTS / f"{NAME}.md"
    write_with_data(path, text + "\n" + hand_written(path) + "\n", {"runs": runs})
    return runs


if __name__ == "__main__":
    main()
