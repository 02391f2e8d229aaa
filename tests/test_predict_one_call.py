"""``lightning_marglik.predict``: the predictive after a fit in one call, inside a real ``Trainer.predict``, against a
float64 brute-force posterior (explicit Jacobians, a dense ``H``), and its one-line refusals."""
from __future__ import annotations

import logging
import math
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import (
    CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence, MargLikCallback, RegressionPrediction,
    map_loss, predict, predict_classification,
)
from lightning_marglik.predictive import describe, over_confident, training_confidence
from tests.lightning_models import trainer as make_trainer
from tests.reference import jacobians

N, D = 48, 2


class Net(pl.LightningModule):
    """A small MLP whose ``predict_step`` is the one call (``source``: the callback, set by the test)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, 3 if kind == "classification" else 1))
        self.prior = GaussianPrior(self.net, structure="layerwise")
        self.likelihood = CategoricalLikelihood() if kind == "classification" else GaussianLikelihood(sigma=0.5)
        self.source = None
        self.method = None  # predict's default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return map_loss(self(x), y, self.likelihood, self.prior)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        assert torch.is_inference_mode_enabled()  # what Lightning's predict loop runs under
        return predict(self.source, self, x, method=self.method)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=2e-2)


def data(kind: str, n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    y = (x[:, 0] > x[:, 1]).long() + (x[:, 0] > 1).long() if kind == "classification" else torch.sin(x[:, :1]) * 2
    return TensorDataset(x, y)


def fitted(kind: str):
    """A float64 fit of 30 epochs with the exact full GGN (estimates after epochs 10, 20, 30), and its callback."""
    torch.manual_seed(0)
    module = Net(kind)
    callback = MargLikCallback(structure="full", approx="ggn", mc_samples=0)
    trainer = make_trainer([callback], max_epochs=30, precision="64-true")
    trainer.fit(module, DataLoader(data(kind, N, 0), batch_size=16))
    module.source = callback
    return module, callback, trainer


def brute_force_covariance(module: Net, x_test: torch.Tensor):
    """``f(x*)`` and ``J* H^-1 J*^T`` with ``H = s sum_n J_n^T Lambda_n J_n + diag(delta)`` built densely."""
    names = [f"net.{n}" for n, _ in module.net.named_parameters()]
    x, _ = data("classification" if isinstance(module.likelihood, CategoricalLikelihood) else "regression", N, 0).tensors
    f, jac = jacobians(module, names, x)
    if isinstance(module.likelihood, CategoricalLikelihood):
        p = f.softmax(1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        scale = 1.0
    else:
        lam = torch.eye(1, dtype=f.dtype).expand(len(x), 1, 1)
        scale = module.likelihood.sigma.detach().double().item() ** -2
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)
    delta = module.prior.per_parameter(module.prior.log_precision.detach()).exp().double()
    h = scale * ggn + torch.diag(delta)
    f_test, j_test = jacobians(module, names, x_test)
    return f_test, j_test @ torch.linalg.inv(h) @ j_test.transpose(1, 2)


def probit(f: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    return torch.softmax(f / torch.sqrt(1 + math.pi / 8 * torch.diagonal(cov, dim1=1, dim2=2)), 1)


def test_classification_in_trainer_predict_equals_the_brute_force_tempered_probit():
    module, callback, trainer = fitted("classification")
    module.method = "tempered"
    test = data("classification", 20, 1)
    batches = trainer.predict(module, DataLoader(test, batch_size=8))
    probs = torch.cat(batches)
    f, cov = brute_force_covariance(module, test.tensors[0])
    center = torch.eye(3, dtype=f.dtype) - 1 / 3  # the default: one scale per input, the centred logits' mean variance
    v = torch.diagonal(center @ cov @ center, dim1=1, dim2=2).mean(1, keepdim=True)
    expected = torch.softmax(f / torch.sqrt(1 + math.pi / 8 * v), 1)
    assert probs.dtype == torch.float64 and probs.shape == (20, 3)
    assert torch.allclose(probs, expected, rtol=1e-8, atol=1e-10)
    assert (probs - f.softmax(1)).abs().max() > 1e-3  # the posterior's variance changed them: not the softmax
    assert (probs - probit(f, cov)).abs().max() > 1e-3  # not laplace-torch's probit, which counts the shared variance
    assert torch.equal(probs.argmax(1), f.argmax(1))  # the network's predicted class
    # laplace-torch's probit on request, the same as the function on the callback's evidence (outside inference mode)
    plain = predict(callback, module, test.tensors[0], method="probit")
    assert torch.allclose(plain, probit(f, cov), rtol=1e-8, atol=1e-10)
    assert torch.equal(plain, predict_classification(callback.evidence, module, test.tensors[0]))


def test_regression_in_trainer_predict_equals_the_brute_force_gaussian():
    module, callback, trainer = fitted("regression")
    test = data("regression", 20, 1)
    batches = trainer.predict(module, DataLoader(test, batch_size=8))
    assert all(isinstance(b, RegressionPrediction) for b in batches)
    mean = torch.cat([b.mean for b in batches])
    model_variance = torch.cat([b.model_variance for b in batches])
    f, cov = brute_force_covariance(module, test.tensors[0])
    assert torch.allclose(mean, f, rtol=1e-12, atol=1e-12)
    assert torch.allclose(model_variance, torch.diagonal(cov, dim1=1, dim2=2), rtol=1e-8, atol=1e-12)
    sigma2 = module.likelihood.sigma.detach().double() ** 2
    assert torch.allclose(torch.cat([b.noise_variance for b in batches]), sigma2.expand_as(mean))
    assert abs(sigma2.item() - 0.25) > 1e-3  # learned, not the declared 0.5^2


@pytest.mark.parametrize("method", [None, "tempered"])
def test_modes_grads_and_requires_grad_are_left_as_they_were(method):
    module, callback, _ = fitted("classification")
    module.train()
    module.net[2].eval()  # mixed flags: each one restored, not module.train()
    grads = [torch.randn_like(p) for p in module.parameters()]
    for p, g in zip(module.parameters(), grads):
        p.grad = g.clone()
    module.net[0].bias.requires_grad_(False)
    flags = [m.training for m in module.modules()]
    with torch.inference_mode():
        x = torch.randn(5, D, dtype=torch.float64)
        probs = predict(callback, module, x, method=method)
    assert probs.shape == (5, 3)
    assert [m.training for m in module.modules()] == flags
    assert all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), grads))
    assert [p.requires_grad for p in module.parameters()] == [True, False, True, True]


def training_figures(module: Net):
    """The fitted network's mean top probability and accuracy on its training data, by hand."""
    x, y = data("classification", N, 0).tensors
    with torch.no_grad():
        p = module.eval()(x).softmax(1)
    return p.max(1).values.mean().item(), (p.argmax(1) == y).double().mean().item()


