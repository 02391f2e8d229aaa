"""Forwards that torch.func.vmap refuses (issue 18.2): the exact path falls back to plain autograd.

The exact per-example rows run under ``vmap``, which refuses Python control flow on tensor values
(e.g. Hugging Face's attention-mask helpers branch on ``mask.all()``). The engine then computes the
same rows with plain autograd, one example at a time, and names the modules in a warning. Proven
in float64 against the dense reference and against a vmap-friendly twin of the same network; the
callback runs the evidence pass on one batch at set-up, so whatever even the loop cannot do fails
before the first training step.
"""
from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from lightning_marglik import (
    CategoricalLikelihood,
    GaussianPrior,
    LaplaceEvidence,
    MargLikCallback,
    MargLikConfigurationError,
    map_loss,
)
from tests.lightning_models import trainer
from tests.reference import graph_problem, hyper, reference_env, rel_err  # noqa: F401 (reference_env: autouse fixture)

TOL = 1e-8


class MaskedScale(nn.Module):
    """Masks padded positions and scales features: not a hook layer, so it takes the exact path.

    ``branch=True`` skips the mask when nothing is padded, as HF's ``masking_utils`` does: the same
    outputs, but a Python ``if`` on a tensor value, which vmap refuses.
    """

    def __init__(self, width: int, branch: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(width))
        self.branch = branch

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not self.branch or not mask.all():
            h = h * mask.unsqueeze(-1)
        return h * self.weight


class Tokens(nn.Module):
    """Embedding -> Linear -> tanh -> MaskedScale -> masked mean -> Linear; forward(input_ids, attention_mask)."""

    def __init__(self, branch: bool, vocab: int = 7, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.scale = MaskedScale(width, branch)
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.scale(torch.tanh(self.mix(self.embed(input_ids))), attention_mask)
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * mask).sum(1) / mask.sum(1))


def token_batches(n: int = 12, batch: int = 4, seq: int = 5, seed: int = 0):
    """Token batches with padding in some examples (and none in others)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 7, (n, seq), generator=g)
    lengths = torch.randint(2, seq + 1, (n,), generator=g)
    mask = (torch.arange(seq) < lengths[:, None]).long()
    y = torch.randint(0, 3, (n,), generator=g)
    inputs = {"input_ids": ids * mask, "attention_mask": mask}
    return inputs, y, [({k: v[i : i + batch] for k, v in inputs.items()}, y[i : i + batch]) for i in range(0, n, batch)]


def twins():
    torch.manual_seed(0)
    branchy = Tokens(branch=True)
    plain = Tokens(branch=False)
    plain.load_state_dict(branchy.state_dict())
    return branchy, plain


def fit(model, data, structure):
    prior, lik = hyper(model, "classification", learn=True)
    return LaplaceEvidence.fit(model, data, lik, prior, structure=structure), prior, lik


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_vmap_refusal_falls_back_to_the_same_numbers(structure):
    branchy, plain = twins()
    inputs, y, data = token_batches()
    named = "every parameter" if structure == "full" else "'scale'"
    with pytest.warns(UserWarning, match=rf"vmap cannot run the forward.*{named}.*plain autograd"):
        ev, prior, lik = fit(branchy, data, structure)
    ref = graph_problem(branchy, inputs, y, "classification").reference(structure, "ggn")
    expected = ref.evaluate(prior, lik)
    assert ev.n_data == ref.n_data == 12
    assert rel_err(ev.log_det(), expected["log_det"]) <= TOL
    assert rel_err(ev.log_marglik(), expected["log_marglik"]) <= TOL
    lib, want = ev.gradient(), ref.gradient(prior, lik)
    for name in want:
        assert rel_err(lib[name], want[name]) <= TOL, name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the vmap-friendly twin: only the slow-path note
        twin, _, _ = fit(plain, data, structure)
    assert rel_err(ev.log_det(), twin.log_det()) <= 1e-12
    assert rel_err(ev.log_marglik(), twin.log_marglik()) <= 1e-12


def test_fallback_is_decided_once_per_pass():
    branchy, _ = twins()
    _, _, data = token_batches(n=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(branchy, data, "diag")
    assert sum("vmap cannot run" in str(w.message) for w in caught) == 1  # 4 batches, one warning


# --- the callback: the evidence pass on one batch at set-up ------------------------------------


class Module(pl.LightningModule):
    def __init__(self, net: nn.Module, n_data: int) -> None:
        super().__init__()
        self.net, self.n_data, self.steps = net, n_data, 0
        self.prior, self.likelihood = GaussianPrior(self.net), CategoricalLikelihood()

    def forward(self, input_ids, attention_mask):
        return self.net(input_ids, attention_mask)

    def marglik_batch(self, batch):
        return batch

    def training_step(self, batch, batch_idx):
        self.steps += 1
        inputs, y = batch
        return map_loss(self(**inputs), y, self.likelihood, self.prior, self.n_data)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=1e-2)


class ReentrantScale(MaskedScale):
    """A reentrant checkpoint around an exact-path module: no gradient reaches its weight at all."""

    def forward(self, h, mask):
        return checkpoint(super().forward, h, mask, use_reentrant=True)


def test_callback_warns_of_the_fallback_before_the_first_step():
    branchy, _ = twins()
    _, _, data = token_batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = Module(branchy, 12)

        class Count(pl.Callback):
            def on_train_batch_start(self, *args):
                self.at_first_step = sum("vmap cannot run" in str(w.message) for w in caught)

        counter = Count()
        trainer([MargLikCallback(structure="diag", steps=1), counter], max_epochs=1).fit(
            module, DataLoader(data, batch_size=None)
        )
    assert counter.at_first_step >= 1


def test_callback_refuses_before_the_first_step_what_even_the_loop_cannot_do():
    torch.manual_seed(0)
    net = Tokens(branch=True)
    net.scale = ReentrantScale(4, branch=True)
    _, _, data = token_batches()
    module = Module(net, 12)
    with pytest.raises(MargLikConfigurationError, match=r"one evidence batch through the evidence pass.*use_reentrant=False"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note that no checkpoint input requires grad
            trainer([MargLikCallback(structure="diag", steps=1)], max_epochs=1).fit(module, DataLoader(data, batch_size=None))
    assert module.steps == 0
