"""Which evidence ``select_models``' default should rank by: the options of issue 33 on the project's studies.

The options, each re-estimated at the final weights with the hyperparameters re-optimised by Newton (BatchNorm
networks folded, as ``select_models`` does by default):

* ``kron-EF``: what ``rank_by="auto"`` resolved to for image classifiers before issue 33;
* ``kron-GGN``: a GGN default;
* ``kron-EF/r``: the EF's curvature divided by its ratio ``r = tr EF / tr GGN`` (``rescale_empirical_fisher``);
* ``kron-EF, flagged /r``: kron-EF, and kron-EF/r for the candidates the EF check flags (evidences mixed);
* ``default (auto)``: ``rank_by="auto"`` now (``lightning_marglik.selection.resolve_auto``): kron-EF, or kron-GGN
  for every candidate of a run (one seed) whose EF check flags a candidate (``r`` below ``EF_RATIO_THRESHOLD``).

Each of these learns the output layer's precision at the ranking step (training holds it: ``MargLikCallback``'s
``output_layer="fixed"``); ``kron-EF``, ``kron-GGN`` and the default also with it held at its trained value (issue 52,
``select_models(rank_output_layer="fixed")``), on the ranking study, in a table of their own.

The studies:

* the ranking study (``examples/ranking_study.py``: 22 MLPs, CNNs and BatchNorm ResNets x 3 seeds, its recipe),
  trained here with its own harness (``train_all``, ``run_candidate``) and only these evidences, cached in
  ``outputs/default_ranking/ranking_study/``;
* the paper's protocol (``examples/paper_protocol.py``: 9 MLPs, CNNs, Fixup CNNs and Fixup ResNets x 2 seeds),
  read from that script's cache (train it with its own command first);
* ``benchmarks/investigations/ef_interpolation.py`` (two MLPs that fit their training set and a CNN, eight checkpoints, delta
  fixed), read from the data its results file carries (run it first).

Per study and option: Spearman rho between the seed-mean evidence and the seed-mean test accuracy with a 95 %
bootstrap interval (``ranking_study.bootstrap_spearman``), over all candidates and over the comparisons the
documentation says to trust; the pick, its points below the best candidate, and whether the EF check flags it.

Usage::

    python benchmarks/investigations/default_ranking.py                    # train the ranking study's runs not cached, analyse
    python benchmarks/investigations/default_ranking.py --shard 0/2 & python benchmarks/investigations/default_ranking.py --shard 1/2
    python benchmarks/investigations/default_ranking.py --analyse --results   # write benchmarks/results/default_ranking.md
    python benchmarks/investigations/default_ranking.py --quick            # smoke test: 4 tiny candidates, 3 epochs, prints only
"""
from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import paper_protocol as pp  # noqa: E402
import ranking_study as rs  # noqa: E402
from benchmarks._common import RESULTS, hand_written, now, read_data  # noqa: E402
from common import OUTPUTS  # noqa: E402
from lightning_marglik.diagnostics import EF_RATIO_THRESHOLD  # noqa: E402
from lightning_marglik.selection import quiet_lightning  # noqa: E402

# the ranking study's evidences of each option (its networks have BatchNorms: folded, as select_models ranks them)
RANKING_EVIDENCES = {"kron-EF": "kron-EF folded", "kron-GGN": "kron-GGN folded", "kron-EF/r": "kron-EF/r folded"}
# the same two with the output layer's precision held at its trained value (the declared delta) by the re-optimisation,
# as select_models ranks since issue 42 (the options above learn it at the ranking step; training holds it in both)
HELD_EVIDENCES = {"kron-EF": "kron-EF folded, output held", "kron-GGN": "kron-GGN folded, output held"}
DEFAULT = "default (auto)"
FLAGGED_RESCALED = "kron-EF, flagged /r"  # each candidate's kron-EF, divided by its ratio where the check flags it
OPTIONS = (*RANKING_EVIDENCES, FLAGGED_RESCALED, DEFAULT)
HELD = ", output held"
HELD_OPTIONS = tuple(f"{option}{HELD}" for option in (*HELD_EVIDENCES, DEFAULT))  # the ranking study only
# the comparisons docs/selection.md ("When to trust Step 2") trusts: networks of one kind, no BatchNorm mixed in
TRUSTED_FAMILIES = {"ranking study": ("MLP", "CNN"), "paper protocol": tuple(pp.FAMILIES)}
CLASSES = 10


