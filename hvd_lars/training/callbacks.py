"""Keras 3 callbacks for data-parallel large-batch training.

Order matters: `hvd_lars.horovod_callbacks.MetricAverageCallback` and `ImagesPerSecond` must precede
`ExactEvaluation`, and all of them must precede the loggers (TensorBoard, CSVLogger, the progress bar),
which then see rank-averaged values.
"""

import os
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from hvd_lars import distributed, faults
from hvd_lars.metrics import top_k_correct


def _repair_keras_async_checkpoint_copy():
    """Lets TensorFlow's asynchronous checkpoints save Keras 3 variables more than once per process.

    TF's async writer copies each variable to a host copy in `object_map` through the variable's
    `_copy_trackable_to_cpu`, first eagerly, then inside a `tf.function` at every later save. Keras 3.15's
    TensorFlow `Variable` makes a new `tf.Variable` for itself on every call, so the second save raises
    "tf.function only supports singleton tf.Variables created on the first call". Here the Keras variable
    is mapped to the host copy of the `tf.Variable` it wraps, which TF updates in place at each save; both
    serialize the same tensor ({"VARIABLE_VALUE": value}). Idempotent; only this one method is replaced.
    """
    from keras.src.backend.tensorflow import core

    if getattr(core.Variable._copy_trackable_to_cpu, "_hvd_lars_repaired", False):
        return

    def _copy_trackable_to_cpu(self, object_map):
        self.value._copy_trackable_to_cpu(object_map)
        object_map[self] = object_map[self.value]

    _copy_trackable_to_cpu._hvd_lars_repaired = True
    core.Variable._copy_trackable_to_cpu = _copy_trackable_to_cpu


def moving_statistics(model):
    """The model's non-trainable float variables (batch-norm moving mean and variance), without the
    dropout seed states, which stay per rank."""
    return [
        v
        for v in model.non_trainable_variables
        if "seed_generator" not in v.path and v.dtype.startswith("float")
    ]


class ImagesPerSecond(keras.callbacks.Callback):
    """Adds `images_per_second` (images of all ranks per second of training, evaluation excluded) and
    `epoch_time_s` to the epoch logs.

    Args:
        images_per_batch: images one training batch (micro-batch) covers over all ranks.
    """

    def __init__(self, images_per_batch):
        super().__init__()
        self.images_per_batch = images_per_batch
        self._start = None
        self._batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1

    def on_epoch_end(self, epoch, logs=None):
        elapsed = time.perf_counter() - self._start
        if logs is not None:
            logs["images_per_second"] = self.images_per_batch * self._batches / elapsed
            logs["epoch_time_s"] = elapsed


class LearningRateWarmup(keras.callbacks.Callback):
    """Sets a float learning rate from a schedule of the optimizer's update counter before every batch.

    For any Keras 3 optimizer built with a plain float learning rate (SGD, Adam, `hvd_lars.LARS`, a
    `LossScaleOptimizer` around one): before each training batch,
    `optimizer.learning_rate = schedule(optimizer.iterations)`. The rate depends only on `schedule` and
    the update counter, never on the optimizer's current (already changed) rate, so a run restored from
    a checkpoint, which restores `iterations`, continues the curve exactly. `optimizer.iterations` counts
    applied updates: with `gradient_accumulation_steps=A` Keras reports micro-batches // A, so the rate
    changes once per update, as the paper's schedule counts iterations (Keras itself would evaluate a
    schedule given to such an optimizer at the micro-batch count).

    Args:
        schedule: callable of the step (int, optimizer updates from 0) returning the rate as a float or
            scalar tensor: any schedule of `hvd_lars.schedules` (`make_schedule(...)`), or any
            `keras.optimizers.schedules.LearningRateSchedule`.

    Raises:
        ValueError: `schedule` is not callable; at train begin, the optimizer's learning rate is itself a
            schedule or a callable (then give it the schedule and drop this callback, or a float).

    With `steps_per_execution=k > 1` Keras runs batch hooks once per k steps, so the rate is set once per
    k steps (a warning says so); a schedule inside the optimizer has no such limit.
    """

    def __init__(self, schedule):
        super().__init__()
        if not callable(schedule):
            raise ValueError(f"schedule must be a callable of the step, got {schedule!r}.")
        self.schedule = schedule

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        rate = _inner(optimizer)._learning_rate
        if not isinstance(rate, keras.Variable):
            raise ValueError(
                "LearningRateWarmup needs an optimizer with a float learning rate; "
                f"{type(optimizer).__name__} {optimizer.name!r} has a {type(rate).__name__}. Pass the "
                "schedule to the optimizer instead, or build the optimizer with a float rate (for example "
                "learning_rate=0.0)."
            )
        steps_per_execution = getattr(self.model, "steps_per_execution", 1) or 1
        if steps_per_execution > 1:
            warnings.warn(
                f"LearningRateWarmup with steps_per_execution={steps_per_execution}: the rate is set once "
                f"per {steps_per_execution} steps.",
                stacklevel=2,
            )
        self._set_rate()  # right from the start, e.g. for callbacks that read it before the first batch

    def on_train_batch_begin(self, batch, logs=None):
        self._set_rate()

    def _set_rate(self):
        optimizer = self.model.optimizer
        optimizer.learning_rate = _scalar(self.schedule(int(_scalar(optimizer.iterations))))


