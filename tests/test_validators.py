"""The shared option checks: canonical values, refusals that name the option, and near-miss suggestions."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from lightning_marglik import GammaHyperprior, LogNormalHyperprior
from lightning_marglik.validators import choice, integer, number, optional, suggestion

STRUCTURES = ("full", "kron", "ekfac", "diag")


@given(st.sampled_from(STRUCTURES), st.booleans(), st.sampled_from(["", " ", "\t"]))
def test_choice_ignores_case_and_surrounding_space(value, upper, pad):
    given_value = pad + (value.upper() if upper else value) + pad
    assert choice(given_value, STRUCTURES, "structure") == value


@pytest.mark.parametrize("bad, near", [("kfac", "kron"), ("krn", "kron"), ("diagonal", "diag"), ("ekfca", "ekfac")])
def test_near_misses_are_refused_with_a_suggestion(bad, near):
    with pytest.raises(ValueError, match=rf"`structure`.*{bad!r} \(did you mean {near!r}\?\)"):
        choice(bad, STRUCTURES, "structure")


@pytest.mark.parametrize("bad", ["banana", None, 3, ["kron"]])
def test_far_misses_and_non_strings_are_refused_without_a_suggestion(bad):
    with pytest.raises(ValueError, match="`structure` must be one of") as info:
        choice(bad, STRUCTURES, "structure")
    assert "did you mean" not in str(info.value)
    assert suggestion(bad, STRUCTURES) == ""


def test_choices_that_differ_only_in_case_need_the_exact_spelling():
    assert choice("A", ("a", "A"), "x") == "A"
    with pytest.raises(ValueError):
        choice("b", ("a", "A"), "x")


@pytest.mark.parametrize("bad", [True, False, 1.0, "2", None, -1])
def test_integer_refuses_bools_floats_strings_and_small_values(bad):
    with pytest.raises(ValueError, match=r"`frequency` must be an int >= 0"):
        integer(bad, "frequency")
    assert integer(0, "frequency") == 0


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, math.nan, math.inf, True, "0.5", None])
def test_number_refuses_values_outside_the_interval_and_non_numbers(bad):
    with pytest.raises(ValueError, match=r"`statistics_fraction` must be a finite number in \(0, 1\]"):
        number(bad, "statistics_fraction", 0, 1)


def test_number_bounds_open_and_closed():
    assert number(1, "f", 0, 1) == 1.0
    assert number(0, "f", 0, 1, low_open=False) == 0.0
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        number(1, "f", 0, 1, low_open=False, high_open=True)
    assert optional(number, None, "lr") is None
    assert optional(number, 0.1, "lr") == 0.1


def test_number_takes_a_one_element_tensor_as_its_number_as_the_hyperparameters_do():
    """GammaHyperprior(torch.tensor(2.0)) was refused as 'must be a finite number ..., got tensor(2.)', where
    GaussianPrior(precision=torch.tensor(2.0)) takes it."""
    assert number(torch.tensor(0.5, dtype=torch.float64), "statistics_fraction", 0, 1) == 0.5
    assert GammaHyperprior(torch.tensor(2.0), rate=torch.tensor([0.5])).log_density(torch.tensor(0.0), 0.0).item() == (
        GammaHyperprior(2.0, 0.5).log_density(torch.tensor(0.0), 0.0).item())
    assert LogNormalHyperprior(torch.tensor(3.0)).scale == 3.0
    for bad in (torch.tensor([0.5, 0.5]), torch.tensor(True), torch.tensor(math.nan), torch.tensor(2.0)):
        with pytest.raises(ValueError, match=r"`statistics_fraction` must be a finite number in \(0, 1\]"):
            number(bad, "statistics_fraction", 0, 1)
