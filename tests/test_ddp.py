"""Real 2-process DDP on CPU (gloo): the evidence, the hyperparameters and the callbacks.

Lightning's ``ddp`` launcher re-executes ``sys.argv``, so each DDP run is a subprocess running
``tests/ddp_worker.py`` (two runs: ``ddp`` with every check in one process group, and
``ddp_spawn``; each started once per module and only if a selected test needs it); every rank
writes its results as JSON and the tests here compare them, with each other and with
single-process references computed in this process from the same weights and data. The collectives time out after 60 s (not the default 30 min), so a desynchronised run
fails instead of hanging the suite.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import LaplaceEvidence
from tests import ddp_worker

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ddp_worker.py"
RUN_TIMEOUT = 420  # a whole worker run, imports of 2-3 processes included, on a loaded 2-core machine
COLLECTIVE_TIMEOUT = ddp_worker.TIMEOUT.total_seconds()
REL_TOL = 1e-9  # float64 throughout; the reduction only reorders sums

# variables that would make the worker think it already runs inside a launched job
_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "PL_GLOBAL_SEED", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE")

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)


class Run:
    """One finished worker run (``worker MODE OUT ARGS...``): return code, wall time, output and the per-rank JSON
    files."""

    def __init__(self, args: List[str], out: Path, package: str = "pytorch_lightning", worker: Path = WORKER) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("SLURM_")}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DDP_WORKER_PACKAGE=package)
        start = time.time()
        proc = subprocess.run(
            [sys.executable, str(worker), args[0], str(out), *args[1:]],
            cwd=str(HERE.parent),
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
        self.ended = time.time()
        self.seconds = self.ended - start
        self.returncode = proc.returncode
        self.output = proc.stdout + proc.stderr
        self.out = out

    def load(self, name: str) -> Dict[str, Any]:
        path = self.out / name
        assert path.exists(), f"{name} missing (return code {self.returncode}); output tail:\n{self.output[-6000:]}"
        return json.loads(path.read_text())

    def expect_success(self) -> "Run":
        assert self.returncode == 0, f"worker failed ({self.returncode}); output tail:\n{self.output[-6000:]}"
        return self


@pytest.fixture(scope="module")
def popen_run(tmp_path_factory) -> Run:
    """``ddp`` (popen), one process group: every evidence case, the short training run, then the
    error cases (the last one ends the run with an error, by design)."""
    return Run(["popen"], tmp_path_factory.mktemp("ddp_popen"))


@pytest.fixture(scope="module")
def popen_ranks(popen_run) -> List[Dict[str, Any]]:
    ranks = [popen_run.load(f"popen-rank{r}.json") for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1]
    return ranks


@pytest.fixture(scope="module")
def lightning_train_ranks(tmp_path_factory) -> List[Dict[str, Any]]:
    """The training run alone, with ``lightning.pytorch`` and ``lightning_marglik.lightning``."""
    pytest.importorskip("lightning.pytorch", reason="the `lightning` package is not installed")
    run = Run(["train"], tmp_path_factory.mktemp("ddp_lightning"), package="lightning").expect_success()
    return [run.load(f"train-rank{r}.json")["train"] for r in range(2)]


@pytest.fixture(params=["pytorch_lightning", "lightning"])
def train_ranks(request) -> List[Dict[str, Any]]:
    """Both ranks' results of the training run (MargLikCheckpoint, MargLikEarlyStopping), per Lightning package."""
    if request.param == "lightning":
        return request.getfixturevalue("lightning_train_ranks")
    return [r["train"] for r in request.getfixturevalue("popen_ranks")]


@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory) -> Run:
    return Run(["spawn"], tmp_path_factory.mktemp("ddp_spawn")).expect_success()


# --------------------------------------------------------------------------------------------
# evidence: 2 ranks == 1 process
# --------------------------------------------------------------------------------------------


def _reference(run: Run, name: str):
    """Single-process evidence on the saved initial weights and the whole data set."""
    _, _, structure, approx, _, _ = ddp_worker.CASES[name]
    case = torch.load(run.out / f"case-{name}.pt", weights_only=True)
    module, _ = ddp_worker.make_case(name)
    module.load_state_dict(case["state_dict"])
    data = DataLoader(TensorDataset(case["x"], case["y"]), batch_size=10)  # batches unlike either rank's
    evidence = LaplaceEvidence.fit(module, data, module.likelihood, module.prior, structure, approx)
    return module, case, evidence


