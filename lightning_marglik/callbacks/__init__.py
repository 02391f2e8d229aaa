"""Algorithm 1 of Immer et al. (2021) as Lightning callbacks.

``MargLikCallback`` estimates the evidence after every ``frequency``-th epoch past ``burnin`` (or, with
``settle``, once the training loss has settled), and takes hyperparameter steps; ``MargLikCheckpoint`` and
``MargLikEarlyStopping`` act on those estimates only (never on a stale or non-finite value, never
during burn-in).

These are the callbacks for ``pytorch_lightning``; ``lightning_marglik.lightning`` has the same
ones for ``lightning.pytorch`` (``import lightning``). Their logic lives in the modules of this
package, shared by both, one job each:

- :mod:`.core`: the estimating callbacks' hooks, the estimate and resume;
- :mod:`.schedule`: when an estimate is due, and whether the latest is fresh; :mod:`.epoch_loss`: the
  training loss a settle rule reads;
- :mod:`.fit_record`, :mod:`.resume` and :mod:`.logged`: the record through a fit that trains nothing, a
  resume whose learnables changed, and what is logged;
- :mod:`.averaging`: Lightning's weight-averaging callbacks, kept off the hyperparameters;
- :mod:`.checks` and :mod:`.data`: the set-up checks and the evidence data;
- :mod:`.training_statistics`: the sums of the training passes (``statistics="training"``);
- :mod:`.followers`: ``MargLikCheckpoint`` and ``MargLikEarlyStopping``;
- :mod:`.bound`: ``MargLikBoundCallback``;
- :mod:`.report` and :mod:`.cost`: what the callbacks say at set-up and when training ends, and the warning
  for a run that would cost more than twice one without the callback;
- :mod:`.package` and :mod:`.progress`: what the callbacks know of a Lightning package, and its progress bar.
"""
from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback, EarlyStopping, ModelCheckpoint, RichProgressBar, TQDMProgressBar
from pytorch_lightning.callbacks.early_stopping import EarlyStoppingReason
from pytorch_lightning.callbacks.progress.tqdm_progress import Tqdm

from .bound import MargLikBoundCallbackCore
from .core import MargLikCallbackCore
from .followers import CheckpointCore, EarlyStoppingCore
from .package import LightningPackage, MargLikConfigurationError, find_hyperparameters  # noqa: F401 - selection uses it

__all__ = ["MargLikBoundCallback", "MargLikCallback", "MargLikCheckpoint", "MargLikConfigurationError", "MargLikEarlyStopping"]

PACKAGE = LightningPackage(
    name="pytorch_lightning",
    trainer=pl.Trainer,
    lightning_module=pl.LightningModule,
    tqdm_bar=TQDMProgressBar,
    tqdm=Tqdm,
    rich_bar=RichProgressBar,
    stopping_reason=EarlyStoppingReason,
)


