"""Whether the learned weight decay predicts held-out data better than the declared one (issue 52's guard).

Where the declared prior already fits, the Laplace-GGN evidence of a trained network chooses a prior too strong
for the weights it trains: fed back as weight decay, the learned precision shrinks the directions the data do
not determine, the evidence reads their smaller norm as a call for a stronger prior, and test NLL grows while
accuracy stays (``benchmarks/results/prior_strength.md``). Kept apart from the MAP, the same evidence loses
every win where the declared prior overfits. :func:`approximate_cv` scores both from the training data alone,
so that a callback can feed the learned precision back only while it scores better.

The score of a candidate weight decay ``delta`` is the training data's K-fold cross-validated log likelihood,
each fold's refit one Newton step from the current weights ``theta`` on the other folds' MAP objective::

    theta_k = theta - H_k^-1 (g - g_k + delta theta),    H_k = (K - 1) / K * s C + diag(delta),

``g_k`` the fold's gradient of its negative log likelihood (tempered) and ``g`` their sum: the step is taken
from weights that are not at the objective's optimum, with their full gradient (the mode correction of Lin,
Antoran and Hernandez-Lobato, 2023). ``s C`` is the evidence's own curvature (its structure, its Monte-Carlo
estimate), of which the held-in folds hold ``(K - 1) / K``: no pass of its own. The held-out fold is scored
by the linearized network at ``theta_k`` (``f + J (theta_k - theta)``, one forward-mode product): the
conditional likelihood of held-out data given the rest (Lotfi et al., ICML 2022), by a Newton refit instead of
retraining. From an over-parameterised network the step overshoots, so the scores are not calibrated
(log likelihoods per datum of -5 to -45 where the test's are -0.01 to -2.6); their order chose as the exact
GGN's did at every estimate of the 100-class family's noise members, 3 seeds each (``prior_guard.md`` against
``prior_strength.md`` in ``benchmarks/results/``).

Cost: the folds' gradients (one forward and backward over the evidence data, a fold's pieces of consecutive
batches joined into calls of a batch's size: :func:`fold_calls`) and one forward-mode pass per candidate;
memory ``K + 1`` vectors of the prior's size in the weights' dtype (the folds' gradients, and the held-in
gradient that each block's solve overwrites with its step), float64 one structure's block at a time.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .curvature import eval_mode, locate
from .curvature.batches import Inputs, batch_dims, call_model, examples, slice_batch
from .curvature.forward_mode import output_and_change
from .evidence import LaplaceEvidence
from .validators import integer

__all__ = ["FOLDS", "approximate_cv", "fold_calls", "fold_pieces"]

#: Folds of the approximate cross-validation.
FOLDS = 5

Batch = Tuple[Inputs, Tensor]
Reduce = Callable[[Tensor], Tensor]


def fold_pieces(batch: Batch, folds: int) -> List[Batch]:
    """The batch cut into ``folds`` contiguous pieces, fold ``k``'s the ``k``-th (a rule of the batch alone, so that
    DDP's ranks cut their batches as one process would): of ``ceil(size / folds)`` examples, the last ones smaller;
    where that would leave a piece empty (a batch of 6, 8 or 16 for 5 folds, whose fifth fold had held nothing), of
    ``size / folds`` rounded down or up. A batch of fewer examples than folds gives one piece per example.

    Raises:
        ValueError: If ``folds`` is not an integer of at least 1.

    Example:
        >>> pieces = fold_pieces((torch.arange(7.0)[:, None], torch.arange(7)), 3)
        >>> [len(target) for _, target in pieces] == [3, 3, 1]
        True
        >>> eight = (torch.arange(8.0)[:, None], torch.arange(8))
        >>> [len(target) for _, target in fold_pieces(eight, 5)] == [1, 2, 1, 2, 2]
        True
    """
    folds = integer(folds, "folds", minimum=1)
    inputs, target = batch
    size = examples(inputs, target)
    width = -(-size // folds)
    if width * (folds - 1) < size:  # the studies' batches (128: 26, 26, 26, 26, 24) keep their pieces
        bounds = [min(k * width, size) for k in range(folds + 1)]
    else:
        bounds = [k * size // folds for k in range(folds + 1)]
    return [(slice_batch(inputs, start, end, size), target[start:end])
            for start, end in zip(bounds, bounds[1:]) if end > start]


def approximate_cv(
    evidence: LaplaceEvidence,
    model: nn.Module,
    batches: Sequence[Batch],
    candidates: Dict[str, Tensor],
    folds: int = FOLDS,
    reduce: Optional[Reduce] = None,
) -> Dict[str, float]:
    """The approximate K-fold cross-validated log likelihood per datum of each candidate weight decay.

    Args:
        evidence: The evidence at the model's current weights (its curvature, likelihood and prior).
        model: The network the evidence was taken of, at those weights (called in eval mode).
        batches: The evidence data, ``(inputs, targets)`` on the parameters' device and dtype.
        candidates: Name -> log precision per prior group (the shape of ``prior.log_precision``).
        folds: K, at least 2.
        reduce: Sums a tensor over processes (``None``: one process).

    Returns:
        Name -> the held-out log likelihood per datum, summed over folds (and processes).

    Raises:
        ValueError: On fewer than 2 folds, no example in ``batches``, or a candidate that is not a finite log
            precision of ``prior.log_precision``'s shape.

    Example:
        >>> from lightning_marglik import CategoricalLikelihood, GaussianPrior
        >>> net = nn.Linear(3, 2)
        >>> prior, likelihood = GaussianPrior(net), CategoricalLikelihood()
        >>> x, y = torch.randn(20, 3), torch.arange(20) % 2
        >>> evidence = LaplaceEvidence.fit(net, [(x, y)], likelihood, prior, mc_samples=0)
        >>> scores = approximate_cv(evidence, net, [(x, y)], {"declared": prior.log_precision.detach()})
        >>> scores["declared"] < 0
        True
    """
    if folds < 2:
        raise ValueError(f"`folds` must be at least 2, got {folds}.")
    prior, likelihood = evidence.prior, evidence.likelihood
    shape = tuple(prior.log_precision.shape)
    for name, log_precision in candidates.items():
        if tuple(log_precision.shape) != shape or not bool(torch.isfinite(log_precision).all()):
            raise ValueError(f"candidate {name!r}: a finite log precision per prior group, shape {shape} (as "
                             f"prior.log_precision), is needed; got shape {tuple(log_precision.shape)} "
                             f"with values {log_precision.tolist()}.")
    reduce = reduce or (lambda t: t)
    names, _ = locate(model, prior)
    theta = [p.detach() for p in prior.params]
    sizes = prior.param_sizes
    calls = fold_calls(batches, folds)
    if not any(calls):
        raise ValueError("`batches` holds no example: pass the evidence data the evidence was fit on.")
    inverse_temperature = float(likelihood.temperature.detach().reciprocal())
    with eval_mode(model), contextlib.ExitStack() as reusing:
        for structure in evidence.structures:  # the candidates' inverses share each factor's decomposition
            reusing.enter_context(structure.reusing_decompositions())
        # one (K, P) buffer, each fold's gradient summed into its row: no list of K flat copies to stack
        gradients = theta[0].new_zeros(folds, sum(sizes))
        for row, fold in zip(gradients, calls):
            _add_fold_gradient(row, model, prior.params, likelihood, fold)
        gradients = reduce(gradients.mul_(inverse_temperature))
        hyper = {name: value.detach().double() for name, value in likelihood.hyperparameters().items()}
        scale = likelihood.curvature_scale(evidence.approx, hyper) * (folds - 1) / folds
        # one more weight-sized vector: the held-in folds' gradient, then (block by block, in place) the step; the
        # evidence's structures cover every prior tensor once (fixed ones too), so no gradient is left in it
        step = torch.empty_like(gradients[0])
        scores = {}
        for name, log_precision in candidates.items():
            delta = [d.exp() for d in prior.tensor_log_precisions(log_precision.detach().double())]
            blocks = [(structure.indices, structure.inverse(scale, delta)) for structure in evidence.structures]
            held_out = torch.zeros((), dtype=torch.float64, device=theta[0].device)
            for k, fold in enumerate(calls):
                step.zero_()
                for j, row in enumerate(gradients):
                    if j != k:
                        step.add_(row)
                pieces = step.split(sizes)
                # block by block (the structures cover the prior's tensors, disjoint): float64 a block at a time
                for indices, block in blocks:
                    objective = [theta[i].reshape(-1).to(torch.float64, copy=True).mul_(delta[i]).add_(pieces[i])
                                 for i in indices]
                    for i, solved in zip(indices, block(objective)):
                        pieces[i].copy_(solved).neg_()
                tangent = [piece.view_as(t) for piece, t in zip(pieces, theta)]
                for inputs, target in fold:
                    output = _linearized(model, names, theta, tangent, inputs)
                    held_out = held_out - likelihood.nll(output, target).double().sum()
            scores[name] = held_out
        values = reduce(torch.stack(list(scores.values())))  # the evidence's n_data is summed over processes already
    return {name: float(value) / float(evidence.n_data) for name, value in zip(scores, values)}


def fold_calls(batches: Sequence[Batch], folds: int) -> List[List[Batch]]:
    """Fold ``k``'s pieces of every batch (:func:`fold_pieces`), consecutive ones joined into calls of at most the
    largest batch's size where their inputs concatenate (the same trailing shapes, the same shared values): a
    fold's gradient and forward-mode products take about as many calls as training takes batches, not ``K`` times
    as many (on a small network, the calls' overhead was most of the guard's time). Consecutive batches of fewer
    examples than folds are joined before they are cut (:func:`_gathered`): cut alone, batches of 1 put every
    example into the first fold, and there was no cross-validation at all.

    Raises:
        ValueError: If ``folds`` is not an integer of at least 1 (:func:`fold_pieces`).

    Example:
        >>> batches = [(torch.arange(4.0)[:, None], torch.arange(4)), (torch.arange(4.0, 8)[:, None], torch.arange(4, 8))]
        >>> first, second = fold_calls(batches, 2)  # one call per fold: the k-th halves of both batches
        >>> (_, target), = first
        >>> target.tolist()
        [0, 1, 4, 5]
    """
    pieces = [fold_pieces(batch, folds) for batch in _gathered(batches, folds)]  # read once: an iterator is taken too
    limit = max((sum(len(target) for _, target in cut) for cut in pieces), default=0)
    calls: List[List[Batch]] = []
    for k in range(folds):
        fold: List[Batch] = []
        for inputs, target in (p[k] for p in pieces if k < len(p)):
            joined = _joined(fold[-1], (inputs, target)) if fold and len(fold[-1][1]) + len(target) <= limit else None
            if joined is None:
                fold.append((inputs, target))
            else:
                fold[-1] = joined
        calls.append(fold)
    return calls


def _gathered(batches: Iterable[Batch], folds: int) -> Iterator[Batch]:
    """The batches, runs of consecutive ones of fewer than ``folds`` examples joined (where their inputs concatenate)
    until they hold ``folds``; larger batches as they are."""
    run: Optional[Batch] = None
    for batch in batches:
        small = len(batch[1]) < folds
        joined = _joined(run, batch) if run is not None and small else None
        if run is not None and joined is None:
            yield run
        run = joined if joined is not None else batch if small else None
        if not small:
            yield batch
        elif len(run[1]) >= folds:
            yield run
            run = None
    if run is not None:
        yield run


class _Apart(Exception):
    """Two pieces whose inputs do not concatenate into one call."""


def _joined(first: Batch, second: Batch) -> Optional[Batch]:
    """The two pieces as one, or ``None`` where their inputs or targets do not concatenate."""
    (a, target_a), (b, target_b) = first, second
    size_a, size_b = examples(a, target_a), examples(b, target_b)

    def join(x: object, y: object, dim_x: object, dim_y: object) -> object:
        if isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y):
            return tuple(join(*parts) for parts in zip(x, y, dim_x, dim_y))  # type: ignore[call-overload]
        if isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
            return {key: join(x[key], y[key], dim_x[key], dim_y[key]) for key in x}  # type: ignore[index]
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            if dim_x == dim_y == 0 and x.shape[1:] == y.shape[1:] and x.dtype == y.dtype:
                return torch.cat([x, y])
            if dim_x is None and dim_y is None and (x is y or (x.shape == y.shape and torch.equal(x, y))):
                return x
            raise _Apart
        # a shared value other than a tensor: the same object, or an equal plain scalar (an array's == is no bool)
        if x is y or (isinstance(x, (bool, int, float, str)) and type(x) is type(y) and x == y):
            return x
        raise _Apart

    try:
        inputs = join(a, b, batch_dims(a, size_a), batch_dims(b, size_b))
        target = join(target_a, target_b, 0, 0)
    except _Apart:
        return None
    return inputs, target  # type: ignore[return-value]


def _add_fold_gradient(row: Tensor, model: nn.Module, params: Sequence[Tensor], likelihood: object,
                       pieces: Sequence[Batch]) -> None:
    """Add the gradient of the fold's summed negative log likelihood (untempered) into ``row`` (flat, in the
    parameters' dtype)."""
    views = [piece.view_as(p) for piece, p in zip(row.split([p.numel() for p in params]), params)]
    for inputs, target in pieces:
        with torch.enable_grad():
            loss = likelihood.nll(call_model(model, inputs), target).sum()  # type: ignore[attr-defined]
            for view, g in zip(views, torch.autograd.grad(loss, list(params), allow_unused=True)):
                if g is not None:
                    view += g


def _linearized(model: nn.Module, names: List[str], theta: List[Tensor], tangent: List[Tensor], inputs: Inputs) -> Tensor:
    """``f(theta) + J(theta) tangent`` of the batch, by one forward-mode product."""
    # attention's fused CPU kernels have no forward-mode derivative; the math one computes the same function
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        output, change = output_and_change(model, names, theta, tangent, inputs)
    return change.add_(output)  # in place: a batch of a vocabulary's logits is large (exact: addition commutes)
