"""Pilot (branch pilot-mc, not shipped): the prior guard scoring each held-out fold by the refit's posterior
predictive (``guard.SAMPLES`` draws of N(step, H_k^-1)) instead of its point, seed 0 of the defaults arm of chosen
cells of the guard study, against that study's b95a88b runs.

    python benchmarks/investigations/guard_pilot_mc.py SAMPLES CELL [CELL ...]
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import _zoo  # noqa: E402
import prior_guard as study  # noqa: E402  (investigations/prior_guard.py)

import lightning_marglik.guard as guard  # noqa: E402


def specs():
    out = {f"{d}/{n}": study.cell_spec(d, n, 0, "defaults") for d, n in study.family.STUDY_CELLS}
    out.update({f"noise{m.noise:g}-n{m.n_train}-d{m.depth}": study.family_spec(m, 0, "defaults") for m in study.family.MEMBERS})
    return out


def main() -> None:
    samples, wanted = int(sys.argv[1]), sys.argv[2:]
    guard.SAMPLES = samples
    table = specs()
    cache = os.path.join(_zoo.output_dir(study.NAME), f"pilot_mc_{samples}")
    for name in wanted:
        spec = table[name]
        new, old = _zoo.cached(spec, cache), _zoo.stored(spec, study.cache_dir())
        print(json.dumps({"cell": name, "new": {"guard": new["guard"], "final": new["final"], "cpu": new["cpu_seconds"]},
                          "old": {"guard": old["guard"], "final": old["final"], "cpu": old["cpu_seconds"]}}), flush=True)


if __name__ == "__main__":
    main()
