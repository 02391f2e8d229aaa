"""What four probing users passed (tenth session), each case refused before training with the problem and its fix,
or now right: a prior over tensors frozen after it was built, Lightning's ``ModelCheckpoint`` ranking by a stale
estimate, ``drop_last`` in order, hyperparameters beyond the buffer's dtype, NaN data in the engine, running
statistics changed after the estimate, a BatchNorm that needs a batch, a batch whose every label is ignored, the
selection's candidates named or built wrongly, two estimating callbacks in one Trainer, a burn-in longer than the fit,
and the end line's epochs."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import (
    CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence, MargLikBoundCallback, MargLikCallback,
    map_loss, predict, select_models,
)
from lightning_marglik.likelihoods import LOG_LIMIT
from lightning_marglik.callbacks.package import MargLikConfigurationError
from lightning_marglik.callbacks.prior_guard import guard_words
from tests.lightning_models import BlobData, Classifier, Regressor, loader, regression_data, trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:.*LeafSpec.*")


def _untrainable(module):
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    return module


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


# --- a prior built before tensors were frozen -----------------------------------------------------------


@pytest.mark.parametrize("frozen", ["net.0", "net.2"])
def test_a_layer_frozen_after_the_prior_is_refused_before_training_naming_it(frozen):
    module = _untrainable(Regressor())
    module.get_submodule(frozen).requires_grad_(False)
    names = [f"{frozen[4:]}.weight", f"{frozen[4:]}.bias"]
    with pytest.raises(MargLikConfigurationError, match=re.escape(f"covers parameters {names!r} that do not require grad")
                       + r".*Build the GaussianPrior after freezing them"):
        trainer([MargLikCallback(frequency=1)], 2).fit(module, loader(regression_data()))


def test_the_engine_refuses_a_frozen_weight_the_prior_covers_and_takes_the_prior_built_after_freezing():
    net = _net()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    before = GaussianPrior(net)
    net[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"covers parameters \['0.weight'\] that do not require grad"):
        LaplaceEvidence.fit(net, [(x, y)], GaussianLikelihood(), before)
    after = GaussianPrior(net)
    assert "0.weight" not in after.param_names
    assert math.isfinite(LaplaceEvidence.fit(net, [(x, y)], GaussianLikelihood(), after).log_marglik().item())


def test_predict_still_reads_a_network_frozen_for_inference():
    net = _net()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    evidence = LaplaceEvidence.fit(net, [(x, y)], GaussianLikelihood(), GaussianPrior(net))
    expected = predict(evidence, net, x[:4])
    net.requires_grad_(False)
    assert torch.equal(predict(evidence, net, x[:4]).variance, expected.variance)


# --- Lightning's ModelCheckpoint on marglik ---------------------------------------------------------------


@pytest.mark.parametrize("arguments, saving", [
    (dict(frequency=2), {}),
    (dict(frequency=1, settle=0.05), {}),
    (dict(frequency=1), dict(save_on_train_epoch_end=False)),
    (dict(frequency=1), dict(every_n_train_steps=2)),
], ids=["frequency=2", "settle", "after validation", "every_n_train_steps"])
def test_lightning_model_checkpoint_on_marglik_without_a_fresh_estimate_is_refused_naming_marglik_checkpoint(
        tmp_path, arguments, saving):
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="marglik", mode="max", **saving)
    with pytest.raises(MargLikConfigurationError, match=r"ModelCheckpoint\(monitor='marglik'\) ranks its saves by "
                                                        r"marglik.*Use MargLikCheckpoint\(save_top_k=\.\.\.\)"):
        trainer([MargLikCallback(structure="diag", **arguments), checkpoint], 4).fit(
            _untrainable(Regressor()), loader(regression_data()))
    assert not list(tmp_path.iterdir())


def test_lightning_model_checkpoint_on_marglik_names_each_file_by_its_own_estimate_when_every_epoch_estimates(tmp_path):
    callback = MargLikCallback(structure="diag", frequency=1, steps=10)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="marglik", mode="max", save_top_k=-1,
                                              filename="{epoch}-{marglik:.6f}")
    trainer([callback, checkpoint], 3).fit(Regressor(), loader(regression_data()))
    named = sorted(float(p.stem.split("marglik=")[1]) for p in tmp_path.iterdir())
    assert named == pytest.approx(sorted(h["marglik"] for h in callback.history), abs=1e-6)


# --- drop_last without shuffling ---------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_last_in_order_is_said_to_leave_examples_out_of_training(shuffle):
    data = DataLoader(regression_data(70), batch_size=16, drop_last=True, shuffle=shuffle)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([MargLikCallback(structure="diag", frequency=1, steps=5)], 1).fit(Regressor(n_data=70), data)
    said = [str(w.message) for w in caught if "drop_last" in str(w.message)]
    if shuffle:  # every example is drawn across epochs: the evidence's N is training's
        assert not said
    else:
        assert said == ["MargLikCallback: the training DataLoader drops its last 6 of 70 examples every epoch "
                        "(drop_last=True with batch_size=16, without shuffling): training never sees them, but the "
                        "evidence covers every example; shuffle, set drop_last=False, or pass `dataloader=` with the "
                        "examples training sees."]


# --- hyperparameters beyond the dtype that holds them ----------------------------------------------------


@pytest.mark.parametrize("make, name", [
    (lambda: GaussianPrior(nn.Linear(2, 2), precision=1e39), "precision"),
    (lambda: GaussianLikelihood(sigma=1e39), "sigma"),
    (lambda: GaussianLikelihood(sigma=1e-46), "sigma"),
    (lambda: CategoricalLikelihood(temperature=1e-50), "temperature"),
    (lambda: GaussianLikelihood(sigma=1e-20), "sigma"),  # 1 / sigma^2 overflows float32: the set-up blamed the data
])
def test_a_hyperparameter_its_float32_buffer_cannot_hold_is_refused_at_construction(make, name):
    torch.set_default_dtype(torch.float32)  # the buffers' dtype outside the suite (conftest restores float64)
    with pytest.raises(ValueError, match=rf"`{name}` must lie within e\^-42.7 to e\^42.7 .*within torch.float32"):
        make()


def test_set_hyperparameters_names_a_value_that_is_not_a_tensor():
    net = _net()
    prior = GaussianPrior(net)
    evidence = LaplaceEvidence.fit(net, [(torch.randn(10, 3), torch.randn(10, 2))], GaussianLikelihood(), prior)
    before = prior.log_precision.clone()
    with pytest.raises(ValueError, match=r"'log_precision' must be a tensor of shape \(4,\).*got list"):
        evidence.set_hyperparameters({"log_precision": [0.0, 0.0, 0.0, 0.0]})
    assert torch.equal(prior.log_precision, before)


def _fitted_exactly():
    """A linear network whose targets are its own outputs: residuals exactly 0, no optimum in sigma."""
    torch.manual_seed(0)
    net, x = nn.Linear(1, 1), torch.randn(50, 1)
    with torch.no_grad():
        y = net(x)
    return net, x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_sigma_without_an_optimum_stays_within_its_buffer_and_is_named(dtype):
    """It ran to e^-76 (sigma^2 = 0 in float32, the loss NaN), a lower value at every estimate, without a word."""
    torch.set_default_dtype(dtype)
    net, x, y = _fitted_exactly()
    likelihood, prior = GaussianLikelihood(), GaussianPrior(net)
    for _ in range(8):  # a solve moves log sigma by about 70: float64's edge takes five
        evidence = LaplaceEvidence.fit(net, [(x, y)], likelihood, prior)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            solution = evidence.optimize()
        evidence.set_hyperparameters(solution.values)  # every solution is writable
        if solution.unbounded:
            break
    assert solution.unbounded == ("log_sigma",) and re.search(
        r"sigma ran to the edge of what torch.float\d\d holds .*the network fits its training data exactly.*"
        r"learn_sigma=False", str(caught[-1].message))
    assert -LOG_LIMIT[dtype] - 1e-5 <= likelihood.log_sigma.item() <= -0.9 * LOG_LIMIT[dtype]  # float32's rounding
    assert likelihood.sigma.pow(2).item() > 0
    assert torch.isfinite(map_loss(net(x), y, likelihood, prior))
    with pytest.raises(ValueError, match=r"Refusing to write 'log_sigma' = -400.0: beyond \+-\d+.\d, where its square"):
        evidence.set_hyperparameters({"log_sigma": torch.tensor(-400.0)})


class HeldAtAnExactFit(pl.LightningModule):
    """Weights that fit the data exactly and do not move (lr 0): every estimate meets residuals of 0."""

    def __init__(self):
        super().__init__()
        # integer weights and inputs (as the DDP probe's): a large curvature, whose scale 1 / sigma^2 overflows
        # float64 before sigma reaches the edge of its range
        g = torch.Generator().manual_seed(5)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g).to(p.dtype))
            self.x = torch.randint(-3, 4, (37, 3), generator=g).to(p.dtype)
            self.y = self.net(self.x)
        self.prior, self.likelihood = GaussianPrior(self.net), GaussianLikelihood()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return map_loss(self(batch[0]), batch[1], self.likelihood, self.prior)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.0)


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "32-true"), (torch.float64, "64-true")])
def test_the_callback_keeps_its_hyperparameters_where_sigma_has_no_optimum(dtype, precision):
    """float64 stopped short of the edge (the curvature's scale overflows first): no warning, sigma at e^-351."""
    torch.set_default_dtype(dtype)
    module = HeldAtAnExactFit()
    callback = MargLikCallback(frequency=1)
    with pytest.warns(UserWarning, match="where the evidence has no finite optimum in log_sigma, the estimate leaves"):
        trainer([callback], 3, precision=precision).fit(module, loader(TensorDataset(module.x, module.y), 8))
    assert torch.isfinite(module.likelihood.sigma.pow(-2)) and math.isfinite(callback.final_marglik)
    assert all(math.isfinite(record["marglik"]) for record in callback.history)


def test_a_prior_that_learns_nothing_runs_no_guard_and_keeps_no_bias_apart():
    """learn=False: the guard scored two identical candidates at every estimate (2-3 epochs each), and the set-up
    line called the biases' precision learned."""
    module = Regressor()
    module.prior = GaussianPrior(module.net, learn=False)
    callback = MargLikCallback(frequency=1)
    trainer([callback], 3).fit(module, loader(regression_data()))
    assert callback.guard_off == "off: the evidence sets no tensor's weight decay" and callback.guard_decisions == []
    assert module.prior.treated("decoupled") == [] and callback.summary["decoupled"] == []
    assert torch.equal(module.prior.applied_precision, module.prior.precision)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_precision_networks_keep_their_hyperparameters_in_float32(half):
    """bf16-true rounded every estimate's update of log delta (steps of ~0.016 near 3) away: the prior stopped
    learning without a word; fp16 turned sigma = 300 into an infinite sigma^2, blamed on the data."""
    module = Regressor()
    module.prior = GaussianPrior(module.net, precision=20.0)
    module.likelihood = GaussianLikelihood(sigma=300.0)
    module.to(half)
    assert module.net[0].weight.dtype == half
    assert module.prior.log_precision.dtype == module.likelihood.log_sigma.dtype == torch.float32
    assert module.prior.precision[0].item() == pytest.approx(20.0, rel=1e-6)
    step = {"log_precision": module.prior.log_precision + 0.005}  # below bf16's spacing there
    LaplaceEvidence.fit(module.net, [(torch.randn(4, 1, dtype=half), torch.randn(4, 1, dtype=half))],
                        module.likelihood, module.prior).set_hyperparameters(step)
    assert torch.equal(module.prior.log_precision, step["log_precision"])
    x, y = torch.randn(8, 1, dtype=half), torch.randn(8, 1, dtype=half)
    assert torch.isfinite(map_loss(module(x), y, module.likelihood, module.prior, n_data=8))
    assert module.double().prior.log_precision.dtype == torch.float64  # wider is kept wider


@pytest.mark.parametrize("flag, said", [(dict(fast_dev_run=True), "fast_dev_run=True"),
                                        (dict(overfit_batches=2), "overfit_batches=2")])
def test_a_limited_epoch_is_said_with_the_flag_the_user_set(flag, said):
    """fast_dev_run and overfit_batches set limit_train_batches themselves: the warning named that instead."""
    with pytest.warns(UserWarning, match=rf"Trainer\({said}\) trains on \d of 4 batches per epoch"):
        trainer([MargLikCallback(frequency=1)], 1, **flag).fit(Regressor(), loader(regression_data()))


def test_predict_under_mixed_precisions_autocast_returns_what_it_returns_without(float32):
    """Inside predict_step under Trainer(precision="bf16-mixed") the predictive came back in bfloat16."""
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(32, 1), torch.randn(32, 1)
    evidence = LaplaceEvidence.fit(net, [(x, y)], GaussianLikelihood(), GaussianPrior(net))
    plain = predict(evidence, net, x[:4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = predict(evidence, net, x[:4])
    assert mixed.mean.dtype == torch.float32 and torch.equal(mixed.mean, plain.mean)
    assert torch.equal(mixed.variance, plain.variance)


class ShortSaid(torch.utils.data.IterableDataset):
    """A stream whose __len__ (30) says less than it yields (41): Lightning trains on the batches its length gives."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(41):
            x = torch.rand(1, generator=g) * 4 - 2
            yield x, torch.sin(2 * x)

    def __len__(self):
        return 30


def test_a_stream_that_yields_more_than_its_length_counts_what_training_reads(float32):
    """The evidence counted all 41 examples where each training epoch read 4 batches (32)."""
    callback = MargLikCallback(frequency=1, guard=False)
    trainer([callback], 1).fit(Regressor(), torch.utils.data.DataLoader(ShortSaid(), batch_size=8))
    assert callback.evidence.n_data == 32


def test_evidence_data_of_another_size_than_the_training_data_are_said():
    """dataloader= of 32 examples for 64 trained: map_loss applied delta / 32, twice the decay, without a word."""
    data = regression_data()
    callback = MargLikCallback(frequency=1, dataloader=loader(TensorDataset(*data[:32])))
    with pytest.warns(UserWarning, match=r"the evidence data hold 32 examples, the training data 64: N, and so the "
                                         r"weight decay map_loss applies"):
        trainer([callback], 1).fit(Regressor(), loader(data))


# --- NaN in the engine's data ---------------------------------------------------------------------------------


@pytest.mark.parametrize("part, structure", [("targets", "kron"), ("inputs", "diag"), ("inputs", "full")])
def test_the_engine_names_the_batch_and_rows_of_non_finite_data(part, structure):
    net = _net()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    (y if part == "targets" else x)[13, 1] = math.nan if part == "targets" else math.inf
    batches = [(x[:10], y[:10]), (x[10:], y[10:])]
    with pytest.raises(ValueError, match=rf"batch 1's {part} hold NaN or inf \(rows \[3\], the first of them\).*clean "
                                         r"the data"):
        LaplaceEvidence.fit(net, batches, GaussianLikelihood(), GaussianPrior(net), structure=structure)


def test_the_engine_warns_where_clean_data_give_a_non_finite_evidence():
    net = _net()
    with torch.no_grad():
        net[0].weight[0, 0] = math.nan
    with pytest.warns(UserWarning, match="not finite at the model's current weights, though the data are"):
        LaplaceEvidence.fit(net, [(torch.randn(10, 3), torch.randn(10, 2))], GaussianLikelihood(), GaussianPrior(net))


# --- running statistics changed after the estimate -----------------------------------------------------------


def test_predict_refuses_running_statistics_that_changed_after_the_estimate():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(40, 3), torch.randint(0, 3, (40,))
    net.train()(x)  # running statistics of the training data
    evidence = LaplaceEvidence.fit(net, [(x, y)], CategoricalLikelihood(), GaussianPrior(net))
    predict(evidence, net, x[:4])  # as fitted
    net.train()(x + 3.0)  # e.g. a forward in train mode, or update_bn on other data
    with pytest.raises(ValueError, match=r"running statistics \(BatchNorm's\), are not those of the posterior's"):
        predict(evidence, net, x[:4])


# --- a BatchNorm that needs a batch ------------------------------------------------------------------------------


def test_a_batchnorm_without_running_statistics_on_features_is_refused_naming_the_fix():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(24, 3), torch.randint(0, 3, (24,))
    with pytest.raises(ValueError, match=r"BatchNorm without running statistics.*one example alone has no statistics"
                                         r".*track_running_stats=True"):
        LaplaceEvidence.fit(net, [(x, y)], CategoricalLikelihood(), GaussianPrior(net))


# --- smaller messages ------------------------------------------------------------------------------------------


def test_a_batch_whose_every_label_is_ignored_adds_no_data_term():
    net = _net()
    prior = GaussianPrior(net)
    prior.record_n_data(50)
    loss = map_loss(net(torch.randn(4, 3)), torch.full((4,), -100), CategoricalLikelihood(), prior)
    assert torch.equal(loss, prior.penalty() / 50)


def test_the_full_structures_memory_refusal_says_sizes_that_are_not_rounded_to_zero():
    net = _net()
    with pytest.raises(ValueError, match=r"needs about 0\.0381 MiB .* above max_memory=0\.000954 MiB"):
        LaplaceEvidence.fit(net, [(torch.randn(4, 3), torch.randn(4, 2))], GaussianLikelihood(), GaussianPrior(net),
                            structure="full", max_memory=1000)


def test_predict_on_one_unbatched_input_says_what_the_batch_dimension_is():
    net = _net()
    x, y = torch.randn(20, 3), torch.randn(20, 2)
    evidence = LaplaceEvidence.fit(net, [(x, y)], GaussianLikelihood(), GaussianPrior(net))
    with pytest.raises(ValueError, match=r"outputs have shape \(2,\), where predict needs one output vector per input, "
                                         r"\(batch, outputs\) with batch 3 \(the inputs' first dimension\).*x\[None\]"):
        predict(evidence, net, x[0])


def test_a_forwards_own_message_is_quoted_without_a_doubled_full_stop():
    class Picky(Regressor):
        def forward(self, x):
            raise RuntimeError("this forward reads a dict.")

    with pytest.raises(MargLikConfigurationError, match=r"RuntimeError: this forward reads a dict\. The evidence pass"):
        trainer([MargLikCallback(frequency=1)], 1).fit(_untrainable(Picky()), loader(regression_data()))


# --- the selection API and the estimating callbacks (the third probe) ---------------------------------------


@pytest.fixture
def float32():  # the selection's Lightning modules are float32, like a user's
    torch.set_default_dtype(torch.float32)


def test_select_models_refuses_a_candidate_name_that_is_not_a_string_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"candidate names must be non-empty strings .*got 8 \(int\)"):
        select_models({8: lambda: pytest.fail("nothing is built")}, datamodule=BlobData(), output_dir=str(tmp_path),
                      verbose=False)
    assert not (tmp_path / "results.json").exists()


def test_select_models_refuses_two_factories_that_return_one_module(float32):
    shared = Classifier(60)
    with pytest.raises(ValueError, match=r"the factory of candidate 'b' returned the module that the factory of "
                                         r"candidate 'a' returned, which that candidate trains"):
        select_models({"a": lambda: shared, "b": lambda: shared}, datamodule=BlobData(),
                      callback={"structure": "diag", "steps": 5}, trainer={"max_epochs": 1, "enable_progress_bar": False},
                      verbose=False)


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes: Python 3.11")
def test_a_candidate_that_fails_in_training_is_named_in_the_traceback(float32):
    class Fails(Classifier):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as raised:
        select_models({"fine": lambda: Classifier(60), "fails": lambda: Fails(60)}, datamodule=BlobData(),
                      callback={"structure": "diag", "steps": 5}, trainer={"max_epochs": 1, "enable_progress_bar": False},
                      verbose=False)
    assert raised.value.__notes__ == ["select_models: raised while training candidate 'fails' (2 of 2); the results of "
                                      "those before it are not kept (no output_dir)."]


def test_two_estimating_callbacks_in_one_trainer_are_refused_before_training():
    with pytest.raises(MargLikConfigurationError, match=r"MargLikCallback next to MargLikBoundCallback in one Trainer: "
                                                        r"both would step the same hyperparameters"):
        trainer([MargLikCallback(frequency=1), MargLikBoundCallback()], 2).fit(
            _untrainable(Regressor()), loader(regression_data()))


def test_a_bound_callbacks_burnin_that_leaves_no_epoch_is_refused_before_training():
    with pytest.raises(MargLikConfigurationError, match=r"MargLikBoundCallback\(burnin=3\), but the fit trains 3 epochs "
                                                        r"\(max_epochs\): no epoch is left"):
        trainer([MargLikBoundCallback(burnin=3)], 3).fit(_untrainable(Regressor()), loader(regression_data()))


def test_the_end_lines_epochs_count_from_zero_as_the_best_epoch_and_the_checkpoint_files():
    last = {"epoch": 115, "learned": -1.0, "declared": -0.5, "applied": "declared"}  # after 115 epochs
    assert "log likelihood per datum at epoch=114:" in guard_words({"estimates": 3, "declared": 2, "last": last})


# --- integrations (the fifth probe) ------------------------------------------------------------------------------


class _SequenceFirst(nn.Module):
    """A batch-first network around PyTorch's default sequence-first TransformerEncoderLayer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(2, 8)
        self.layer = nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=8, dropout=0.0)  # batch_first=False
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # (B, T, 2)
        return self.head(self.layer(self.embed(x).transpose(0, 1)).mean(0))


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_a_sequence_first_layer_whose_length_equals_the_batch_size_is_not_taken_batch_first(structure):
    torch.manual_seed(0)
    net = _SequenceFirst().eval()
    x, y = torch.randn(24, 4, 2), torch.randint(0, 3, (24,))  # sequences of 4
    prior, likelihood = GaussianPrior(net), CategoricalLikelihood()

    def log_det(batch):
        batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, 24, batch)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exact path's warning
            return LaplaceEvidence.fit(net, batches, likelihood, prior, structure=structure, mc_samples=0).log_det()

    assert torch.allclose(log_det(4), log_det(3), rtol=1e-10)  # batches of 4, the sequences' length, as of 3


def test_the_scale_invariance_of_a_compiled_network_is_found_as_of_the_plain_one():
    class Net(Regressor):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(1, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))
            self.prior = GaussianPrior(self.net)

    plain, compiled = Net(), Net()
    compiled.net = torch.compile(compiled.net)  # the default backend (inductor): its forward skips module hooks
    compiled.prior = GaussianPrior(compiled.net)
    for module in (plain, compiled):
        trainer([MargLikCallback(frequency=1, steps=5)], 1).fit(module, loader(regression_data()))
    assert plain.prior.treatments["scale-invariant"][0] == ["0.weight", "0.bias"]
    assert compiled.prior.treatments["scale-invariant"][0] == ["_orig_mod.0.weight", "_orig_mod.0.bias"]