def options_of(study: Dict[str, np.ndarray], names: Sequence[str], n_params: Sequence[int],
               n_rows: int) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """Every option's evidence ``(candidates, seeds)`` of a study and the default's choice per seed."""
    default, choices = rs.default_ranking(study["kron-EF"], study["kron-GGN"], study["ratio"], names, n_params, n_rows)
    flagged_rescaled = np.where(study["ratio"] < EF_RATIO_THRESHOLD, study["kron-EF/r"], study["kron-EF"])
    options = {**{option: study[option] for option in RANKING_EVIDENCES}, FLAGGED_RESCALED: flagged_rescaled,
               DEFAULT: default}
    if f"kron-EF{HELD}" in study:  # the same choice per seed (the EF check does not depend on the prior)
        held, _ = rs.default_ranking(study[f"kron-EF{HELD}"], study[f"kron-GGN{HELD}"], study["ratio"], names,
                                     n_params, n_rows)
        options.update({f"{option}{HELD}": study[f"{option}{HELD}"] for option in HELD_EVIDENCES},
                       **{f"{DEFAULT}{HELD}": held})
    return options, choices


def score(evidences: Dict[str, np.ndarray], accuracy: np.ndarray, names: Sequence[str], flagged: Sequence[str],
          samples: int) -> Dict[str, Dict[str, Any]]:
    """Per option: rho with its interval, the pick, its gap to the best, whether the check flags it.

    ``accuracy``: per test example, ``(candidates, seeds, test examples)``.
    """
    mean_accuracy = accuracy.mean(2).mean(1)
    best = int(np.argmax(mean_accuracy))
    out = {}
    for option, evidence in evidences.items():
        pick = int(np.argmax(evidence.mean(1)))
        out[option] = {"rho": rs.bootstrap_spearman(evidence, accuracy, samples),
                       "pick": names[pick], "pick_accuracy": float(mean_accuracy[pick]), "best": names[best],
                       "gap_points": 100 * float(mean_accuracy[best] - mean_accuracy[pick]),
                       "pick_flagged": names[pick] in flagged}
    return out


def study_arrays(runs: Dict[Tuple[str, int], Dict], names: Sequence[str], seeds: Sequence[int],
                 labels: Dict[str, str], ratio: Any) -> Dict[str, np.ndarray]:
    """The options' evidences, the EF ratio (``ratio(run)``) and the test accuracy per example of a study's runs."""
    def array(get: Any) -> np.ndarray:
        return np.array([[get(runs[(n, s)]) for s in seeds] for n in names], dtype=float)

    final = lambda run: run["checkpoints"]["100%"]  # noqa: E731
    out = {option: array(lambda run, label=label: final(run)["evidence"][label]["marglik"])
           for option, label in labels.items()}
    out["ratio"] = array(ratio)
    out["accuracy"] = array(lambda run: final(run)["test_correct"])
    return out


def analyse_part(arrays: Dict[str, np.ndarray], names: Sequence[str], n_params: Sequence[int], n_rows: int,
                 keep: Sequence[int], samples: int) -> Dict[str, Any]:
    """The candidates ``keep`` of a study as one ``select_models`` run over them (per seed) would rank them."""
    part = {key: value[list(keep)] for key, value in arrays.items()}
    kept = [names[i] for i in keep]
    evidences, choices = options_of(part, kept, [n_params[i] for i in keep], n_rows)
    flagged = [n for n, r in zip(kept, part["ratio"]) if (r < EF_RATIO_THRESHOLD).any()]
    return {"n": len(kept), "choices": choices, "scores": score(evidences, part["accuracy"], kept, flagged, samples),
            "flagged": {n: [round(float(v), 3) for v in part["ratio"][kept.index(n)]] for n in flagged},
            "ratio_range": [float(np.nanmin(part["ratio"])), float(np.nanmax(part["ratio"]))]}


def analyse_study(name: str, runs: Dict[Tuple[str, int], Dict], names: Sequence[str], seeds: Sequence[int],
                  families: Sequence[str], labels: Dict[str, str], ratio: Any, samples: int) -> Dict[str, Any]:
    """One study's options over all its candidates and over the ones the documentation trusts comparing."""
    arrays = study_arrays(runs, names, seeds, labels, ratio)
    n_params = [runs[(n, seeds[0])]["n_params"] for n in names]
    n_rows = runs[(names[0], seeds[0])]["recipe"]["n_train"] * CLASSES
    trusted = [i for i, f in enumerate(families) if f in TRUSTED_FAMILIES[name]]
    parts = {"all": analyse_part(arrays, names, n_params, n_rows, range(len(names)), samples)}
    if len(trusted) < len(names):  # the comparisons trusted are a subset
        parts["trusted"] = analyse_part(arrays, names, n_params, n_rows, trusted, samples)
    return {
        "study": name, "seeds": list(seeds), "trusted_families": list(TRUSTED_FAMILIES[name]), **parts,
        "libraries": sorted({r.get("posthoc_library", r.get("library", "not recorded")) for r in runs.values()}),
    }


