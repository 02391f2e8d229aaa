"""Reliability of the callbacks in a real Trainer (issue 8, and issue 11 item 5).

* The evidence covers exactly the examples one training epoch draws (the sampler's index set),
  and refuses samplers that draw another distribution.
* MargLikCheckpoint never keeps non-finite weights or a non-finite evidence.
* Every fit starts afresh; a resumed fit restores; a changed set of learnable hyperparameters
  restarts the Adam state with a warning; load_state_dict tolerates missing keys.
* The final estimate in on_train_end updates best_marglik and callback_metrics.
* An endless stream is read for one training epoch's batches, or refused at set-up.
* Set-up mistakes fail before the first training step, with a message naming the fix.
* Progress of the evidence pass; early stopping says when and why.
"""
from __future__ import annotations

import itertools
import logging
import math
from typing import Iterator, List

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.callbacks import Callback
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from lightning_marglik import GaussianLikelihood, GaussianPrior, LaplaceEvidence, MargLikCallback, MargLikCheckpoint
from lightning_marglik import MargLikEarlyStopping, map_loss
from lightning_marglik.distributed import evidence_loader
from tests.lightning_models import Regressor, loader, regression_data, trainer
from tests.lightning_models import Classifier, blobs

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*", "ignore:.*LeafSpec.*", "ignore:.*no `val_dataloader`.*",
    "ignore:.*exists and is not empty.*",
)


def _fit(callbacks, max_epochs, model=None, data=None, ckpt_path=None, **kwargs):
    pl.seed_everything(0, verbose=False)
    model = model or Regressor()
    t = trainer(callbacks, max_epochs, **kwargs)
    t.fit(model, data if data is not None else loader(regression_data()), ckpt_path=ckpt_path)
    return model, t


def _quick(**kwargs) -> MargLikCallback:
    options = dict(structure="diag", approx="ef", steps=5, settle=None, frequency=1)  # an estimate every epoch
    options.update(kwargs)
    return MargLikCallback(**options)


def _reference(model, data) -> LaplaceEvidence:
    return LaplaceEvidence.fit(model, DataLoader(data, batch_size=64), model.likelihood, model.prior, "diag", "ef")


# --- 1: the examples one training epoch draws ----------------------------------------------------