def test_a_prior_built_before_peft_wrapped_the_network_names_the_order_to_build_them_in():
    peft = pytest.importorskip("peft")
    net = _net()
    prior = GaussianPrior(net)
    net = peft.get_peft_model(net, peft.LoraConfig(r=2, target_modules=["0"], lora_dropout=0.0))
    with pytest.raises(RuntimeError, match=r"peft wrapped its layers after the prior was built\. Build the "
                                           r"GaussianPrior after get_peft_model"):
        LaplaceEvidence.fit(net, [(torch.randn(8, 3), torch.randn(8, 2))], GaussianLikelihood(), prior)


def test_predict_on_per_position_outputs_says_it_has_no_per_position_form():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 5))  # (B, T) tokens -> (B, T, 5) logits
    x, y = torch.randint(0, 10, (6, 4)), torch.randint(0, 5, (6, 4))
    evidence = LaplaceEvidence.fit(net, [(x, y)], CategoricalLikelihood(), GaussianPrior(net))
    with pytest.raises(ValueError, match=r"outputs have shape \(6, 4, 5\): one output per position of each input.*"
                                         r"no per-position form"):
        predict(evidence, net, x)


class _ItemBranch(nn.Module):
    """A forward with Python control flow on a tensor's value, which vmap refuses."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(x) * (2.0 if x.sum().item() > 0 else 1.0)


def test_predicts_fallback_warning_gives_no_structure_advice_it_cannot_take():
    net = _ItemBranch()
    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        evidence = LaplaceEvidence.fit(net, [(x, y)], CategoricalLikelihood(), GaussianPrior(net), structure="full")
    with pytest.warns(UserWarning, match=r"For the fast path, write the forward without") as caught:
        predict(evidence, net, x[:3], method="probit")
    assert not any("structure=" in str(w.message) for w in caught)


def test_non_finite_data_in_a_one_pass_iterable_are_not_called_clean():
    net = _net()
    x, y = torch.randn(10, 3), torch.randn(10, 2)
    y[2, 0] = math.nan
    with pytest.warns(UserWarning, match="a one-pass iterable, which could not be read again to tell which") as caught:
        LaplaceEvidence.fit(net, (batch for batch in [(x, y)]), GaussianLikelihood(), GaussianPrior(net), structure="diag")
    assert not any("though the data are" in str(w.message) for w in caught)
