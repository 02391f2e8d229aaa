"""The private names of torch and Lightning that lightning_marglik reads (issue 51, item 6).

Each is read in one function of :mod:`lightning_marglik.private`. These tests check every one on the
installed torch and Lightning objects (real callbacks, strategies, FSDP modules, samplers), and that
its absence (``monkeypatch.delattr`` on the real class or object) fails loudly, naming the name and
the installed version, or falls back with a warning; never silently. After an upgrade, run this file
first.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import prune
from torch.utils.data import SubsetRandomSampler

from lightning_marglik import MargLikCallback, private
from lightning_marglik.callbacks.checks import check_stock_monitors
from lightning_marglik.distributed import epoch_keys
from lightning_marglik.hyperparameters import GaussianPrior
from lightning_marglik.private import PrivateAPIError
from tests.lightning_models import Regressor, loader, regression_data, trainer

ROOT = Path(__file__).resolve().parent.parent


def _lightning_packages():
    yield pl
    try:
        import lightning.pytorch
    except ImportError:
        return
    yield lightning.pytorch


PACKAGES = list(_lightning_packages())


def _loud(raised, name: str, package: str) -> None:
    """The error names the private name, the installed version of its package and the fix."""
    message = str(raised.value)
    version = importlib.import_module(package).__version__
    assert name in message and f"installed {package} {version} does not have" in message, message
    assert f"Install an earlier {package} (one that has it)" in message, message


# --- nothing outside lightning_marglik/private.py reads a private name of torch or Lightning --------------------


def test_no_module_but_private_reads_a_private_name_of_torch_or_lightning():
    reads = re.compile(
        r'getattr\([^,]+,\s*"_[a-z]'  # getattr(x, "_name", default): silent when renamed
        r'|from (torch|lightning|pytorch_lightning|lightning_fabric)[\w.]* import .*\b_[A-Za-z]'  # private imports
        r'|\._(version|forward_pre_hooks|tensor_name|training_state|get_fsdp_state|average_model|sampler'
        r'|batches_that_stepped|check_on_train_epoch_end|strong_wolfe|NormBase|ConvNd)\b'
        r'|_fsdp_wrapped_module|_checkpoint_wrapped_module'  # the wrappers' name prefixes
    )
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in (ROOT / "lightning_marglik").rglob("*.py") if path.name != "private.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if reads.search(line)]
    assert not found, "read these through lightning_marglik.private:\n" + "\n".join(found)


# --- Lightning: the weight-averaging callbacks' average -----------------------------------------------------------


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
@pytest.mark.parametrize("kind", ["EMAWeightAveraging", "StochasticWeightAveraging"])
def test_the_averaging_callbacks_keep_their_average_where_it_is_read(package, kind):
    make = {"EMAWeightAveraging": lambda: package.callbacks.EMAWeightAveraging(decay=0.9),
            "StochasticWeightAveraging": lambda: package.callbacks.StochasticWeightAveraging(swa_lrs=1e-2)}[kind]
    callback = make()
    assert "_average_model" in vars(callback) and private.averaged_module(callback) is None  # before set-up
    if package is not pl:
        return  # the fit below is the pytorch_lightning one; tests/test_trust_round5.py fits with `lightning`
    module = Regressor()
    estimator = MargLikCallback(structure="diag", frequency=1, steps=2)
    trainer([callback, estimator], 2).fit(module, loader(regression_data()))
    average = private.averaged_module(callback)
    assert isinstance(average, Regressor) and average is not module  # the averaged copy of the LightningModule
    assert torch.equal(average.prior.log_precision, module.prior.log_precision)  # kept out of the average


def _renamed(monkeypatch, cls: type, name: str) -> None:
    """``cls`` as if Lightning renamed its attribute ``name``: what it writes there is kept under another name, and
    ``name`` reads as missing."""
    def read(self):
        raise AttributeError(name)

    def write(self, value):
        self.__dict__["_renamed" + name] = value

    monkeypatch.setattr(cls, name, property(read, write), raising=False)


@pytest.mark.parametrize("kind", ["EMAWeightAveraging", "StochasticWeightAveraging"])
def test_an_average_kept_elsewhere_fails_before_training_naming_it(kind, monkeypatch):
    cls = getattr(pl.callbacks, kind)
    _renamed(monkeypatch, cls, "_average_model")
    callback = cls(**({"swa_lrs": 1e-2} if "Stochastic" in kind else {}))
    module = Regressor()
    with pytest.raises(PrivateAPIError) as raised:
        trainer([callback, MargLikCallback(structure="diag")], 1).fit(module, loader(regression_data()))
    _loud(raised, f"{kind}._average_model", "pytorch_lightning")
    assert "averaged with the weights" in str(raised.value) and f"or train without {kind}" in str(raised.value)
    assert module.train_modes == [] and "_renamed_average_model" in vars(callback)  # set up, but no training step


# --- Lightning: the fit loop's batch count, EarlyStopping's moment, FSDPStrategy's keywords ----------------------


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_the_fit_loop_counts_the_batches_that_stepped(package):
    module = Regressor()
    fit = package.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False, accelerator="cpu")
    if package is not pl:
        from tests.lightning_models import RegressorSteps

        lightning_module = pytest.importorskip("lightning.pytorch").LightningModule
        module = type("Module", (RegressorSteps, lightning_module), {})()
    fit.fit(module, loader(regression_data()))  # 64 examples in batches of 16
    assert private.batches_that_stepped(fit) == 8 == fit.fit_loop.epoch_loop._batches_that_stepped


def test_without_the_batch_count_the_global_step_is_used_with_a_warning(monkeypatch):
    fit = trainer([], 1)
    fit.fit(Regressor(), loader(regression_data()))
    monkeypatch.delattr(fit.fit_loop.epoch_loop, "_batches_that_stepped")
    with pytest.warns(UserWarning, match=r"pytorch_lightning \S+ has no _TrainingEpochLoop\._batches_that_stepped; .*"
                                         r"logged at trainer\.global_step instead"):
        assert private.batches_that_stepped(fit) == fit.global_step == 4


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
@pytest.mark.parametrize("argument,interval,expected", [(None, 1.0, True), (None, 0.5, False), (False, 1.0, False),
                                                        (True, 0.5, True)])
def test_early_stoppings_moment_is_read_from_lightning(package, argument, interval, expected):
    stopping = package.callbacks.EarlyStopping(monitor="marglik", check_on_train_epoch_end=argument)
    fit = package.Trainer(val_check_interval=interval, logger=False, enable_progress_bar=False, accelerator="cpu")
    assert private.early_stopping_checks_at_epoch_end(stopping, fit) is expected
    stopping.setup(fit, None, "fit")  # Lightning's own decision at its set-up: the same
    assert stopping._check_on_train_epoch_end is expected


def test_without_early_stoppings_moment_lightnings_rule_is_assumed_with_a_warning(monkeypatch):
    stopping = pl.callbacks.EarlyStopping(monitor="marglik", check_on_train_epoch_end=False)
    monkeypatch.delattr(stopping, "_check_on_train_epoch_end")
    fit = pl.Trainer(callbacks=[stopping], logger=False, enable_progress_bar=False, accelerator="cpu")
    with pytest.warns(UserWarning, match=r"has no EarlyStopping\._check_on_train_epoch_end; assuming it checks at the "
                                         r"end of every training epoch, as Lightning's default does"):
        check_stock_monitors(fit, "MargLikCallback", every_epoch=True)


@pytest.mark.parametrize("name", ["_save_on_train_epoch_end", "_every_n_train_steps", "_train_time_interval"])
def test_without_model_checkpoints_moment_lightnings_default_is_assumed_with_a_warning(monkeypatch, name):
    checkpoint = pl.callbacks.ModelCheckpoint(monitor="marglik", save_on_train_epoch_end=False)
    assert not private.checkpoint_saves_at_epoch_end(checkpoint, pl.Trainer(logger=False, accelerator="cpu"))
    fit = pl.Trainer(callbacks=[checkpoint], logger=False, enable_progress_bar=False, accelerator="cpu")
    monkeypatch.delattr(checkpoint, name)
    with pytest.warns(UserWarning, match=rf"has no ModelCheckpoint\.{name}; assuming it saves at the end of every "
                                         r"training epoch, as Lightning's default does"):
        check_stock_monitors(fit, "MargLikCallback", every_epoch=True)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_the_fsdp_strategy_keeps_fsdps_keywords(package):
    strategy = package.strategies.FSDPStrategy
    assert private.fsdp_strategy_kwargs(strategy(use_orig_params=False))["use_orig_params"] is False
    assert private.fsdp_strategy_kwargs(strategy())["use_orig_params"] is True  # Lightning's default


def test_without_the_fsdp_strategys_keywords_use_orig_params_goes_unchecked_with_a_warning(monkeypatch):
    strategy = pl.strategies.FSDPStrategy(use_orig_params=False)
    monkeypatch.delattr(strategy, "kwargs")
    with pytest.warns(UserWarning, match=r"has no FSDPStrategy\.kwargs; use_orig_params=False, .* is not checked"):
        assert private.fsdp_strategy_kwargs(strategy) == {}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_the_fsdp_strategy_keeps_its_state_dict_type(package):
    strategy = package.strategies.FSDPStrategy
    assert private.fsdp_state_dict_type(strategy(state_dict_type="sharded")) == "sharded"
    assert private.fsdp_state_dict_type(strategy()) == "full"  # Lightning's default


def test_without_the_fsdp_strategys_state_dict_type_a_full_save_is_assumed_with_a_warning(monkeypatch):
    strategy = pl.strategies.FSDPStrategy(state_dict_type="sharded")
    monkeypatch.delattr(strategy, "_state_dict_type")
    with pytest.warns(UserWarning, match=r"has no FSDPStrategy\._state_dict_type; taking it for 'full'"):
        assert private.fsdp_state_dict_type(strategy) == "full"


# --- torch: FSDP2's training state and the wrappers' name prefixes (one process, gloo) ---------------------------


@pytest.fixture
def one_process_group():
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fully_sharded() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def test_fsdp2_modules_take_the_recomputing_state_and_get_their_own_back(one_process_group):
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    net = _fully_sharded()
    modules = [net[0], net]
    states = [module._get_fsdp_state() for module in modules]
    assert [state._training_state for state in states] == [TrainingState.IDLE] * 2
    with private.fsdp2_recomputing(modules):
        assert [state._training_state for state in states] == [TrainingState.PRE_BACKWARD] * 2
        x = torch.randn(5, 3)
        for module in modules:
            module.unshard()
        net(x)  # FSDP2's hooks, as during a recomputation: no reshard after the forward
        assert all(type(p).__name__ != "DTensor" for p in net.parameters())
    assert [state._training_state for state in states] == [TrainingState.IDLE] * 2
    for module in modules:
        module.reshard()


@pytest.mark.parametrize("gone", ["TrainingState", "_get_fsdp_state", "_training_state"])
def test_fsdp2_without_its_private_names_fails_before_any_collective(one_process_group, gone, monkeypatch):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    net = _fully_sharded()
    owner = {"TrainingState": _fsdp_common, "_get_fsdp_state": FSDPModule, "_training_state": net._get_fsdp_state()}
    monkeypatch.delattr(owner[gone], gone)
    with pytest.raises(PrivateAPIError) as raised:
        private.fsdp2_recomputing([net])
    _loud(raised, gone, "torch")
    message = str(raised.value)
    assert "FSDP2's hooks would reshard" in message and "or use FSDPStrategy (FSDP1) or DDP" in message


def test_the_wrappers_prefixes_are_those_torch_puts_into_the_names(one_process_group):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    plain = [name for name, _ in net.named_parameters()]
    prior = GaussianPrior(net)
    net[0] = checkpoint_wrapper(net[0])
    with pytest.warns(UserWarning, match="NO_SHARD"):  # one process
        net[2] = FullyShardedDataParallel(net[2], device_id=torch.device("cpu"), use_orig_params=True)
    wrapped = [name for name, _ in net.named_parameters()]
    assert wrapped == ["0._checkpoint_wrapped_module.weight", "0._checkpoint_wrapped_module.bias",
                       "2._fsdp_wrapped_module.weight", "2._fsdp_wrapped_module.bias"]
    assert [private.strip_wrapper_prefixes(name) for name in wrapped] == plain
    assert [p.data_ptr() for p in prior.params] == [p.data_ptr() for p in net.parameters()]


class _Renamed(nn.Module):
    """A wrapper whose name lightning_marglik does not know, as torch's would be after a rename."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._new_wrapped_module = module

    def forward(self, x):
        return self._new_wrapped_module(x)