def test_the_default_returns_the_networks_softmax_where_it_is_not_over_confident_on_its_training_data(caplog):
    module, callback, trainer = fitted("classification")
    confidence, accuracy = training_figures(module)
    assert confidence <= accuracy  # a network that fits its data: the posterior could only lower its confidence
    test = data("classification", 20, 1)
    with caplog.at_level(logging.INFO, logger="lightning_marglik.predictive"):
        probs = torch.cat(trainer.predict(module, DataLoader(test, batch_size=8)))
    with torch.no_grad():
        assert torch.equal(probs, torch.cat([module.eval()(x).softmax(1) for x in test.tensors[0].split(8)]))
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_marglik.predictive"]
    assert len(lines) == 1 and "the network's own softmax (method='auto'" in lines[0], lines
    assert f"on its {N} training data" in lines[0] and "epoch 30" in lines[0]
    assert f"mean top probability {confidence:.4f}, accuracy {accuracy:.4f}" in lines[0]
    with pytest.raises(ValueError, match="`samples` must be an int >= 1, got 0"):
        predict(callback, module, test.tensors[0], samples=0)  # refused before the default decides not to draw


def noisy_linear_model():
    """A 10-class linear model confident on its data, a tenth of whose labels are wrong: over-confident on it."""
    model, x, _ = confident_linear_model(precision=1.0)
    y = torch.arange(200) % 10
    y[::10] = (y[::10] + 1) % 10
    evidence = LaplaceEvidence.fit(model, [(x, y)], CategoricalLikelihood(), GaussianPrior(model), mc_samples=0)
    return model, x, y, evidence