def _close(a: float, b: float, rel: float = REL_TOL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


@pytest.mark.parametrize("name", list(ddp_worker.CASES))
def test_evidence_under_ddp_equals_single_process(popen_run, popen_ranks, name):
    """MargLikCallback.estimate on 2 ranks (N=37, odd; shuffled training loader with drop_last,
    which Lightning pads with a DistributedSampler) gives the single-process evidence."""
    module, case, ref = _reference(popen_run, name)
    n = case["x"].shape[0]
    assert n == ddp_worker.N_EVIDENCE and n % 2 == 1
    expected = {
        "log_marglik": ref.log_marglik().item(),
        "log_likelihood": ref.log_likelihood().item(),
        "log_prior": ref.log_prior().item(),
        "log_det": ref.log_det().item(),
    }
    per_rank = [r["evidence"][name] for r in popen_ranks]
    for rank, got in enumerate(per_rank):
        assert got["world_size"] == 2
        assert got["n_data"] == n == ref.n_data
        assert got["counted_at_setup"] == n  # map_loss's N: the shards' counts summed at set-up
        for key, value in expected.items():
            assert _close(got[key], value), f"rank {rank} {key}: {got[key]!r} != single-process {value!r}"
        # every summed statistic of the likelihood too: for a classifier the confidence and the correct count that
        # predict's default compares, over both ranks' shards without the sampler's padding
        statistics = {k: v.item() for k, v in ref.likelihood_statistics.items()}
        assert got["likelihood_statistics"].keys() == statistics.keys()
        assert all(_close(got["likelihood_statistics"][k], v) for k, v in statistics.items()), (statistics, got)
        assert got["estimations"] == 1
        assert _close(got["last_marglik"], expected["log_marglik"] / n)
        assert got["logged_marglik"] == got["last_marglik"]
        # the weights did not move (lr 0), so the reference is at the very same point
        initial = [p.reshape(-1).tolist() for p in module.net.parameters()]
        assert got["epoch"]["weights"] == initial
        assert got["epoch"]["dtype"] == "torch.float64"
    # every rank reduced to the very same statistics
    for key in ("log_marglik", "log_det", "last_marglik", "logged_marglik"):
        assert per_rank[0][key] == per_rank[1][key], key


def test_the_prior_guard_under_ddp_scores_both_ranks_folds_as_one_process_scores_them(popen_run, popen_ranks):
    """The guard's approximate cross-validation on 2 ranks equals one process's over both ranks' evidence batches
    (a fold is the same piece of every batch, wherever the batch is), and both ranks decide alike."""
    from lightning_marglik.distributed import evidence_loader
    from lightning_marglik.guard import approximate_cv

    name = ddp_worker.GUARD_CASE
    module, case, _ = _reference(popen_run, name)
    dataset = TensorDataset(case["x"], case["y"])
    batches = [b for rank in range(2) for b in evidence_loader(ddp_worker.train_loader(dataset), rank, 2)]
    evidence = LaplaceEvidence.fit(module, batches, module.likelihood, module.prior, "kron", "ggn")
    learned = torch.tensor(popen_ranks[0]["guard"]["after_first"]["log_precision"], dtype=torch.float64)
    decoupled = [i for i, n in enumerate(module.prior.param_names) if n.endswith("bias")]  # biases (and the held head)
    learned[decoupled] = 0.0
    learned[-2:] = 0.0  # the output layer held at the declared precision
    expected = approximate_cv(evidence, module, batches, {"learned": learned, "declared": torch.zeros_like(learned)})
    first = [r["guard"]["decisions"][0] for r in popen_ranks]
    assert first[0] == first[1] and first[0]["epoch"] == 1
    for key in ("learned", "declared"):
        assert _close(first[0][key], expected[key]), f"{key}: {first[0][key]!r} != single-process {expected[key]!r}"
    assert first[0]["applied"] == ("learned" if expected["learned"] >= expected["declared"] else "declared")


def test_training_loader_pads_and_drops_but_the_evidence_does_not(popen_ranks):
    """The premise of the test above: Lightning's training loader repeated an example (37 -> 38)
    and each rank trained on 16 examples (drop_last), yet every evidence counted N=37."""
    for ranks_result in popen_ranks:
        for name, got in ranks_result["evidence"].items():
            assert got["epoch"]["sampler"] == "DistributedSampler", name
            assert got["epoch"]["sampler_total_size"] == 38, name
            assert got["epoch"]["seen"] == 16, name  # 19 per rank, batches of 8, last dropped
            assert got["n_data"] == 37, name


@pytest.mark.parametrize(
    "name, regime",
    [("full-woodbury", "woodbury"), ("full-woodbury-loader", "woodbury"), ("full-gram", "gram"),
     ("full-mixed", "gram"), ("full-ggn-classification", "gram")],
)
def test_full_structure_regimes(popen_ranks, name, regime):
    """Rows gathered across ranks (determinant lemma) when N*k < P, Gram matrices otherwise, also
    when only one rank switched to its Gram matrix during its own pass ("full-mixed")."""
    sizes, _, _, approx, _, _ = ddp_worker.CASES[name]
    n_params = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    if name == "full-mixed":  # EF: one row per example; 19 (rank 0) >= P = 19 > 18 (rank 1)
        assert approx == "ef" and n_params == 19
    for ranks_result in popen_ranks:
        assert ranks_result["evidence"][name]["regime"] == regime


def test_one_collective_reduces_every_statistic(popen_ranks):
    """Issue 9: all declared sum statistics travel in ONE flattened all-reduce per estimate; the
    full structure adds one all-reduce of its Gram matrix, or gathers its rows (lengths, rows)."""
    for ranks_result in popen_ranks:
        for name, got in ranks_result["evidence"].items():
            calls = got["collectives"]
            assert calls[0].startswith("reduce:"), (name, calls)
            structure = ddp_worker.CASES[name][2]
            if structure != "full":
                assert len(calls) == 1, (name, calls)
            elif got["regime"] == "gram":
                assert [c.split(":")[0] for c in calls] == ["reduce", "reduce"], (name, calls)
            else:
                assert [c.split(":")[0] for c in calls] == ["reduce", "all_gather", "all_gather"], (name, calls)


@pytest.mark.parametrize("name", list(ddp_worker.SAMPLER_CASES))
def test_evidence_under_ddp_covers_the_samplers_subset(popen_run, popen_ranks, name):
    """The training loader samples 15 of the 37 examples (SubsetRandomSampler): whether Lightning
    wrapped it in a padding DistributedSamplerWrapper or every rank kept it, the evidence is the
    single-process evidence over those 15 examples."""
    module, case, _ = _reference(popen_run, ddp_worker.SAMPLER_MODEL)
    subset = ddp_worker.SAMPLER_SUBSET
    data = DataLoader(TensorDataset(case["x"][subset], case["y"][subset]), batch_size=10)
    _, _, structure, approx, _, _ = ddp_worker.CASES[ddp_worker.SAMPLER_MODEL]
    ref = LaplaceEvidence.fit(module, data, module.likelihood, module.prior, structure, approx)
    wrapped = ddp_worker.SAMPLER_CASES[name]
    for ranks_result in popen_ranks:
        got = ranks_result["samplers"][name]
        assert got["epoch"]["sampler"] == ("DistributedSamplerWrapper" if wrapped else "SubsetRandomSampler")
        if wrapped:
            assert got["epoch"]["sampler_total_size"] == 16  # Lightning padded the training shards
        assert got["n_data"] == len(subset) == 15
        assert _close(got["log_marglik"], ref.log_marglik().item())


def test_evidence_under_ddp_covers_every_ranks_own_shard(popen_run, popen_ranks):
    """use_distributed_sampler=False, each rank given its own half of the 37 examples: the evidence split each half
    again and covered 19 of them, silently. It now takes each rank's data whole: the single-process evidence."""
    module, case, _ = _reference(popen_run, ddp_worker.SAMPLER_MODEL)
    _, _, structure, approx, _, _ = ddp_worker.CASES[ddp_worker.SAMPLER_MODEL]
    data = DataLoader(TensorDataset(case["x"], case["y"]), batch_size=10)
    ref = LaplaceEvidence.fit(module, data, module.likelihood, module.prior, structure, approx)
    for ranks_result in popen_ranks:
        got = ranks_result["samplers"][ddp_worker.OWN_SHARDS]
        assert got["n_data"] == ddp_worker.N_EVIDENCE
        assert _close(got["log_marglik"], ref.log_marglik().item())


# --------------------------------------------------------------------------------------------
# training: hyperparameters, checkpoint, early stopping
# --------------------------------------------------------------------------------------------


def test_hyperparameters_bit_identical_across_ranks(popen_ranks):
    a, b = (r["train"] for r in popen_ranks)
    assert a["buffers"] == b["buffers"]  # exact: .tolist() of float64 buffers
    assert a["weights"] == b["weights"]
    assert len(a["epochs"]) == len(b["epochs"]) >= 3
    for ea, eb in zip(a["epochs"], b["epochs"]):
        assert ea["buffers"] == eb["buffers"], ea["epoch"]
        assert ea["marglik"] == eb["marglik"], ea["epoch"]  # `marglik` as logged on each rank
    assert a["history"] == b["history"]
    assert a["estimations"] == len(a["epochs"])  # F = 1: every epoch
    assert [e["marglik"] for e in a["epochs"]] == [h["marglik"] for h in a["history"]]
    # the hyperparameters were learned (all precisions start at 1, sigma at 0.8), but the output layer's (the last
    # two tensors), held at the declared precision by default
    assert all(v != 0.0 for v in a["buffers"]["log_precision"][:-2]) and a["buffers"]["log_precision"][-2:] == [0.0, 0.0]
    assert a["buffers"]["log_sigma"] != math.log(0.8)


def test_checkpoint_holds_the_best_evidence_epoch(train_ranks):
    a, b = train_ranks
    assert a["trainer_checkpoint_is_ours"] and a["trainer_early_stopping_is_ours"]  # the Trainer's own, either package
    assert a["best_model_path"] == b["best_model_path"] != ""
    assert a["best_marglik"] == b["best_marglik"] and a["best_epoch"] == b["best_epoch"]
    path = Path(a["best_model_path"])
    assert path.exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # save_top_k=1
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    # the best epoch is not the last one (the evidence fell after the learning-rate jump)
    assert a["best_epoch"] < a["epochs"][-1]["epoch"]
    assert ckpt["epoch"] == a["best_epoch"]
    assert f"epoch={a['best_epoch']}-" in path.name
    state = ckpt["callbacks"]["MargLikCallback"]
    assert state["last_marglik"] == state["best_marglik"] == a["best_marglik"]
    assert a["best_model_score"] == a["best_marglik"]
    assert a["best_marglik"] == max(h["marglik"] for h in a["history"])
    # the stored hyperparameters and weights are those of the best epoch (after its update)
    best = next(e for e in a["epochs"] if e["epoch"] == a["best_epoch"])
    sd = ckpt["state_dict"]
    assert sd["prior.log_precision"].tolist() == best["buffers"]["log_precision"]
    assert sd["likelihood.log_sigma"].tolist() == best["buffers"]["log_sigma"]
    flat = [sd[k].reshape(-1).tolist() for k in sd if k.startswith("net.")]
    assert flat == best["weights"]


def test_denormals_flushed_on_every_rank_for_the_fit_then_restored(train_ranks):
    for rank in train_ranks:
        assert [e["flushing"] for e in rank["epochs"]] == [True] * len(rank["epochs"])
        assert rank["flushing_after"] is False  # the worker's own setting: torch's default


def test_early_stopping_stops_both_ranks_in_the_same_epoch(train_ranks):
    a, b = train_ranks
    assert a["should_stop"] and b["should_stop"]
    assert a["stopped_epoch"] == b["stopped_epoch"] == a["best_epoch"] + 1  # patience 1
    assert a["current_epoch"] == b["current_epoch"] == a["stopped_epoch"] + 1 < a["max_epochs"]
    assert a["epochs"][-1]["epoch"] == b["epochs"][-1]["epoch"] == a["stopped_epoch"]


# --------------------------------------------------------------------------------------------
# ddp_spawn
# --------------------------------------------------------------------------------------------


def test_ddp_spawn_runs_and_returns_weights_and_buffers_but_no_callback_state(spawn_run):
    r0, r1 = (spawn_run.load(f"spawn-rank{r}.json") for r in range(2))
    main = spawn_run.load("spawn-main.json")
    assert len({r0["pid"], r1["pid"], main["pid"]}) == 3  # two spawned ranks besides the main process
    # the ranks agree
    assert r0["buffers"] == r1["buffers"] and r0["weights"] == r1["weights"]
    assert r0["history"] == r1["history"] and r0["estimations"] == 2
    # Lightning sends rank 0's state_dict back: weights AND hyperparameter buffers arrive
    assert main["buffers"] == r0["buffers"] != main["buffers_before"]
    assert main["weights"] == r0["weights"]
    # ... and the callback metrics (as logged, float32) and the checkpoint path
    assert main["logged_marglik"] == pytest.approx(r0["history"][-1]["marglik"], rel=1e-6)
    assert "marglik" in main["callback_metrics"] and "sigma" in main["callback_metrics"]
    assert main["best_model_path"] and Path(main["best_model_path"]).exists()
    # ... but not the callback's own state: read `trainer.callback_metrics` or the checkpoint
    assert main["history"] == [] and main["estimations"] == 0 and main["best_marglik"] == -math.inf


# --------------------------------------------------------------------------------------------
# an error on one rank
# --------------------------------------------------------------------------------------------


def test_error_on_one_rank_raises_on_every_rank_without_hanging(popen_run):
    """Rank 1 alone fails in the set-up check or inside the evidence pass; both ranks raise at
    once (rank 0 rank 1's error, naming its process), every time but the last both continue in
    step to the next fit, the last time both processes exit with an error, long before the 60 s
    collective timeout."""
    assert popen_run.returncode != 0
    own = {
        "error-setup": ("MargLikConfigurationError", "(inputs, targets) pair"),
        "error-batch": ("TypeError", "(inputs, targets) pair"),
        "error-collect": ("RuntimeError", "injected failure"),
    }
    assert list(own) == ddp_worker.ERROR_CASES
    failed = []
    for case, (kind, text) in own.items():
        r0, r1 = (popen_run.load(f"{case}-rank{r}.json") for r in range(2))
        assert r1["type"] == kind and text in r1["message"], r1
        assert r0["type"] == kind and text in r0["message"] and "(raised on process 1)" in r0["message"], r0
        for r in (r0, r1):
            assert r["epoch"] == 0  # at set-up, or the first estimate
            assert r["flushing_after"] is False  # the denormal mode restored after the failed fit
            if case == "error-setup":
                assert r["entered"] is None  # before the first epoch ended
            else:
                assert r["failed"] - r["entered"] < COLLECTIVE_TIMEOUT / 4, r
        failed.append(max(r0["failed"], r1["failed"]))
    assert popen_run.ended - failed[-1] < COLLECTIVE_TIMEOUT / 2  # both processes gone soon after
    assert "(raised on process 1)" in popen_run.output and "injected failure" in popen_run.output


# --------------------------------------------------------------------------------------------
# evidence_loader (single process): the unpadded shards the DDP runs above rely on
# --------------------------------------------------------------------------------------------


def _indexed(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float64).unsqueeze(1), torch.arange(n))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_evidence_loader_shards_cover_every_example_once(world_size):
    from lightning_marglik.distributed import evidence_loader

    train = DataLoader(_indexed(37), batch_size=8, shuffle=True, drop_last=True)
    seen = []
    for rank in range(world_size):
        batches = list(evidence_loader(train, rank, world_size))
        ids = torch.cat([y for _, y in batches]).tolist()
        assert ids == list(range(rank, 37, world_size))  # in order, nothing dropped or repeated
        assert all(len(y) == 8 for _, y in batches[:-1])
        seen += ids
    assert sorted(seen) == list(range(37))


