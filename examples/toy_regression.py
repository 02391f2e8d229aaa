"""Paper Fig. 1: the evidence compares a 1- and a 3-hidden-layer MLP on 1-D regression with a gap.

Both networks (50 tanh units per layer) are trained with ``MargLikCallback``, which learns a
layerwise prior precision and the observation noise ``sigma`` online (Algorithm 1). After
training, their final log evidence per datum (``callback.final_marglik``) is compared: higher is
better. The plot shows each fit with the linearized-Laplace epistemic band (dense GGN posterior
computed here with ``torch.func.jacrev``; fine for these tiny networks) and the predictive band
that adds the learned noise.

Usage::

    python examples/toy_regression.py                  # full run, ~1-2 min on CPU
    python examples/toy_regression.py --quick          # smoke test: 3 epochs, no plot
    python examples/toy_regression.py --trainer.max_epochs=500 --model.width=20   # any config override
    python examples/toy_regression.py fit --config configs/toy_regression.yaml    # one plain LightningCLI fit

Script options: ``--config PATH``, ``--plot PATH``, ``--no-plot``, ``--quick``; the rest are
LightningCLI overrides of the config. Writes ``examples/results/toy_regression.png``.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.func import functional_call, jacrev

try:
    from .common import CONFIGS, RESULTS, MLPRegressor, ToyRegressionData, fit, markdown_table, script_main
except ImportError:  # run as a script: examples/ is on sys.path
    from common import CONFIGS, RESULTS, MLPRegressor, ToyRegressionData, fit, markdown_table, script_main

CONFIG = os.path.join(CONFIGS, "toy_regression.yaml")
PLOT = os.path.join(RESULTS, "toy_regression.png")
QUICK = ["--trainer.max_epochs=3", "--trainer.callbacks.init_args.frequency=1", "--trainer.callbacks.init_args.steps=5"]


def jacobian(model: MLPRegressor, x: torch.Tensor) -> torch.Tensor:
    """``(len(x), P)`` Jacobian of the (single) output, columns in the prior's parameter order."""
    net, names = model.net, model.prior.param_names
    params = {n: p.detach() for n, p in net.named_parameters()}

    def f(p: Dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(net, p, (x,)).squeeze(1)

    jac = jacrev(f)(params)
    return torch.cat([jac[n].reshape(len(x), -1) for n in names], dim=1)


@torch.no_grad()
def linearized_laplace(model: MLPRegressor, x_train: torch.Tensor, x_test: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """Mean and epistemic variance of ``f(x_test)`` under the linearized Laplace posterior.

    Posterior precision ``H = J^T J / sigma^2 + diag(delta)`` (the exact GGN, as ``structure="full"``),
    inverted by Woodbury through the ``N x N`` matrix ``sigma^2 I + J D^-1 J^T``.
    """
    model.eval()
    with torch.enable_grad():
        j_train = jacobian(model, x_train).double()
        j_test = jacobian(model, x_test).double()
    prior_var = model.prior.per_parameter(model.prior.log_precision).double().neg().exp()  # 1 / delta_p
    sigma2 = model.likelihood.sigma.double() ** 2
    kernel = (j_train * prior_var) @ j_train.T + sigma2 * torch.eye(len(x_train), dtype=torch.float64)
    cross = (j_train * prior_var) @ j_test.T  # (N, M)
    chol = torch.linalg.cholesky(kernel)
    reduction = torch.cholesky_solve(cross, chol)
    var = ((j_test * prior_var) * j_test).sum(1) - (cross * reduction).sum(0)
    return model(x_test).squeeze(1), var.clamp(min=0).float()


def gaussian_nll(y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> float:
    return (0.5 * torch.log(2 * math.pi * var) + 0.5 * (y - mean) ** 2 / var).mean().item()


def run(
    config: str = CONFIG,
    overrides: Sequence[str] = (),
    depths: Sequence[int] = (1, 3),
    plot: Optional[str] = None,
    verbose: bool = True,
) -> Dict[str, Any]:
    """Train one network per depth and compare their evidence.

    Returns:
        ``{"rows": [...], "marglik": {depth: final log evidence / N}, "best_depth": depth}``, one row
        per depth with the learned ``sigma``, the prior precisions, errors and seconds.
    """
    rows: List[Dict[str, Any]] = []
    fits = {}
    for depth in depths:
        result = fit(MLPRegressor, ToyRegressionData, config, [*overrides, f"--model.depth={depth}"])
        model, data, callback = result["model"], result["data"], result["callback"]
        mean, var_f = linearized_laplace(model, data.x_train, data.x_test)
        sigma = model.likelihood.sigma.item()
        y_test = data.y_test.squeeze(1)
        x_gap = torch.linspace(-data.gap, data.gap, 101).unsqueeze(1)  # inside the gap
        with torch.no_grad():
            train_rmse = (model(data.x_train) - data.y_train).pow(2).mean().sqrt().item()
            gap_rmse = (model(x_gap) - ToyRegressionData.function(x_gap)).pow(2).mean().sqrt().item()
        rows.append({
            "depth": depth,
            "params": model.prior.n_params,
            "marglik": callback.final_marglik,
            "sigma": sigma,
            "prior_precision": [round(v, 3) for v in model.prior.precision.tolist()],
            "train_rmse": train_rmse,
            "test_rmse": (mean - y_test).pow(2).mean().sqrt().item(),
            "test_nll": gaussian_nll(y_test, mean, var_f + sigma**2),
            "gap_rmse": gap_rmse,
            "epochs": result["trainer"].current_epoch,
            "seconds": result["seconds"],
        })
        fits[depth] = (model, data)
        if verbose:
            print(f"depth {depth}: marglik {callback.final_marglik:.4f}  sigma {sigma:.4f}  "
                  f"({result['seconds']:.1f} s)", flush=True)
    marglik = {r["depth"]: r["marglik"] for r in rows}
    best = max(marglik, key=lambda d: marglik[d])
    if verbose:
        print(markdown_table(rows, ["depth", "params", "marglik", "sigma", "train_rmse", "test_rmse", "test_nll",
                                    "gap_rmse", "epochs", "seconds"]))
        print("prior precisions (layerwise: weight, bias per layer):")
        for r in rows:
            print(f"  depth {r['depth']}: {r['prior_precision']}")
        print(f"evidence prefers depth {best}")
    if plot:
        make_plot(fits, rows, plot)
        if verbose:
            print(f"saved {plot}")
    return {"rows": rows, "marglik": marglik, "best_depth": best}


def make_plot(fits: Dict[int, Any], rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_max = 2 * next(iter(fits.values()))[1].x_max
    x = torch.linspace(-x_max, x_max, 400).unsqueeze(1)
    fig, axes = plt.subplots(1, len(fits), figsize=(5.2 * len(fits), 4), sharey=True, squeeze=False)
    for ax, (depth, (model, data)), row in zip(axes[0], fits.items(), rows):
        mean, var_f = linearized_laplace(model, data.x_train, x)
        sigma = model.likelihood.sigma.item()
        sd_f, sd_y = var_f.sqrt(), (var_f + sigma**2).sqrt()
        xs, m = x.squeeze(1).numpy(), mean.detach().numpy()
        ax.fill_between(xs, m - 2 * sd_y.numpy(), m + 2 * sd_y.numpy(), color="C0", alpha=0.15,
                        label=r"predictive $\pm 2\sqrt{\mathrm{var}_f+\sigma^2}$")
        ax.fill_between(xs, m - 2 * sd_f.numpy(), m + 2 * sd_f.numpy(), color="C0", alpha=0.35,
                        label=r"epistemic $\pm 2\,\mathrm{sd}_f$")
        ax.axvspan(-data.gap, data.gap, color="0.9", zorder=0, label="gap (no training data)")
        ax.plot(xs, m, color="C0", lw=2, label="MAP fit")
        ax.plot(xs, ToyRegressionData.function(x).squeeze(1).numpy(), "k--", lw=1, label=r"$\sin(3x)$")
        ax.scatter(data.x_train.squeeze(1), data.y_train.squeeze(1), s=10, color="k", zorder=3, label="training data")
        ax.set_title(f"{depth} hidden layer{'s' if depth > 1 else ''}: log evidence/N = {row['marglik']:.3f}\n"
                     f"learned $\\sigma$ = {sigma:.3f} (true {data.noise:g})")
        ax.set_xlabel("x")
        ax.set_ylim(-3, 3)
    axes[0][0].set_ylabel("y")
    axes[0][0].legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return script_main(argv, MLPRegressor, ToyRegressionData, CONFIG, PLOT, run, QUICK)


if __name__ == "__main__":
    main()
