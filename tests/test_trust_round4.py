"""Trust, fourth round (issue 35, items 1-7): the mistakes a new user makes first, a killed job that
keeps its work, and a pruned layer that keeps its Kronecker factors.

Real Trainers and checkpoints on disk; numbers in float64 against the dense references of
``tests/reference.py``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_marglik import (
    CategoricalLikelihood,
    GaussianLikelihood,
    GaussianPrior,
    LaplaceEvidence,
    MargLikCallback,
    MargLikConfigurationError,
    predict_classification,
    select_models,
)
from tests.lightning_models import BlobData, Classifier, Regressor, loader, regression_data, trainer


class NoTraining(Regressor):
    """A Regressor whose training must never start (the refusal comes first)."""

    def training_step(self, batch, batch_idx):
        raise AssertionError("training must not start")


# --- item 2: the likelihood names the likely fix for targets of the other kind ---------------------


def test_regression_targets_under_a_categorical_likelihood_name_gaussian_likelihood_before_training():
    model = NoTraining()
    model.likelihood = CategoricalLikelihood()  # float targets (64, 1): a regression problem
    with pytest.raises(MargLikConfigurationError, match=r"got \(16, 1\) of torch.float64\. Floating-point targets are "
                       r"regression targets: for regression use GaussianLikelihood"):
        trainer([MargLikCallback()], 1).fit(model, loader(regression_data()))


def test_class_labels_under_a_gaussian_likelihood_name_categorical_likelihood():
    net = nn.Linear(2, 3)
    labels = torch.randint(0, 3, (8,))
    data = [(torch.randn(8, 2), labels)]
    with pytest.raises(ValueError, match="Integer targets are class labels: for classification use CategoricalLikelihood"):
        LaplaceEvidence.fit(net, data, GaussianLikelihood(), GaussianPrior(net), structure="diag")
    single = nn.Linear(2, 1)  # one output: the labels fit its shape, their dtype does not
    with pytest.raises(ValueError, match="expects floating-point targets, got torch.int64. Integer targets are class"):
        LaplaceEvidence.fit(single, data, GaussianLikelihood(), GaussianPrior(single), structure="diag")


# --- items 3 and 4: select_models refuses what it cannot train, before training anything ----------


def _counted(built: list):
    """A factory of Classifier that records each call in ``built``."""
    def factory():
        built.append(1)
        return Classifier(n_data=60)
    return factory


def test_select_models_refuses_a_module_instance_before_training_any_candidate():
    built: list = []
    with pytest.raises(ValueError, match=r"candidate 'mlp' is a Classifier instance, not a factory: give a class or a "
                       r"function that returns a fresh module, e.g. \{'mlp': Classifier\}"):
        select_models({"first": _counted(built), "mlp": Classifier(n_data=60)}, datamodule=BlobData(),
                      trainer={"max_epochs": 1}, verbose=False)
    assert built == []  # refused before the first candidate was built


def test_select_models_refuses_a_factory_that_returns_no_lightning_module():
    with pytest.raises(ValueError, match=r"candidate 'net''s factory returned a Linear, not a pytorch_lightning.LightningModule"):
        select_models({"net": lambda: nn.Linear(2, 3)}, datamodule=BlobData(), verbose=False)


def test_select_models_names_the_callback_argument_meant_before_training():
    built: list = []
    with pytest.raises(ValueError, match=r"`callback` has keys that are not MargLikCallback arguments: 'structre' "
                       r"\(did you mean 'structure'\?\)"):
        select_models({"mlp": _counted(built)}, datamodule=BlobData(), callback={"structre": "full"}, verbose=False)
    with pytest.raises(ValueError, match=r"`structure` must be one of .*got 'fulll' \(did you mean 'full'\?\)"):
        select_models({"mlp": _counted(built)}, datamodule=BlobData(), callback={"structure": "fulll"}, verbose=False)
    assert built == []


# --- item 5: every choice-valued option of the prior (and the engine's) says what was meant -------


def _evidence() -> LaplaceEvidence:
    net = nn.Linear(2, 3)
    data = [(torch.randn(8, 2), torch.randint(0, 3, (8,)))]
    return LaplaceEvidence.fit(net, data, CategoricalLikelihood(), GaussianPrior(net), structure="diag")


@pytest.mark.parametrize("call, meant", [
    (lambda: GaussianPrior(nn.Linear(2, 2), structure="layer-wise"), "layerwise"),
    (lambda: GaussianPrior(nn.Linear(2, 2), structure="diag"), "diagonal"),
    (lambda: GaussianPrior(nn.Linear(2, 2), structure="per-tensor"), "layerwise"),
    (lambda: GaussianPrior(nn.Linear(2, 2)).treat_scale_invariant([], "decouple"), "decoupled"),
    (lambda: GaussianPrior(nn.Linear(2, 2)).treat([], "fix", "mine"), "fixed"),
    (lambda: _evidence().optimize(solver="newtn"), "newton"),
    (lambda: predict_classification(_evidence(), nn.Linear(2, 3), torch.randn(2, 2), method="probt"), "probit"),
], ids=["layer-wise", "diag", "per-tensor", "scale_invariant", "treatment", "solver", "method"])
def test_choice_valued_options_of_the_prior_and_engine_name_the_value_meant(call, meant):
    with pytest.raises(ValueError, match=rf"\(did you mean '{meant}'\?\)"):
        call()


def test_choice_valued_options_of_the_prior_ignore_case():
    assert GaussianPrior(nn.Linear(2, 2), structure=" Layerwise ").structure == "layerwise"

