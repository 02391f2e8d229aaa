"""``marglik-select CONFIG.yaml [overrides]``: the command line over :mod:`.config` (jsonargparse,
as LightningCLI)."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ..callbacks import MargLikCallback, MargLikConfigurationError
from .config import check_config, missing_module_fix, select_from_config
from .driver import (
    AUTO_FULL_MAX_DIRECTIONS, DEFAULT_RANK_BY, DEFAULT_RANK_OUTPUT_LAYER, quiet_lightning, rank_by_choices,
)
from .results import CandidateResult, ResultsInUse, written_since

__all__ = ["DEFAULT_THREADS", "QUICK_NOTICE", "QUICK_OVERRIDES", "build_parser", "duplicate_key", "explain_import_error",
           "main", "plain_text", "run_command_line"]

# One thread is fastest for small models on a shared CPU (measured in docs/install.md, "Threads").
DEFAULT_THREADS = 1
# What `--quick` means: one epoch of two batches and one cheap estimate per candidate. The
# evidence pass still sees the whole training set, so a quick run exercises everything.
QUICK_OVERRIDES = (
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--callback.frequency=1",
    "--callback.steps=5",
)
# printed before and after a quick run's table
QUICK_NOTICE = ("--quick: a smoke test (1 epoch of 2 batches per candidate) that checks everything runs; its "
                "ranking means nothing. Run without --quick to rank the candidates.")


def plain_text(text: str) -> str:
    """``text`` without reStructuredText markup, for ``--help`` (docstrings are written for the docs).

    Example:
        >>> plain_text('``"newton"`` (see :mod:`lightning_marglik.solvers`, :func:`~torch.manual_seed`)')
        '"newton" (see lightning_marglik.solvers, manual_seed)'
    """
    text = re.sub(r":[a-z]+(?::[a-z]+)?:`~[\w.]*?(\w+)`", r"\1", text)  # :func:`~a.b` -> b
    text = re.sub(r":[a-z]+(?::[a-z]+)?:`([^`]+)`", r"\1", text)  # :mod:`a.b` -> a.b
    text = re.sub(r"`([^`<]+?)\s*<[^`>]+>`_", r"\1", text)  # `label <url>`_ -> label
    return re.sub(r"``(.+?)``", r"\1", text)


def _help_formatter() -> type:
    from jsonargparse import DefaultHelpFormatter

    class PlainHelpFormatter(DefaultHelpFormatter):
        """jsonargparse's help (types and defaults) in plain text: no docstring markup."""

        def _get_help_string(self, action: Any) -> str:
            return plain_text(super()._get_help_string(action))

        def start_section(self, heading: Optional[str]) -> None:
            super().start_section(plain_text(heading) if heading else heading)

        def add_text(self, text: Optional[str]) -> None:
            super().add_text(plain_text(text) if text else text)

    return PlainHelpFormatter


def explain_import_error(message: str, directory: Optional[str] = None) -> str:
    """jsonargparse's report of a ``class_path`` whose module is not on the Python path, as the
    one-line fix of :func:`.config.missing_module_fix` (``directory``: the working directory the
    command started in); any other message unchanged.

    Example:
        >>> print(explain_import_error("Problem with given class_path 'nowhere.Data': No module named 'nowhere'")[:60])
        class_path 'nowhere.Data' cannot be imported: No module name
        >>> explain_import_error("Parser key 'seed': expected an int")
        "Parser key 'seed': expected an int"
    """
    class_path = re.search(r"class_path '([\w.]+)'", message)
    missing = re.search(r"No module named '([\w.]+)'", message)
    fix = missing_module_fix(class_path[1], missing[1], directory) if class_path and missing else None
    if fix is None:
        return message
    return f"class_path {class_path[1]!r} cannot be imported: No module named {missing[1]!r}. {fix}"


