"""Periodic checkpoints of model and optimizer through `tf.train.CheckpointManager`, on rank 0."""

import glob
import os
import shutil
import time

import keras
import tensorflow as tf

from hvd_lars import keras_internals
from hvd_lars.parallel import collectives
from hvd_lars.training import faults, lineage
from hvd_lars.training.evaluation import moving_statistics


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
        progress: the `hvd_lars.training.epoch_logs.Progress` whose record the checkpoint holds, filled before
            each save; or None.
    """

    def __init__(
        self, manager, every_steps, accumulation_steps=1, at_epoch_end=True, asynchronous=False, progress=None
    ):
        super().__init__()
        self.manager = manager
        self.progress = progress
        self.every_steps = every_steps
        self.accumulation_steps = accumulation_steps
        self.at_epoch_end = at_epoch_end
        self.options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=bool(asynchronous))
        if asynchronous:
            keras_internals.repair_async_checkpoint_copy()
        self._last_saved = None
        self._pending_step = None

    def save(self):
        """Saves the checkpoint of the current update (once per update). A collective: every rank calls it.

        Raises:
            hvd_lars.training.faults.FileFailure: rank 0 could not write the checkpoint, or some rank
                noted a failed write or read before (no checkpoint is then written; every rank raises it).
        """
        step = int(self.model.optimizer.iterations)
        # Every rank, at the same steps: the checkpoint (rank 0's) then holds the statistics of all ranks,
        # and a run resumed from it continues as the uninterrupted run does.
        collectives.average_variables(moving_statistics(self.model), name="hvd_lars.checkpoint_statistics")
        if self.progress is not None:
            self.progress.capture()
        if step != self._last_saved and collectives.is_chief() and not faults.noted():
            error = self._wait()  # the previous background write, if any, first
            if not error:
                try:
                    self._pending_step = step
                    self.manager.save(checkpoint_number=step, options=self.options)
                except (OSError, tf.errors.OpError) as e:
                    error = self._error(e)
            if error:
                faults.note(error)
        faults.agree("hvd_lars.checkpoint_error")
        self._last_saved = step
        faults.heartbeat()

    def _error(self, e):
        # Rank 0: the message, once the files of the failed checkpoint are removed (the index never named
        # them; a resumed run would else find a checkpoint cut short beside the complete ones).
        step, folder = self._pending_step, self.manager.directory
        if os.path.join(folder, f"ckpt-{step}") not in self.manager.checkpoints:
            prefix = os.path.join(folder, f"ckpt-{step}")
            shutil.rmtree(f"{prefix}_temp", ignore_errors=True)
            faults.remove_quietly(*glob.glob(f"{prefix}.*"), *glob.glob(f"{folder}/checkpoint.tmp*"))
        return faults.write_failure(f"the checkpoint of step {step} to {folder}", e)

    def _wait(self):
        # Rank 0: waits for its background write; the error message if it failed, else None.
        if not collectives.is_chief():
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

    def sync(self):
        """Waits until rank 0's background write (if any) is complete and the index names it. Not a
        collective (any rank may call it; only rank 0 waits).

        Raises:
            hvd_lars.training.faults.FileFailure: on rank 0, the write failed.
        """
        error = self._wait()
        if error:
            raise faults.FileFailure(error)

    def finish(self):
        """`sync` on every rank together: a collective that raises `faults.FileFailure` on every rank
        when rank 0's last write failed (or any rank noted a failed write or read)."""
        error = self._wait()
        if error:
            faults.note(error)
        faults.agree("hvd_lars.checkpoint_error")

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


class CheckpointReadError(ValueError):
    """No checkpoint of the run could be read back (each is cut short, empty or missing); the message
    names every file and why (the main program: one line, exit status 2)."""


def set_aside_damaged_index(folder, run_dir):
    """False when `folder`'s index file `checkpoint` was cut short, empty or another run's (it is then
    moved under `<run_dir>/damaged/`, with a warning); True when it is sound or absent."""
    index = os.path.join(folder, "checkpoint")
    if not os.path.exists(index):
        return True
    try:
        with open(index, "rb") as f:
            text = f.read().decode()
        state = tf.train.get_checkpoint_state(folder)  # None when it does not parse
        ok = state is not None and bool(text.strip()) and bool(state.model_checkpoint_path)
        if ok:
            named = [state.model_checkpoint_path, *state.all_model_checkpoint_paths]
            named = [p if os.path.isabs(p) else os.path.join(folder, p) for p in named]
            ok = all(os.path.dirname(os.path.abspath(p)) == folder for p in named)
    except (UnicodeDecodeError, OSError, ValueError):  # ValueError: "Invalid checkpoint state"
        ok = False
    if not ok:
        kept = lineage.keep_damaged(index, run_dir)
        lineage.warn(
            f"the checkpoint index {index} is cut short, empty or another run's (kept as {kept}); "
            "rebuilt from the checkpoint files in its folder"
        )
    return ok


def open_manager(checkpoint, directory, max_to_keep, run_dir=None, wait_s=120):
    """`tf.train.CheckpointManager(checkpoint, directory, max_to_keep)`, also when the index file there is
    damaged: rank 0 first sets a damaged index aside (`set_aside_damaged_index`); the other ranks, whose
    managers never write, wait up to `wait_s` seconds for rank 0 to have done so."""
    folder = os.path.abspath(directory)
    if collectives.is_chief() and os.path.isdir(folder):
        set_aside_damaged_index(folder, run_dir or os.path.dirname(folder))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return tf.train.CheckpointManager(checkpoint, directory, max_to_keep=max_to_keep)
        except ValueError:  # "Invalid checkpoint state": an empty index that rank 0 is setting aside
            if collectives.is_chief() or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