class MargLikCallback(MargLikCallbackCore, Callback):
    """Learn prior precisions, noise and temperature by the Laplace evidence during training.

    After epoch ``e`` (counted from 1) with ``e > burnin`` and ``e % frequency == 0`` (by default
    every 10th epoch, from the start: Algorithm 1 of Immer et al. 2021), and after the last epoch of
    ``max_epochs``, the callback computes the evidence over the examples one training epoch draws at the current weights, steps the log hyperparameters (``solver``:
    Newton steps until converged, within ``steps`` evaluations, or ``steps`` Adam steps), writes
    them into the ``GaussianPrior`` and ``Likelihood`` registered on the LightningModule, and logs
    ``marglik`` (log evidence per datum, after the update) with every hyperparameter. If training
    ends otherwise (``max_steps``, ``max_time``, early stopping on another metric) after epochs
    without an estimate, a final estimate is made in ``on_train_end`` (``final_marglik``; it also
    updates ``best_marglik`` and ``trainer.callback_metrics``).

    The evidence data are the examples of the training loader's sampler, each once (a
    ``SubsetRandomSampler``'s indices, a custom sampler's keys, else the whole data set); samplers
    that draw another distribution (``WeightedRandomSampler`` with replacement or of fewer samples
    than weights, ``RandomSampler(replacement=True)``, repeated keys) are refused: pass ``dataloader=``.
    An iterable-style training set is read for the batches one training epoch uses
    (``limit_train_batches``); one without length or limit is refused.

    Everything the evidence needs is checked when training starts, before the first step: the
    ``dataloader`` source, one eval-mode ``forward`` of one evidence batch (a single output tensor
    whose shape fits the likelihood and the targets), and hyperparameters that are finite in the
    module's dtype. Every problem raises a :class:`MargLikConfigurationError` naming the fix.
    The targets of every evidence batch are then read once (no forward; the random state is
    restored) to count the data ``N``, summed over ranks: data without a datum (every label
    ``ignore_index``) are refused, and ``N`` is stored on the prior (``prior.n_data``) for
    :func:`lightning_marglik.map_loss`, as after every estimate.

    Each ``fit`` starts afresh (history, best value, Adam state of the hyperparameter steps); a
    ``fit(ckpt_path=...)`` restores them from the checkpoint, and a fit that trains nothing (a Trainer
    that has finished) keeps the previous fit's, with a warning. With ``reload_dataloaders_every_n_epochs``
    ``N`` is counted again when an epoch's training loader is new. Weight averaging
    (``EMAWeightAveraging``, ``StochasticWeightAveraging``) must be listed before this callback: the
    hyperparameters are never averaged, and the end-of-training estimate is that of the averaged weights. If the learnable hyperparameters
    changed since the checkpoint (e.g. ``learn_temperature`` turned on, or other tensors in
    ``GaussianPrior(fixed=...)``), the Adam state starts afresh with a warning; the rest of the
    state is kept. A tensor the checkpoint learned and the prior now fixes takes the declared
    ``precision`` (with a warning).

    The LightningModule's ``forward(inputs)`` must return the network outputs (batches are
    ``(inputs, targets)`` pairs, or define ``marglik_batch(self, batch) -> (inputs, targets)``),
    its prior must cover all trainable parameters, and its loss should be
    :func:`lightning_marglik.map_loss`. With Lightning's progress bar on (TQDM or Rich), the
    evidence pass shows its own line. The evidence pass and the set-up check set the submodules'
    ``training`` flags themselves and restore them; the module's own ``train()``/``eval()`` is
    never called.

    These callbacks are for ``pytorch_lightning``; with ``import lightning``, import the same
    ones from ``lightning_marglik.lightning``.

    Args:
        structure: Curvature structure, ``"kron"``, ``"ekfac"`` (eigenvalue-corrected Kronecker:
            two passes over the evidence data, one process only), ``"diag"`` or ``"full"``.
        approx: ``"ggn"`` or ``"ef"``.
        frequency: Estimate every ``frequency`` epochs (``F``). Default 10, the paper's setting for
            large problems: with the exact Kronecker GGN, whose pass costs 3-9 training epochs, a run then
            costs at most about twice a run without the callback
            (``benchmarks/results/vs_cross_validation.md``); 1 learns from every epoch at that cost per epoch.
        burnin: Epochs before the first estimate (``B``); the last epoch estimates in any case, so a ``burnin`` of
            ``max_epochs`` or more leaves only that estimate (warned when training starts).
        steps: Adam steps per estimate (``K``), or the Newton solver's evaluation budget.
        lr: Adam learning rate on the log hyperparameters (``gamma``; ``solver="adam"`` only).
        mc_samples: Monte-Carlo samples per example for the GGN (0: exact).
        dataloader: Data for the evidence pass (e.g. the training set without augmentation): a
            ``DataLoader``, or the name of a method of the LightningModule or DataModule that
            returns one (usable from YAML). Default: the trainer's training data.
        seed: Seed of the Monte-Carlo samples (the estimate of epoch ``e`` uses ``seed + e``), 0 to ``2**64 - 1``.
        solver: Hyperparameter steps per estimate: ``"newton"`` (Newton with a line search until
            converged, at most ``steps`` evaluations; see :mod:`lightning_marglik.solvers`) or
            ``"adam"`` (``steps`` Adam steps at ``lr``, the paper's Algorithm 1; its moments carry
            over between estimates).
        backend: Curvature backend: ``"hooks"`` (ours, any network) or ``"backpack"`` (optional
            extra ``lightning_marglik[backpack]``; Sequential networks of Linear/Conv2d layers).
        scale_invariant: Treatment of the tensors the training loss is scale-invariant in (a layer
            whose output goes only into a BatchNorm/GroupNorm/LayerNorm), found from the graph when
            training starts and named in one warning: ``"decoupled"`` (the evidence learns their
            precision, their weight decay stays at the prior's initial ``precision``),
            ``"fixed"`` (their precision stays at its initial value) or ``"learn"`` (no special
            treatment: the learned precision can grow without bound and shrink them).
            ``GaussianPrior(fixed=...)`` wins for the tensors it names. See
            ``examples/results/normalization_treatment.md``.
        statistics: Where the curvature sums come from: ``"pass"`` (the evidence pass over the
            data after the epoch) or ``"training"`` (``approx="ef"`` with ``structure="diag"`` or
            ``"kron"``: the sums of the training steps' own forward and backward in estimation
            epochs, scaled by the loss's reduction, so an estimate needs no pass over the data;
            the weights move within the epoch). The first training batch's sums are checked
            against the evidence pass at the same weights (the loss must be ``map_loss`` of one
            ``forward`` call, the training forward as in eval mode); manual optimization,
            ``precision="16-mixed"`` and parameters on the exact per-example path are refused.
            An epoch not seen whole (a resume within it, ``max_steps``) falls back to the pass.
        statistics_fraction: With ``statistics="training"``: the fraction of an estimation epoch's
            batches whose layer products are summed, its last ``ceil(fraction * batches)`` (the
            weights nearest the estimate's), scaled to all the epoch's data; the likelihood's
            statistics still come from every batch. Below 1 the curvature is a subsample's
            estimate at a fraction of the products' cost; it needs a sized training dataloader.
        max_step: Largest change of any learned ``log delta_g`` per estimate (a trust region: a
            factor ``e^max_step``), for Newton and Adam alike (``LaplaceEvidence.optimize``), as the
            paper's ``K`` Adam steps bound an estimate's move. Default ``None``: unbounded, each estimate
            solved to convergence (with every 10th epoch a bound of 1 kept the precisions from where the
            evidence puts them: ``benchmarks/results/vs_cross_validation.md``).
        biases: Treatment of the biases and normalization parameters (every tensor with at most
            one dimension or named ``*.bias``: :func:`lightning_marglik.hyperparameters.no_decay_names`),
            declared when training starts: ``"decoupled"`` (the evidence learns their precision, their
            weight decay stays at the prior's initial ``precision``), ``"fixed"`` or ``"learn"``;
            ``None`` (default): as declared on the prior (``GaussianPrior.treat``), else
            ``"decoupled"`` (a scalar prior learns its one precision), the convention of deep
            learning recipes that the remedies study measured (``benchmarks/results/remedies.md``).
            ``GaussianPrior(fixed=...)`` wins for the tensors it names. A hyperprior on the learned
            precisions is the prior's own (``GaussianPrior(hyperprior=...)``).
        settle: A number in (0, 1): estimate only once training has settled: not before the epochs' mean training loss,
            having fallen (relatively) more than ``settle`` below its first epoch's, changed by at most
            ``settle`` over two epochs (:func:`~lightning_marglik.schedule_rules.loss_has_settled`), then
            every ``frequency``-th epoch (:class:`~lightning_marglik.callbacks.schedule.SettledSchedule`);
            the last epoch always estimates (a batch's loss: what ``training_step`` returns or, when it returns
            nothing, as under manual optimization, the losses it backpropagated); until then the network trains with
            the prior's declared precision. A run whose loss never settles gets one estimate, at its end; under
            a decaying learning rate the loss keeps falling and it settles late, which threw away the learned prior's
            gains (``benchmarks/results/vs_cross_validation.md``). Default ``None``: Algorithm 1 from
            epoch ``burnin + 1`` (the paper's schedule).
        flush_denormals: Flush denormal floats to zero on the CPU for the whole fit (``on_fit_start`` to
            ``teardown``, or an exception), then restore the process's own setting. The weights and Adam
            moments of groups whose precision the evidence raises decay into the denormal range, where
            CPU arithmetic can be many times slower (an Adam step, ``sqrt``); flushing changes results by
            less than float resolution (:mod:`lightning_marglik.denormals`). No effect on GPUs.
            ``False``: leave the mode alone.
        output_layer: Treatment of the output layer's tensors: walking back from the network's output
            in one forward when training starts, the first module on each path that applies a weight matrix
            of its own (none where a weight tied to another module or applied outside its module makes the
            output; :func:`~lightning_marglik.callbacks.output_layer.find_output_layer`): ``"fixed"`` (held
            at the prior's declared ``precision``), ``"decoupled"`` or ``"learn"`` (learned like every other
            layer: the plain evidence). What set-up
            decided, and why, is in ``output_decision`` and on the prior (``prior.treatments["output layer"]``);
            a scalar prior learns its one precision. ``GaussianPrior(fixed=...)`` wins for the tensors it names
            (it also holds a layer of your choice). See ``benchmarks/results/never_worse_default.md``.
        guard: After each estimate within training (not after the last epoch; a decision after which training
            stopped, e.g. by early stopping, is dropped when it ends), score the learned weight decay
            against the declared ``precision`` by the training data's approximate 5-fold cross-validated log
            likelihood (:mod:`lightning_marglik.guard`: one Newton step per fold from the current weights, the
            evidence's own curvature, no extra curvature pass) and feed the learned one back into the MAP loss only
            while it scores at least as well; otherwise the evidence's learned tensors are decoupled for
            training (``prior.treatments["prior guard"]``) and their learned precision stays the evidence's own
            choice. Each decision is in ``guard_decisions`` and said at the end of training. Off under a
            strategy that shards the parameters. ``False``: the learned weight decay is always fed back (the
            plain Algorithm 1). See ``benchmarks/results/prior_guard.md``.

    Raises:
        ValueError: On an invalid argument (the message names it).
        MargLikConfigurationError: When training starts, on ``biases`` other than ``"learn"`` with a
            scalar prior, or an optimizer's ``weight_decay`` on tensors the prior covers (the prior is their
            weight decay: set ``weight_decay=0``).

    Example:
        >>> callback = MargLikCallback(structure="diag", approx="ef", frequency=5, steps=100)
        >>> trainer = pl.Trainer(max_epochs=1, callbacks=[callback], logger=False)
    """

    _package = PACKAGE