def interpolation_picks(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``benchmarks/investigations/ef_interpolation.py``'s checkpoints: each option's pick and its gap to the best, per epoch."""
    out = []
    for epoch in sorted({r["epoch"] for r in rows}):
        at = [r for r in rows if r["epoch"] == epoch]
        study = {option: np.array([[r["evidence"][option]["marglik"]] for r in at]) for option in RANKING_EVIDENCES}
        study["ratio"] = np.array([[r["ratio"]] for r in at])
        names = [r["candidate"] for r in at]
        evidences, (choice,) = options_of(study, names, [r["params"] for r in at], at[0]["n_rows"])
        best = max(r["test_acc"] for r in at)
        flagged = [r["candidate"] for r in at if r["ratio"] < EF_RATIO_THRESHOLD]
        row: Dict[str, Any] = {"epoch": epoch, "best": max(at, key=lambda r: r["test_acc"])["candidate"],
                               "flagged": flagged, "choice": choice}
        for option, evidence in evidences.items():
            pick = at[int(np.argmax(evidence[:, 0]))]
            row[option] = {"pick": pick["candidate"], "gap_points": 100 * (best - pick["test_acc"]),
                           "pick_flagged": pick["candidate"] in flagged}
        out.append(row)
    return out


# --- the report -----------------------------------------------------------------------------------


def _cell(s: Dict[str, Any]) -> str:
    rho, low, high = s["rho"]
    return (f"{rho:.2f} [{low:.2f}, {high:.2f}]; {s['pick']}, {s['gap_points']:.1f}"
            + (" **flagged**" if s["pick_flagged"] else ""))


def output_layer_lines(parts: List[Tuple[Dict[str, Any], str]]) -> List[str]:
    """The table of the output layer's treatment at the ranking step, learned against held (studies that have both)."""
    pairs = [(option, f"{option}{HELD}") for option in (*HELD_EVIDENCES, DEFAULT)]
    rows = [(s, part) for s, part in parts if pairs[0][1] in s[part]["scores"]]
    if not rows:
        return []
    lines = [
        "",
        "## The output layer's precision at the ranking step: learned, or held at the declared delta",
        "",
        "Training holds it in both (`MargLikCallback`'s default `output_layer=\"fixed\"`, issue 42); the re-optimisation "
        "at the final weights learns it (the options above) or holds it at its trained value, delta = 1 "
        "(`select_models` before issue 52; its evidence re-optimises the callback's prior, which holds it). "
        "Cells as above.",
        "",
        "| study | candidates | " + " | ".join(f"{option} learned | {option} held" for option, _ in pairs) + " |",
        "|---|---|" + "---|" * (2 * len(pairs)),
    ]
    for s, part in rows:
        label = "all" if part == "all" else " + ".join(s["trusted_families"])
        lines.append(f"| {s['study']} | {label} ({s[part]['n']} x {len(s['seeds'])} seeds) | " + " | ".join(
            f"{_cell(s[part]['scores'][learned])} | {_cell(s[part]['scores'][held])}" for learned, held in pairs) + " |")
    return lines


def markdown(studies: List[Dict[str, Any]], interpolation: List[Dict[str, Any]], command: str, samples: int,
             interpolation_library: str) -> str:
    lines = [
        "# Which evidence the default ranks by: the options of issue 33 on the project's studies",
        "",
        f"{now()}. Command: `{command}`. Libraries: "
        + "; ".join(f"{s['study']} {', '.join(s['libraries'])}" for s in studies)
        + f"; ef_interpolation {interpolation_library}.",
        "",
        "Each option re-estimated at the final weights, hyperparameters re-optimised by Newton, BatchNorms folded. "
        f"{DEFAULT}: `select_models`' `rank_by=\"auto\"` (`resolve_auto`) per seed: kron-EF, or kron-GGN for every "
        f"candidate of that seed where the EF check flags one (tr EF / tr GGN below {EF_RATIO_THRESHOLD:g}). Cells: "
        f"Spearman rho(seed-mean evidence, seed-mean test accuracy) [95 % bootstrap, {samples} resamples over seeds "
        "and test examples]; the pick, its points of test accuracy below the best candidate; **flagged**: the EF "
        "check flags the pick.",
        "",
        "| study | candidates | " + " | ".join(OPTIONS) + " |",
        "|---|---|" + "---|" * len(OPTIONS),
    ]
    parts = [(s, part) for s in studies for part in ("all", "trusted") if part in s]
    for s, part in parts:
        label = "all" if part == "all" else " + ".join(s["trusted_families"])
        lines.append(f"| {s['study']} | {label} ({s[part]['n']} x {len(s['seeds'])} seeds) | "
                     + " | ".join(_cell(s[part]["scores"][option]) for option in OPTIONS) + " |")
    lines.append("")
    for s, part in parts:
        p = s[part]
        flagged = ", ".join(f"{n} (r {v})" for n, v in p["flagged"].items()) or "none"
        lines.append(f"- {s['study']}, {'all' if part == 'all' else ' + '.join(s['trusted_families'])}: best "
                     f"{p['scores'][DEFAULT]['best']}; EF ratio r {p['ratio_range'][0]:.3f}..{p['ratio_range'][1]:.3f}; "
                     f"flagged (r per seed): {flagged}; the default resolves per seed to "
                     + ", ".join(f"{seed} {choice}" for seed, choice in zip(s["seeds"], p["choices"])) + ".")
    lines += output_layer_lines(parts)
    lines += [
        "",
        "## ef_interpolation: the pick per checkpoint (3 candidates, one seed, delta fixed at 1)",
        "",
        "| epoch | best | flagged | " + " | ".join(OPTIONS) + " |",
        "|---|---|---|" + "---|" * len(OPTIONS),
    ]
    for row in interpolation:
        lines.append(f"| {row['epoch']} | {row['best']} | {', '.join(row['flagged']) or '-'} | " + " | ".join(
            f"{row[o]['pick']}, {row[o]['gap_points']:.1f}" + (" **flagged**" if row[o]["pick_flagged"] else "")
            for o in OPTIONS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    options = rs.study_options(__doc__, "default_ranking", (0, 1, 2), "smoke test: 4 tiny candidates, 3 epochs; "
                               "prints only", "md")
    options.add_argument("--paper-cache", default=os.path.join(OUTPUTS, "paper_protocol", "runs"),
                         help="the paper protocol's run cache (examples/paper_protocol.py's default)")
    args, shard = rs.parse_study(options, argv)
    start = time.perf_counter()
    recipe, names = rs.RECIPE, list(rs.CANDIDATES)
    if args.quick:
        recipe = {**rs.RECIPE, "max_epochs": 3, "n_train": 400, "n_total": 500,
                  "callback": {**rs.RECIPE["callback"], "frequency": 1, "steps": 5}}
        names, args.bootstrap = list(rs.QUICK_CANDIDATES), min(args.bootstrap, 50)
    cache = args.cache or os.path.join(OUTPUTS, "default_ranking", "quick" if args.quick else "ranking_study")
    wanted = (*RANKING_EVIDENCES.values(), *HELD_EVIDENCES.values())
    if not args.analyse:
        data = rs.load_mnist(recipe["n_train"], recipe["image_size"], recipe["split_seed"], recipe.get("n_total"))
        with quiet_lightning():
            rs.train_all(names, args.seeds, recipe, cache, data, shard,
                         run=functools.partial(rs.run_candidate, wanted=wanted), wanted=wanted)
    runs = rs.load_runs(cache, names, args.seeds, recipe, wanted)
    seeds = [s for s in args.seeds if all((n, s) in runs for n in names)]
    if not seeds:
        print(f"{len(runs)} runs of the ranking study cached, no seed complete: analyse once every shard has finished")
        return {}
    ef_ratio = lambda run: run["checkpoints"]["100%"]["evidence"]["kron-EF folded"]["ef_ratio"]  # noqa: E731
    labels = {**RANKING_EVIDENCES, **{f"{option}{HELD}": label for option, label in HELD_EVIDENCES.items()}}
    studies = [analyse_study("ranking study", runs, names, seeds, [rs.CANDIDATES[n][0] for n in names],
                             labels, ef_ratio, args.bootstrap)]
    paper = rs.load_runs(args.paper_cache, list(pp.CANDIDATES), [0, 1], pp.RECIPE, pp.POSTHOC)
    if not args.quick and len(paper) == 2 * len(pp.CANDIDATES):
        labels = {option: option for option in RANKING_EVIDENCES}  # no BatchNorm: folded is the network itself
        studies.append(analyse_study("paper protocol", paper, list(pp.CANDIDATES), [0, 1],
                                     [f for f, _ in pp.CANDIDATES.values()], labels, lambda run: run["ef_ratio"],
                                     args.bootstrap))
    interpolation = read_data(RESULTS / "ef_interpolation.md")
    picks = interpolation_picks(interpolation["rows"]) if interpolation and not args.quick else []
    command = " ".join(["python benchmarks/investigations/default_ranking.py", *(sys.argv[1:] if argv is None else argv)])
    text = markdown(studies, picks, command, args.bootstrap, interpolation.get("library", "not run"))
    print(text, flush=True)
    print(f"this invocation: {(time.perf_counter() - start) / 60:.1f} min wall", flush=True)
    if args.quick and not args.output_dir:
        return {"studies": studies, "interpolation": picks}
    path = Path(args.output_dir or (RESULTS if args.results else OUTPUTS)) / "default_ranking.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n" + hand_written(path) + "\n")
    print(f"results in {path}", flush=True)
    return {"studies": studies, "interpolation": picks}


if __name__ == "__main__":
    main()