def test_the_default_applies_the_tempered_posterior_where_the_network_is_over_confident_on_its_training_data():
    model, x, y, evidence = noisy_linear_model()
    with torch.no_grad():
        p = model(x).softmax(1)
    confidence, accuracy = p.max(1).values.mean().item(), (p.argmax(1) == y).double().mean().item()
    assert accuracy == 0.9 and confidence > 0.99
    assert training_confidence(evidence) == pytest.approx((confidence, accuracy), rel=1e-12)
    assert over_confident(evidence)
    auto = predict(evidence, model, x[:7])
    assert torch.equal(auto, predict(evidence, model, x[:7], method="tempered"))
    assert (auto - model(x[:7]).softmax(1)).abs().max() > 1e-4  # the posterior applied: not the softmax
    line = describe(evidence, "auto")
    assert "tempered" in line and "over-confident on its training data, on its 200 training data" in line
    assert f"mean top probability {confidence:.4f}, accuracy {accuracy:.4f}" in line


def test_the_default_names_what_it_needs_from_a_likelihood_that_does_not_sum_it():
    class Bare(CategoricalLikelihood):
        def term_statistics(self, output, target, mask):
            return {"log_lik": -self.term_nll(output, target)[mask].sum()}

    model, x, y, _ = noisy_linear_model()
    evidence = LaplaceEvidence.fit(model, [(x, y)], Bare(), GaussianPrior(model), mc_samples=0)
    with pytest.raises(ValueError, match=r"only \['log_lik', 'n_data'\].*method='tempered', 'probit' or 'mc'"):
        predict(evidence, model, x)
    assert predict(evidence, model, x, method="probit").shape == (200, 10)


def test_states_once_what_it_used(caplog):
    module, callback, _ = fitted("classification")
    x = torch.randn(4, D, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="lightning_marglik.predictive"):
        predict(callback, module, x, method="tempered")
        predict(callback, module, x)
        predict(callback, module, x, method="mc", samples=10)
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_marglik.predictive"]
    assert len(lines) == 1, lines
    assert "tempered" in lines[0] and "full-ggn" in lines[0] and "epoch 30" in lines[0]
    # the output layer (net.2: the prior names 2.*) is held at its declared precision by the callback's default
    assert "held at their declared value (2.weight, 2.bias)" in lines[0]


