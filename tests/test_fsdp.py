"""Real 2-process FSDP on CPU (gloo): the callbacks under Lightning's FSDPStrategy (issue 40).

One worker run (``tests/fsdp_worker.py``, a subprocess: Lightning's launcher re-executes
``sys.argv`` for rank 1) fits every case in one process group and writes each rank's results;
the tests compare them with each other, with DDP and with single-process fits run here on the
same weights and data. Before the fix, every FSDP sharding but NO_SHARD failed at the set-up
check ("mat2 must be a matrix, got 1-D tensor": the module's forward met FSDP's flat shards).
"""
from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from tests import fsdp2_worker, fsdp_worker
from tests.test_ddp import Run

pl = pytest.importorskip("pytorch_lightning")

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)

WORKER = Path(fsdp_worker.__file__)
LOG_DELTA_TOL = 1e-4  # the target; FSDP keeps float32 buffers (Lightning's '32-true' casts them)
SHARDED = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "full_shard_wrapped", "diag_full_shard"]
# torch < 2.14's FSDP1 crashes saving a full state dict of weights on the CPU, where these runs train: refused there
FULL_SAVE_ON_CPU = torch.__version__ >= (2, 14)


class FSDPRun(Run):
    """A worker run: ``tests/fsdp_worker.py all OUT`` (FSDP1) or ``tests/fsdp2_worker.py all OUT`` (FSDP2)."""

    def __init__(self, out: Path, worker: Path = WORKER) -> None:
        super().__init__(["all"], out, worker=worker)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> List[Dict[str, Any]]:
    run = FSDPRun(tmp_path_factory.mktemp("fsdp")).expect_success()
    results = [run.load(f"rank{r}.json") for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    return results


def _single_process(callback_kind: str, n: int) -> Dict[str, Any]:
    """The same callback, model and data in one process (no strategy); for kron also ``evidence_with`` diag."""
    torch.set_num_threads(1)
    module, callback = fsdp_worker.Model(), fsdp_worker.CALLBACKS[callback_kind]()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=[callback], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=fsdp_worker.loader(fsdp_worker.make_data(n)))
    after = {f"evidence_with_{s}": callback.evidence_with(trainer, module, s, "ggn") for s in ("diag", "kron")
             if callback_kind == "kron"}
    return {**fsdp_worker.hyperparameters(module), "history": callback.history, **after}


@pytest.fixture(scope="module")
def single() -> Dict[str, Dict[str, Any]]:
    return {kind: _single_process(kind, n) for kind, n in (("kron", fsdp_worker.N), ("diag", fsdp_worker.N), ("training", 40))}