class FixedIndices(Sampler):
    """A custom sampler: a fixed list of keys in a random order per epoch."""

    def __init__(self, indices: List[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter([self.indices[i] for i in torch.randperm(len(self.indices))])

    def __len__(self) -> int:
        return len(self.indices)


@pytest.mark.parametrize("sampler", ["subset_random", "custom"])
def test_evidence_covers_the_sampled_examples_only(sampler):
    data = regression_data(64)
    half = list(range(0, 64, 2))
    chosen = SubsetRandomSampler(half) if sampler == "subset_random" else FixedIndices(half[::-1])
    cb = _quick(steps=0)
    model, _ = _fit([cb], 1, model=Regressor(n_data=32, lr=0.0), data=DataLoader(data, batch_size=8, sampler=chosen))
    assert cb.evidence.n_data == 32  # not the 64 of the data set
    expected = _reference(model, Subset(data, half))
    assert cb.last_marglik == pytest.approx(expected.log_marglik().item() / 32, rel=1e-9)


@pytest.mark.parametrize(
    "sampler,match",
    [
        (lambda d: WeightedRandomSampler(torch.ones(len(d)), len(d)), "WeightedRandomSampler.*by weight"),
        (lambda d: RandomSampler(d, replacement=True), r"RandomSampler\(replacement=True\)"),
        (lambda d: RandomSampler(d, num_samples=20), r"RandomSampler\(num_samples=20\).*random part"),
        (lambda d: FixedIndices([0, 1, 2, 1]), "FixedIndices draws example 1 more than once"),
    ],
    ids=["weighted", "replacement", "num_samples", "repeats"],
)
def test_sampler_of_another_distribution_refused_before_training(sampler, match):
    data = regression_data(64)
    model = Regressor()
    with pytest.raises(MisconfigurationException, match=match + ".*`dataloader=`"):
        _fit([_quick()], 2, model=model, data=DataLoader(data, batch_size=8, sampler=sampler(data)))
    assert model.train_modes == []  # refused at set-up, before the first training step


@pytest.mark.parametrize("world_size", [2, 3])
def test_evidence_loader_shards_the_wrapped_sampler_unpadded(world_size):
    """Under DDP Lightning wraps a custom sampler in a DistributedSamplerWrapper (padding its
    shards); the evidence shards the user's sampler's index set, each example on one rank."""
    data = TensorDataset(torch.arange(40.0).unsqueeze(1), torch.arange(40))
    subset = [3, 7, 8, 12, 20, 21, 30, 31, 33, 38, 39]
    seen = []
    for rank in range(world_size):
        wrapped = DistributedSamplerWrapper(SubsetRandomSampler(subset), num_replicas=world_size, rank=rank)
        batches = evidence_loader(DataLoader(data, batch_size=4, sampler=wrapped), rank, world_size)
        seen += torch.cat([y for _, y in batches]).tolist()
    assert sorted(seen) == subset  # every example once: no padding, nothing outside the subset


# --- 3: no checkpoint of non-finite weights or evidence ----------------------------------------


def test_checkpoint_never_saves_non_finite_evidence_or_weights(tmp_path):
    data = regression_data(64)
    data.tensors[0][50] = float("nan")  # NaN input after the set-up batch: the weights are NaN from step 4
    ck = MargLikCheckpoint(dirpath=tmp_path, save_top_k=1, save_last=True)
    with pytest.warns(UserWarning, match="not finite"):
        _fit([_quick(), ck], 2, data=loader(data))
    assert ck.best_model_path == "" and ck.best_model_score is None
    assert list(tmp_path.iterdir()) == []  # no best and no last.ckpt


class PoisonWeights(Callback):
    """Sets the weights to NaN at the start of epoch ``epoch`` (from 0)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            with torch.no_grad():
                pl_module.net[0].weight.fill_(float("nan"))


def test_checkpoint_keeps_the_last_finite_estimate(tmp_path):
    # room in the top 3 for a non-finite epoch: Lightning would keep it (as score -inf) and link last.ckpt to it
    ck = MargLikCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=3, save_last=True)
    cb = _quick()
    with pytest.warns(UserWarning, match="not finite"):
        _fit([PoisonWeights(2), cb, ck], 4)
    assert [math.isfinite(h["marglik"]) for h in cb.history] == [True, True, False, False]
    assert ck.best_model_path.endswith(f"epoch={cb.best_epoch}.ckpt") and cb.best_epoch in (0, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["epoch"] == 1
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values())


# --- 5: a new fit starts afresh; a resumed one restores ----------------------------------------


def test_second_fit_with_the_same_callbacks_starts_afresh():
    cb, es = _quick(steps=20, solver="adam"), MargLikEarlyStopping(patience=3)
    _fit([cb, es], 3)
    first_best = cb.best_marglik
    other = Regressor(hidden=8)
    other.prior = GaussianPrior(other.net, structure="scalar")  # another model: other hyperparameter shapes
    _fit([cb, es], 2, model=other)
    assert [h["epoch"] for h in cb.history] == [1, 2] and cb.estimations == 2
    assert cb.best_marglik == max(h["marglik"] for h in cb.history) != first_best
    assert cb._optimizer_state["state"][0]["step"].item() == 2 * 20  # Adam state of this model only
    assert es.best_score.item() == pytest.approx(cb.best_marglik, rel=1e-6)


def test_resume_restores_history_and_best(tmp_path):
    def run(max_epochs, ckpt_path=None):
        cb = _quick(steps=20, solver="adam")
        _fit([cb, MargLikCheckpoint(dirpath=tmp_path, save_last=True)], max_epochs, ckpt_path=ckpt_path)
        return cb

    first = run(2)
    resumed = run(4, ckpt_path=tmp_path / "last.ckpt")
    assert [h["epoch"] for h in resumed.history] == [1, 2, 3, 4]
    assert resumed.history[:2] == first.history
    assert resumed.best_marglik == max(h["marglik"] for h in resumed.history)
    assert resumed._optimizer_state["state"][0]["step"].item() == 4 * 20  # Adam continued


def test_load_state_dict_tolerates_missing_keys():
    cb = _quick()
    cb.load_state_dict({"estimations": 3, "history": [{"epoch": 3, "step": 12, "marglik": -0.5}]})
    assert cb.estimations == 3 and cb.history[0]["epoch"] == 3
    assert cb.best_marglik == -math.inf and cb.best_epoch == -1 and cb._optimizer_state == {}


def test_changed_learnable_hyperparameters_restart_the_adam_state(tmp_path):
    _fit([_quick(steps=10, solver="adam"), MargLikCheckpoint(dirpath=tmp_path, save_last=True)], 2)
    model = Regressor()
    model.likelihood = GaussianLikelihood(learn_temperature=True)
    cb = _quick(steps=10, solver="adam")
    resume = dict(model=model, ckpt_path=tmp_path / "last.ckpt")
    with pytest.warns(UserWarning, match=r"learnable hyperparameters changed.*log_temperature.*starts afresh"):
        _fit([cb, MargLikCheckpoint(dirpath=tmp_path, save_last=True)], 3, **resume)
    assert [h["epoch"] for h in cb.history] == [1, 2, 3]  # the history was kept
    assert model.likelihood.log_temperature.item() != 0.0  # the temperature is learned now


# --- 7: the final estimate ----------------------------------------------------------------------


def test_final_estimate_updates_best_and_callback_metrics():
    cb = _quick(frequency=5, steps=50)
    _, t = _fit([cb], 20, max_steps=4 * 7)  # 4 batches per epoch: stops after epoch 7
    assert [h["epoch"] for h in cb.history] == [5, 7]
    assert cb.history[1]["marglik"] > cb.history[0]["marglik"]  # so the final estimate is the best
    assert cb.best_marglik == cb.final_marglik and cb.best_epoch == 6
    assert t.callback_metrics["marglik"].item() == pytest.approx(cb.final_marglik)
    assert t.callback_metrics["sigma"].item() == pytest.approx(cb.logged_values(cb.final_marglik)["sigma"])


# --- 8: endless streams -------------------------------------------------------------------------


class Stream(IterableDataset):
    """An endless stream of regression examples; fails (instead of hanging) past ``guard`` items."""

    def __init__(self, guard: int = 5000) -> None:
        self.guard = guard

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in itertools.count():
            if i >= self.guard:
                raise RuntimeError("the stream was read without a bound")
            x = 4 * torch.rand(1, generator=g) - 2
            yield x, torch.sin(2 * x)


def test_endless_stream_read_for_one_training_epoch():
    cb = _quick()
    with pytest.warns(UserWarning, match=r"first 3 batches.*limit_train_batches=3"):
        _fit([cb], 2, data=DataLoader(Stream(), batch_size=8), limit_train_batches=3)
    assert cb.evidence.n_data == 24 and cb.estimations == 2


def test_limited_map_style_epoch_warns_that_the_evidence_covers_every_example():
    cb = _quick()
    with pytest.warns(UserWarning, match=r"limit_train_batches=2\) trains on 2 of 4 batches.*`dataloader=`"):
        _fit([cb], 1, limit_train_batches=2)
    assert cb.evidence.n_data == 64


def test_endless_stream_without_limit_refused_at_setup():
    model = Regressor()
    with pytest.raises(MisconfigurationException, match=r"without a length.*limit_train_batches.*`dataloader=`"):
        _fit([_quick()], 2, model=model, data=DataLoader(Stream(), batch_size=8), max_steps=3)
    assert model.train_modes == []


# --- 10: mistakes found at set-up, before the first training step -------------------------------


class NoForward(Regressor):
    forward = pl.LightningModule.forward  # as if forward had not been defined

    def training_step(self, batch, batch_idx):
        self.train_modes.append(self.training)
        return self.net(batch[0]).pow(2).mean()


class TupleForward(Regressor):
    def forward(self, x):
        return self.net(x), x


class DictForward(Regressor):
    def forward(self, x):
        return {"out": self.net(x)}


class WideForward(Regressor):
    """Three outputs for one-dimensional targets."""

    def forward(self, x):
        return self.net(x).expand(-1, 3)


def _float32_overflow() -> Regressor:
    model = Regressor()
    with torch.no_grad():  # log 690.8: finite, but exp overflows float32 (beyond what the constructor takes)
        model.prior.log_precision.fill_(math.log(1e300))
    return model.float()


@pytest.mark.parametrize(
    "make,kwargs,match",
    [
        (NoForward, {}, "NoForward defines no forward.*def forward"),
        (TupleForward, {}, "forward returned tuple.*return only that tensor"),
        (DictForward, {}, "forward returned dict"),
        (WideForward, {}, r"target shape \(16, 1\) does not match output shape \(16, 3\).*marglik_batch"),
        (Regressor, {"dataloader": "n_data"}, r"dataloader='n_data'.*Regressor.n_data is a value of type int, not a"),
        (Regressor, {"dataloader": "missing"}, r"dataloader='missing'.*neither the DataModule nor"),
        (_float32_overflow, {}, r"prior.log_precision = 1e\+300.*not finite in the module's dtype torch.float32"),
    ],
    ids=["no_forward", "tuple", "dict", "shape", "attribute", "missing", "overflow"],
)
def test_setup_mistakes_fail_before_training(make, kwargs, match):
    model = make()
    data = regression_data()
    if next(model.parameters()).dtype == torch.float32:
        data = TensorDataset(*(t.float() for t in data.tensors))
    with pytest.raises(MisconfigurationException, match=match):
        _fit([_quick(burnin=3, **kwargs)], 5, model=model, data=loader(data))
    assert model.train_modes == []


class DictInputForward(Regressor):
    """A forward that reads a dict: the evidence batches hold a tensor, and no ``marglik_batch`` maps them."""

    def forward(self, inputs):
        return self.net(inputs["x"])


class NestedInputs(DictInputForward):
    """A forward of one dict (``forward(batch)``, as Hugging Face models wrapped in Lightning often take theirs):
    ``marglik_batch`` passes it as the one positional argument, the tensor one container down."""

    def training_step(self, batch, batch_idx):
        (inputs,), y = self.marglik_batch(batch)
        return map_loss(self(inputs), y, self.likelihood, self.prior, self.n_data)

    def marglik_batch(self, batch):
        return ({"x": batch[0]},), batch[1]


def test_a_forward_the_evidence_pass_cannot_call_is_named_before_training():
    model = DictInputForward()
    with pytest.raises(MisconfigurationException, match=r"through forward: TypeError: .*forward\(x\) for a tensor x"
                                                        r".*marglik_batch"):
        _fit([_quick(burnin=3)], 5, model=model)
    assert model.train_modes == []


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_a_forward_of_one_dict_mapped_by_marglik_batch_learns_as_the_tensor_forward(structure):
    pl.seed_everything(0, verbose=False)
    nested = NestedInputs()
    pl.seed_everything(0, verbose=False)
    plain = Regressor()  # the same initial weights
    callbacks = [_quick(structure=structure), _quick(structure=structure)]
    _fit([callbacks[0]], 3, model=nested)
    _fit([callbacks[1]], 3, model=plain)
    assert [h["marglik"] for h in callbacks[0].history] == [h["marglik"] for h in callbacks[1].history]
    assert torch.equal(nested.prior.log_precision, plain.prior.log_precision)


@pytest.mark.parametrize(
    "tensor,row,value,match",
    [
        (0, 5, math.nan, r"1 of its 16 data is not finite: its inputs hold NaN or inf \(rows \[5\]"),
        (1, 7, math.inf, r"1 of its 16 data is not finite: its targets hold NaN or inf \(rows \[7\]"),
    ],
    ids=["nan_input", "inf_target"],
)
def test_non_finite_data_in_the_setup_batch_fail_before_training(tensor, row, value, match):
    data = [t.clone() for t in regression_data().tensors]
    data[tensor][row] = value
    model = Regressor()
    with pytest.raises(MisconfigurationException, match=match):
        _fit([_quick(burnin=3)], 5, model=model, data=loader(TensorDataset(*data)))
    assert model.train_modes == []


def test_outputs_that_are_not_finite_at_finite_data_are_named_before_training():
    model = Regressor()
    with torch.no_grad():
        model.net[2].weight[0, 0] = math.nan  # a forward that is not finite at these weights
    with pytest.raises(MisconfigurationException, match=r"outputs are not finite at finite inputs and targets"):
        _fit([_quick(burnin=3)], 5, model=model)
    assert model.train_modes == []


# --- issue 11 item 5: progress and stopping reasons ---------------------------------------------


@pytest.mark.parametrize("bar", [True, False])
def test_evidence_pass_shows_progress_only_with_a_progress_bar(bar, capsys):
    _fit([_quick()], 1, enable_progress_bar=bar)
    out = capsys.readouterr().out
    assert ("Evidence pass" in out) == bar
    if bar:
        assert "/4" in out  # 4 evidence batches


def test_early_stopping_says_when_and_why(caplog):
    cb = MargLikCallback(settle=None, structure="diag", approx="ef", frequency=2, steps=0)
    es = MargLikEarlyStopping(patience=2)
    logger = logging.getLogger("pytorch_lightning.callbacks.early_stopping")
    logger.addHandler(caplog.handler)  # Lightning's loggers do not propagate to the root
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            _fit([cb, es], 30, model=Regressor(lr=0.0))
    finally:
        logger.removeHandler(caplog.handler)
    assert es.stopped_epoch == 5
    message = es.stopping_reason_message
    assert message is not None and "after epoch 6" in message
    assert "marglik" in message and "2 estimations (patience=2)" in message
    assert message in caplog.messages


# --- issue 17 items 2, 6, 7: one N for map_loss and the evidence; no datum; integer labels ------


def test_map_loss_and_the_evidence_use_one_n(tmp_path):
    """``map_loss(..., n_data=32)``, the batch size for N = 200, trained with a prior 6x too strong
    without a word. The callback counts N when training starts and stores it on the prior: map_loss
    without ``n_data`` trains exactly as with ``n_data=200``, a differing ``n_data`` warns, and the
    count is saved with the weights."""
    data = loader(regression_data(200), batch_size=32)
    runs = {}
    for n_data in (None, 200):
        torch.manual_seed(0)
        runs[n_data] = _fit([_quick(frequency=5)], 10, model=Regressor(n_data=n_data), data=data)
    (counted, t), (explicit, _) = runs[None], runs[200]
    assert int(counted.prior.n_data) == 200
    for (name, a), b in zip(counted.state_dict().items(), explicit.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.warns(UserWarning, match=r"map_loss\(n_data=32\), but the evidence counts N=200 data.*6.25x as strong"):
        _fit([_quick(frequency=5)], 1, model=Regressor(n_data=32), data=data)
    t.save_checkpoint(tmp_path / "model.ckpt")
    loaded = Regressor(n_data=None)  # e.g. trained on in a plain loop: map_loss knows N
    loaded.load_state_dict(torch.load(tmp_path / "model.ckpt", weights_only=True)["state_dict"])
    assert int(loaded.prior.n_data) == 200


def test_labels_all_ignored_refused_at_setup():
    """Every label ``ignore_index``: a ZeroDivisionError after an epoch before; now refused before training."""
    x, y = torch.randn(40, 5, 2), torch.full((40, 5), -100)
    t = trainer([_quick()], 2)
    with pytest.raises(MisconfigurationException, match=r"no datum \(n_data = 0\): every label equals ignore_index=-100"):
        t.fit(Classifier(200), DataLoader(TensorDataset(x, y), batch_size=8))
    assert t.global_step == 0


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_integer_labels_of_every_dtype_train_as_int64(dtype):
    """int32 labels passed the set-up check and then crashed after an epoch; every integer dtype now
    trains and estimates exactly as int64 labels do (the diag-EF pass one-hot encodes them)."""
    x, y = blobs(60, 0).tensors
    runs = {}
    for labels in (y, y.to(dtype)):
        torch.manual_seed(0)
        model, _ = _fit([cb := _quick()], 2, model=Classifier(60), data=DataLoader(TensorDataset(x.double(), labels), batch_size=20))
        runs[labels.dtype] = (cb.history, model.state_dict())
    assert runs[dtype][0] == runs[torch.int64][0]
    for name, value in runs[torch.int64][1].items():
        assert torch.equal(runs[dtype][1][name], value), name