class LearningRateLogger(keras.callbacks.Callback):
    """Adds `learning_rate` to the epoch logs: the rate the optimizer used for its last update of the epoch.

    Works for a float rate (set by `LearningRateWarmup`, by Keras's `LearningRateScheduler` or by hand;
    read at epoch end, so its place relative to `LearningRateWarmup` does not matter) and for a schedule
    inside the optimizer, whatever counter that optimizer feeds its schedule (applied updates for
    `hvd_lars.LARS`, micro-batches for Keras's optimizers with gradient accumulation): the schedule's
    rate is read through `optimizer.learning_rate` before each batch, which is what the batch's update
    uses. Place it before CSVLogger and TensorBoard. Keras's TensorBoard also writes `learning_rate`
    itself, as the optimizer's rate at epoch end: the same for a float rate, one update later for a
    schedule (its value for the next update).

    Args:
        key: str, the name in the logs (`"learning_rate"`).
    """

    def __init__(self, key="learning_rate"):
        super().__init__()
        self.key = key
        self._scheduled = False
        self._rate = None

    def on_train_begin(self, logs=None):
        self._scheduled = not isinstance(_inner(self.model.optimizer)._learning_rate, keras.Variable)

    def on_train_batch_begin(self, batch, logs=None):
        if self._scheduled:
            self._rate = self.model.optimizer.learning_rate

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        rate = self._rate if self._scheduled else self.model.optimizer.learning_rate
        if rate is not None:
            logs[self.key] = _scalar(rate)


def _inner(optimizer):
    # Wrappers (LossScaleOptimizer, DistributedOptimizer) hold the rate in the optimizer they wrap.
    from hvd_lars.distributed_optimizer import innermost_optimizer

    return innermost_optimizer(optimizer)


def _scalar(value):
    # Variables through .numpy(): NumPy 2 warns when np.array() converts a Keras variable.
    if isinstance(value, keras.Variable):
        value = value.numpy()
    return float(keras.ops.convert_to_numpy(value))


class ExactEvaluation(keras.callbacks.Callback):
    """Evaluates every `every_epochs` epochs (and at the last) on each rank's shard; sums exact counts.

    Adds `<prefix>_loss` (mean softmax cross-entropy), `<prefix>_top1` and `<prefix>_top5` (fractions)
    computed from correct-prediction counts summed over ranks, so every evaluation image counts exactly
    once. A prediction is correct by `hvd_lars.metrics.top_k_correct` (ties broken by class index, as
    argmax does), the rule of the training metrics. `prefix` is "test" for the test set and "val" for a
    validation split (Keras's TensorBoard callback writes `val_*` to its `validation/` folder, as the
    same tags).

    Raises:
        RuntimeError: the ranks together evaluated a number of images other than `num_examples`.
    """

    def __init__(self, dataset, num_examples, every_epochs=1, last_epoch=None, prefix="test"):
        super().__init__()
        self.dataset = dataset
        self.num_examples = num_examples
        self.every_epochs = every_epochs
        self.last_epoch = last_epoch
        self.prefix = prefix
        self._step = None

    def _counts(self):
        if self._step is None:

            @tf.function(reduce_retracing=True)
            def step(images, labels):
                logits = tf.cast(self.model(images, training=False), tf.float32)
                labels = tf.cast(labels, tf.int32)
                loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
                # The training metrics' rule (hvd_lars.metrics): ties broken by class index.
                top1 = top_k_correct(labels, logits, 1)
                top5 = top_k_correct(labels, logits, min(5, logits.shape[-1]))
                return tf.stack(
                    [
                        tf.reduce_sum(loss),
                        tf.reduce_sum(tf.cast(top1, tf.float32)),
                        tf.reduce_sum(tf.cast(top5, tf.float32)),
                        tf.cast(tf.size(labels), tf.float32),
                    ]
                )

            self._step = step
        total = np.zeros(4, dtype=np.float64)
        for images, labels in self.dataset:
            total += self._step(images, labels).numpy()
            faults.heartbeat()
        return total

    def on_epoch_end(self, epoch, logs=None):
        last = self.last_epoch is not None and epoch + 1 == self.last_epoch
        if not (last or (epoch + 1) % self.every_epochs == 0):
            return
        # One model for every rank: each rank's batch-norm moving statistics follow its own batches.
        distributed.average_variables(moving_statistics(self.model))
        loss, top1, top5, count = distributed.allreduce_sum(self._counts(), name="hvd_lars.eval_counts")
        if int(count) != self.num_examples:
            raise RuntimeError(
                f"evaluated {int(count)} {self.prefix} images across ranks, expected {self.num_examples}."
            )
        if logs is not None:
            logs[f"{self.prefix}_loss"] = loss / count
            logs[f"{self.prefix}_top1"] = top1 / count
            logs[f"{self.prefix}_top5"] = top5 / count


class CheckpointWriteError(OSError):
    """Rank 0 could not write a checkpoint (a full or read-only file system, a vanished folder)."""


