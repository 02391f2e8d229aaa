"""select_models ranks BatchNorm networks by the evidence of their folded copy (``fold_batchnorm``, the
default), through ``MargLikCallback.fold_batchnorm`` and ``evidence_with(folded=...)``: the value is the
evidence of the folded network by hand, the trained module is left as it is, a network without BatchNorm
is ranked as before, and a forward that folding breaks is ranked as trained with a warning."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from lightning_marglik import LaplaceEvidence, MargLikCallback, select_models
from lightning_marglik.callbacks.output_layer import OUTPUT_LAYER
from lightning_marglik.folding import fold_batchnorm
from lightning_marglik.selection import run_command_line
from tests.lightning_models import BlobData, Classifier, blobs
from tests.test_selection import CALLBACK, TRAINER, write_config


@pytest.fixture(autouse=True)
def float32():  # Lightning modules here are float32, like a user's
    torch.set_default_dtype(torch.float32)


def run(factory, **kwargs):
    return select_models({"net": factory}, datamodule=BlobData(), callback=CALLBACK, trainer=TRAINER, verbose=False,
                         **kwargs)[0]


def by_hand(module: Classifier, fold: bool, structure: str = "kron", approx: str = "ef",
            learn_output: bool = True) -> float:
    """The evidence per datum of the trained module (or its folded copy), Newton from the learned precisions; the
    output layer's learned too (``learn_output``: as select_models ranks, rank_output_layer="learn"), else held as
    trained (as ``MargLikCallback.evidence_with``)."""
    loader = DataLoader(blobs(60, 0), batch_size=60)
    names, _ = module.prior.treatments[OUTPUT_LAYER]
    module.prior.treat(names, "learn" if learn_output else "fixed", OUTPUT_LAYER)
    model, prior = module, module.prior
    if fold:
        folded = fold_batchnorm(module, blobs(60, 0).tensors[0][:20], prior=module.prior)
        model, prior = folded.model, folded.prior
    evidence = LaplaceEvidence.fit(model, loader, module.likelihood, prior, structure=structure, approx=approx)
    return evidence.optimize(solver="newton", max_evaluations=50).value.item() / 60


@pytest.mark.parametrize("rank_by", ["kron-ef", "auto"])
def test_a_batchnorm_network_is_ranked_by_the_evidence_of_its_folded_copy(rank_by):
    made = []

    def factory():
        made.append(Classifier(60, norm=True))
        return made[-1]

    result = run(factory, rank_by=rank_by)
    module = made[-1]
    assert result.folded == {"net.0": "net.1"} and result.settings["fold_batchnorm"] is True
    assert isinstance(module.net[1], torch.nn.BatchNorm1d) and "1.weight" in module.prior.param_names  # untouched
    if rank_by == "auto":  # tiny: the exact full GGN of the folded network, kron-ef and kron-ggn beside it
        assert result.rank_by == "full-ggn"
        assert result.evidences["full-ggn"] == pytest.approx(by_hand(module, True, "full", "ggn"), rel=1e-5)
        assert result.evidences["kron-ef"] == pytest.approx(by_hand(module, True), rel=1e-5)
        assert result.evidences["kron-ggn"] == pytest.approx(by_hand(module, True, "kron", "ggn"), rel=1e-5)
    else:
        assert result.marglik == pytest.approx(by_hand(module, True), rel=1e-5)
    assert abs(by_hand(module, True) - by_hand(module, False)) > 1e-3  # folding is not a no-op here
    unfolded = run(lambda: Classifier(60, norm=True), rank_by=rank_by, fold_batchnorm=False)
    assert unfolded.folded == {} and unfolded.settings["fold_batchnorm"] is False
    assert unfolded.online_marglik == result.online_marglik  # same training
    assert unfolded.evidences.get("kron-ef", unfolded.marglik) == pytest.approx(by_hand(module, False), rel=1e-5)


def test_a_network_without_batchnorm_and_the_online_ranking_are_as_before():
    folded, plain = (run(lambda: Classifier(60), rank_by="kron-ef", fold_batchnorm=f) for f in (True, False))
    assert folded.folded == plain.folded == {} and folded.marglik == plain.marglik
    online = run(lambda: Classifier(60, norm=True), rank_by="online")
    assert online.folded == {} and online.settings["fold_batchnorm"] is False
    assert online.marglik == online.online_marglik


def test_a_fold_batchnorm_that_is_not_a_bool_is_refused_before_training():
    made = []
    with pytest.raises(ValueError, match=r"`fold_batchnorm` must be True or False \(fold each candidate's "
                                         r"BatchNorms before ranking it\), got 'false'"):
        run(lambda: made.append(1), fold_batchnorm="false")
    assert made == []


class ReadsTheNorm(Classifier):
    """A forward that reads the BatchNorm's scale itself: the folded copy (an Identity there) cannot run it."""

    def forward(self, x):
        return self.net(x) * self.net[1].weight.mean()


def test_a_forward_that_folding_breaks_is_ranked_as_trained_with_a_warning():
    with pytest.warns(UserWarning, match="candidate 'net' is ranked by the evidence of the network as trained.*"
                                         "broke the model's forward .*AttributeError"):
        warned = run(lambda: ReadsTheNorm(60, norm=True), rank_by="kron-ef")
    plain = run(lambda: ReadsTheNorm(60, norm=True), rank_by="kron-ef", fold_batchnorm=False)
    assert warned.folded == {} and warned.marglik == plain.marglik


def test_the_callback_folds_only_after_a_fit_and_scores_only_a_copy_with_its_prior():
    callback, module = MargLikCallback(**CALLBACK), Classifier(60, norm=True)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         callbacks=[callback])
    with pytest.raises(RuntimeError, match="MargLikCallback.fold_batchnorm reads the prior .* after trainer.fit"):
        callback.fold_batchnorm(trainer, module)
    trainer.fit(module, datamodule=BlobData())
    without_prior = fold_batchnorm(module, blobs(60, 0).tensors[0][:20])
    with pytest.raises(ValueError, match="needs the folded copy's prior: make it with MargLikCallback.fold_batchnorm"):
        callback.evidence_with(trainer, module, "kron", "ef", folded=without_prior)
    with pytest.raises(ValueError, match="takes what MargLikCallback.fold_batchnorm returns, got bool"):
        callback.evidence_with(trainer, module, "kron", "ef", folded=True)
    folded = callback.fold_batchnorm(trainer, module)
    assert callback.evidence_with(trainer, module, "kron", "ef", folded=folded) == pytest.approx(
        by_hand(module, True, learn_output=False), rel=1e-5)


def test_the_command_line_and_the_yaml_take_fold_batchnorm(tmp_path, capsys):
    candidates = {"bn": {"class_path": "tests.lightning_models.Classifier", "init_args": {"norm": True}}}
    path = write_config(tmp_path, candidates=candidates, rank_by="kron-ef")
    results, config = run_command_line([path, "--fold_batchnorm=false", "--trainer.max_epochs=1"])
    assert config["fold_batchnorm"] is False and results[0].folded == {}
    results, config = run_command_line([path, "--trainer.max_epochs=1"])
    assert config["fold_batchnorm"] is True and results[0].folded == {"net.0": "net.1"}  # a new setting: retrained
    with pytest.raises(SystemExit):  # a YAML string is not a bool: the parser refuses it, naming the key
        run_command_line([write_config(tmp_path, candidates=candidates, fold_batchnorm="sometimes")])
    assert 'Parser key "fold_batchnorm"' in capsys.readouterr().err