def test_a_wrapper_name_that_is_not_stripped_is_named_in_the_error():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    prior = GaussianPrior(net)
    net[2] = _Renamed(net[2])
    with pytest.raises(RuntimeError, match=re.escape(
            "parameters ['2.weight', '2.bias'] are no longer in the model; it has ['2._new_wrapped_module.bias', "
            "'2._new_wrapped_module.weight'] instead: a wrapper's name that lightning_marglik does not strip "
            "(it strips _fsdp_wrapped_module, _checkpoint_wrapped_module")):
        prior.params


# --- torch: pruning hooks, version counters, the L-BFGS line search, the layers' base classes ---------------------


def test_pruning_hooks_name_the_tensor_they_compute():
    layer = nn.Linear(3, 4)
    assert private.pruned_tensors(layer) == {}
    prune.l1_unstructured(layer, "weight", amount=0.5)
    prune.random_unstructured(layer, "bias", amount=0.5)
    prune.l1_unstructured(layer, "weight", amount=0.2)  # pruned again: a PruningContainer
    assert private.pruned_tensors(layer) == {"weight": "weight_orig", "bias": "bias_orig"}


def test_without_the_pruning_hooks_names_pruning_fails_loudly(monkeypatch):
    layer = nn.Linear(3, 4)
    prune.l1_unstructured(layer, "weight", amount=0.5)
    (hook,) = layer._forward_pre_hooks.values()
    monkeypatch.delattr(hook, "_tensor_name")
    with pytest.raises(PrivateAPIError) as raised:
        private.pruned_tensors(layer)
    _loud(raised, "prune.BasePruningMethod._tensor_name", "torch")
    monkeypatch.delattr(layer, "_forward_pre_hooks")
    with pytest.raises(PrivateAPIError) as raised:
        private.pruned_tensors(layer)
    _loud(raised, "nn.Module._forward_pre_hooks", "torch")


