"""``select_models``' ranking evidence learns the output layer's precision that training holds (issue 52, item 5).

Training keeps ``MargLikCallback``'s default ``output_layer="fixed"``; the evidence at the final weights, re-estimated
for the ranking, re-optimises every layer's precision, the output layer's included (``rank_output_layer="learn"``,
the default), or holds it as trained (``"fixed"``). References: the evidence of the trained weights computed by hand
(one exact pass, Newton from the trained precisions) with that precision learned, and with it held.
"""
from __future__ import annotations

import pytest
import torch
import yaml

from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence, select_models
from lightning_marglik.callbacks.output_layer import OUTPUT_LAYER
from lightning_marglik.curvature import collect_statistics
from lightning_marglik.selection import build_parser, check_config
from tests.lightning_models import Classifier, blobs, loader

torch.set_num_threads(1)

N = 60
CALLBACK = {"structure": "kron", "approx": "ggn", "steps": 20}
TRAINER = {"max_epochs": 10, "enable_progress_bar": False}


@pytest.fixture(autouse=True)
def float32():  # Lightning modules here are float32, like a user's
    torch.set_default_dtype(torch.float32)


def ranked(**kwargs):
    """One candidate through ``select_models``; its result and its trained module."""
    modules = []

    def build() -> Classifier:
        modules.append(Classifier(n_data=N, width=8))
        return modules[-1]

    (result,) = select_models({"mlp": build}, train_dataloader=loader(blobs(N, 0), batch_size=20),
                              callback=CALLBACK, trainer=TRAINER, **kwargs)
    return result, modules[-1]


def by_hand(module: Classifier, hold_output: bool) -> float:
    """The kron-GGN evidence per datum at the module's weights, its precisions re-optimised by Newton from the
    trained ones: every layer's (a prior without treatments), or all but the output layer's."""
    prior = GaussianPrior(module.net)
    prior.log_precision.copy_(module.prior.log_precision)
    if hold_output:
        prior.treat(["2.weight", "2.bias"], "fixed", OUTPUT_LAYER)
    likelihood = CategoricalLikelihood()
    stats = collect_statistics(module.net, loader(blobs(N, 0), batch_size=20), likelihood, prior, "kron", "ggn", 0)
    evidence = LaplaceEvidence.from_statistics(stats, likelihood, prior)
    prior.record_n_data(evidence.n_data)
    return evidence.optimize(solver="newton", max_evaluations=50).value.item() / evidence.n_data


def test_the_ranking_evidence_learns_the_output_layer_that_training_holds(capsys):
    learned, module = ranked(rank_by="kron-ggn")
    printed = capsys.readouterr().out
    held, held_module = ranked(rank_by="kron-ggn", rank_output_layer="fixed", verbose=False)
    # training held it in both runs (the declared delta = 1), the same training
    for trained in (module, held_module):
        assert trained.prior.treatments[OUTPUT_LAYER] == (["2.weight", "2.bias"], "fixed")  # restored after ranking
        assert trained.prior.log_precision[-2:].tolist() == [0.0, 0.0]
        assert trained.prior.log_precision[:2].abs().min() > 0.1  # the hidden layer's was learned
    for a, b in zip(module.parameters(), held_module.parameters()):
        assert torch.equal(a, b)
    reference_learned, reference_held = by_hand(module, hold_output=False), by_hand(module, hold_output=True)
    assert reference_learned > reference_held + 1e-3  # the two treatments differ here: the check below can fail
    assert learned.marglik == pytest.approx(reference_learned, rel=1e-6)
    assert held.marglik == pytest.approx(reference_held, rel=1e-6)
    # recorded, and said
    assert "`2.weight`, `2.bias`" in learned.rank_output_layer and "learned by the ranking evidence" in learned.rank_output_layer
    assert held.rank_output_layer is None
    assert learned.settings["rank_output_layer"] == "learn" and held.settings["rank_output_layer"] == "fixed"
    assert "select_models ranks 1 of 1 candidates with the output layer's precision" in printed


def test_auto_ranks_with_the_output_layer_learned_and_online_as_trained():
    auto, module = ranked()
    assert auto.evidences["kron-ggn"] == pytest.approx(by_hand(module, hold_output=False), rel=1e-6)
    assert auto.rank_output_layer is not None
    online, _ = ranked(rank_by="online", verbose=False)
    assert online.rank_output_layer is None and online.marglik == online.online_marglik


def test_an_unknown_rank_output_layer_is_refused_before_training_and_the_command_line_takes_it(tmp_path):
    with pytest.raises(ValueError, match=r"`rank_output_layer` must be one of \('learn', 'fixed'\), got 'held'"):
        select_models({"mlp": lambda: Classifier(n_data=N)}, train_dataloader=loader(blobs(N, 0)),
                      rank_output_layer="held")
    config = {"data": {"class_path": "tests.lightning_models.BlobData"},
              "candidates": {"a": {"class_path": "tests.lightning_models.Classifier"}}}
    check_config({**config, "rank_output_layer": "fixed"})
    with pytest.raises(ValueError, match="rank_output_layer"):
        check_config({**config, "rank_output_layer": "held"})
    assert build_parser().get_defaults().rank_output_layer == "learn"
    path = tmp_path / "candidates.yaml"
    path.write_text(yaml.safe_dump(config))
    assert build_parser().parse_args(["--config", str(path), "--rank_output_layer=fixed"]).rank_output_layer == "fixed"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", str(path), "--rank_output_layer=held"])