def test_evidence_loader_keeps_batching_and_worker_setup():
    from torch.utils.data import BatchSampler, SequentialSampler

    from lightning_marglik.distributed import evidence_loader

    data = _indexed(10)

    def collate(items):
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    def init(worker_id):
        pass

    loader = evidence_loader(DataLoader(data, batch_size=4, collate_fn=collate, num_workers=1, worker_init_fn=init), 1, 2)
    assert loader.batch_size == 4 and loader.collate_fn is collate and loader.worker_init_fn is init
    # a custom batch sampler: its batch size
    custom = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), batch_size=3, drop_last=True))
    assert [len(y) for _, y in evidence_loader(custom, 0, 2)] == [3, 2]
    # no automatic batching: the items already are batches and stay whole
    batches = [(torch.randn(5, 1), torch.arange(5)) for _ in range(3)]
    prebatched = DataLoader(batches, batch_size=None)
    got = list(evidence_loader(prebatched, 0, 2))
    assert [tuple(x.shape) for x, _ in got] == [(5, 1), (5, 1)]  # items 0 and 2


def test_evidence_loader_refuses_what_it_cannot_shard():
    from torch.utils.data import IterableDataset

    from lightning_marglik.distributed import evidence_loader

    class Stream(IterableDataset):
        def __iter__(self):
            yield from zip(torch.randn(4, 1), torch.randn(4, 1))

    stream = DataLoader(Stream(), batch_size=2)
    assert [len(x) for x, _ in evidence_loader(stream, 0, 1, max_batches=1)] == [2]  # one training epoch's batches
    with pytest.raises(ValueError, match="without a length.*limit_train_batches"):
        evidence_loader(stream, 0, 1)  # no length, no limit: it might never end
    with pytest.raises(ValueError, match="IterableDataset"):
        evidence_loader(stream, 0, 2, max_batches=1)
    with pytest.raises(ValueError, match="fewer than the 4 processes"):
        evidence_loader(DataLoader(_indexed(3)), 0, 4)