def test_a_tensors_version_counts_its_in_place_changes():
    tensor = torch.zeros(3)
    before = private.tensor_version(tensor)
    tensor.add_(1.0)
    assert private.tensor_version(tensor) == before + 1
    assert private.tensor_version(tensor + 1) == 0
    with pytest.raises(PrivateAPIError) as raised:
        private.tensor_version(object())  # torch's TensorBase cannot lose it here: an object without one
    _loud(raised, "Tensor._version", "torch")


def test_the_lbfgs_line_search_is_torchs(monkeypatch):
    import torch.optim.lbfgs as lbfgs

    assert private.strong_wolfe() is lbfgs._strong_wolfe
    monkeypatch.delattr(lbfgs, "_strong_wolfe")
    with pytest.raises(PrivateAPIError) as raised:
        private.strong_wolfe()
    _loud(raised, "torch.optim.lbfgs._strong_wolfe", "torch")


def test_the_base_classes_are_those_of_the_norms_and_convolutions(monkeypatch):
    from torch.nn.modules import batchnorm, conv

    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.SyncBatchNorm, nn.InstanceNorm2d, nn.LazyBatchNorm1d)
    assert all(issubclass(cls, private.norm_base()) for cls in norms)
    assert not issubclass(nn.LayerNorm, private.norm_base()) and not issubclass(nn.GroupNorm, private.norm_base())
    convolutions = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.LazyConv2d)
    assert all(issubclass(cls, private.conv_base()) for cls in convolutions)
    assert not issubclass(nn.Linear, private.conv_base())
    monkeypatch.delattr(batchnorm, "_NormBase")
    monkeypatch.delattr(conv, "_ConvNd")
    for read, name in [(private.norm_base, "batchnorm._NormBase"), (private.conv_base, "conv._ConvNd")]:
        with pytest.raises(PrivateAPIError) as raised:
            read()
        _loud(raised, f"torch.nn.modules.{name}", "torch")


