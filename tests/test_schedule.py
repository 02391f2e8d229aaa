"""The schedules the callbacks estimate on: when an estimate is due, and whether the latest is fresh.

The callbacks' tests follow them through real fits (``history`` epochs, bound steps every k
batches, checkpoints and early stopping on fresh estimates only); here each answer is read off a
real Trainer placed at a given epoch.
"""
import pytorch_lightning as pl

from lightning_marglik.callbacks.schedule import BatchSchedule, EpochSchedule


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
