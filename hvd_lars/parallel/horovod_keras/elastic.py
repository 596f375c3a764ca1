"""`horovod.tensorflow.keras.elastic` for Keras 3: the core's `KerasState` and `run`
(`hvd_lars.parallel.elastic`), and Horovod's three callbacks, which commit at update boundaries only."""

import keras

from hvd_lars.arguments import at_least, check
from hvd_lars.parallel.accumulation import at_update_boundary
from hvd_lars.parallel.elastic import KerasState, run  # noqa: F401


class CommitStateCallback(keras.callbacks.Callback):
    """Horovod's `hvd.elastic.CommitStateCallback`: commits `state` every `batches_per_commit` (a whole
    number >= 1) batches and at every epoch end, waiting for the end of a gradient-accumulation cycle."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        check("batches_per_commit", batches_per_commit, at_least(1, whole=True))
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._batches = 0
        self._due = False

    def on_train_begin(self, logs=None):
        self._batches, self._due = 0, False  # the same count on every rank after a sync

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.batches_per_commit == 0:
            self._due = True
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        self._due = True
        self._commit_if_due()

    def _commit_if_due(self):
        if self._due and at_update_boundary(self.model.optimizer):
            self._due = False
            self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Horovod's `hvd.elastic.UpdateBatchStateCallback`: keeps `state.batch` = the batches of the current
    epoch done (0 at each epoch end), and after a reset shortens the next `fit`'s first epoch by the batches
    the restored state had done (`model.stop_training`: Keras 3 reads no `params['steps']`)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._done_before = 0
        self._stopped = False

    def on_train_begin(self, logs=None):
        self._done_before = int(self.state.batch)

    def on_epoch_begin(self, epoch, logs=None):
        self._stopped = False

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._done_before + batch + 1
        steps = (self.params or {}).get("steps")
        if self._done_before and steps and self.state.batch >= steps and not self.model.stop_training:
            self.model.stop_training = self._stopped = True

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._done_before = 0
        if self._stopped:
            self.model.stop_training = self._stopped = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Horovod's `hvd.elastic.UpdateEpochStateCallback`: at each epoch end, `state.epoch` = the epochs
    done in all attempts (Keras counts from 0 in every `fit`)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._first_epoch = None

    def on_train_begin(self, logs=None):
        self._first_epoch = int(self.state.epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._first_epoch + epoch + 1