# --- Lightning: the user's sampler inside DistributedSamplerWrapper --------------------------------------------


@pytest.mark.parametrize("fabric", ["lightning_fabric", "lightning.fabric"])
def test_the_users_sampler_is_found_inside_either_packages_distributed_wrapper(fabric):
    if fabric == "lightning.fabric":
        pytest.importorskip("lightning")
    wrapper = importlib.import_module(f"{fabric}.utilities.distributed").DistributedSamplerWrapper
    inner = SubsetRandomSampler([7, 3, 5])
    wrapped = wrapper(inner, num_replicas=1, rank=0, shuffle=False)
    assert private.user_sampler(wrapped.dataset) is inner
    assert list(epoch_keys(wrapped)) == [3, 5, 7]  # the subset's keys, not the first three of the data set
    assert private.user_sampler(list(range(4))) is None


def test_without_the_wrappers_names_the_keys_are_refused_not_guessed(monkeypatch):
    from lightning_fabric.utilities import distributed

    wrapped = distributed.DistributedSamplerWrapper(SubsetRandomSampler([7, 3, 5]), num_replicas=1, rank=0)
    monkeypatch.delattr(wrapped.dataset, "_sampler")
    with pytest.raises(PrivateAPIError) as raised:
        epoch_keys(wrapped)
    _loud(raised, "_DatasetSamplerWrapper._sampler", "lightning_fabric")
    monkeypatch.delattr(distributed, "_DatasetSamplerWrapper")
    with pytest.raises(PrivateAPIError) as raised:
        epoch_keys(wrapped)
    _loud(raised, "lightning_fabric.utilities.distributed._DatasetSamplerWrapper", "lightning_fabric")
    assert "or set Trainer(use_distributed_sampler=False)" in str(raised.value)