def duplicate_key(text: str) -> Optional[str]:
    r"""The first key that one mapping of the YAML ``text`` holds twice, with its lines; ``None`` if none (or if the
    text is no YAML: the parser says so). PyYAML keeps the last silently: a candidate copied and not renamed would
    replace the one above it.

    Example:
        >>> duplicate_key("candidates:\n  mlp: {}\n  cnn: {}\n  mlp: {}\n")
        "'mlp' twice in one mapping (lines 2 and 4): YAML keeps only the last; rename or remove one"
    """
    import yaml

    class Strict(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            lines: Dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key == "<<" or not isinstance(key, (str, int, float, bool)):  # merges and odd keys: PyYAML's own
                    continue
                line = key_node.start_mark.line + 1
                if key in lines:
                    raise _Duplicate(f"{key!r} twice in one mapping (lines {lines[key]} and {line}): YAML keeps only "
                                     "the last; rename or remove one")
                lines[key] = line
            return super().construct_mapping(node, deep)

    try:
        yaml.load(text, Loader=Strict)
    except _Duplicate as found:
        return str(found)
    except yaml.YAMLError:
        return None
    return None


class _Duplicate(Exception):
    """A key held twice by one YAML mapping."""


def build_parser() -> Any:
    """The ``marglik-select`` parser (jsonargparse, as LightningCLI): YAML plus dotted overrides."""
    from typing import Literal

    from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser

    class SelectionParser(ArgumentParser):
        """Reports a ``class_path`` that cannot be imported with its fix (the data's class is
        imported while parsing, before :func:`.config.check_config` sees it)."""

        def error(self, message: str, ex: Optional[Exception] = None) -> Any:
            return super().error(explain_import_error(message, started_in), ex)

    started_in = os.getcwd()  # parsing runs in the YAML's directory

    parser = SelectionParser(
        prog="marglik-select",
        allow_abbrev=False,  # a prefix of an option (--callback.structur) is a misspelling, not that option
        formatter_class=_help_formatter(),
        usage="marglik-select CONFIG.yaml [--trainer.KEY=VALUE] [--callback.KEY=VALUE] [--data.KEY=VALUE] "
              "[--seed=N] [--output_dir=DIR] [--quick] [--rerun] [--threads=N]",
        description="Train every candidate of CONFIG.yaml with MargLikCallback and rank them by their "
                    "Laplace evidence (log marginal likelihood / N; higher is better).",
        epilog="The YAML imports the modules it names (as LightningCLI's): use only files from a trusted source.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="The YAML file (also the first positional argument).")
    parser.add_argument("--seed", type=int, default=0, help="Seed set before every candidate.")
    parser.add_argument("--output_dir", "--output-dir", type=Optional[str], default=None,
                        help="Where results.json, results.csv and evidence.png go.")
    parser.add_argument("--predictive", type=Literal["map", "probit"], default="map",
                        help="Predictive of the test metrics (never used to select).")
    # a str checked by check_config: case-insensitive, with "did you mean", and structures registered later
    parser.add_argument("--rank_by", "--rank-by", type=str, default=DEFAULT_RANK_BY,
                        help="The evidence that ranks the candidates: STRUCTURE-APPROX re-estimated at the final "
                             "weights (hyperparameters re-optimised); 'auto' (the default): full-ggn for all "
                             "candidates if the exact full GGN is affordable for every one (min(N C, P) <= "
                             f"{AUTO_FULL_MAX_DIRECTIONS}), else kron-ef, or kron-ggn if the empirical Fisher's "
                             "check flags a candidate (one that fits its training set); or 'online' (the "
                             f"callback's final estimate); one of {', '.join(rank_by_choices())}.")
    parser.add_argument("--fold_batchnorm", "--fold-batchnorm", type=bool, default=True,
                        help="Rank each candidate by the evidence of its network with the BatchNorms folded into "
                             "the layers before them (the test-time function without normalization layers; no "
                             "effect on networks without BatchNorm or with rank_by=online).")
    parser.add_argument("--rank_output_layer", "--rank-output-layer", type=Literal["learn", "fixed"],
                        default=DEFAULT_RANK_OUTPUT_LAYER,
                        help="learn (the default): the ranking evidence learns the output layer's precision that "
                             "training holds (callback output_layer=fixed; training still holds it); fixed: ranks "
                             "with it held as trained.")
    parser.add_argument("--trainer", type=Dict[str, Any], default={},
                        help="pl.Trainer arguments, e.g. --trainer.max_epochs=5; names and types are checked "
                             "against pl.Trainer's signature before anything is built. Defaults here: "
                             "accelerator=cpu, logger=False, enable_checkpointing=False, enable_model_summary=False.")
    parser.add_class_arguments(MargLikCallback, "callback")
    parser.groups["callback"].title = "MargLikCallback arguments (--callback.KEY=VALUE)"
    parser.add_subclass_arguments(pl.LightningDataModule, "data", required=True)
    # Lightning's docstring would title this group with half a sentence
    parser.groups["data"].title = "The data: a LightningDataModule subclass (--data.KEY=VALUE sets its init_args)"
    parser.add_argument("--candidates", type=Dict[str, Dict[str, Any]], required=True,
                        help="Name to {class_path: a LightningModule subclass, init_args: {...}}.")
    parser.add_argument("--quick", action=ActionYesNo(yes_prefix="", no_prefix=None), default=False,
                        help="Smoke test: " + " ".join(QUICK_OVERRIDES) + " (later overrides win); "
                             "writes to OUTPUT_DIR/quick (--print_config shows OUTPUT_DIR) and trains every candidate "
                             "again. Its ranking means "
                             "nothing (barely trained candidates): it checks that everything runs.")
    parser.add_argument("--rerun", action=ActionYesNo(yes_prefix="", no_prefix=None), default=False,
                        help="Train every candidate again instead of reusing finished ones from results.json.")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help="torch.set_num_threads: 1 is fastest for small models on a shared CPU.")
    return parser


def run_command_line(argv: Optional[Sequence[str]] = None) -> Tuple[List[CandidateResult], Dict[str, Any]]:
    """What ``marglik-select`` does, for a script: returns the results and the configuration used.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``): ``CONFIG.yaml`` and overrides.

    Returns:
        The results (best evidence first) and the configuration after all overrides (as given to
        :func:`select_from_config`).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--config", args[0], *args[1:]]
    sys.path.insert(0, os.getcwd())  # class paths of the user's own modules, as with `python -m`
    parser = build_parser()
    if not any(a == "--config" or a.startswith("--config=") for a in args):
        stray = [a for a in args if not a.startswith("-") and a.endswith((".yaml", ".yml"))]
        if stray:  # jsonargparse would call it an unrecognized argument
            parser.error(f"the configuration file comes first: marglik-select {stray[0]} [options] (got it after an "
                         "option).")
    for path in _config_paths(args):
        with contextlib.suppress(OSError, UnicodeDecodeError):  # an unreadable file: the parser's own error
            found = duplicate_key(open(path, encoding="utf-8").read())
            if found:
                parser.error(f"{path}: {found}.")
    # --quick's overrides right after the YAML, so that the user's own win; given on the command line, before the
    # first parse, where --print_config prints (and exits)
    at = 2 if args[:1] == ["--config"] else 1 if args[:1] and args[0].startswith("--config=") else 0
    quick = [*args[:at], *QUICK_OVERRIDES, *args[at:]]
    cfg = parser.parse_args(quick if "--quick" in args else args)
    if cfg.quick and "--quick" not in args:  # `quick: true` in the YAML
        cfg = parser.parse_args(quick)
    if cfg.threads < 1:
        parser.error(f"--threads must be at least 1, got {cfg.threads}.")
    torch.set_num_threads(cfg.threads)
    config = {
        "seed": cfg.seed,
        "output_dir": cfg.output_dir,
        "predictive": cfg.predictive,
        "rank_by": cfg.rank_by,
        "fold_batchnorm": cfg.fold_batchnorm,
        "rank_output_layer": cfg.rank_output_layer,
        "trainer": dict(cfg.trainer),
        "callback": cfg.callback.as_dict(),
        "data": cfg.data.as_dict(),
        "candidates": cfg.candidates,
    }
    if cfg.quick and config["output_dir"]:
        config["output_dir"] = os.path.join(config["output_dir"], "quick")  # never mixed with real results
    try:
        check_config(config)
    except ValueError as error:
        parser.error(str(error))
    if cfg.quick:
        print(QUICK_NOTICE, flush=True)
    with quiet_lightning():
        if cfg.quick:  # it trains on 2 batches on purpose; the evidence still covers all the data
            warnings.filterwarnings("ignore", message=".*limit_train_batches.*")
        started = time.time()
        results = select_from_config(config, resume=not (cfg.rerun or cfg.quick))
    width = max(len("candidate"), *(len(r.name) for r in results))
    print(f"{'rank':>4}  {'candidate':<{width}}  {'marglik':>9}  {'params':>8}  metrics")
    for rank, r in enumerate(results, 1):
        shown = " ".join(f"{k}={v:.4f}" for k, v in r.metrics.items())
        print(f"{rank:>4}  {r.name:<{width}}  {r.marglik:>9.4f}  {r.n_params:>8}  {shown}")
    if config["output_dir"]:
        print(f"results in {config['output_dir']}/ ({', '.join(written_since(config['output_dir'], started))})")
    else:
        print("no output_dir: nothing written (give `output_dir:` in the YAML or --output_dir=DIR to keep "
              "results.csv, results.json and evidence.png)")
    if cfg.quick:
        print(QUICK_NOTICE)
    return results, config


def _config_paths(args: Sequence[str]) -> List[str]:
    """The YAML files that ``--config`` names in ``args``."""
    return [value for option, value in zip(args, args[1:]) if option == "--config"] + [
        a.split("=", 1)[1] for a in args if a.startswith("--config=")]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``marglik-select CONFIG.yaml [overrides]``: rank the configured candidates by evidence."""
    try:
        run_command_line(argv)
    except ResultsInUse as error:  # a run's own state, not a bug: one line, as the parser's errors
        sys.exit(f"marglik-select: error: {error}")
    except MargLikConfigurationError as error:  # a candidate's set-up refused it: the message and which candidate
        sys.exit("marglik-select: error: " + "\n".join([str(error), *getattr(error, "__notes__", [])]))
    except (SIGTERMException, KeyboardInterrupt) as stop:  # Lightning's SIGTERM exit would report success (0)
        signal_name, code = ("SIGTERM", 143) if isinstance(stop, SIGTERMException) else ("interrupt", 130)
        print(f"marglik-select: stopped by {signal_name}; the candidates finished before are kept in output_dir: the "
              "same command again trains only the others.", file=sys.stderr)
        sys.exit(code)
