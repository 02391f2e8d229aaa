"""Options a probe passed that were taken wrongly or failed late, each now refused at construction (or at set-up)
with one line that names the value and the fix, or taken right."""
from __future__ import annotations

import math
import re
import warnings

import pytest

from lightning_marglik import (
    CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LogNormalHyperprior, MargLikBoundCallback, MargLikCallback, MargLikCheckpoint,
    MargLikEarlyStopping,
)
from lightning_marglik.callbacks.package import MargLikConfigurationError
from tests.lightning_models import Regressor, loader, regression_data, trainer

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


# --- the followers' options, which Lightning reads only at the first save or check --------------------------------


@pytest.mark.parametrize("make, message", [
    (lambda: MargLikCheckpoint(save_top_k=1.5), r"`save_top_k` must be an int >= -1 \(.*-1: all, 0: none\), got 1.5\."),
    (lambda: MargLikCheckpoint(save_top_k="1"), r"`save_top_k` must be an int >= -1 .*got '1'\."),
    (lambda: MargLikCheckpoint(save_top_k=None), r"`save_top_k` must be an int >= -1 .*got None\."),
    (lambda: MargLikCheckpoint(save_top_k=True), r"`save_top_k` must be an int >= -1 .*got True\."),
    (lambda: MargLikCheckpoint(save_top_k=-2), r"`save_top_k` must be an int >= -1 .*got -2\."),
    (lambda: MargLikCheckpoint(filename=3), r"`filename` must be a str pattern .* or None for 'marglik-\{epoch\}-\{step\}', "
                                            r"got 3\."),
    (lambda: MargLikCheckpoint(dirpath=3), r"`dirpath` must be a directory \(a str or path\), or None .*got 3\."),
    (lambda: MargLikCheckpoint(verbose="yes"), r"`verbose` must be True or False \(log a line per save\), got 'yes'\."),
    (lambda: MargLikEarlyStopping(verbose="no"), r"`verbose` must be True or False \(also log every check\), got 'no'\."),
    (lambda: MargLikEarlyStopping(patience=1.0), r"`patience` must be an int >= 1, got 1.0\."),
    (lambda: MargLikEarlyStopping(min_delta="0"), r"`min_delta` must be a finite number in \[0, inf\), got '0'\."),
])
def test_a_followers_bad_option_is_refused_at_construction_naming_it(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("save_top_k, filename, files", [
    (0, None, 0),
    (-1, None, 3),
    (1, "", 1),  # an empty pattern: the default names, not a validation ModelCheckpoint's "epoch=0-step=4.ckpt"
])
def test_the_checkpoints_save_top_k_and_filename_edges_train_and_keep_their_files(tmp_path, save_top_k, filename, files):
    checkpoint = MargLikCheckpoint(dirpath=tmp_path, filename=filename, save_top_k=save_top_k)
    trainer([MargLikCallback(frequency=1, guard=False), checkpoint], 3).fit(Regressor(), loader(regression_data()))
    names = [p.name for p in tmp_path.glob("*.ckpt")]
    assert len(names) == files and all(name.startswith("marglik-epoch=") for name in names)


# --- a seed near torch.Generator.manual_seed's limit ---------------------------------------------------------------


@pytest.mark.parametrize("make", [MargLikCallback, MargLikBoundCallback])
@pytest.mark.parametrize("seed", [2**64, 2**70, -1])
def test_a_seed_manual_seed_cannot_take_is_refused_at_construction_naming_it(make, seed):
    with pytest.raises(ValueError, match=rf"`seed` must be an int in \[0, {2**64 - 1}\] \(torch.Generator.manual_seed's "
                                         rf"range\), got {seed}\."):
        make(seed=seed)


@pytest.mark.parametrize("make", [
    lambda seed: MargLikCallback(frequency=1, mc_samples=1, seed=seed, guard=False),
    lambda seed: MargLikBoundCallback(every_k_batches=2, mc_samples=1, seed=seed),
])
def test_the_largest_seeds_draw_every_estimate(make):
    callback = make(2**64 - 2)  # (seed + epoch) * world_size + rank overflowed manual_seed at the first estimate
    trainer([callback], 2).fit(Regressor(), loader(regression_data()))
    assert len(callback.history) == 2 and all(math.isfinite(h["marglik"]) for h in callback.history)


# --- two priors or two likelihoods on one module ---------------------------------------------------------------


@pytest.mark.parametrize("attribute, make, message", [
    ("head_prior", lambda module: GaussianPrior(module.net[2]),
     r"exactly one GaussianPrior on the LightningModule, found 2 \(prior, head_prior\): keep one prior over the "
     r"whole network, e\.g\. `self\.prior = GaussianPrior\(self\.net\)`"),
    ("aux_likelihood", lambda module: GaussianLikelihood(),
     r"exactly one Likelihood on the LightningModule, found 2 \(likelihood, aux_likelihood\): keep one likelihood"),
])
def test_two_priors_or_likelihoods_are_refused_naming_them_and_saying_to_keep_one(attribute, make, message):
    module = Regressor()
    setattr(module, attribute, make(module))
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    with pytest.raises(MargLikConfigurationError, match=message):
        trainer([MargLikCallback(frequency=1)], 1).fit(module, loader(regression_data()))


# --- a log-normal hyperprior whose 1/scale**2 is no float ----------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-200, 1e-155, 1e155, 1e300])
def test_a_log_normal_scale_whose_inverse_square_is_no_finite_float_is_refused_at_construction(scale):
    with pytest.raises(ValueError, match=rf"`scale` must be a finite number in \[1e-150, 1e\+150\] \(.*1/scale\*\*2 is a "
                                         rf"finite float\), got {re.escape(repr(scale))}\."):
        LogNormalHyperprior(scale=scale)


@pytest.mark.parametrize("scale", [1e-150, 1e150])
def test_the_extreme_log_normal_scales_estimate(scale):
    module = Regressor()
    module.prior = GaussianPrior(module.net, hyperprior=LogNormalHyperprior(scale=scale))
    callback = MargLikCallback(frequency=1, guard=False)
    trainer([callback], 1).fit(module, loader(regression_data()))
    assert math.isfinite(callback.history[0]["marglik"])


# --- the learning rate Adam's divergence warning suggests -----------------------------------------------------------


def _adam_warnings(lr):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([MargLikCallback(frequency=1, solver="adam", lr=lr, guard=False)], 1).fit(
            Regressor(), loader(regression_data()))
    return [str(w.message) for w in caught if str(w.message).startswith("Adam")]


@pytest.mark.parametrize("lr", [1e6, 100.0])
def test_adams_divergence_warning_suggests_a_learning_rate_that_does_not_diverge(lr):
    (message,) = _adam_warnings(lr)
    assert f"Adam (lr={lr:g})" in message and "try lr=0.5 or smaller" in message  # lr / 10 diverged again
    assert _adam_warnings(0.5) == []


# --- dataloader= naming a method that needs arguments, or a near miss ------------------------------------------------


class _WithEvidenceData(Regressor):
    def evidence_data(self):
        return loader(regression_data())


@pytest.mark.parametrize("name, message", [
    ("forward", r"dataloader='forward'\): _WithEvidenceData\.forward\(x: 'torch\.Tensor'\) -> 'torch\.Tensor' cannot be "
                r"called without arguments; pass the name of a method that returns a DataLoader when called without"),
    ("training_step", r"_WithEvidenceData\.training_step\(batch, batch_idx\) cannot be called without arguments"),
    ("EVIDENCE_DATA", r"neither the DataModule nor the LightningModule has such a method \(did you mean "
                      r"'evidence_data'\?\); pass the name"),
    ("evidence_dat", r"has such a method \(did you mean 'evidence_data'\?\)"),
    ("missing", r"has such a method; pass the name"),
])
def test_a_dataloader_method_that_needs_arguments_or_is_misspelt_is_refused_before_training(name, message):
    module = _WithEvidenceData()
    module.training_step = lambda batch, batch_idx: pytest.fail("training must not start")
    with pytest.raises(MargLikConfigurationError, match=message):
        trainer([MargLikCallback(frequency=1, dataloader=name)], 1).fit(module, loader(regression_data()))


def test_a_dataloader_method_without_arguments_is_taken():
    callback = MargLikCallback(frequency=1, dataloader="evidence_data")
    trainer([callback], 1).fit(_WithEvidenceData(), loader(regression_data()))
    assert len(callback.history) == 1


# --- settle=1 and a burn-in as long as the fit ------------------------------------------------------------------


@pytest.mark.parametrize("settle", [1, 1.0])
def test_a_settle_of_one_that_a_falling_positive_loss_never_meets_is_refused(settle):
    with pytest.raises(ValueError, match=rf"`settle` must be a finite number in \(0, 1\) .*got {settle}\."):
        MargLikCallback(settle=settle)


@pytest.mark.parametrize("burnin", [2, 5])
def test_a_burnin_as_long_as_the_fit_warns_once_that_only_the_last_epoch_estimates(burnin):
    callback = MargLikCallback(frequency=1, burnin=burnin, guard=False)
    with pytest.warns(UserWarning, match=rf"MargLikCallback\(burnin={burnin}\), but the fit trains 2 epochs "
                                         r"\(max_epochs\): the only estimate is the one after the last epoch") as caught:
        trainer([callback], 2).fit(Regressor(), loader(regression_data()))
    assert sum("the only estimate" in str(w.message) for w in caught) == 1
    assert [row["epoch"] for row in callback.history] == [2]


def test_a_burnin_that_leaves_an_epoch_before_the_last_does_not_warn():
    callback = MargLikCallback(frequency=1, burnin=1, guard=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer([callback], 2).fit(Regressor(), loader(regression_data()))
    assert not [w for w in caught if "the only estimate" in str(w.message)]
    assert [row["epoch"] for row in callback.history] == [2]


# --- output_layer given a module's name ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["net.2", "head", "classifier.out_proj"])
def test_an_output_layer_given_as_a_module_name_says_the_layer_is_found_and_how_to_hold_one(name):
    with pytest.raises(ValueError, match=rf"`output_layer` must be one of .*got '{name}'\. It says how to treat the output "
                                         r"layer, which is found from the network's output when training starts; to hold "
                                         rf"a layer you choose .*GaussianPrior\(fixed=\['{name}\.\*'\]\)"):
        MargLikCallback(output_layer=name)


@pytest.mark.parametrize("value, message", [("fixd", r"got 'fixd' \(did you mean 'fixed'\?\)\.$"), (3, r"got 3\.$")])
def test_an_output_layer_near_miss_or_non_string_gets_no_layer_advice(value, message):
    with pytest.raises(ValueError, match=message):
        MargLikCallback(output_layer=value)


def test_the_fixed_pattern_the_advice_names_holds_that_layer():
    module = Regressor()
    module.prior = GaussianPrior(module, fixed=["net.0.*"])  # a prior over the module itself: its names start "net."
    callback = MargLikCallback(frequency=1, output_layer="learn", guard=False)
    trainer([callback], 1).fit(module, loader(regression_data()))
    assert module.prior.fixed == ["net.0.weight", "net.0.bias"]
    assert module.prior.precision[:2].tolist() == [1.0, 1.0] and module.prior.precision[2:].ne(1.0).all()
