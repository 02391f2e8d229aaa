"""The prior guard (issue 52): the approximate cross-validation against a dense float64 brute force, and what the
callback does with it in a real ``Trainer``: the decision follows the scores, the learned weight decay reaches
training only while it wins, the record survives a checkpoint on disk, the final epoch is not scored (until a
resumed fit trains on from it, as the uninterrupted run), and an
operation without a forward-mode derivative turns the guard off with a warning instead of ending the fit."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_marglik import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, LaplaceEvidence, MargLikCallback
from lightning_marglik.callbacks.prior_guard import GUARD
from lightning_marglik.guard import approximate_cv, fold_calls, fold_pieces
from tests.lightning_models import Classifier, Regressor, loader, regression_data, trainer
from tests.reference import curvature_scale, jacobians, loss_hessians

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*", "ignore:.*LeafSpec.*")


def _problem(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3 if kind == "classification" else 2)).double()
    x = torch.randn(23, 3, dtype=torch.float64)
    if kind == "classification":
        y, likelihood = torch.randint(0, 3, (23,)), CategoricalLikelihood(temperature=0.7)
    else:
        y, likelihood = torch.randn(23, 2, dtype=torch.float64), GaussianLikelihood(sigma=0.6, temperature=0.7)
    prior = GaussianPrior(net)
    with torch.no_grad():
        prior.log_precision.copy_(torch.tensor([0.3, -0.5, 1.1, 0.2], dtype=torch.float64))
    batches = [(x[:10], y[:10]), (x[10:], y[10:])]  # 10 and 13 examples: uneven pieces
    return net, likelihood, prior, batches


def _brute_force(net, likelihood, prior, batches, candidates, folds, kind):
    """K-fold CV by dense matrices: fold k is the k-th contiguous piece of every batch; its refit one Newton
    step of the held-in objective with the dense GGN x (K - 1) / K; the held-out fold's linearized log likelihood."""
    names = [n for n, _ in net.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    fold = torch.cat([torch.arange(len(b[1])) // -(-len(b[1]) // folds) for b in batches])
    f, jac = jacobians(net, names, x)
    temperature = likelihood.temperature.detach()
    log_sigma = getattr(likelihood, "log_sigma", None)
    scale = curvature_scale(kind, "ggn", None if log_sigma is None else log_sigma.detach(), temperature.log())
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, loss_hessians(f, y, kind, "ggn"), jac) * scale
    if kind == "classification":
        residual = f.softmax(1) - nn.functional.one_hot(y, 3).double()  # d nll / d f
    else:
        residual = (f - y) / likelihood.sigma.detach() ** 2
    per_example = torch.einsum("nc,ncp->np", residual, jac) / temperature  # tempered nll gradients
    sizes = [p.numel() for p in net.parameters()]
    scores = {}
    for name, log_delta in candidates.items():
        delta = torch.cat([log_delta[i].exp().expand(s) for i, s in enumerate(sizes)])
        total = 0.0
        for k in range(folds):
            held_in = per_example[fold != k].sum(0)
            step = -torch.linalg.solve(ggn * (folds - 1) / folds + torch.diag(delta), held_in + delta * theta)
            out = f[fold == k] + jac[fold == k] @ step
            total -= likelihood.nll(out, y[fold == k]).sum().item()
        scores[name] = total / len(y)
    return scores


@pytest.mark.parametrize("kind", ["classification", "regression"])
def test_the_approximate_cross_validation_equals_a_dense_float64_brute_force(kind):
    net, likelihood, prior, batches = _problem(kind)
    evidence = LaplaceEvidence.fit(net, batches, likelihood, prior, structure="full", mc_samples=0)
    candidates = {"learned": prior.log_precision.detach().clone(),
                  "declared": torch.zeros(4, dtype=torch.float64), "strong": torch.full((4,), 3.0, dtype=torch.float64)}
    got = approximate_cv(evidence, net, batches, candidates, folds=4)
    expected = _brute_force(net, likelihood, prior, batches, candidates, 4, kind)
    assert set(got) == set(candidates)
    for name in candidates:
        assert got[name] == pytest.approx(expected[name], rel=1e-10, abs=1e-12)
    # the candidates are told apart (a stronger prior moves the refits): the comparison can fail
    assert len({round(v, 6) for v in got.values()}) == 3


def test_a_kronecker_evidence_scores_by_its_own_blocks_and_fewer_than_two_folds_are_refused():
    net, likelihood, prior, batches = _problem("classification")
    kron = LaplaceEvidence.fit(net, batches, likelihood, prior, structure="kron", mc_samples=0)
    full = LaplaceEvidence.fit(net, batches, likelihood, prior, structure="full", mc_samples=0)
    candidates = {"declared": torch.zeros(4, dtype=torch.float64)}
    by_kron, by_full = approximate_cv(kron, net, batches, candidates), approximate_cv(full, net, batches, candidates)
    assert math.isfinite(by_kron["declared"]) and by_kron["declared"] != pytest.approx(by_full["declared"], rel=1e-6)
    with pytest.raises(ValueError, match="`folds` must be at least 2, got 1"):
        approximate_cv(kron, net, batches, candidates, folds=1)
    # a hurried caller's candidates: one value for every group, or a NaN, are named, not scored as NaN
    with pytest.raises(ValueError, match=r"candidate 'one': .* shape \(4,\) .* got shape \(\)"):
        approximate_cv(kron, net, batches, {"one": torch.zeros((), dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"candidate 'nan': a finite log precision"):
        approximate_cv(kron, net, batches, {"nan": torch.full((4,), float("nan"), dtype=torch.float64)})
    # no data, or folds that are no count, are named before any pass; an iterator of batches scores as the list does
    with pytest.raises(ValueError, match="`batches` holds no example"):
        approximate_cv(kron, net, [], candidates)
    with pytest.raises(ValueError, match=r"`folds` must be an int >= 1, got 2.5"):
        approximate_cv(kron, net, batches, candidates, folds=2.5)
    assert approximate_cv(kron, net, iter(batches), candidates) == by_kron


def test_fold_pieces_cut_tuple_inputs_and_leave_no_empty_piece():
    x, mask, y = torch.arange(4.0)[:, None], torch.ones(4, 2), torch.arange(4)
    pieces = fold_pieces(((x, mask), y), 5)
    assert [p[1].tolist() for p in pieces] == [[0], [1], [2], [3]]
    assert pieces[2][0][1].shape == (1, 2)


def test_fold_calls_join_a_folds_pieces_only_where_their_inputs_concatenate():
    def batch(start, n, width=2, shared=None):
        inputs = {"x": torch.arange(start, start + n * width, dtype=torch.float64).reshape(n, width), "scale": shared}
        return inputs, torch.arange(start, start + n)

    shared = torch.tensor([2.0])
    # two batches of 6 into 3 folds: each fold's two pieces of 2 become one call of 4 (the limit is 6)
    calls = fold_calls([batch(0, 6, shared=shared), batch(100, 6, shared=shared)], 3)
    assert [[t.tolist() for _, t in fold] for fold in calls] == [[[0, 1, 100, 101]], [[2, 3, 102, 103]], [[4, 5, 104, 105]]]
    assert calls[0][0][0]["x"].shape == (4, 2) and calls[0][0][0]["scale"] is shared
    # inputs of other trailing shapes, a different shared value, or more than the largest batch stay apart
    apart = [batch(0, 6), batch(100, 6, width=3)], [batch(0, 6, shared=shared), batch(100, 6, shared=shared + 1)]
    for batches in apart:
        assert [len(fold) for fold in fold_calls(list(batches), 3)] == [2, 2, 2]
    assert [len(fold) for fold in fold_calls([batch(0, 4), batch(100, 4), batch(200, 4)], 2)] == [2, 2]
    assert [len(fold) for fold in fold_calls(iter([batch(0, 6), batch(100, 6)]), 3)] == [1, 1, 1]  # read once
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"`folds` must be an int >= 1"):
            fold_calls([batch(0, 6)], bad)
    # shared values other than tensors: an equal plain scalar joins, an equal array of another object stays apart
    # (its == is elementwise), neither raises
    for shared_a, shared_b, calls_per_fold in ((3, 3, 1), (np.ones(2), np.ones(2), 2)):
        assert [len(fold) for fold in fold_calls([batch(0, 6, shared=shared_a), batch(100, 6, shared=shared_b)], 3)] \
            == [calls_per_fold] * 3
    # what is joined is what was cut: every example once, in its fold
    for folds in (2, 3, 5):
        batches = [batch(0, 7), batch(100, 5), batch(200, 1)]
        joined = [torch.cat([t for _, t in fold]).tolist() for fold in fold_calls(batches, folds)]
        cut = [[i for p in (fold_pieces(b, folds) for b in batches) if k < len(p) for i in p[k][1].tolist()]
               for k in range(folds)]
        assert joined == cut


@pytest.mark.parametrize("batch_size", [1, 2, 6, 8, 16, 40])
def test_no_fold_is_left_empty_whatever_the_batch_size(batch_size):
    """Pieces of ceil(B / 5): batches of 8 or 16 made 4 (the fifth fold held nothing, the rest 4-fold), a batch of 1
    put every example into the first fold (no cross-validation at all), and the guard's decision moved with the
    batch size."""
    x, y = torch.arange(40.0)[:, None], torch.arange(40)
    batches = [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, 40, batch_size)]
    folds = fold_calls(batches, 5)
    sizes = [sum(len(t) for _, t in fold) for fold in folds]
    assert sorted(i for fold in folds for _, t in fold for i in t.tolist()) == list(range(40))
    assert min(sizes) >= 40 / 5 / 2, sizes  # at least half a fifth each


def test_batches_that_ceil_widths_cut_into_five_keep_their_pieces():
    """The studies' batches of 128 (and a last one of 8): the pieces the prior guard study ran on."""
    widths = [[len(t) for _, t in fold_pieces((torch.zeros(n, 1), torch.zeros(n)), 5)] for n in (128, 100, 21, 8)]
    assert widths == [[26, 26, 26, 26, 24], [20] * 5, [5, 5, 5, 5, 1], [1, 2, 1, 2, 2]]


# --- in a Trainer ------------------------------------------------------------------------------


def _data(n: int = 90, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=30)


def _fit(callback, epochs: int = 6, module=None, **kwargs):
    torch.manual_seed(0)
    module = module or Classifier(n_data=90)
    t = trainer([callback], max_epochs=epochs, **kwargs)
    t.fit(module, _data())
    return module, t


def test_each_decision_follows_its_scores_and_training_decays_by_the_last_one():
    callback = MargLikCallback(frequency=1, steps=20)
    module, _ = _fit(callback)
    prior = module.prior
    decisions = callback.guard_decisions
    # every estimate but the last epoch's is scored (no training follows that one)
    assert [d["epoch"] for d in decisions] == [1, 2, 3, 4, 5] and callback.estimations == 6
    for d in decisions:
        assert d["applied"] == ("learned" if d["learned"] >= d["declared"] else "declared")
    guarded = prior.treatments.get(GUARD, ([], ""))[0]
    body = ["0.weight"]  # the output layer is held, the biases decoupled: the first weight is what the evidence sets
    decay = prior.per_tensor(prior.weight_decay_log_precision())
    learned = prior.per_tensor(prior.log_precision.detach())
    if decisions[-1]["applied"] == "declared":
        assert guarded == body and decay[0].item() == pytest.approx(math.log(prior.initial_precision))
    else:
        assert guarded == [] and decay[0].item() == pytest.approx(learned[0].item())
    assert callback.summary["guard"] == {
        "estimates": 5, "declared": sum(d["applied"] == "declared" for d in decisions), "last": decisions[-1]}


def test_guard_false_feeds_the_learned_weight_decay_back_and_a_bad_value_is_refused_by_name():
    callback = MargLikCallback(frequency=1, steps=20, guard=False)
    module, _ = _fit(callback, epochs=3)
    assert callback.guard_decisions == [] and GUARD not in module.prior.treatments and callback.guard_off == "off (guard=False)"
    assert callback.summary["guard"] is None
    with pytest.raises(ValueError, match="`guard` must be True or False"):
        MargLikCallback(guard="yes")


def test_the_guard_changes_training_where_it_keeps_the_declared_prior():
    """The same fit with and without the guard: equal until its first decision for the declared prior, then the
    guarded run trains at the declared weight decay (its first weight differs)."""
    guarded, plain = MargLikCallback(frequency=1, steps=20), MargLikCallback(frequency=1, steps=20, guard=False)
    a, _ = _fit(guarded, epochs=4)
    b, _ = _fit(plain, epochs=4)
    # on this data (fixed seeds) the guard keeps the declared weight decay from the first estimate on
    assert [d["applied"] for d in guarded.guard_decisions] == ["declared"] * 3
    assert not torch.equal(a.net[0].weight, b.net[0].weight)
    # the first estimate saw the same weights: its evidence is the same
    assert guarded.history[0]["marglik"] == pytest.approx(plain.history[0]["marglik"], rel=1e-12)


def test_the_decisions_survive_a_checkpoint_on_disk_and_a_resume_restores_the_treatment(tmp_path):
    from pytorch_lightning.callbacks import ModelCheckpoint

    callback = MargLikCallback(frequency=1, steps=20)
    first = Classifier(n_data=90)
    torch.manual_seed(0)
    trainer([callback, ModelCheckpoint(dirpath=tmp_path, save_last=True)], max_epochs=3).fit(first, _data())
    saved = list(callback.guard_decisions)
    assert [d["epoch"] for d in saved] == [1, 2]  # the estimate after the last epoch is not scored
    # resumed to epoch 5 from the checkpoint on disk: epoch 3's estimate, unscored when it ended the first fit, is
    # scored when training goes on, and the run is the uninterrupted one's (decisions, scores, evidence)
    resumed, second = MargLikCallback(frequency=1, steps=20), Classifier(n_data=90)
    trainer([resumed], max_epochs=5).fit(second, _data(), ckpt_path=str(tmp_path / "last.ckpt"))
    whole = MargLikCallback(frequency=1, steps=20)
    uninterrupted, _ = _fit(whole, epochs=5)
    assert resumed.guard_decisions[:2] == saved and [d["epoch"] for d in resumed.guard_decisions] == [1, 2, 3, 4]
    assert resumed.guard_decisions == whole.guard_decisions
    assert resumed.history == whole.history
    assert torch.equal(second.net[0].weight, uninterrupted.net[0].weight)
    held = second.prior.treatments.get(GUARD, ([], ""))[0]
    assert bool(held) == (whole.guard_decisions[-1]["applied"] == "declared")


class NoForwardMode(torch.autograd.Function):
    """tanh with a backward and no jvp: forward-mode products through it fail."""

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (output,) = ctx.saved_tensors
        return grad * (1 - output ** 2)


class LegacyTanh(torch.autograd.Function):
    """tanh as an autograd.Function of the legacy form (forward(ctx, x)), which torch.func refuses."""

    @staticmethod
    def forward(ctx, x):
        output = torch.tanh(x)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad):
        (output,) = ctx.saved_tensors
        return grad * (1 - output ** 2)


class OpaqueTanh(nn.Module):
    def __init__(self, function=NoForwardMode):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function.apply(x)


@pytest.mark.parametrize("function", [NoForwardMode, LegacyTanh], ids=["no jvp", "legacy form"])
def test_a_network_without_forward_mode_derivatives_turns_the_guard_off_with_a_warning_and_trains_on(function):
    module = Classifier(n_data=90)
    module.net[1] = OpaqueTanh(function)
    callback = MargLikCallback(frequency=1, steps=20)
    with pytest.warns(UserWarning, match="prior guard off: the network's forward has no forward-mode derivative"):
        _fit(callback, epochs=3, module=module)
    assert callback.guard_decisions == [] and callback.estimations == 3
    assert not module.prior.treatments.get(GUARD, ([], ""))[0]
    assert callback.guard_off.startswith("off: the network's forward has no forward-mode derivative")


def test_a_scalar_prior_turns_the_guard_off_at_set_up_and_says_why():
    module = Classifier(n_data=90)
    module.prior = GaussianPrior(module.net, structure="scalar")
    callback = MargLikCallback(frequency=1, steps=20)
    _fit(callback, epochs=3, module=module)
    assert callback.guard_off == "off: a scalar prior's one precision cannot be kept from training apart (a layerwise prior's can)"
    assert callback.guard_decisions == [] and callback.estimations == 3 and GUARD not in module.prior.treatments


# a fresh process: torch loads its forward-mode decompositions at a process's first dual tensor, once
_FIRST_PRODUCT = """
import warnings, torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    {call}
print(sum("torch.jit.script" in str(w.message) for w in caught))
"""


def _torch_script_warnings(call: str) -> int:
    done = subprocess.run([sys.executable, "-c", _FIRST_PRODUCT.format(call=call)], capture_output=True, text=True,
                          check=True)
    return int(done.stdout.split()[-1])


def test_the_first_forward_mode_product_keeps_torchs_own_deprecation_warning_from_the_user():
    """torch scripts its forward-mode decompositions at a process's first forward-mode product and warns of its own
    deprecation of torch.jit.script there: every default fit's first guard showed it. The guard's and the linearized
    evidence's products (curvature.forward_mode) keep it quiet; a plain jvp in a fresh process still warns."""
    if not _torch_script_warnings("torch.func.jvp(torch.tanh, (torch.ones(2),), (torch.ones(2),))"):
        pytest.skip("this torch loads its forward-mode decompositions without the warning")
    ours = ("from lightning_marglik.curvature.forward_mode import output_and_change; "
            "output_and_change(torch.nn.Linear(2, 1), ['weight'], [torch.ones(1, 2)], [torch.ones(1, 2)], torch.ones(3, 2))")
    assert _torch_script_warnings(ours) == 0


_ONCE_PER_PLACE = """
import warnings, torch
from lightning_marglik.curvature.forward_mode import output_and_change
product = lambda: output_and_change(torch.nn.Linear(2, 1), ['weight'], [torch.ones(1, 2)], [torch.ones(1, 2)],
                                    torch.ones(3, 2))
shown = []
warnings.showwarning = lambda message, *rest: shown.append(str(message))
warnings.simplefilter("default")
product()
for _ in range(3):
    warnings.warn("the user's own", UserWarning)
    product()
print(len(shown))
"""


def test_later_forward_mode_products_leave_the_warning_filters_alone():
    """Python forgets which warnings it has shown once whenever the filters change: only a process's first product
    filters torch's warning, so a user's once-per-place warning is shown once however many products follow."""
    done = subprocess.run([sys.executable, "-c", _ONCE_PER_PLACE], capture_output=True, text=True, check=True)
    assert int(done.stdout.split()[-1]) == 1


def test_forward_mode_products_need_a_primal_and_a_tangent_per_name():
    from lightning_marglik.curvature.forward_mode import output_and_change

    net = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="one primal and one tangent per name, got 2 names, 1 primals and 1 tangents"):
        output_and_change(net, ["weight", "bias"], [net.weight.detach()], [torch.ones(1, 2)], torch.ones(3, 2))


def test_fewer_data_than_folds_turn_the_guard_off_with_its_reason():
    """Four data in five folds: a fold held no example, and the guard still decided."""
    callback = MargLikCallback(frequency=1)
    trainer([callback], 2).fit(Regressor(n_data=4), loader(regression_data(4), batch_size=2))
    assert callback.guard_off == "off: 4 data, fewer than the 5 folds of its cross-validation"
    assert callback.guard_decisions == []

