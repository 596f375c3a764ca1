"""What a checkpoint records beyond the model, so that a resumed run records what an uninterrupted one does.

- The epoch in progress: the running sums (totals and counts) of its training metrics (loss, top-1,
  top-5), averaged over ranks. A run resumed mid-epoch starts that epoch's metrics from them instead of from
  zero, so the epoch's logged values are the whole epoch's (within float rounding of the uninterrupted
  run's), not the mean of the updates after the resume.
- The run's time: `wall_time_s` is the training and evaluation time summed over the run's segments (the
  starts that trained it), each counted up to the checkpoint the next one resumed from (work redone after
  a kill is counted once); `segments` counts them, 1 for an uninterrupted run.

The record is a JSON string `tf.Variable` the run's `tf.train.Checkpoint` holds under "progress"
(`Progress.variable`); the checkpoint callback fills it before each save (`capture`, a collective).
"""

import json
import time

import keras
import tensorflow as tf

from hvd_lars.parallel import collectives

KEY = "progress/.ATTRIBUTES/VARIABLE_VALUE"


class Progress(keras.callbacks.Callback):
    """Keras callback: adds the metric sums of an epoch resumed mid-way to those of its first batch.

    Args:
        steps_per_epoch: updates per epoch (a checkpoint at an epoch's end starts no epoch mid-way).
    """

    def __init__(self, steps_per_epoch):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.variable = tf.Variable("", dtype=tf.string, trainable=False, name="progress")
        self.restored = {}
        self._pending = None
        self._begun = time.perf_counter()

    def resume(self, prefix):
        """Reads the record of the checkpoint at `prefix` (rank 0; None or "": a fresh start, or a checkpoint
        without one) and hands it to every rank (a collective)."""
        record = None
        if collectives.is_chief() and prefix:
            reader = tf.train.load_checkpoint(prefix)
            record = json.loads(reader.get_tensor(KEY).decode() or "{}") if reader.has_tensor(KEY) else None
        self.restored = collectives.broadcast_object(record, name="hvd_lars.progress.resume") or {}
        self._begun = time.perf_counter()

    @property
    def segments(self):
        """The starts that trained this run so far, this one included."""
        return self.restored.get("segments", 0) + 1

    def wall_time_s(self):
        """Seconds of training and evaluation over the run's segments up to now (see the module)."""
        return self.restored.get("wall_time_s", 0.0) + time.perf_counter() - self._begun

    def capture(self):
        """Puts the record of now into `variable` (every rank: a collective)."""
        sums = [float(keras.ops.convert_to_numpy(v)) for v in self.model.metrics_variables]
        mean = collectives.allreduce_sum(sums, name="hvd_lars.progress") / collectives.size()
        record = {
            "step": int(self.model.optimizer.iterations),
            "metric_sums": mean.tolist(),
            "wall_time_s": self.wall_time_s(),
            "segments": self.segments,
        }
        self.variable.assign(json.dumps(record))

    def on_epoch_begin(self, epoch, logs=None):
        step, sums = int(self.model.optimizer.iterations), self.restored.pop("metric_sums", None)
        if sums and step % self.steps_per_epoch and step == self.restored.get("step"):
            self._pending = sums

    def on_train_batch_end(self, batch, logs=None):
        # An epoch resumed mid-way adds the sums of its earlier updates to those of its first batch here:
        # Keras builds the compiled metrics' variables in the first training step, not before.
        if self._pending is None:
            return
        sums, self._pending, variables = self._pending, None, self.model.metrics_variables
        if len(sums) == len(variables):
            for variable, value in zip(variables, sums):
                variable.assign_add(value)
