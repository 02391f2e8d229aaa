"""What the callbacks tell the user (issue 51 item 2): one line at set-up naming the decisions set-up made
(the estimator and why, the curvature, what was held or decoupled and why, the schedule), and a summary when
training ends (estimates, final and best evidence, the learned precisions' range, what was held, whether the
evidence was still rising), both on rank zero through Lightning's own ``rank_zero_info``, where the Trainer's
"GPU available: ..." lines print; the summary's facts in ``callback.summary``."""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Iterator, List

import lightning_utilities.core.rank_zero as rank_zero_module
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import GaussianPrior, MargLikBoundCallback, MargLikCallback, MargLikEarlyStopping
from lightning_marglik.callbacks import core, prior_guard
from lightning_marglik.callbacks.prior_guard import guard_words
from lightning_marglik.callbacks.report import FLAT, summary_line, trend
from tests.lightning_models import Classifier, trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:.*LeafSpec.*")


def _data(n: int = 60, classes: int = 3) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long() * (classes - 2)), batch_size=20)


class Frozen(Classifier):
    """Trains at ``lr=0``: every estimate sees the same weights."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=0.0)


@contextmanager
def lightning_lines() -> Iterator[List[logging.LogRecord]]:
    """The records of the logger Lightning's ``rank_zero_info`` writes to (its loggers do not propagate)."""
    records: List[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, handler = rank_zero_module.log, Keep(logging.INFO)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _fit(callback, module=None, epochs: int = 3, classes: int = 3):
    torch.manual_seed(0)
    module = module or Classifier(n_data=60)
    with lightning_lines() as records:
        trainer([callback], max_epochs=epochs).fit(module, _data(classes=classes))
    return module, [r.getMessage() for r in records]


# --- the set-up line -------------------------------------------------------------------------


def test_one_setup_line_names_the_estimator_curvature_held_tensors_and_schedule_where_lightning_prints():
    callback = MargLikCallback(frequency=2, burnin=1)
    module, lines = _fit(callback)
    assert any(line.startswith("GPU available") for line in lines)  # Lightning's own lines, through the same logger
    (setup,) = [line for line in lines if line.startswith("MargLikCallback: estimator")]
    assert callback.estimator == "auto: the exact GGN (2 backward passes per batch, at most 10)"
    assert f"estimator {callback.estimator};" in setup
    assert "structure='kron', approx='ggn'" in setup
    decision = callback.output_decision
    assert decision["names"] == ["2.weight", "2.bias"] and decision["treatment"] == "fixed"
    assert decision["reason"] == "output layer `net.2`: held at the declared precision"
    assert f"; {decision['reason']}, as a learned one cost held-out NLL" in setup
    # 2.bias is held as the output layer's: only 0.bias is named as decoupled (0.weight too, where the prior guard
    # kept the declared weight decay for training after an estimate)
    guarded = module.prior.treatments.get("prior guard", ([], ""))[0]
    assert [n for n in module.prior.treated("decoupled") if n not in guarded] == ["0.bias"]
    assert "biases and normalization parameters (0.bias): decoupled" in setup
    assert "prior guard: after each estimate in training" in setup
    assert "learns the precisions of 2 of 4 tensors" in setup
    assert "an estimate after every 2 epochs from epoch 2, and after the last (frequency=2, burnin=1)" in setup



def test_the_set_up_line_prints_the_set_up_analysis_record_and_the_estimates_run_what_its_pass_resolved():
    from lightning_marglik.callbacks.report import setup_line
    from lightning_marglik.curvature import collect_statistics

    callback = MargLikCallback(frequency=1, mc_samples="auto", steps=0)
    module, lines = _fit(callback, epochs=1)
    analysis = callback.setup_analysis
    (setup,) = [line for line in lines if line.startswith("MargLikCallback: estimator")]
    assert setup == setup_line(callback) and f"estimator {analysis.estimator};" in setup
    assert callback.estimator is analysis.estimator and callback.output_decision is analysis.output_decision
    # "auto" resolved once, by the set-up batch's pass: the estimates are given the count it chose
    assert callback.requested_options.mc_samples == "auto" and callback.options is analysis.options
    assert analysis.options.mc_samples == 0 and callback.evidence.estimator == "as set: the exact GGN"
    inputs, target = _data().dataset.tensors
    direct = collect_statistics(module, [(inputs[:20], target[:20])], module.likelihood, module.prior,
                                options=callback.requested_options)
    assert direct.options == analysis.options and direct.estimator == analysis.estimator


def test_the_setup_line_names_a_learned_output_layer_and_a_scale_invariant_treatment():
    callback = MargLikCallback(output_layer="learn", scale_invariant="fixed", frequency=1)
    _, lines = _fit(callback, Classifier(n_data=60, norm=True), epochs=1)
    (setup,) = [line for line in lines if line.startswith("MargLikCallback: estimator")]
    assert callback.output_decision["names"] == ["3.weight", "3.bias"]  # Linear, BatchNorm, Tanh, Linear
    assert "; output layer `net.3`: learned like every other layer;" in setup
    assert "scale-invariant tensors (0.weight): held at the declared precision, as the training loss does not " \
           "change with their scale" in setup
    assert "biases and normalization parameters (1.weight, 1.bias, 3.bias): decoupled" in setup


class TiedOutput(Classifier):
    """Its output is ``h @ W1``: the first layer's weight applied outside its module (tied), no layer of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.net[0]
        return torch.tanh(first(x)) @ first.weight


def test_the_setup_line_says_why_no_output_layer_is_held():
    callback = MargLikCallback(frequency=1)
    _, lines = _fit(callback, TiedOutput(n_data=60, classes=2), epochs=1, classes=2)
    (setup,) = [line for line in lines if line.startswith("MargLikCallback: estimator")]
    decision = callback.output_decision
    assert decision["names"] == [] and decision["reason"].startswith("nothing treated: ")
    assert f"; output layer: {decision['reason']};" in setup


def test_the_bound_callback_says_its_bound_and_batch_schedule():
    callback = MargLikBoundCallback(every_k_batches=2)
    _, lines = _fit(callback, epochs=2)
    (setup,) = [line for line in lines if line.startswith("MargLikBoundCallback: estimator")]
    assert "estimator as set: the exact GGN; bound='parametric', structure='kron', approx='ggn'" in setup
    assert "a bound step after every 2 training batches (every_k_batches=2, burnin=0)" in setup
    (end,) = [line for line in lines if line.startswith("MargLikBoundCallback at the end of training")]
    assert callback.summary is not None and callback.summary["estimates"] == 2
    assert callback.summary["trend"] == trend(callback.history)[0] != "unknown"
    words = {"rising": "(a smaller `every_k_batches`)", "flat": "flat at the last estimate", "falling": "fell"}
    assert words[callback.summary["trend"]] in end


def test_nothing_is_said_on_a_rank_other_than_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_module.rank_zero_only, "rank", 1)
    _, lines = _fit(MargLikCallback(frequency=1), epochs=1)
    assert not [line for line in lines if line.startswith("MargLikCallback")]


def test_the_callback_of_the_lightning_package_says_it_where_that_trainer_prints():
    L = pytest.importorskip("lightning.pytorch", reason="the `lightning` package is not installed")
    from lightning_marglik.lightning import MargLikCallback as LightningCallback
    from tests.test_lightning_packages import LightningRegressor

    callback = LightningCallback(frequency=1)
    data = DataLoader(TensorDataset(torch.randn(32, 1), torch.randn(32, 1)), batch_size=16)
    with lightning_lines() as records:
        L.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_progress_bar=False, accelerator="cpu",
                  enable_model_summary=False, enable_checkpointing=False).fit(LightningRegressor(n_data=32), data)
    lines = [r.getMessage() for r in records]
    assert any(line.startswith("GPU available") for line in lines)
    assert len([line for line in lines if line.startswith("MargLikCallback: estimator")]) == 1
    assert len([line for line in lines if line.startswith("MargLikCallback at the end of training")]) == 1


# --- the summary -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, expected",
    [
        ([-1.2, -1.0, -0.9], "rising"),
        ([-1.2, -0.9, -0.9 - FLAT / 2], "flat"),
        ([-1.2, -0.9, -0.9 + FLAT / 2], "flat"),
        ([-1.2, -0.9, -0.95], "falling"),
        ([-1.2, -0.9, math.nan], "rising"),  # the last two finite estimates
        ([-1.2], "unknown"),
        ([], "unknown"),
    ],
)
def test_trend_compares_the_last_two_finite_estimates(values, expected):
    history = [{"epoch": i + 1, "step": i, "marglik": v} for i, v in enumerate(values)]
    assert trend(history)[0] == expected


def _summary(direction: str, change: float) -> dict:
    return {"estimates": 4, "final_marglik": -0.5, "best_marglik": -0.5, "best_epoch": 3, "precisions": {"a": 2.0},
            "lowest": ("a", 2.0), "highest": ("a", 2.0), "held": [], "decoupled": [], "trend": direction,
            "change": change}


def test_the_summary_line_says_rising_with_what_to_change_or_flat():
    rising = summary_line("MargLikCallback", _summary("rising", 0.02))
    assert "still rising at the last estimate (+0.0200 per datum): more epochs, or estimates more often " \
           "(a smaller `frequency`), may change the learned prior" in rising
    flat = summary_line("MargLikCallback", _summary("flat", 1e-5))
    assert "flat at the last estimate" in flat and "rising" not in flat


def test_a_real_fit_still_learning_says_rising_and_holds_the_facts():
    callback = MargLikCallback(frequency=1)
    module, lines = _fit(callback, epochs=3)
    (end,) = [line for line in lines if line.startswith("MargLikCallback at the end of training")]
    history = [h["marglik"] for h in callback.history]
    assert history[-1] - history[-2] > FLAT  # the network is still learning after 3 epochs
    summary = callback.summary
    assert summary["trend"] == "rising" and summary["change"] == history[-1] - history[-2]
    assert "still rising" in end
    assert summary["estimates"] == callback.estimations == 3
    assert summary["final_marglik"] == callback.final_marglik and summary["best_epoch"] == callback.best_epoch
    # the learned precisions: the prior's own values of the learned tensors (layerwise: one per tensor)
    prior = module.prior
    learned = {n: d for n, d in zip(prior.param_names, prior.precision.tolist()) if n in prior.learned_names()}
    assert summary["precisions"] == pytest.approx(learned, rel=1e-12)
    assert summary["lowest"][1] == min(learned.values()) and summary["highest"][1] == max(learned.values())
    # decoupled: the bias, and the first weight where the prior guard kept the declared weight decay at the end
    guard = summary["guard"]
    assert guard["estimates"] == 2 and guard["last"] == callback.guard_decisions[-1]  # the last epoch's is not scored
    kept = guard["last"]["applied"] == "declared"
    assert summary["held"] == ["2.weight", "2.bias"] and summary["decoupled"] == ["0.weight"] * kept + ["0.bias"]
    assert f"{summary['lowest'][1]:.3g} ({summary['lowest'][0]})" in end
    assert "held at the declared precision: 2.weight, 2.bias" in end
    assert f"prior guard: the declared weight decay kept for training at {guard['declared']} of 2 estimates" in end \
        if guard["declared"] else "prior guard: the learned weight decay scored at least as well at all 2 estimates" in end


def test_a_real_fit_at_fixed_weights_says_flat():
    callback = MargLikCallback(frequency=1)
    _, lines = _fit(callback, Frozen(n_data=60), epochs=3)
    (end,) = [line for line in lines if line.startswith("MargLikCallback at the end of training")]
    assert callback.summary["trend"] == "flat" and abs(callback.summary["change"]) <= FLAT
    assert "flat at the last estimate" in end


def test_a_fit_that_trains_nothing_keeps_the_previous_summary():
    callback = MargLikCallback(frequency=1)
    fitted = trainer([callback], max_epochs=2)
    fitted.fit(Classifier(n_data=60), _data())
    summary = callback.summary
    with pytest.warns(UserWarning, match="trained nothing"):
        fitted.fit(Classifier(n_data=60), _data())
    assert callback.summary is summary


def test_a_prior_that_learns_nothing_says_every_tensor_is_held():
    """GaussianPrior(learn=False): the end line named only the output layer as held, where every tensor stays at the
    declared precision."""
    module = Classifier(n_data=60)
    module.prior = GaussianPrior(module.net, learn=False)
    callback = MargLikCallback(frequency=1)
    trainer([callback], max_epochs=2).fit(module, _data())
    assert callback.summary["held"] == module.prior.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert "held at the declared precision: 0.weight, 0.bias, 2.weight and 1 more;" in summary_line(
        "MargLikCallback", callback.summary)


def test_one_guarded_estimate_is_said_in_the_singular():
    summary = {"estimates": 1, "declared": 0, "last": {"epoch": 3, "learned": -1.0, "declared": -2.0,
                                                       "applied": "learned"}}
    assert guard_words(summary).startswith("prior guard: the learned weight decay scored at least as well at the one "
                                           "estimate (")


def test_a_decision_after_which_early_stopping_ended_training_is_dropped(monkeypatch):
    """MargLikEarlyStopping ended training right after a guarded estimate: its decision guarded no training, yet
    the end line counted it and said training applied it at the end. It is dropped, as the estimate after the last
    epoch of max_epochs is not scored, and the prior is left as the decision before it."""
    callback = MargLikCallback(frequency=1, steps=10)
    stopping = MargLikEarlyStopping(patience=1, min_delta=10.0)  # no estimate gains 10: a stop after the second
    module = Classifier(n_data=60)
    fitted = trainer([callback, stopping], max_epochs=8)
    decided = []
    run = prior_guard.run_guard

    def recording(*args, **kwargs):
        decided.append(run(*args, **kwargs))
        return decided[-1]

    monkeypatch.setattr(core, "run_guard", recording)  # the real guard, its decisions recorded as made
    fitted.fit(module, _data())
    assert fitted.current_epoch == 2 and [h["epoch"] for h in callback.history] == [1, 2]
    assert [d["epoch"] for d in decided] == [1, 2]  # the guard did score the estimate training stopped after
    assert callback.guard_decisions == decided[:1] and callback.summary["guard"]["estimates"] == 1
    declared = decided[0]["applied"] == "declared"
    assert (prior_guard.GUARD in module.prior.treatments) == declared


def test_one_learned_precision_is_said_once():
    """A scalar prior (or one learned tensor) read "learned precisions 4.64 (all tensors) to 4.64 (all tensors)"."""
    one = {**_summary("flat", 1e-5), "lowest": ("all tensors", 4.64), "highest": ("all tensors", 4.64)}
    line = summary_line("MargLikCallback", one)
    assert "learned precision 4.64 (all tensors);" in line and " to 4.64" not in line
    two = {**_summary("flat", 1e-5), "lowest": ("0.bias", 0.5), "highest": ("0.weight", 2.0)}
    assert "learned precisions 0.5 (0.bias) to 2 (0.weight);" in summary_line("MargLikCallback", two)