class MargLikBoundCallback(MargLikBoundCallbackCore, Callback):
    """Learn the hyperparameters by a stochastic lower bound of the evidence, a step every ``k`` batches.

    Instead of Algorithm 1's evidence pass over the data after an epoch, after every
    ``every_k_batches``-th training batch (from epoch ``burnin + 1`` on) the callback computes a
    lower bound of the Laplace evidence on that batch at the current weights (Immer et al., ICML
    2023; :mod:`lightning_marglik.bounds`), and takes one Adam step on the log hyperparameters
    along its gradient: no pass over the data beyond training's own, a forward and the curvature
    of one batch per step. Under DDP each process's batch is one part of the data and the
    gradient is all-reduced once per step. The mean of an epoch's estimates (log evidence per
    datum, a stochastic lower bound at moving weights) is logged as ``marglik`` at the epoch's
    end, with every hyperparameter; ``MargLikCheckpoint`` and ``MargLikEarlyStopping`` act on it.
    ``history`` holds one entry per epoch with steps: that mean, and how many ``steps`` it averages.

    The set-up checks, the count of ``N`` stored on the prior, the treatment of scale-invariant
    tensors and resuming (the Adam state of the steps is saved) are those of
    :class:`MargLikCallback`; its other defaults are not: every tensor's precision is learned and fed back (no held
    output layer, no decoupled biases, no prior guard). The bound's batches are the training batches (the
    LightningModule's ``marglik_batch`` maps them, as for the evidence pass).

    Args:
        bound: ``"parametric"`` (the curvature ``structure`` of each batch, Kronecker or diagonal:
            cheap for large networks) or ``"ntk"`` (the exact kernel of subsets of
            ``subset_size`` examples: tighter per datum, cost ``(subset_size C)^2 P``).
        structure: The parametric bound's structure: ``"kron"``, ``"diag"`` or ``"full"``.
        approx: ``"ggn"`` or ``"ef"``.
        every_k_batches: A hyperparameter step after every ``k``-th training batch of an epoch.
        burnin: Epochs without steps.
        lr: Adam learning rate on the log hyperparameters.
        subset_size: ``"ntk"``: examples per kernel (default: the whole batch).
        mc_samples: Monte-Carlo samples per example for the GGN (0: exact; ``"auto"``: decided on the set-up
            batch's outputs as for :class:`MargLikCallback`, and named in the set-up line).
        seed: Seed of the Monte-Carlo samples, 0 to ``2**64 - 1``.
        backend: ``"hooks"`` or ``"backpack"`` (``"parametric"`` only).
        scale_invariant: As for :class:`MargLikCallback`.
        flush_denormals: As for :class:`MargLikCallback`.

    Raises:
        ValueError: On an invalid argument (the message names it and the fix).
        MargLikConfigurationError: At set-up for a prior with a hyperprior (the bound would count its term once
            per part), and when training starts, as for :class:`MargLikCallback`.

    Example:
        >>> callback = MargLikBoundCallback(bound="parametric", structure="kron", every_k_batches=10, lr=0.05)
        >>> trainer = pl.Trainer(max_epochs=1, callbacks=[callback, MargLikCheckpoint()], logger=False)
    """

    _package = PACKAGE


