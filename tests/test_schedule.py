"""The schedules the callbacks estimate on: when an estimate is due, and whether the latest is fresh.

The callbacks' tests follow them through real fits (``history`` epochs, bound steps every k
batches, checkpoints and early stopping on fresh estimates only); here each answer is read off a
real Trainer placed at a given epoch.
"""
import pytest
import pytorch_lightning as pl

from lightning_marglik.callbacks.schedule import BatchSchedule, EpochSchedule, SettledSchedule


def _at_epoch(trainer: pl.Trainer, epoch: int) -> pl.Trainer:
    """``trainer`` with ``epoch`` epochs completed (``trainer.current_epoch == epoch``)."""
    trainer.fit_loop.epoch_progress.current.completed = epoch
    assert trainer.current_epoch == epoch
    return trainer


def test_epoch_schedule_after_every_frequency_th_epoch_past_burnin_and_the_last():
    trainer = pl.Trainer(max_epochs=7, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    schedule = EpochSchedule(frequency=2, burnin=2)
    due = [schedule.is_due(_at_epoch(trainer, epoch)) for epoch in range(7)]
    assert [epoch + 1 for epoch, d in enumerate(due) if d] == [4, 6, 7]  # F=2 past B=2, and max_epochs
    assert not schedule.is_due(_at_epoch(trainer, 3), batch_idx=0)  # never within an epoch


def test_batch_schedule_every_k_th_batch_past_burnin_and_never_at_an_epoch_end():
    trainer = pl.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    schedule = BatchSchedule(every=3, burnin=1)
    assert not any(schedule.is_due(_at_epoch(trainer, 0), batch_idx=i) for i in range(6))  # burn-in
    assert [i for i in range(7) if schedule.is_due(_at_epoch(trainer, 1), batch_idx=i)] == [2, 5]
    assert not schedule.is_due(trainer)


def test_the_record_says_fresh_in_its_epoch_only_and_survives_a_checkpoint():
    trainer = pl.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    schedule = EpochSchedule(frequency=1, burnin=0)
    assert not schedule.is_fresh(_at_epoch(trainer, 0))
    schedule.record(trainer, epoch=1)  # the estimate after epoch 1, made while current_epoch == 0
    assert schedule.is_fresh(trainer) and schedule.is_current(trainer)
    assert not schedule.is_fresh(_at_epoch(trainer, 1))
    restored = EpochSchedule(frequency=1, burnin=0)
    restored.load_state_dict(schedule.state_dict())
    assert (restored.last_epoch, restored.last_step) == (0, trainer.global_step)
    restored.load_state_dict({})  # an older checkpoint without the record: a fresh fit's
    assert (restored.last_epoch, restored.last_step) == (-1, -1)


def test_settled_schedule_waits_for_the_training_loss_to_flatten_then_stays_settled():
    trainer = pl.Trainer(max_epochs=9, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    schedule = SettledSchedule(frequency=1, burnin=0, settle=0.05, window=2)
    losses = [2.0, 1.0, 0.7, 0.6, 0.59, 0.585, 0.9, 0.58, 0.57]
    due = []
    for epoch, loss in enumerate(losses):
        schedule.observe_loss(loss)
        due.append(schedule.is_due(_at_epoch(trainer, epoch)))
    # epoch 6 (0.585 against 0.6 two epochs before: 2.5 %) is the first settled one; the jump at
    # epoch 7 does not undo it; the last epoch is always due
    assert [epoch + 1 for epoch, d in enumerate(due) if d] == [6, 7, 8, 9]
    assert schedule.settled_epoch == 6
    restored = SettledSchedule(frequency=1, burnin=0, settle=0.05)
    restored.load_state_dict(schedule.state_dict())
    assert restored.losses == losses and restored.settled_epoch == 6
    never = SettledSchedule(frequency=1, burnin=0, settle=0.05)
    for epoch, loss in enumerate([2.0, 1.0, 0.5, 0.25]):
        never.observe_loss(loss)
        assert never.is_due(_at_epoch(trainer, epoch)) is False
    assert never.is_due(_at_epoch(trainer, 8)) is True  # max_epochs


def test_the_callbacks_settle_rule_follows_the_epochs_mean_training_loss():
    """A real fit: the loss falls, then flattens; the estimates start in the epoch the rule first holds on
    the epochs' mean losses, and the settle point survives a checkpoint. A loss that never falls (lr = 0:
    a plateau at the start) has not settled: the last epoch only."""
    import torch
    from torch.utils.data import DataLoader

    from lightning_marglik import MargLikCallback
    from lightning_marglik.schedule_rules import loss_has_settled
    from tests.lightning_models import Regressor, regression_data, trainer as make_trainer

    callback = MargLikCallback(frequency=1, steps=5, settle=0.05)
    make_trainer([callback], 6).fit(Regressor(lr=0.02), DataLoader(regression_data(), batch_size=16))
    losses = callback.schedule.losses
    first = next(e for e in range(1, 7) if loss_has_settled(losses[:e], window=2, rel_tol=0.05))
    assert 1 < first < 6 and callback.schedule.settled_epoch == first and len(losses) == 6
    assert [row["epoch"] for row in callback.history] == list(range(first, 7))
    assert callback.state_dict()["settled_epoch"] == first
    flat = MargLikCallback(frequency=1, steps=5, settle=0.05)
    make_trainer([flat], 4).fit(Regressor(lr=0.0), DataLoader(regression_data(), batch_size=16))
    assert flat.schedule.settled_epoch == -1 and [row["epoch"] for row in flat.history] == [4]
    moving = MargLikCallback(frequency=1, steps=5, settle=1e-6)  # never settles: the last epoch only
    make_trainer([moving], 4).fit(Regressor(lr=0.05), DataLoader(regression_data(), batch_size=16))
    assert [row["epoch"] for row in moving.history] == [4]
    with pytest.raises(ValueError, match="`settle` must be a finite number in \\(0, 1\\)"):
        MargLikCallback(settle=0.0)
    assert torch.isfinite(torch.tensor(callback.last_marglik))


def test_epochs_whose_steps_were_all_skipped_never_settle():
    """A training_step that returns None skips the step: such an epoch has no loss, so a constant 0
    must not pass for a settled one (only the last epoch estimates)."""
    from torch.utils.data import DataLoader

    from lightning_marglik import MargLikCallback
    from tests.lightning_models import Regressor, regression_data, trainer as make_trainer

    class Skipping(Regressor):
        def training_step(self, batch, batch_idx):
            return None

    callback = MargLikCallback(frequency=1, steps=5, settle=0.05)
    make_trainer([callback], 4).fit(Skipping(lr=0.0), DataLoader(regression_data(), batch_size=16))
    assert [row["epoch"] for row in callback.history] == [4]
    assert callback.schedule.settled_epoch == -1


def test_with_settle_training_before_the_loss_settles_is_training_without_the_callback():
    """The settle schedule's promise: until the loss settles the network trains at the declared
    precision, so a run that never settles ends with the very weights of a run without the callback
    (the set-up check's batch draws no random state from a shuffled loader), and its one estimate
    (after the last epoch) learns the hyperparameters for what comes next."""
    import torch
    from torch.utils.data import DataLoader

    from lightning_marglik import MargLikCallback
    from tests.lightning_models import Regressor, regression_data, trainer as make_trainer

    def fit(callbacks):
        torch.manual_seed(0)
        model = Regressor(lr=0.05)
        make_trainer(callbacks, 4).fit(model, DataLoader(regression_data(), batch_size=16, shuffle=True))
        return model

    callback = MargLikCallback(settle=0.05, frequency=1)
    with_callback, without = fit([callback]), fit([])
    assert callback.settle == 0.05 and callback.schedule.settled_epoch in (-1, 4)  # not before the last epoch
    assert [row["epoch"] for row in callback.history] == [4]
    for name, value in without.net.state_dict().items():
        assert torch.equal(with_callback.net.state_dict()[name], value), name
    assert not torch.equal(with_callback.prior.log_precision, without.prior.log_precision)  # learned at the end
    # nor do estimates that change nothing (steps=0) shift the shuffled batch order: their passes draw no random state
    observer = MargLikCallback(settle=None, frequency=1, steps=0)
    watched = fit([observer])
    assert [row["epoch"] for row in observer.history] == [1, 2, 3, 4]
    for name, value in without.net.state_dict().items():
        assert torch.equal(watched.net.state_dict()[name], value), name
