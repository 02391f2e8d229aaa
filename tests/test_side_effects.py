"""``LaplaceEvidence.fit`` leaves the model as it found it.

Per-submodule train/eval flags restored (mixed modes, Dropout, BatchNorm), no hooks left behind
(also after an error mid-pass), no ``.grad`` written, parameters and BatchNorm running statistics
unchanged; the pass itself runs in eval mode (deterministic, matches the eval-mode reference).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence
from tests.reference import Problem, hyper, loader, reference_env, rel_err  # noqa: F401 (reference_env: autouse fixture)

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def dropout_bn_model(n_out: int = 2) -> nn.Sequential:
    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Linear(3, 6),
        nn.Tanh(),
        nn.Dropout(0.5),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, n_out),
    ).double()
    bn = model[4]
    bn.weight.requires_grad_(False)  # frozen affine: the prior and Kronecker layers stay Linear-only
    bn.bias.requires_grad_(False)
    with torch.no_grad():
        bn.running_mean.copy_(0.2 * torch.randn(6))
        bn.running_var.copy_(1 + 0.5 * torch.rand(6))
        bn.weight.copy_(1 + 0.2 * torch.randn(6))
    model.train()
    model[3].eval()  # a mixed state: one submodule in eval mode inside a training model
    return model


def snapshot(model: nn.Module) -> dict:
    return {
        "modes": [(name, m.training) for name, m in model.named_modules()],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def assert_untouched(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["modes"] == before["modes"]
    assert after["requires_grad"] == before["requires_grad"]
    for n, p in before["params"].items():
        assert torch.equal(after["params"][n], p), n
    for n, b in before["buffers"].items():
        assert torch.equal(after["buffers"][n], b), n  # BatchNorm running stats, num_batches_tracked
    for name, m in model.named_modules():
        for attr in HOOK_DICTS:
            assert len(getattr(m, attr)) == 0, (name, attr)
    for attr in GLOBAL_HOOKS:
        assert len(getattr(module_mod, attr)) == 0, attr
    for n, p in model.named_parameters():
        assert p.grad is None, n


@pytest.mark.parametrize("approx", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_fit_leaves_the_model_untouched_and_runs_in_eval_mode(kind, structure, approx):
    n_out = 2 if kind == "regression" else 3
    model = dropout_bn_model(n_out)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=gen)
    y = torch.randn(20, n_out, generator=gen) if kind == "regression" else torch.randint(0, n_out, (20,), generator=gen)
    prior, lik = hyper(model, kind, "layerwise")
    before = snapshot(model)
    ev = LaplaceEvidence.fit(model, loader(x, y, 8), lik, prior, structure=structure, approx=approx)
    assert_untouched(model, before)
    again = LaplaceEvidence.fit(model, loader(x, y, 8), lik, prior, structure=structure, approx=approx)
    assert again.log_marglik().item() == pytest.approx(ev.log_marglik().item(), rel=1e-12)  # no dropout noise
    # the reference evaluates in eval mode (dropout off, BatchNorm on its running statistics)
    expected = Problem(model, prior.param_names, x, y, kind).reference(structure, approx).evaluate(prior, lik)
    assert rel_err(ev.log_marglik(), expected["log_marglik"]) <= 1e-8
    assert rel_err(ev.log_det(), expected["log_det"]) <= 1e-8
    assert_untouched(model, before)


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_existing_grads_are_left_alone(structure):
    model = dropout_bn_model()
    x, y = torch.randn(10, 3), torch.randn(10, 2)
    grads = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
            grads[n] = p.grad.clone()
    LaplaceEvidence.fit(model, loader(x, y), GaussianLikelihood(), GaussianPrior(model), structure=structure)
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.equal(p.grad, grads[n]), n
        else:
            assert p.grad is None


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_modes_and_hooks_restored_after_an_error_mid_pass(structure):
    """The second batch carries float class labels: the pass fails halfway, the model is restored."""
    model = dropout_bn_model(3)
    before = snapshot(model)
    batches = [
        (torch.randn(6, 3), torch.randint(0, 3, (6,))),
        (torch.randn(6, 3), torch.zeros(6)),  # invalid labels
    ]
    with pytest.raises(ValueError):
        LaplaceEvidence.fit(model, batches, CategoricalLikelihood(), GaussianPrior(model), structure=structure)
    assert_untouched(model, before)
    with pytest.raises(TypeError):  # and on a malformed batch after a good one
        LaplaceEvidence.fit(model, [batches[0], (batches[0][0],)], CategoricalLikelihood(), GaussianPrior(model), structure=structure)
    assert_untouched(model, before)


def test_fit_does_not_touch_hyperparameters():
    model = dropout_bn_model()
    x, y = torch.randn(10, 3), torch.randn(10, 2)
    prior, lik = hyper(model, "regression", "layerwise", learn=True)
    bufs = [prior.log_precision, lik.log_sigma, lik.log_temperature]
    before = [b.clone() for b in bufs]
    ev = LaplaceEvidence.fit(model, loader(x, y), lik, prior, structure="kron")
    ev.log_marglik()
    ev.gradient()
    for a, b in zip(before, bufs):
        assert torch.equal(a, b) and not b.requires_grad and b.grad is None