class MargLikCheckpoint(CheckpointCore, ModelCheckpoint):
    """Keep the best-evidence model(s) instead of validation-based checkpointing.

    Keeps the best models only at the end of training epochs in which ``MargLikCallback`` estimated
    the evidence: never on a stale value, never during burn-in, independent of validation loops.
    With ``save_last``, ``last.ckpt`` is written after *every* training epoch, before the first
    estimate too, so that a killed job resumes from its last epoch (``trainer.fit(...,
    ckpt_path=".../last.ckpt")``: weights, hyperparameters, optimizer and the callbacks' state, the
    run then identical to one never interrupted). An estimate that is not finite, or weights (or
    buffers) that are not, are never saved, neither as a best model nor as ``last.ckpt``: until a
    finite estimate exists, ``best_model_path`` is empty. A checkpoint holds the weights and (as
    module buffers) the hyperparameters.

    Like Lightning's ``ModelCheckpoint``, the top-k ranking persists across fits of the same
    instance (e.g. to keep the best-evidence model of several candidates in one directory).

    Args:
        dirpath: Directory of the checkpoints (default: the logger's); one that cannot be
            written raises a ``MargLikConfigurationError`` when training starts.
        filename: File name pattern, e.g. ``"{epoch}-{marglik:.3f}"``; default ``"marglik-{epoch}-{step}"``
            (``marglik-epoch=29-step=660.ckpt``: told apart from a validation ``ModelCheckpoint``'s
            ``epoch=29-step=660.ckpt`` in the same folder).
        save_top_k: How many of the best-evidence models to keep (-1: all, 0: none).
        save_last: Also write ``last.ckpt`` after every training epoch with finite weights (``True``
            or ``False``; not Lightning's ``"link"``, which would point to the latest best file).
        verbose: Print a line per save.

    Raises:
        ValueError: If ``dirpath`` is not a str, path or ``None``, ``filename`` not a str or ``None``,
            ``save_top_k`` not an int ``>= -1``, ``verbose`` not a bool, or ``save_last`` not ``None`` or a bool.

    Example:
        >>> checkpoint = MargLikCheckpoint(save_top_k=1, save_last=True)
        >>> trainer = pl.Trainer(max_epochs=1, callbacks=[MargLikCallback(), checkpoint], logger=False)
    """

    _package = PACKAGE


class MargLikEarlyStopping(EarlyStoppingCore, EarlyStopping):
    """Stop training when the evidence stops improving, without validation data.

    Patience counts *estimations* (every ``frequency`` epochs), not epochs. Stops on a
    non-finite evidence. When it stops, it logs why and when at info level (on rank 0) and keeps
    the message in ``stopping_reason_message`` (the kind in ``stopping_reason``). Its counters
    start afresh with every fit, are saved in checkpoints and restored on resume.

    Args:
        patience: Estimations without an improvement of more than ``min_delta`` before stopping.
        min_delta: Smallest increase of ``marglik`` (log evidence per datum) that counts.
        verbose: Also log every check (improvements), as Lightning's ``EarlyStopping`` does.

    Raises:
        ValueError: If ``patience`` is not an int ``>= 1``, ``min_delta`` not a finite number ``>= 0``, or
            ``verbose`` not a bool.

    Example:
        >>> stopper = MargLikEarlyStopping(patience=3, min_delta=1e-3)
        >>> trainer = pl.Trainer(max_epochs=1, callbacks=[MargLikCallback(), stopper], logger=False)
    """

    _package = PACKAGE
