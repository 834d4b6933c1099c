"""``hvd.elastic`` for Keras: ``KerasState`` and Horovod's callbacks that keep it up to date.

An aiacc job keeps the ranks it started with (see :mod:`aiacc.elastic`): the state objects commit,
restore and sync as in Horovod, ``run`` calls the function once after ``state.sync()``.
"""

from __future__ import annotations

from ..elastic import ElasticStateError, ObjectState, State, TensorFlowKerasState, restart_count, run
from aiacc.exceptions import HostsUpdatedInterrupt
from .callbacks import BATCHES_BEFORE, _Callback

__all__ = ["State", "ObjectState", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run", "restart_count", "ElasticStateError",
           "HostsUpdatedInterrupt"]


class KerasState(TensorFlowKerasState):
    """State of a built Keras model, its optimizer and of the keyword arguments (exposed as attributes)."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(_Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every epoch (Horovod's).

    The commit is taken once every callback has seen the batch or epoch that ended: at the start of the next
    batch or epoch, or at the end of ``fit``. So ``state.batch`` and ``state.epoch`` in a commit always belong to
    the weights in it, whatever the order of the callbacks (Horovod's documentation lists this one before
    ``UpdateBatchStateCallback``; committing at once would record the previous batch's position)."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be at least 1, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit
        self._due = False
        self._first = 0

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit
        self._due = False
        self._first = 0

    def on_train_batch_end(self, batch, logs=None):
        # with steps_per_execution > 1 one call ends several batches (first .. batch)
        self.batches_remaining -= batch - self._first + 1
        if self.batches_remaining <= 0:
            self._due = True
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self._due = True

    def on_train_batch_begin(self, batch, logs=None):
        self._first = batch
        self._commit_if_due()

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_train_end(self, logs=None):
        self._commit_if_due()

    def _commit_if_due(self):
        if self._due:
            self._due = False
            self.state.commit()


class UpdateBatchStateCallback(_Callback):
    """Keep ``state.batch`` at the number of batches of the current epoch trained so far (0 after each epoch).

    A ``fit`` that begins while ``state.batch`` is not 0 continues that epoch: its batches count on from
    ``state.batch``. A job resumed inside an epoch passes ``fit`` the rest of that epoch's data (from batch
    ``state.batch`` on) for one epoch, then fits the remaining epochs: see "Fault tolerance" in the README.
    (Horovod's callback records the last batch's index, one less, and a resume repeats that batch.)"""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.done_before = 0

    def on_train_begin(self, logs=None):
        self.done_before = self.state.batch
        self._note()

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self.done_before + batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self.done_before = 0
        self._note()

    def _note(self):
        """The learning-rate callbacks count a continued epoch's batches on from these (``BATCHES_BEFORE``)."""
        object.__setattr__(self.model, BATCHES_BEFORE, self.done_before)  # (past Keras' attribute tracking)


class UpdateEpochStateCallback(_Callback):
    """Keep ``state.epoch`` at the number of finished epochs.

    The first epoch a ``fit`` runs is taken to be epoch ``state.epoch``, whether the ``fit`` counts from 0
    (Horovod's ``fit(epochs=epochs - state.epoch)``) or from ``initial_epoch=state.epoch``."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch
        self._first_epoch = None

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch
        self._first_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._first_epoch is None:
            self._first_epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        first = epoch if self._first_epoch is None else self._first_epoch
        self.state.epoch = self.initial_epoch + (epoch - first) + 1
