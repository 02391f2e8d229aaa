"""The optional BackPACK backend equals the hook backend in float64, and refuses what it cannot take."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence, MargLikCallback
from tests.lightning_models import Regressor, loader as lightning_loader, regression_data, trainer
from tests.reference import hyper, loader, reference_env, rel_err, setup  # noqa: F401 (reference_env: autouse fixture)

pytest.importorskip("backpack")


@pytest.mark.parametrize("kind", ["regression", "classification"])
@pytest.mark.parametrize(
    "model_name,structure,approx", [("mlp_deep", "diag", "ggn"), ("mlp_deep", "diag", "ef"), ("mlp_deep", "kron", "ggn"),
                                    ("cnn", "diag", "ggn"), ("cnn", "diag", "ef")]
)
def test_backpack_backend_equals_hooks(model_name, structure, approx, kind):
    model, x, y, _ = setup(model_name, kind)
    prior, lik = hyper(model, kind, "layerwise", learn=True)
    ours = LaplaceEvidence.fit(model, loader(x, y, 12), lik, prior, structure, approx)
    theirs = LaplaceEvidence.fit(model, loader(x, y, 12), lik, prior, structure, approx, backend="backpack")
    assert rel_err(theirs.log_marglik(), ours.log_marglik()) <= 1e-10
    for name, grad in ours.gradient().items():
        assert rel_err(theirs.gradient()[name], grad) <= 1e-10, name
    assert not any(p.grad is not None for p in model.parameters())  # BackPACK ran on a copy


@pytest.mark.parametrize(
    "model_name,structure,approx,match",
    [
        ("cnn", "kron", "ggn", "Conv2d"),
        ("mlp_deep", "kron", "ef", "Kronecker-factored empirical Fisher"),
        ("mlp_deep", "full", "ggn", "full"),
    ],
)
def test_backpack_backend_refuses_what_it_cannot_take(model_name, structure, approx, match):
    model, x, y, _ = setup(model_name, "classification")
    with pytest.raises(ValueError, match=rf"backend='backpack' cannot take this model: .*{match}.*backend='hooks'"):
        LaplaceEvidence.fit(model, loader(x, y), CategoricalLikelihood(), GaussianPrior(model), structure, approx,
                            backend="backpack")


def test_backpack_backend_refuses_a_network_that_is_not_sequential():
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return x + self.fc(x)

    model = Residual()
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    with pytest.raises(ValueError, match="nn.Sequential"):
        LaplaceEvidence.fit(model, loader(x, y), GaussianLikelihood(), GaussianPrior(model), "diag", backend="backpack")


def test_callback_with_the_backpack_backend_learns_the_same_hyperparameters():
    results = []
    for backend in ("hooks", "backpack"):
        torch.manual_seed(0)
        model = Regressor().double()
        data = lightning_loader(regression_data())
        data.dataset.tensors = tuple(t.double() for t in data.dataset.tensors)
        trainer([cb := MargLikCallback(structure="kron", steps=20, backend=backend)], max_epochs=2).fit(model, data)
        results.append((cb.history[-1]["marglik"], model.prior.log_precision.clone()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-9)
    assert torch.allclose(results[1][1], results[0][1], rtol=1e-8)
    with pytest.raises(ValueError, match="backend.*'jax'"):
        MargLikCallback(backend="jax")