def test_refusals_name_the_mistake_and_the_fix():
    module, callback, _ = fitted("classification")
    x = torch.randn(4, D, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="no estimate yet.*after trainer.fit"):
        predict(MargLikCallback(), module, x)
    with pytest.raises(TypeError, match="MargLikCallback or a LaplaceEvidence, got Tensor"):
        predict(x, module, x)
    with pytest.raises(ValueError, match="list of 2.*batch\\[0\\]"):
        predict(callback, module, [x, torch.zeros(4)])
    with pytest.raises(ValueError, match="outputs have shape \\(3,\\).*x\\[None\\]"):
        predict(callback, module, x[0])
    with pytest.raises(ValueError, match="forward failed on inputs \\(4, 5\\)"):
        predict(callback, module, torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="outputs have shape \\(0, 3\\).*at least one input"):
        predict(callback, module, x[:0])
    nan_row = x.clone()
    nan_row[2, 1] = float("nan")
    with pytest.raises(ValueError, match="not finite for 1 of 4 inputs \\(rows \\[2\\]\\).*NaN or inf"):
        predict(callback, module, nan_row)
    with pytest.raises(ValueError, match="method.*'sample'"):
        predict(callback, module, x, method="sample")
    with pytest.raises(ValueError, match="not the network of this posterior"):
        predict(callback, Net("classification").double(), x)
    with torch.no_grad():
        module.net[0].weight[0, 0] += 1e-3  # e.g. a checkpoint loaded after the last estimate
    with pytest.raises(ValueError, match="weights, or its running statistics .BatchNorm's., are not those of the posterior's estimate.*LaplaceEvidence.fit"):
        predict(callback, module, x)
    # the fix the message names: an evidence at these weights
    evidence = LaplaceEvidence.fit(module, DataLoader(data("classification", N, 0), batch_size=16), module.likelihood,
                                   module.prior, "full")
    assert predict(evidence, module, x).shape == (4, 3)
    with pytest.raises(ValueError, match="`samples` must be an int >= 1, got True"):
        predict(evidence, module, x, samples=True)
    with torch.no_grad():
        module.net[0].weight[0, 0] = float("nan")  # a training that diverged, e.g. on a NaN past the set-up batch
    with pytest.raises(ValueError, match="weights are not finite: training diverged, or the training data hold NaN"):
        predict(evidence, module, x)


@pytest.mark.parametrize("kind", ["classification", "regression"])
def test_an_evidence_fitted_directly_predicts_plain_tensors_outside_inference_mode(kind):
    """The covariance of an evidence fitted directly carries its hyperparameters' graph: the one call's outputs must
    not (``.numpy()`` refuses a tensor that requires grad), nor may reading the first batch's confidence for the
    near-uniform check make torch warn about one."""
    module = Net(kind).double()
    x, y = data(kind, N, 0).tensors
    evidence = LaplaceEvidence.fit(module, [(x, y)], module.likelihood, module.prior, mc_samples=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = predict(evidence, module, x[:5], method="tempered" if kind == "classification" else None)
    tensors = [out] if kind == "classification" else list(out)
    assert all(not t.requires_grad for t in tensors)
    assert all(t.numpy().shape[0] == 5 for t in tensors)


def test_regression_refuses_monte_carlo():
    module, callback, _ = fitted("regression")
    with pytest.raises(ValueError, match="method='mc' is for classification"):
        predict(callback, module, torch.randn(3, D, dtype=torch.float64), method="mc")


def confident_linear_model(precision: float):
    """A 10-class linear model confident on its data, and its exact-GGN evidence under a prior of ``precision``."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(10, 5, generator=g, dtype=torch.float64)
    y = torch.arange(200) % 10
    x = centres[y] + 0.1 * torch.randn(200, 5, generator=g, dtype=torch.float64)
    model = nn.Linear(5, 10).double()
    with torch.no_grad():
        model.weight.copy_(20 * centres)
        model.bias.copy_(-10 * centres.pow(2).sum(1))
    evidence = LaplaceEvidence.fit(model, [(x, y)], CategoricalLikelihood(), GaussianPrior(model, precision=precision),
                                   mc_samples=0)
    return model, x, evidence


def test_a_posterior_that_swamps_a_confident_networks_logits_warns_on_its_first_batch():
    model, x, evidence = confident_linear_model(precision=1e-4)  # the prior barely binds: a wide posterior
    assert model(x).softmax(1).max(1).values.mean() > 0.9
    with pytest.warns(UserWarning, match=r"near uniform on this batch \(mean top probability 0\.1\d\d; uniform 0\.100\)"):
        probs = predict(evidence, model, x[:50], method="tempered")
    assert probs.max(1).values.mean() < 0.19
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        predict(evidence, model, x[50:], method="tempered")  # once per evidence
        narrow_model, narrow_x, narrow = confident_linear_model(precision=1e4)
        probs = predict(narrow, narrow_model, narrow_x, method="tempered")  # a posterior that leaves the logits their spread
    assert probs.max(1).values.mean() > 0.5
