"""Options a probe passed that were taken wrongly or failed late, each now refused at construction (or at set-up)
with one line that names the value and the fix, or taken right."""
from __future__ import annotations

import re

import pytest

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior
from tests.lightning_models import Regressor

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:.*LeafSpec.*")


# --- flags given as strings or numbers --------------------------------------------------------------------------


@pytest.mark.parametrize("make, name", [
    (lambda value: GaussianPrior(Regressor().net, learn=value), "learn"),
    (lambda value: GaussianLikelihood(learn_sigma=value), "learn_sigma"),
    (lambda value: GaussianLikelihood(learn_temperature=value), "learn_temperature"),
    (lambda value: CategoricalLikelihood(learn_temperature=value), "learn_temperature"),
])
@pytest.mark.parametrize("value", ["false", "no", 0, None])
def test_a_hyperparameters_learn_flag_that_is_not_a_bool_is_refused(make, name, value):
    with pytest.raises(ValueError, match=rf"`{name}` must be True or False.*got {re.escape(repr(value))}\."):
        make(value)
