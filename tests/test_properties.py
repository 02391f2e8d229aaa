"""Property-based checks (hypothesis) over hyperparameters, output/target shapes and batch sizes.

For every structure x approximation x likelihood: the evidence is finite (moderate log
hyperparameters) or NaN/-inf, never an exception; ``optimize`` never ends below its start; the
buffers are never written non-finite. Extremes (log values up to +-30) must not raise either.
"""
from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence
from tests.reference import reference_env  # noqa: F401 (autouse fixture)

N = 12
# derandomize (as tests/test_solvers.py): the same examples on every run, so CI's verdict is reproducible
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


class Net(nn.Module):
    """Linear -> LayerNorm -> tanh -> Linear, on (B, d) or (B, T, d) inputs (outputs follow)."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


@st.composite
def problems(draw, log_range: float):
    structure = draw(st.sampled_from(["diag", "kron", "full"]))
    approx, mc = draw(st.sampled_from([("ggn", 0), ("ef", 0), ("ggn", 2)]))
    kind = draw(st.sampled_from(["regression", "classification"]))
    positions = draw(st.sampled_from([None, 3]))  # (B, C) or (B, T, C) outputs
    batch = draw(st.integers(1, N))
    prior_structure = draw(st.sampled_from(["scalar", "layerwise"] + ([] if structure == "kron" else ["diagonal"])))
    seed = draw(st.integers(0, 2**16))
    logs = st.floats(-log_range, log_range, allow_nan=False)
    torch.manual_seed(seed)
    out = 2 if kind == "regression" else 3
    model = Net(out)
    shape = (N, 3) if positions is None else (N, positions, 3)
    x = torch.randn(shape)
    if kind == "regression":
        y = torch.randn(shape[:-1] + (out,))
        lik = GaussianLikelihood(sigma=math.exp(draw(logs)), temperature=math.exp(draw(logs) / 3), learn_temperature=True)
    else:
        y = torch.randint(0, out, shape[:-1])
        if positions is not None:
            y[0, 0] = -100  # an ignored position
        lik = CategoricalLikelihood(temperature=math.exp(draw(logs) / 3), learn_temperature=True)
    prior = GaussianPrior(model, precision=1.0, structure=prior_structure)
    with torch.no_grad():
        prior.log_precision.copy_(torch.tensor([draw(logs) for _ in range(prior.log_precision.numel())]))
    data = DataLoader(TensorDataset(x, y), batch_size=batch)
    ev = LaplaceEvidence.fit(model, data, lik, prior, structure=structure, approx=approx, mc_samples=mc,
                             generator=torch.Generator().manual_seed(seed))
    return ev


@SETTINGS
@given(problems(log_range=5.0))
def test_evidence_is_finite_at_moderate_hyperparameters(ev):
    assert torch.isfinite(ev.log_marglik()), ev.log_marglik()
    assert ev.n_data in (N, 3 * N, 3 * N - 1)


@SETTINGS
@given(problems(log_range=30.0), st.sampled_from(["adam", "newton"]), st.sampled_from([0.1, 3.0]))
def test_optimize_never_ends_below_its_start_and_buffers_stay_finite(ev, solver, lr):
    start = ev.log_marglik()  # never raises, whatever the extremes
    solution = ev.optimize(steps=15, lr=lr, solver=solver)
    if torch.isfinite(start):
        assert solution.value >= start - 1e-9 * abs(start)
    if all(torch.isfinite(v).all() for v in solution.values.values()):
        ev.set_hyperparameters(solution.values)
    for buffer in ev.hyperparameters().values():
        assert torch.isfinite(buffer).all()
