"""``Structure.inverse``: every structure's ``H_b^-1``, ``H = s C + diag(delta)``, against a dense float64 inverse.

The operators are applied to the identity's columns and the dense matrix they give is compared with
``torch.linalg.inv`` of the dense ``H`` built from explicit Jacobians (tests/reference.py): the Kronecker
blocks of ``kron`` (and the exact diagonal blocks of the tensors it hands to ``diag``), the diagonal of the
dense curvature for ``diag``, the dense curvature for ``full`` (the base class's dense inverse through its
covariance). EKFAC's second moments have no reference apart from the structure's own basis: its operator
is compared with the dense ``H^-1`` its covariance gives (``LaplaceEvidence.jacobian_covariance`` of the
identity). The layouts: BatchNorm and GroupNorm parameters in diagonal blocks, conv groups, an Embedding's
diagonal input factor, a weight stored (in, out) (HF Conv1D).
"""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from torch import nn

from lightning_marglik import LaplaceEvidence
from lightning_marglik.linearized import _inverse_precision, _structure_delta
from tests.real_networks import batches, make_case
from tests.reference import (  # noqa: F401 (reference_env: autouse fixture)
    curvature_scale, graph_problem, hyper, reference_env, rel_err,
)

_CASES: dict = {}


def case(name):
    """(model, x, y, GraphProblem) of a layout network, cached (the dense Jacobians do not depend on the structure)."""
    if name not in _CASES:
        if name == "hf_conv1d":
            conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
            torch.manual_seed(0)
            model = nn.Sequential(conv1d(5, 3), nn.Tanh(), conv1d(3, 5)).double()  # Conv1D(nf=out, nx=in)
            x, y = torch.randn(20, 3), torch.randint(0, 3, (20,))
        else:
            model, x, y = make_case(name, "classification", n=20)
        _CASES[name] = (model, x, y, graph_problem(model, x, y, "classification"))
    return _CASES[name]


def operator_matrix(evidence: LaplaceEvidence, scale, delta) -> torch.Tensor:
    """The dense ``H^-1`` the structures' operators give: each applied to the identity's columns on its own tensors."""
    sizes = evidence.prior.param_sizes
    offsets = [0, *itertools.accumulate(sizes)]
    dense = torch.zeros(offsets[-1], offsets[-1])
    for structure in evidence.structures:
        apply = structure.inverse(scale, delta)
        own = [sizes[i] for i in structure.indices]
        index = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in structure.indices])
        columns = [torch.cat(apply(list(column.split(own)))) for column in torch.eye(len(index))]
        dense[index[:, None], index] = torch.stack(columns, 1)
    return dense


def dense_precision(problem, structure: str, prior, lik) -> torch.Tensor:
    """``s C + diag(delta)`` of ``structure`` from the dense reference curvature."""
    ref = problem.reference("kron" if structure == "kron" else "full", "ggn")
    log_delta, log_sigma, log_temperature = ref.hyper_from(prior, lik)
    curvature = ref.full if structure == "full" else torch.diag(torch.diagonal(ref.full))
    if structure == "kron":
        curvature = torch.zeros_like(ref.full)
        for block in ref.blocks:
            curvature[block.index[:, None], block.index] = block.matrix
    scale = curvature_scale("classification", "ggn", log_sigma, log_temperature)
    return scale * curvature + torch.diag(log_delta.exp())