class PeriodicCheckpoint(keras.callbacks.Callback):
    """Rank 0 saves the `tf.train.Checkpoint` of `manager` (model, optimizer with its step counter and
    slots) every `every_steps` optimizer updates and at each epoch end, numbered by the update count.

    Progress is the optimizer's update counter (epoch = step // steps per epoch). The manager writes the
    checkpoint files first and its `checkpoint` index last, by atomic rename, so a job killed while
    writing still points at its last complete checkpoint; it keeps the newest `max_to_keep`.

    With `asynchronous`, rank 0 copies the variables to host memory and returns to training while
    TensorFlow's background thread writes the files (`tf.train.CheckpointOptions(
    experimental_enable_async_checkpoint=True)`); the manager replaces the index only once they are
    complete, so the guarantee above holds. The other ranks never wait for the disk. The write is waited
    for at the end of each `fit` (`on_train_end`) and before the next save begins.

    Args:
        manager: `tf.train.CheckpointManager`.
        every_steps: int >= 0; 0 saves at epoch ends only.
        accumulation_steps: micro-batches per update; saves happen only at update boundaries.
        at_epoch_end: bool; save at each epoch end (after evaluation). Without it, the state at the end of
            each `fit` is saved instead of the epoch ends', so a finished run still has its final checkpoint.
        asynchronous: bool; write in the background (see above).
    """

    def __init__(self, manager, every_steps, accumulation_steps=1, at_epoch_end=True, asynchronous=False):
        super().__init__()
        self.manager = manager
        self.every_steps = every_steps
        self.accumulation_steps = accumulation_steps
        self.at_epoch_end = at_epoch_end
        self.options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=bool(asynchronous))
        if asynchronous:
            _repair_keras_async_checkpoint_copy()
        self._last_saved = None
        self._pending_step = None

    def save(self):
        """Saves the checkpoint of the current update (once per update). A collective: every rank calls it.

        Raises:
            CheckpointWriteError: rank 0 could not write the checkpoint (raised on every rank, saying why).
        """
        step = int(self.model.optimizer.iterations)
        # Every rank, at the same steps: the checkpoint (rank 0's) then holds the statistics of all ranks,
        # and a run resumed from it continues as the uninterrupted run does.
        distributed.average_variables(moving_statistics(self.model), name="hvd_lars.checkpoint_statistics")
        error = None
        if step != self._last_saved and distributed.is_chief():
            error = self._wait()  # the previous background write, if any, first
            if not error:
                try:
                    self._pending_step = step
                    self.manager.save(checkpoint_number=step, options=self.options)
                except (OSError, tf.errors.OpError) as e:
                    error = self._error(e)
        self._raise_together(error)
        self._last_saved = step
        faults.heartbeat()

    def _error(self, e):
        return f"could not write the checkpoint of step {self._pending_step} to {self.manager.directory}: {e}"

    def _wait(self):
        # Rank 0: waits for its background write; the error message if it failed, else None.
        if not distributed.is_chief():
            return None
        try:
            self.manager.sync()
        except (OSError, tf.errors.OpError) as e:
            return self._error(e)
        step = self._pending_step
        if step is None or os.path.exists(os.path.join(self.manager.directory, f"ckpt-{step}.index")):
            return None
        # TensorFlow's background writer keeps its exception until the next save and sync() does not raise
        # it: the missing files show the failure, and the exception (a private attribute) says why.
        writer = getattr(self.manager._checkpoint, "_async_checkpointer_impl", None)
        reason = getattr(writer, "_async_error", None)
        if reason is not None:
            writer._async_error = None
        return self._error(reason or "its files are missing after the write")

    def _raise_together(self, error):
        # Rank 0's outcome on every rank, so that all stop together instead of waiting for rank 0.
        error = distributed.broadcast_object(error, name="hvd_lars.checkpoint_error")
        if error:
            raise CheckpointWriteError(error)

    def sync(self):
        """Waits until rank 0's background write (if any) is complete and the index names it. Not a
        collective (any rank may call it; only rank 0 waits).

        Raises:
            CheckpointWriteError: on rank 0, the write failed.
        """
        error = self._wait()
        if error:
            raise CheckpointWriteError(error)

    def finish(self):
        """`sync` on every rank together: a collective that raises `CheckpointWriteError` on every rank when
        rank 0's last write failed."""
        self._raise_together(self._wait())

    def on_train_batch_end(self, batch, logs=None):
        # The epoch's last update is saved by on_epoch_end, after evaluation, so that a job killed while
        # evaluating restarts that epoch's evaluation instead of losing it.
        last_of_epoch = self.at_epoch_end and self.params and batch + 1 == self.params.get("steps")
        if self.every_steps and (batch + 1) % self.accumulation_steps == 0 and not last_of_epoch:
            if int(self.model.optimizer.iterations) % self.every_steps == 0:
                self.save()

    def on_epoch_end(self, epoch, logs=None):
        if self.at_epoch_end:
            self.save()

    def on_train_end(self, logs=None):
        if not self.at_epoch_end:
            self.save()
        self.finish()
