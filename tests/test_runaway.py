"""Run-away precisions: which tensors count, and the callback's one warning per tensor that names them."""
import math
import warnings

import pytest
import torch
from torch import nn

from lightning_marglik import GaussianPrior, MargLikCallback
from lightning_marglik.runaway import RUNAWAY_LOG_RISE, runaway_message, runaway_precisions
from tests.lightning_models import Regressor, loader, regression_data, trainer


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))


def test_rises_are_measured_from_the_declared_precision_over_learned_tensors_only():
    prior = GaussianPrior(_net(), precision=10.0, fixed=["2.bias"])
    start = math.log(10.0)
    prior.log_precision[:] = start + torch.tensor([1.0, RUNAWAY_LOG_RISE + 0.5, RUNAWAY_LOG_RISE, 20.0])
    # 0.bias is above the threshold, 2.weight exactly at it (not above), 2.bias fixed (not learned)
    assert runaway_precisions(prior) == pytest.approx({"0.bias": RUNAWAY_LOG_RISE + 0.5})
    for bad in (float("nan"), -1.0, "8"):  # a hurried threshold is refused, not silently "nothing ran away"
        with pytest.raises(ValueError, match="`threshold` must be a finite number"):
            runaway_precisions(prior, threshold=bad)
    assert runaway_precisions(prior, threshold=0.5) == pytest.approx(
        {"0.weight": 1.0, "0.bias": RUNAWAY_LOG_RISE + 0.5, "2.weight": RUNAWAY_LOG_RISE}
    )


def test_below_a_declared_precision_of_1_rises_are_measured_from_1():
    """A weak declared prior (1e-4) made an ordinary learned precision (0.55) a runaway of +8.6, with advice to hold
    the tensor."""
    prior = GaussianPrior(_net(), precision=1e-4)
    prior.log_precision[:] = torch.tensor([math.log(0.547), 0.0, RUNAWAY_LOG_RISE + 0.5, -3.0])
    assert runaway_precisions(prior) == pytest.approx({"2.weight": RUNAWAY_LOG_RISE + 0.5})


def test_scalar_and_diagonal_priors():
    scalar = GaussianPrior(_net(), structure="scalar")
    scalar.log_precision[:] = 9.0
    assert runaway_precisions(scalar) == {"every parameter": 9.0}
    assert runaway_precisions(GaussianPrior(_net(), structure="scalar", learn=False)) == {}
    diagonal = GaussianPrior(_net(), structure="diagonal")
    sizes = diagonal.param_sizes  # 6, 3, 3, 1
    diagonal.log_precision[sizes[0] + 1] = 12.0  # one entry of 0.bias: the tensor's largest counts
    assert runaway_precisions(diagonal) == {"0.bias": 12.0}


def test_the_message_tells_trained_from_decoupled_tensors():
    prior = GaussianPrior(_net())
    prior.treat(["0.bias"], "decoupled", "bias/normalization")
    message = runaway_message(prior, {"0.bias": 9.0, "2.weight": 10.25})
    assert message.startswith("MargLikCallback: the learned prior precision")
    assert "being switched off: 2.weight (+10.2)" in message and "GaussianPrior(fixed=['2.weight'])" in message
    assert "counts them as pruned: 0.bias (+9.0)" in message
    assert runaway_message(prior, {}) == ""
    scalar = GaussianPrior(_net(), structure="scalar")  # no per-tensor fix exists: the message says what does
    assert "use structure='layerwise'" in runaway_message(scalar, {"every parameter": 9.0})
    assert "fixed=" not in runaway_message(scalar, {"every parameter": 9.0})


def _fit(callback: MargLikCallback, epochs: int) -> list:
    model = Regressor()
    # a bias precision far above the declared 1: with max_step=1 an estimate moves it by at most 1
    model.prior.log_precision[1] = RUNAWAY_LOG_RISE + 5.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], epochs).fit(model, loader(regression_data()))
    assert model.prior.log_precision[1] > RUNAWAY_LOG_RISE  # still run away after the estimates
    return [str(w.message) for w in caught if "rose more than e^8" in str(w.message)]


def test_the_callback_names_each_run_away_tensor_once_per_fit():
    decoupled = _fit(MargLikCallback(frequency=1, steps=5, settle=None, max_step=1.0), epochs=3)
    assert len(decoupled) == 1  # three estimates, one warning
    assert "counts them as pruned: 0.bias" in decoupled[0]
    learned = _fit(MargLikCallback(frequency=1, steps=5, settle=None, max_step=1.0, biases="learn"), epochs=2)
    assert len(learned) == 1 and "being switched off: 0.bias" in learned[0]
