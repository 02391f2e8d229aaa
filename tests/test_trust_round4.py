"""Trust, fourth round (issue 35, items 1-7): the mistakes a new user makes first, a killed job that
keeps its work, and a pruned layer that keeps its Kronecker factors.

Real Trainers and checkpoints on disk; numbers in float64 against the dense references of
``tests/reference.py``.
"""
from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import prune

from lightning_marglik import (
    CategoricalLikelihood,
    GaussianLikelihood,
    GaussianPrior,
    LaplaceEvidence,
    MargLikCallback,
    MargLikConfigurationError,
    map_loss,
    predict_classification,
    select_models,
)
from lightning_marglik.curvature.layers import is_kron_layer
from lightning_marglik.linearized import _structure_delta
from tests.lightning_models import BlobData, Classifier, Regressor, RegressorSteps, loader, regression_data, trainer
from tests.real_networks import batches
from tests.reference import graph_problem, reference_env, rel_err  # noqa: F401 (reference_env: autouse)
from tests.test_ekfac import check_moments_against_reference
from tests.test_real_networks_reference import check_against_reference, fit, hyperparameters
from tests.test_structure_inverse import dense_precision, operator_matrix


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


# --- item 1: a training loss without the prior is named, on the first training batch -------------

PRIOR_NOT_IN_LOSS = "the training loss does not carry the prior"


class MSEOnly(RegressorSteps):
    """The hurried user's training_step: the data term alone, the prior never reaches the weights."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)


class MapLossPlusTerm(RegressorSteps):
    """map_loss with a term of the user's own added."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        return map_loss(out, y, self.likelihood, self.prior) + 1e-3 * out.pow(2).mean()


class OwnLossWithPenalty(RegressorSteps):
    """The user's own data term with the prior's term added by hand."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y) + self.prior.penalty() / self.n_data


class ManualMapLoss(RegressorSteps):
    """Manual optimization (as several optimizers need) with map_loss through manual_backward."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        self.manual_backward(map_loss(self(x), y, self.likelihood, self.prior))
        optimizer.step()


class SkipsFirstBatch(MSEOnly):
    """Skips its first step (returns None): the first batch with a backward decides."""

    def training_step(self, batch, batch_idx):
        return None if self.trainer.global_step == 0 and batch_idx == 0 else super().training_step(batch, batch_idx)


def _lightning_module(body: type, package: str):
    """``body`` as a LightningModule of ``package``, and the trainer and callback classes of that package."""
    if package == "lightning":
        L = pytest.importorskip("lightning.pytorch", reason="the `lightning` package is not installed")
        from lightning_marglik.lightning import MargLikBoundCallback as Bound, MargLikCallback as Callback
        return type(body.__name__, (body, L.LightningModule), {}), L.Trainer, Callback, Bound
    from lightning_marglik import MargLikBoundCallback as Bound
    return type(body.__name__, (body, pl.LightningModule), {}), pl.Trainer, MargLikCallback, Bound