def _max_diff(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", SHARDED)
def test_learned_log_delta_equals_single_process(ranks, single, name):
    """Under every FSDP sharding (also with an auto_wrap_policy: one FSDP unit per Linear), the learned log
    precisions and noise after two estimates (kron, and diag; 20 steps each, frozen weights) are the single-process ones,
    the evidence per datum too, and both ranks hold bit-identical hyperparameters."""
    a, b = (r["cases"][name] for r in ranks)
    ref = single[fsdp_worker.CASES[name][2]]
    assert a["log_precision"] == b["log_precision"] and a["log_sigma"] == b["log_sigma"]
    assert a["history"] == b["history"]
    assert ref["log_precision"] != [0.0] * len(ref["log_precision"])  # learned: they start at log 1
    assert _max_diff(a["log_precision"], ref["log_precision"]) < LOG_DELTA_TOL
    assert _max_diff(a["log_sigma"], ref["log_sigma"]) < LOG_DELTA_TOL
    assert [h["epoch"] for h in a["history"]] == [h["epoch"] for h in ref["history"]] == [1, 2]
    for got, want in zip(a["history"], ref["history"]):
        assert math.isclose(got["marglik"], want["marglik"], rel_tol=1e-6)
    assert a["n_data"] == fsdp_worker.N  # Lightning padded the training shards to 38; the evidence counts 37
    assert a["warnings"] == []  # rank 0's: e.g. the check that the training loss carries the prior found it
    wrapped = "auto_wrap_policy" in fsdp_worker.CASES[name][1]
    assert a["fsdp_units"] == (4 if wrapped else 1)  # the root and, auto-wrapped, one unit per Linear
    # the prior guard is off under FSDP (any FSDP unit, NO_SHARD too), and says why
    assert a["guard_off"] == "off under a strategy that shards the parameters (its folds' gradients are whole-model vectors)"


def test_weights_stay_sharded_and_unchanged(ranks):
    """The estimates gathered the weights for their passes and left FSDP's shards as they were: lr 0 keeps
    the weights, which a gather after each epoch finds equal to the initial ones (in float32: Lightning's
    FSDP precision '32-true' converts the float64 module)."""
    initial = [p.detach().float().reshape(-1).tolist() for p in fsdp_worker.Model().net.parameters()]
    for rank in ranks:
        for name in SHARDED:
            for epoch in rank["cases"][name]["epochs"]:
                assert epoch["weights"] == initial, (name, epoch["epoch"])


def test_training_statistics_under_fsdp(ranks, single):
    """statistics='training' (the training passes' sums, under FULL_SHARD with one unit per Linear) learns the
    single-process hyperparameters, from the training sums (no fallback to the evidence pass)."""
    a, b = (r["cases"]["training_full_shard"] for r in ranks)
    ref = single["training"]
    assert a["log_precision"] == b["log_precision"]
    assert _max_diff(a["log_precision"], ref["log_precision"]) < LOG_DELTA_TOL
    assert _max_diff(a["log_sigma"], ref["log_sigma"]) < LOG_DELTA_TOL
    assert a["n_data"] == 40
    assert not any("runs the evidence pass instead" in w for w in a["warnings"]), a["warnings"]


def test_bound_callback_under_fsdp_equals_ddp(ranks):
    """MargLikBoundCallback's per-batch steps under FULL_SHARD (auto-wrapped) give DDP's hyperparameters."""
    for rank in ranks:
        fsdp, ddp = rank["cases"]["bound_full_shard"], rank["cases"]["bound_ddp"]
        assert ddp["fsdp_units"] == 0 and fsdp["fsdp_units"] == 4
        assert _max_diff(fsdp["log_precision"], ddp["log_precision"]) < 1e-6
        assert _max_diff(fsdp["log_sigma"], ddp["log_sigma"]) < 1e-6
        for got, want in zip(fsdp["history"], ddp["history"], strict=True):
            assert math.isclose(got["marglik"], want["marglik"], rel_tol=1e-6)
        assert fsdp["log_precision"] != [0.0] * len(fsdp["log_precision"])


@pytest.mark.skipif(not FULL_SAVE_ON_CPU, reason=f"torch {torch.__version__}'s FSDP1 crashes saving a full state dict "
                    "on the CPU (fixed in 2.14): refused at set-up (test_full_state_dict_save_on_the_cpu_refused_before_torch_2_14)")
def test_best_checkpoint_under_fsdp_loads_into_a_plain_module(ranks):
    """MargLikCheckpoint under FULL_SHARD writes the best-evidence epoch (full state dict) and last.ckpt; both
    load into a plain single-process module, with the whole weights and hyperparameters of their epochs."""
    a, b = (r["train"] for r in ranks)
    assert a["best_model_path"] == b["best_model_path"] and a["history"] == b["history"]
    assert a["best_marglik"] == max(h["marglik"] for h in a["history"])
    assert a["best_epoch"] < a["history"][-1]["epoch"] - 1  # the evidence fell after the learning-rate jump
    assert a["stopped_epoch"] == a["best_epoch"] + 1  # MargLikEarlyStopping(patience=1)
    best = Path(a["best_model_path"])
    assert best.is_file() and f"epoch={a['best_epoch']}-" in best.name
    for path, epoch in ((best, a["best_epoch"]), (Path(a["last_model_path"]), a["epochs"][-1]["epoch"])):
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        assert ckpt["epoch"] == epoch
        module = fsdp_worker.Model()
        module.load_state_dict(ckpt["state_dict"])  # strict: every key, whole shapes
        recorded = next(e for e in a["epochs"] if e["epoch"] == epoch)
        assert module.prior.log_precision.tolist() == recorded["log_precision"]
        assert module.likelihood.log_sigma.reshape(-1).tolist() == recorded["log_sigma"]
        assert [p.detach().reshape(-1).tolist() for p in module.net.parameters()] == recorded["weights"]
    state = torch.load(best, map_location="cpu", weights_only=False)["callbacks"]["MargLikCallback"]
    assert state["best_marglik"] == a["best_marglik"]


def _assert_refused(got: Dict[str, Any], names: List[str]) -> None:
    assert got["type"] == "MargLikConfigurationError", got
    for word in names:
        assert word in got["message"], (word, got["message"])


def test_full_state_dict_save_on_the_cpu_refused_before_torch_2_14(ranks):
    """torch < 2.14's FSDP1 crashed the process (a segmentation fault, no Python error) at the first save of a full
    state dict of weights on the CPU, MargLikCheckpoint's best-evidence file: there such a fit is refused at set-up
    on both ranks, before its first epoch, naming the torch version and what works. From torch 2.14 it trains
    (test_best_checkpoint_under_fsdp_loads_into_a_plain_module)."""
    for rank in ranks:
        refused = rank["train"].get("refused")
        if FULL_SAVE_ON_CPU:
            assert refused is None
            continue
        _assert_refused(refused, [f"torch {torch.__version__}'s FSDP", "segmentation fault", "torch>=2.14",
                                  "state_dict_type='sharded'", "strategy='ddp'", "MargLikCheckpoint"])
        assert refused["epochs"] == []


def test_unsupported_sharding_refused_at_setup(ranks, fsdp2_ranks):
    """FSDP's use_orig_params=False, and tensor parallelism through ModelParallelStrategy (its default on one node:
    tensor_parallel_size = the number of devices), are refused at set-up on both ranks, naming the strategy and
    what works instead (not a low-level error inside the evidence pass)."""
    for rank in ranks:
        _assert_refused(rank["refused"]["use_orig_params_false"], ["use_orig_params=False", "default, True"])
    for rank in fsdp2_ranks:
        _assert_refused(rank["refused"], ["ModelParallelStrategy with tensor_parallel_size=2", "tensor_parallel_size=1",
                                          "device_mesh['data_parallel']", "strategy='ddp'", "FSDPStrategy"])


def test_evidence_with_and_fold_batchnorm_after_fsdp_training(ranks, single):
    """After a fit under FULL_SHARD (one unit per Linear), evidence_with (another structure, re-optimised) equals
    the single-process value, and fold_batchnorm's copy holds whole weights (those of the module, in float32)."""
    initial = [p.detach().float().reshape(-1).tolist() for p in fsdp_worker.Model().net.parameters()]
    for rank in ranks:
        got = rank["cases"]["full_shard_wrapped"]
        assert math.isclose(got["evidence_with_diag"], single["kron"]["evidence_with_diag"], rel_tol=1e-6)
        assert got["folded_weights"] == initial


def test_kron_curvature_is_owned_by_layer_across_ranks(ranks, single):
    """Under FSDP each rank holds the Kronecker factors of its own layers only (the largest layers spread over the
    ranks, together every layer once; the non-Kronecker rest replicated); the summed evidence's gradient in every
    log hyperparameter (prior precisions and noise) equals central differences of its value, and the Newton
    re-optimisation on it (evidence_with kron, closed-form derivatives summed across ranks) equals the
    single-process one; its posterior covariance is refused with what to do instead. Before, every rank held every
    layer's factors (benchmarks/results/fsdp.md)."""
    a, b = (r["cases"]["full_shard_wrapped"]["sharded"] for r in ranks)
    assert len(a["held"]) == len(b["held"]) == 1  # the three Linears are all Kronecker layers
    assert a["held"][0] and b["held"][0] and not set(a["held"][0]) & set(b["held"][0])
    assert sorted(a["held"][0] + b["held"][0]) == ["net.0", "net.2", "net.4"]
    for rank in (a, b):
        assert len(rank["grad"]) == 8  # six prior tensors, the noise and the temperature
        for grad, central in zip(rank["grad"], rank["central"], strict=True):
            assert math.isclose(grad, central, rel_tol=1e-5, abs_tol=1e-6), (rank["grad"], rank["central"])
    assert a["grad"] == b["grad"]
    for rank in (a, b):  # the posterior would need every layer: refused, naming what to do
        assert "needs every layer's curvature in one process" in rank["covariance_refused"]
        assert "LaplaceEvidence.fit" in rank["covariance_refused"]
    for rank in ranks:
        got = rank["cases"]["full_shard_wrapped"]["evidence_with_kron"]
        assert math.isclose(got, single["kron"]["evidence_with_kron"], rel_tol=1e-6)


def test_a_failure_on_one_rank_ends_the_sharded_pass_on_both(ranks):
    """Rank 1 alone fails in the sharded evidence pass (at its first batch, before it planned the layers' owners;
    at its second, while rank 0 sends), or before it (building the evidence loader): both ranks raise at once, rank
    1 its own error, rank 0 the same error naming process 1, and both go on in step to the next fit (the worker's
    later fits ran). Without the exchange's agreement rounds rank 0 would wait in a reduction for rank 1 until the
    collective timeout."""
    for name in fsdp_worker.FAILURES:
        r0, r1 = (rank["failures"][name] for rank in ranks)
        assert r1["type"] == "RuntimeError" and "injected failure" in r1["message"], r1
        assert r0["type"] == "RuntimeError" and "injected failure" in r0["message"], r0
        assert r0["message"].endswith("(raised on process 1)"), r0
        for r in (r0, r1):
            assert r["entered"] is not None and r["failed"] - r["entered"] < fsdp_worker.TIMEOUT.total_seconds() / 4


def test_resume_from_a_sharded_last_checkpoint_is_exact(ranks):
    """Under FULL_SHARD with sharded state dicts (each checkpoint a directory of shards), two epochs and then a
    fresh Trainer resumed from last.ckpt for the third end exactly where three epochs straight end: the evidence
    history, the hyperparameters, the whole weights and the best-evidence checkpoint."""
    for rank in ranks:
        straight, first, resumed = (rank["resume"][k] for k in ("straight", "first", "resumed"))
        assert Path(first["last_model_path"]).is_dir()  # sharded: a directory per checkpoint
        assert len(resumed["history"]) == 3 and resumed["history"][:2] == first["history"]
        assert [h["marglik"] for h in resumed["history"]] == [h["marglik"] for h in straight["history"]]
        assert resumed["log_precision"] == straight["log_precision"] != first["log_precision"]
        assert resumed["log_sigma"] == straight["log_sigma"]
        assert resumed["weights"] == straight["weights"]
        assert resumed["best_epoch"] == straight["best_epoch"]
        assert Path(resumed["best_model_path"]).name == Path(straight["best_model_path"]).name


def test_sharded_best_checkpoint_loads_into_a_plain_module(ranks, tmp_path):
    """The sharded best-evidence checkpoint, converted with torch's dcp_to_torch_save, loads into a plain module
    (strict) with the hyperparameters and whole weights of its epoch."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    first = ranks[0]["resume"]["first"]
    assert first["best_epoch"] == 1 == len(first["history"]) - 1  # its last epoch: the values recorded at the end
    path = Path(first["best_model_path"])
    dcp_to_torch_save(path, tmp_path / "best.pt")
    module = fsdp_worker.Model()
    module.load_state_dict(torch.load(tmp_path / "best.pt", weights_only=False)["model"])
    assert module.prior.log_precision.tolist() == first["log_precision"]
    assert [p.detach().reshape(-1).tolist() for p in module.net.parameters()] == first["weights"]
    meta = torch.load(path / "meta.pt", weights_only=False)
    assert meta["epoch"] == 1 and meta["callbacks"]["MargLikCallback"]["best_marglik"] == first["history"][1]["marglik"]


def _check_gradients_freed(results: Dict[str, Any]) -> None:
    default, own = results["default"], results["own_zero_grad"]
    assert default["freed"] == [True, True, True]  # freed before each estimate: not held through its peak
    assert own["freed"] == [False, False, False]  # the module's own optimizer_zero_grad: left to it
    # Lightning frees them before the next backward anyway: the same training to the last bit
    assert default["weights"] == own["weights"]
    assert default["log_precision"] == own["log_precision"] and default["log_sigma"] == own["log_sigma"]


def test_applied_gradients_are_freed_before_an_estimate_and_training_is_unchanged(ranks):
    """Under FULL_SHARD the callback frees the gradients Adam has applied before each estimate (their shards are a
    quarter of the training state, held through the estimate's peak otherwise, benchmarks/results/fsdp.md), and
    leaves them to a module that overrides optimizer_zero_grad; three epochs end with the same weights and
    hyperparameters either way."""
    for rank in ranks:
        _check_gradients_freed(rank["gradients"])


def test_map_loss_trains_as_under_ddp(ranks):
    """map_loss's prior term under FULL_SHARD with one unit per Linear (units reshard during training_step) trains
    the weights DDP trains, to float32 rounding (Lightning's FSDP '32-true' computes in float32), and the prior
    (precision 100) moved them."""
    initial = [x for p in fsdp_worker.Model(seed=3).net.parameters() for x in p.detach().reshape(-1).tolist()]
    for rank in ranks:
        ddp, fsdp = ([x for p in rank["map"][k] for x in p] for k in ("ddp", "fsdp"))
        assert _max_diff(fsdp, ddp) < 1e-6
        assert _max_diff(ddp, initial) > 1e-3


def test_prior_follows_its_parameters_into_wrappers():
    """FSDP's auto_wrap_policy and activation checkpointing wrap layers after the prior was built, which puts
    `_fsdp_wrapped_module.` / `_checkpoint_wrapped_module.` into the parameters' names: the prior still finds its
    tensors, and a prior built on the wrapped network names them as the plain one does."""
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from lightning_marglik import GaussianPrior

    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    prior = GaussianPrior(net)
    plain = list(net.parameters())
    net[0] = checkpoint_wrapper(net[0])
    assert any("_checkpoint_wrapped_module" in n for n, _ in net.named_parameters())
    assert all(a is b for a, b in zip(prior.params, plain, strict=True))
    assert GaussianPrior(net).param_names == prior.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]


# --- FSDP2: fully_shard through ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) -----------------


@pytest.fixture(scope="module")
def fsdp2_ranks(tmp_path_factory) -> List[Dict[str, Any]]:
    run = FSDPRun(tmp_path_factory.mktemp("fsdp2"), worker=Path(fsdp2_worker.__file__)).expect_success()
    results = [run.load(f"rank{r}.json") for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    return results


@pytest.mark.parametrize("name", ["kron", "kron_uneven", "kron_root", "diag", "training"])
def test_fsdp2_learned_log_delta_equals_single_process(fsdp2_ranks, single, name):
    """Under FSDP2 (fully_shard on every Linear and the root, or on the root only), the learned log precisions and
    noise after two estimates (kron, diag, statistics='training'; 20 steps each, frozen weights) are the
    single-process ones, the evidence per datum too; both ranks hold bit-identical hyperparameters, and after each
    estimate FSDP2 holds every weight sharded again (a DTensor), unchanged. Before FSDP2 was supported the set-up
    refused ModelParallelStrategy; without the gather, the estimate met DTensors in the prior's norms; with the
    gather but FSDP2's forward hooks left to act, ranks whose evidence shards take 3 and 2 batches ("kron_uneven")
    timed out in gloo (their all-gathers no longer paired)."""
    a, b = (r["cases"][name] for r in fsdp2_ranks)
    _, kind, n = fsdp2_worker.CASES[name]
    ref = _single_process(kind, n) if n == fsdp2_worker.UNEVEN else single[kind]
    assert a["log_precision"] == b["log_precision"] and a["log_sigma"] == b["log_sigma"] and a["history"] == b["history"]
    assert ref["log_precision"] != [0.0] * len(ref["log_precision"])  # learned: they start at log 1
    assert _max_diff(a["log_precision"], ref["log_precision"]) < LOG_DELTA_TOL
    assert _max_diff(a["log_sigma"], ref["log_sigma"]) < LOG_DELTA_TOL
    assert [h["epoch"] for h in a["history"]] == [h["epoch"] for h in ref["history"]] == [1, 2]
    for got, want in zip(a["history"], ref["history"]):
        assert math.isclose(got["marglik"], want["marglik"], rel_tol=1e-6)
    assert a["n_data"] == n
    assert a["warnings"] == []  # e.g. statistics='training' fell back to the evidence pass, or the prior not in the loss
    initial = [p.detach().reshape(-1).tolist() for p in fsdp_worker.Model().net.parameters()]
    for epoch in a["epochs"]:
        assert epoch["sharded"] and epoch["weights"] == initial, epoch["epoch"]


def test_bound_callback_under_fsdp2_equals_ddp(fsdp2_ranks):
    """MargLikBoundCallback's per-batch steps under FSDP2 give DDP's hyperparameters and bounds."""
    for rank in fsdp2_ranks:
        fsdp, ddp = rank["cases"]["bound"], rank["cases"]["bound_ddp"]
        assert _max_diff(fsdp["log_precision"], ddp["log_precision"]) < 1e-6
        assert _max_diff(fsdp["log_sigma"], ddp["log_sigma"]) < 1e-6
        for got, want in zip(fsdp["history"], ddp["history"], strict=True):
            assert math.isclose(got["marglik"], want["marglik"], rel_tol=1e-6)
        assert fsdp["log_precision"] != [0.0] * len(fsdp["log_precision"])
        assert all(e["sharded"] for e in fsdp["epochs"])


def test_applied_gradients_are_freed_under_fsdp2_and_training_is_unchanged(fsdp2_ranks):
    """As under FULL_SHARD: freed before each estimate, left to a module's own optimizer_zero_grad, the same
    training either way."""
    for rank in fsdp2_ranks:
        _check_gradients_freed(rank["gradients"])


@pytest.mark.parametrize("name", list(fsdp2_worker.GRAD_CASES))
def test_map_loss_under_fsdp2_equals_single_process(fsdp2_ranks, name):
    """map_loss under FSDP2 on one batch (the same on both ranks): its value and the whole gradient (FSDP2's reduced
    shards, gathered) are the single-process ones, with the weights sharded DTensors in the prior's term (fully_shard
    on every Linear: the layers reshard after their forward; a diagonal prior reads each whole tensor) or whole
    (fully_shard on the root only). The prior (precision 100) moves the gradient far more than the tolerance.
    Before the fix, the DTensors' norms failed ('got mixed torch.Tensor and DTensor'); a one-output last layer
    leaves rank 1 an empty shard of its weight and bias (`_empty_shard`: FSDP2's gradient reduction failed on the
    shape DTensor's own reduction gave back)."""
    from lightning_marglik import GaussianPrior, map_loss

    per_layer, structure, outputs = fsdp2_worker.GRAD_CASES[name]
    torch.set_default_dtype(torch.float32)  # as in the worker: float32 hyperparameter buffers (the fixture restores it)
    module = fsdp2_worker.narrowed(fsdp_worker.Model(seed=3), outputs)
    x, y = fsdp2_worker.grad_data(outputs)
    grads = {}
    for precision in (fsdp2_worker.GRAD_PRECISION, 1e-8):
        module.zero_grad()
        prior = GaussianPrior(module.net, precision=precision, structure=structure)
        loss = map_loss(module(x), y, module.likelihood, prior, n_data=fsdp2_worker.GRAD_N)
        loss.backward()
        grads[precision] = [g for p in module.net.parameters() for g in p.grad.reshape(-1).tolist()]
        if precision == fsdp2_worker.GRAD_PRECISION:
            want_loss = loss.item()
    want = grads[fsdp2_worker.GRAD_PRECISION]
    assert _max_diff(want, grads[1e-8]) > 1e-2  # the prior's share of the gradient
    for rank in fsdp2_ranks:
        got = rank["grad"][name]
        assert math.isclose(got["loss"], want_loss, rel_tol=1e-12)
        assert _max_diff([g for p in got["grads"] for g in p], want) < 1e-12


def _consolidated(path: Path, tmp_path: Path) -> Dict[str, Any]:
    """A distributed checkpoint (a directory) as one file, by Lightning's converter (Fabric's ``consolidate``; that
    of ``pytorch_lightning.utilities`` expects FSDPStrategy's "model" key and fails on ModelParallelStrategy's)."""
    out = tmp_path / f"{path.name}.consolidated"
    subprocess.run([sys.executable, "-m", "lightning_fabric.utilities.consolidate_checkpoint", str(path),
                    "--output_file", str(out)], check=True, capture_output=True, timeout=300)
    return torch.load(out, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("kind", ["full", "distributed"])
def test_best_checkpoint_under_fsdp2_loads_into_a_plain_module(fsdp2_ranks, kind, tmp_path):
    """MargLikCheckpoint under FSDP2 writes the best-evidence epoch and last.ckpt, as one file
    (save_distributed_checkpoint=False) or as a directory of shards (True, converted with Lightning's consolidate);
    both load (strict) into a plain single-process module, with the whole weights and hyperparameters of their
    epochs and the callback's best evidence."""
    a, b = (r["train"][kind] for r in fsdp2_ranks)
    assert a["best_model_path"] == b["best_model_path"] and a["history"] == b["history"]
    assert a["best_marglik"] == max(h["marglik"] for h in a["history"])
    assert a["best_epoch"] < a["history"][-1]["epoch"] - 1  # the evidence fell after the learning-rate jump
    assert a["stopped_epoch"] == a["best_epoch"] + 1  # MargLikEarlyStopping(patience=1)
    best = Path(a["best_model_path"])
    assert f"epoch={a['best_epoch']}-" in best.name and (best.is_dir() if kind == "distributed" else best.is_file())
    for path, epoch in ((best, a["best_epoch"]), (Path(a["last_model_path"]), a["epochs"][-1]["epoch"])):
        ckpt = _consolidated(path, tmp_path) if kind == "distributed" else torch.load(path, weights_only=False)
        assert ckpt["epoch"] == epoch
        module = fsdp_worker.Model()
        module.load_state_dict(ckpt["state_dict"])  # strict: every key, whole shapes
        recorded = next(e for e in a["epochs"] if e["epoch"] == epoch)
        assert module.prior.log_precision.tolist() == recorded["log_precision"]
        assert module.likelihood.log_sigma.reshape(-1).tolist() == recorded["log_sigma"]
        assert [p.detach().reshape(-1).tolist() for p in module.net.parameters()] == recorded["weights"]
        if path == best:
            assert ckpt["callbacks"]["MargLikCallback"]["best_marglik"] == a["best_marglik"]


def test_evidence_with_after_fsdp2_training_and_fold_batchnorm_refused(fsdp2_ranks, single):
    """After a fit under FSDP2, evidence_with (another structure, re-optimised) equals the single-process value and
    leaves the weights sharded; fold_batchnorm, whose copy FSDP2's modules refuse ("FSDP does not support deepcopy"),
    is refused naming what works instead."""
    for rank in fsdp2_ranks:
        got = rank["cases"]["kron"]
        assert math.isclose(got["evidence_with_diag"], single["kron"]["evidence_with_diag"], rel_tol=1e-6)
        assert got["sharded_after"]
        _assert_refused(got["fold_refused"], ["fold_batchnorm", "FSDP2", "deepcopy", "lightning_marglik.folding"])


def test_resume_under_fsdp2_is_exact(fsdp2_ranks):
    """Under FSDP2 with Lightning's distributed checkpoints (a directory each), two epochs and then a fresh Trainer
    resumed from last.ckpt for the third end exactly where three epochs straight end: the evidence history, the
    hyperparameters, the whole weights and the best-evidence checkpoint."""
    for rank in fsdp2_ranks:
        straight, first, resumed = (rank["resume"][k] for k in ("straight", "first", "resumed"))
        assert Path(first["last_model_path"]).is_dir()
        assert len(resumed["history"]) == 3 and resumed["history"][:2] == first["history"]
        assert [h["marglik"] for h in resumed["history"]] == [h["marglik"] for h in straight["history"]]
        assert resumed["log_precision"] == straight["log_precision"] != first["log_precision"]
        assert resumed["log_sigma"] == straight["log_sigma"]
        assert resumed["weights"] == straight["weights"] != first["weights"]
        assert resumed["best_epoch"] == straight["best_epoch"]
        assert Path(resumed["best_model_path"]).name == Path(straight["best_model_path"]).name