@pytest.mark.parametrize("structure, prior_structure", [
    ("kron", "layerwise"), ("ekfac", "layerwise"), ("diag", "layerwise"), ("diag", "diagonal"), ("full", "layerwise"),
    ("full", "diagonal"),
])
@pytest.mark.parametrize("name", ["cnn_bn_res", "conv2d_grouped", "tokens_gn", "hf_conv1d"])
def test_the_inverse_is_the_dense_inverse_of_the_posterior_precision(name, structure, prior_structure):
    model, x, y, problem = case(name)
    prior, lik = hyper(model, "classification", prior_structure=prior_structure)
    evidence = LaplaceEvidence.fit(model, batches(x, y, 8), lik, prior, structure=structure)
    scale = lik.curvature_scale("ggn", {k: v.detach() for k, v in lik.hyperparameters().items()})
    delta = _structure_delta(prior)
    dense = operator_matrix(evidence, scale, delta)
    if structure == "ekfac":
        expected = evidence.jacobian_covariance(torch.eye(prior.n_params).unsqueeze(0))[0]
    else:
        expected = torch.linalg.inv(dense_precision(problem, structure, prior, lik))
    assert rel_err(dense, expected) <= 1e-10
    # linearized_evidence's preconditioner: the structures' blocks put together over the flat parameters
    combined = _inverse_precision(evidence.structures, prior.param_sizes, scale, delta)
    assert torch.equal(torch.stack([combined(column) for column in torch.eye(prior.n_params)], 1), dense)


@pytest.mark.parametrize("structure", ["kron", "ekfac", "diag", "full"])
def test_inverses_reusing_their_decompositions_equal_fresh_ones_bit_for_bit(structure):
    """The prior guard's candidates share each factor's decomposition (``reusing_decompositions``): the operators at
    two precisions equal those decomposed afresh, and a Kronecker layer is decomposed once for both."""
    model, x, y, _ = case("cnn_bn_res")
    prior, lik = hyper(model, "classification")
    evidence = LaplaceEvidence.fit(model, batches(x, y, 8), lik, prior, structure=structure)
    scale = lik.curvature_scale("ggn", {k: v.detach() for k, v in lik.hyperparameters().items()})
    deltas = [_structure_delta(prior), [d * 7.0 for d in _structure_delta(prior)]]
    fresh = [operator_matrix(evidence, scale, delta) for delta in deltas]
    decompositions = []
    eigh = torch.linalg.eigh

    def counted(matrix, *args, **kwargs):
        decompositions.append(matrix.shape)
        return eigh(matrix, *args, **kwargs)

    torch.linalg.eigh = counted
    try:
        with contextlib.ExitStack() as reusing:
            for s in evidence.structures:
                reusing.enter_context(s.reusing_decompositions())
            reused = [operator_matrix(evidence, scale, delta) for delta in deltas]
            twice = len(decompositions)
            reused.append(operator_matrix(evidence, scale, deltas[0]))
            assert len(decompositions) == twice  # a third inverse decomposes nothing
    finally:
        torch.linalg.eigh = eigh
    assert all(torch.equal(a, b) for a, b in zip(fresh + fresh[:1], reused))
    if structure == "kron":  # EKFAC holds its bases from the pass; diag and full decompose in prepare
        assert decompositions  # the first inverse decomposed the layers; the others reused them


@pytest.mark.parametrize("prior_structure", ["layerwise", "diagonal"])
@pytest.mark.parametrize("n, form", [(4, "rows"), (40, "gram")])
def test_the_full_operator_is_the_dense_inverse_in_both_of_its_forms(n, form, prior_structure):
    """``full`` applies ``H^-1`` without a dense form: by Woodbury over the rows it holds below ``P`` rows, by a
    Cholesky solve of its Gram matrix above; both against ``torch.linalg.inv`` of the explicit ``s C + D``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()  # P = 31
    x, y = torch.randn(n, 3, dtype=torch.float64), torch.randint(0, 3, (n,))
    prior, lik = hyper(model, "classification", prior_structure=prior_structure)
    evidence = LaplaceEvidence.fit(model, batches(x, y, 8), lik, prior, structure="full", mc_samples=0)
    (structure,) = evidence.structures
    assert (structure.gram is None) == (form == "rows")
    scale = lik.curvature_scale("ggn", {k: v.detach() for k, v in lik.hyperparameters().items()})
    expected = torch.linalg.inv(dense_precision(graph_problem(model, x, y, "classification"), "full", prior, lik))
    assert rel_err(operator_matrix(evidence, scale, _structure_delta(prior)), expected) <= 1e-10