def _fit_one_batch(body: type, package: str = "pytorch_lightning", bound: bool = False, **trainer_kwargs):
    """One training batch (a second one where the first is skipped) under the estimating callback; the warnings."""
    module_class, trainer_class, callback_class, bound_class = _lightning_module(body, package)
    module = module_class()
    callback = bound_class() if bound else callback_class(settle=None, steps=1)
    kwargs = dict(max_epochs=1, limit_train_batches=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")
    kwargs.update(trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_class(callbacks=[callback], **kwargs).fit(module, loader(regression_data()))
    assert module.prior._penalty_nodes is None  # nothing is recorded after the fit
    return [str(w.message) for w in caught if PRIOR_NOT_IN_LOSS in str(w.message)]


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning"])
def test_a_training_loss_without_the_prior_is_named_on_the_first_training_batch(package):
    (message,) = _fit_one_batch(MSEOnly, package)
    assert "MargLikCallback: the training loss does not carry the prior" in message
    assert "map_loss(output, target, self.likelihood, self.prior)" in message and "self.prior.penalty() / N" in message


def test_the_bound_callback_names_a_training_loss_without_the_prior():
    (message,) = _fit_one_batch(MSEOnly, bound=True)
    assert message.startswith("MargLikBoundCallback: the training loss does not carry the prior")


def test_the_first_batch_with_a_backward_decides():
    assert len(_fit_one_batch(SkipsFirstBatch, limit_train_batches=2)) == 1


def test_the_warning_can_be_made_an_error_that_stops_the_fit_at_the_first_batch():
    module_class, trainer_class, callback_class, _ = _lightning_module(MSEOnly, "pytorch_lightning")
    module = module_class()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*training loss does not carry the prior")  # as docs/callback.md says
        with pytest.raises(UserWarning, match="map_loss"):
            trainer_class(callbacks=[callback_class(settle=None)], max_epochs=3, logger=False, enable_progress_bar=False,
                          enable_checkpointing=False, accelerator="cpu").fit(module, loader(regression_data()))
    assert module.trainer.global_step == 1 and module.prior._penalty_nodes is None


@pytest.mark.parametrize("body", [MapLossPlusTerm, OwnLossWithPenalty, ManualMapLoss, RegressorSteps],
                         ids=["extra term", "own loss + penalty", "manual optimization", "map_loss"])
@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning"])
def test_a_training_loss_that_carries_the_prior_is_never_named(body, package):
    accumulate = 1 if body is ManualMapLoss else 2  # two backwards before a step: the check sees each
    assert _fit_one_batch(body, package, limit_train_batches=2, accumulate_grad_batches=accumulate) == []


# --- item 6: a killed job resumes from last.ckpt, exactly ----------------------------------------


class Killed(RuntimeError):
    """The job's death, in the middle of an epoch."""


class KillAt(pl.Callback):
    """Raises :class:`Killed` at the second batch of epoch ``epoch`` (from 0): that epoch's work is lost."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == 1:
            raise Killed(f"killed in epoch {self.epoch}")


def _job(dirpath, kill_at=None, ckpt_path=None, seed=0):
    """The README's recipe (best and last checkpoints, early stopping) on 12 epochs, with the settle rule (its first
    estimate comes late, so a kill can come before it)."""
    from lightning_marglik import MargLikCheckpoint, MargLikEarlyStopping

    torch.manual_seed(seed)  # a resumed job starts from other random weights: the checkpoint must overwrite them
    model = Regressor()
    callback = MargLikCallback(frequency=2, steps=20, settle=0.05, max_step=1.0)
    checkpoint = MargLikCheckpoint(dirpath=dirpath, save_top_k=1, save_last=True)
    stopping = MargLikEarlyStopping(patience=20)
    callbacks = [callback, checkpoint, stopping] + ([KillAt(kill_at)] if kill_at is not None else [])
    trainer([*callbacks], 12).fit(model, loader(regression_data()), ckpt_path=ckpt_path)
    return model, callback, checkpoint, stopping


def _identical(a, b) -> bool:
    """Bitwise equality of nested states (tensors, dicts, lists, numbers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # NaN equals NaN here


@pytest.mark.parametrize("kill_at", [2, 9], ids=["before the first estimate", "after estimates"])
def test_a_job_killed_mid_epoch_resumes_from_last_ckpt_as_if_never_interrupted(kill_at, tmp_path):
    whole_model, whole, whole_checkpoint, whole_stopping = _job(tmp_path / "whole")
    first_estimate = whole.history[0]["epoch"]  # counted from 1
    assert 3 < first_estimate < 10  # the settle rule waits past epoch 3; the second kill comes after estimates
    with pytest.raises(Killed):
        _job(tmp_path / "killed", kill_at=kill_at)
    last = torch.load(tmp_path / "killed" / "last.ckpt", weights_only=False)
    assert last["epoch"] == kill_at - 1  # the last complete epoch, estimate or not
    model, resumed, checkpoint, stopping = _job(tmp_path / "killed", ckpt_path=tmp_path / "killed" / "last.ckpt",
                                                seed=1)
    assert _identical(model.state_dict(), whole_model.state_dict())  # weights and hyperparameters (buffers)
    assert _identical(resumed.state_dict(), whole.state_dict())  # history, best, Adam state, the settle rule's losses
    assert resumed.final_marglik == whole.final_marglik
    assert _identical(checkpoint.best_model_score, whole_checkpoint.best_model_score)
    assert _identical(stopping.state_dict(), whole_stopping.state_dict())
    best = torch.load(checkpoint.best_model_path, weights_only=False)["state_dict"]
    assert _identical(best, torch.load(whole_checkpoint.best_model_path, weights_only=False)["state_dict"])


def test_last_ckpt_is_written_every_epoch_before_the_first_estimate(tmp_path):
    from lightning_marglik import MargLikCheckpoint

    checkpoint = MargLikCheckpoint(dirpath=tmp_path, save_top_k=1, save_last=True)
    callback = MargLikCallback(frequency=2, steps=5, settle=0.05)
    with pytest.raises(Killed):
        trainer([callback, checkpoint, KillAt(2)], 12).fit(Regressor(), loader(regression_data()))
    assert callback.history == [] and checkpoint.best_model_path == ""  # no estimate yet, so no best model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert state["epoch"] == 1 and len(next(v for k, v in state["callbacks"].items() if "MargLikCallback" in k)
                                       ["training_losses"]) == 2


def test_save_last_takes_true_or_false_not_link():
    from lightning_marglik import MargLikCheckpoint

    with pytest.raises(ValueError, match=r"`save_last` must be True or False \(write last.ckpt after every epoch"):
        MargLikCheckpoint(save_last="link")


# --- item 7: a pruned layer keeps its Kronecker factors where its mask allows --------------------

PRUNINGS = {
    "ones": lambda m: prune.identity(m, "weight"),
    "rows": lambda m: prune.ln_structured(m, "weight", amount=0.5, n=1, dim=0),  # whole output units / channels
    "columns": lambda m: prune.ln_structured(m, "weight", amount=0.5, n=1, dim=1),  # whole inputs / input channels
    "rows and columns": lambda m: (PRUNINGS["rows"](m), PRUNINGS["columns"](m)),  # pruned twice: r c^T
    "bias": lambda m: (prune.identity(m, "weight"), prune.l1_unstructured(m, "bias", amount=0.5)),
    "unstructured": lambda m: prune.l1_unstructured(m, "weight", amount=0.4),  # no outer product
}
OUTER = [name for name in PRUNINGS if name != "unstructured"]  # masks r c^T: the layer keeps its factors
_PRUNED: dict = {}


def pruned_case(layer: str, pruning: str, kind: str):
    """(model, x, y, GraphProblem): a Linear or a grouped Conv2d pruned by ``pruning``, then a Linear (cached)."""
    key = (layer, pruning, kind)
    if key not in _PRUNED:
        torch.manual_seed(0)
        if layer == "linear":
            model, x = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)), torch.randn(20, 3)
        else:  # the (out, in) matrix of a grouped conv's weight: out x (in / groups) k k
            model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
            x = torch.randn(20, 4, 6, 6)
        model = model.double()
        PRUNINGS[pruning](model[0])
        y = torch.randint(0, 2, (20,)) if kind == "classification" else torch.randn(20, 2)
        _PRUNED[key] = (model, x, y, graph_problem(model, x, y, kind))
    return _PRUNED[key]


