"""The posterior predictive (issue 53): what the one call costs, why the predictive is under-confident, and
which predictive is never worse than the network alone.

``--cost``: :func:`lightning_marglik.predict` against a plain forward pass, per 1,000 inputs, side by side in
one process on one thread (the MLP and CNN of the study, probit and MC).

``--train``: the study's runs, cached in ``outputs/predictive/runs`` (``_zoo.cached``): 8-class generated images
(``shapes8``: ``_zoo.draw_bars`` with a cross and a corner besides bars, diagonals, square and plus; 14x14, noise
0.2: at bars' 0.45 the MLP ends at accuracy 0.33), the MLP and CNN of ``_zoo.build``, 40 epochs of Adam (lr 1e-3, cosine), ``MargLikCallback()`` at its
defaults, seeds 0-2, MNIST-14 test images as out-of-distribution inputs.

``--analyse``: from each run's final weights, the predictive's variance split by tensor and its variants
(the posterior as trained, post-hoc precisions, the output layer's block alone, probit and MC), scored on the
same test and OOD inputs as the network alone; writes ``results/predictive.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _zoo  # noqa: E402

NETWORKS = ("mlp", "cnn")
SEEDS = (0, 1, 2)
N_TRAIN, N_TEST = 3000, 500
NOISE = 0.2
EPOCHS = 40


def shapes8(n_train: int, n_test: int, split_seed: int) -> _zoo.Data:
    """8 classes of strokes on noise (``_zoo.draw_bars(classes=8)``), training and test drawn apart."""
    x_tr, y_tr = _zoo.draw_bars(n_train, 11 + split_seed, noise=NOISE, classes=8)
    x_te, y_te = _zoo.draw_bars(n_test, 1011 + split_seed, noise=NOISE, classes=8)
    return _zoo.Data(x_tr, y_tr, x_te, y_te, 14, 8)


_zoo.DATA_LOADERS["shapes8"] = shapes8


def spec(network: str, seed: int, quick: bool = False) -> _zoo.RunSpec:
    """One run of the study: the callback at its defaults."""
    base = _zoo.RunSpec(network=network, dataset="shapes8", seed=seed, epochs=EPOCHS, n_train=N_TRAIN,
                        n_test=N_TEST, batch_size=128, lr=1e-3, schedule="cosine", trace=False, ood="mnist",
                        callback={})
    return replace(base, epochs=3, n_train=300, n_test=200) if quick else base


def plan(quick: bool) -> List[_zoo.RunSpec]:
    return [spec(network, seed, quick) for network in NETWORKS for seed in SEEDS]


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", action="store_true", help="train (or read from the cache) the study's runs")
    parser.add_argument("--shard", type=int, nargs=2, metavar=("K", "N"), default=(0, 1),
                        help="with --train: shard K of N of the runs")
    parser.add_argument("--cache", default=os.path.join(_zoo.output_dir("predictive"), "runs"))
    parser.add_argument("--quick", action="store_true", help="3 epochs on 300 images (a smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.train:
        _zoo.run_shard(plan(args.quick), args.shard[0], args.shard[1], args.cache)


if __name__ == "__main__":
    main()