@pytest.mark.parametrize("structure, approx", [("kron", "ggn"), ("kron", "ef"), ("diag", "ggn"), ("full", "ggn")])
@pytest.mark.parametrize("pruning", list(PRUNINGS))
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_pruned_layer_keeps_its_kronecker_factors_where_its_mask_allows_and_equals_the_dense_reference(
    layer, pruning, structure, approx
):
    """The reference's blocks of a pruned tensor are D_m (block) D_m (tests/reference.py); Kronecker blocks
    where the weight's mask has rank one, exact diagonal blocks otherwise."""
    model, x, y, problem = pruned_case(layer, pruning, "regression")
    prior, lik = hyperparameters(model, "regression")
    assert "0.weight_orig" in prior.param_names
    ev = fit(model, batches(x, y, 8), lik, prior, structure, approx)
    assert ev.slow == {}  # the hook path: no per-example Jacobians
    assert is_kron_layer(model[0]) == (pruning in OUTER)
    check_against_reference(ev, problem.reference(structure, approx), prior, lik)


@pytest.mark.parametrize("pruning", OUTER)
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_pruned_layer_under_ekfac_has_the_dense_blocks_moments_in_its_masked_kronecker_eigenbasis(layer, pruning):
    model, x, y, problem = pruned_case(layer, pruning, "classification")
    prior, lik = hyperparameters(model, "classification")
    ev = fit(model, batches(x, y, 8), lik, prior, "ekfac")
    assert check_moments_against_reference(ev, problem, "classification", "ggn") == len(prior.param_sizes)


@pytest.mark.parametrize("structure", ["kron", "ekfac"])
@pytest.mark.parametrize("pruning", ["rows and columns", "bias"])
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_pruned_layers_posterior_inverse_is_the_dense_inverse(layer, pruning, structure):
    """The predictive's covariance and linearized_evidence's preconditioner (Structure.inverse) on the masked blocks."""
    model, x, y, problem = pruned_case(layer, pruning, "classification")
    prior, lik = hyperparameters(model, "classification")
    ev = fit(model, batches(x, y, 8), lik, prior, structure)
    scale = lik.curvature_scale("ggn", {k: v.detach() for k, v in lik.hyperparameters().items()})
    dense = operator_matrix(ev, scale, _structure_delta(prior))
    covariance = ev.jacobian_covariance(torch.eye(prior.n_params).unsqueeze(0))[0]
    expected = covariance if structure == "ekfac" else torch.linalg.inv(dense_precision(problem, "kron", prior, lik))
    assert rel_err(dense, expected) <= 1e-10 and rel_err(covariance, expected) <= 1e-10
