"""Checkpoints: `PeriodicCheckpoint` saves them, `resume` restores one (docs/design.md, "A start")."""

import contextlib
import glob
import json
import logging
import math
import os
import re
import shutil

import keras
import tensorflow as tf

from hvd_lars import keras_internals
from hvd_lars.parallel import collectives
from hvd_lars.training import faults
from hvd_lars.training.plan import changed_settings, plan_changes, refuse_plan_changes

log = logging.getLogger(__name__)
warn = log.warning  # one warning line of the run log
PLAN_KEY = "plan/.ATTRIBUTES/VARIABLE_VALUE"  # the plan, as tf.train.Checkpoint(plan=variable) saves it
AFRESH = "to train afresh, give another --run_name or remove {}"  # .format(the run directory)
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def moving_statistics(model):
    """The model's non-trainable float variables (batch-norm moving statistics), not the seed states."""
    variables = model.non_trainable_variables
    return [v for v in variables if "seed_generator" not in v.path and v.dtype.startswith("float")]


def strict(value):
    """`value` (nested dicts, lists, tuples), each non-finite float as "NaN", "Infinity" or "-Infinity"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    return [strict(v) for v in value] if isinstance(value, (list, tuple)) else value


def _floats(value):
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


def read_json(path):
    """The JSON file at `path`, with "NaN", "Infinity" and "-Infinity" read back as floats."""
    with open(path) as f:
        return _floats(json.load(f))


class ResumeRefused(ValueError):
    """Rank 0 refused to start from the run directory's checkpoints (one line, exit status 2)."""


def plan_variable(settings):
    """The string `tf.Variable` a checkpoint saves under "plan": `settings` (`Plan.settings`) as JSON."""
    return tf.Variable(json.dumps(settings, sort_keys=True), dtype=tf.string, trainable=False, name="plan")


def read_plan(prefix):
    """The plan (dict) of the checkpoint at `prefix`, once every tensor is read; ValueError: unreadable."""
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
        plan = json.loads(reader.get_tensor(PLAN_KEY).decode()) if reader.has_tensor(PLAN_KEY) else None
    except (tf.errors.OpError, ValueError, OSError, IndexError) as e:
        raise ValueError(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}") from None
    if not isinstance(plan, dict):
        raise ValueError("it holds no plan record")
    return plan


class PeriodicCheckpoint(keras.callbacks.Callback):
    """Rank 0 saves `manager`'s checkpoint every `every_steps` updates (0: never), at epoch ends if asked."""

    def __init__(
        self, manager, every_steps, accumulation_steps=1, at_epoch_end=True, asynchronous=False, progress=None
    ):
        super().__init__()
        self.manager, self.every_steps, self.progress = manager, every_steps, progress
        self.accumulation_steps, self.at_epoch_end = accumulation_steps, at_epoch_end
        self.options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=bool(asynchronous))
        if asynchronous:
            keras_internals.repair_async_checkpoint_copy()
        self._last_saved = self._pending_step = None

    def save(self):
        """A collective: saves this update's checkpoint once; `faults.FileFailure` where a write failed."""
        step = int(self.model.optimizer.iterations)
        collectives.average_variables(moving_statistics(self.model), name="hvd_lars.checkpoint_statistics")
        if self.progress is not None:
            self.progress.capture()
        if step != self._last_saved and collectives.is_chief() and not faults.note():
            faults.note(self._wait(then_save=step))
        faults.agree("hvd_lars.checkpoint_error")
        self._last_saved = step
        faults.heartbeat()

    def _wait(self, then_save=None):
        # Rank 0: waits for its background write, then writes update `then_save`; the failure's message.
        if not collectives.is_chief():
            return None
        try:
            self.manager.sync()
            step = self._pending_step
            if step is not None and not os.path.exists(f"{self.manager.directory}/ckpt-{step}.index"):
                # sync() does not raise the background writer's exception (a private attribute, TF 2.21).
                writer = getattr(self.manager._checkpoint, "_async_checkpointer_impl", None)
                reason = getattr(writer, "_async_error", None)
                if reason is not None:
                    writer._async_error = None
                return self._error(reason or "its files are missing after the write")
            if then_save is not None:
                self._pending_step = then_save
                self.manager.save(checkpoint_number=then_save, options=self.options)
        except (OSError, tf.errors.OpError) as e:
            return self._error(e)

    def _error(self, e):
        step, folder = self._pending_step, self.manager.directory
        prefix = os.path.join(folder, f"ckpt-{step}")
        if prefix not in self.manager.checkpoints:
            shutil.rmtree(f"{prefix}_temp", ignore_errors=True)
            faults.remove_quietly(*glob.glob(f"{prefix}.*"), *glob.glob(f"{folder}/checkpoint.tmp*"))
        return faults.write_failure(f"the checkpoint of step {step} to {folder}", e)

    def finish(self):
        """Waits for rank 0's background write (a collective): `faults.FileFailure` on every rank if rank 0's
        or any rank's failed."""
        faults.note(self._wait())
        faults.agree("hvd_lars.checkpoint_error")

    def on_train_batch_end(self, batch, logs=None):
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


def candidates(folder):
    """The checkpoint prefixes of `folder`, in the order a start tries them."""
    state = None
    with contextlib.suppress(ValueError):  # an index empty or not text
        state = tf.train.get_checkpoint_state(folder)  # None where absent or it does not parse
    names = os.listdir(folder) if os.path.isdir(folder) else []
    steps = sorted(int(m.group(1)) for m in map(re.compile(r"ckpt-(\d+)\.index$").match, names) if m)
    newest = [os.path.abspath(state.model_checkpoint_path)] if state else []
    return newest + [p for p in (os.path.join(folder, f"ckpt-{s}") for s in steps[::-1]) if p not in newest]


def resume(model, optimizer, build, run_dir, plan, allow_plan_change):
    """Rank 0 restores the newest readable checkpoint of `run_dir`: its path or None; `ResumeRefused`."""
    folder, unreadable = os.path.abspath(os.path.join(run_dir, "checkpoints")), []
    for path in candidates(folder):
        try:
            recorded = read_plan(path)
        except ValueError as e:
            unreadable.append(f"{path} ({e})")
            continue
        for skipped in unreadable:
            warn(f"the checkpoint {skipped} cannot be read: an older one is tried, its files are left")
        if refusal := refuse_plan_changes(plan_changes(recorded, plan, allow_plan_change), run_dir, path):
            raise ResumeRefused(refusal)
        try:
            status = tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
            status.assert_existing_objects_matched()
            build()
            if not changed_settings(recorded, plan):
                status.assert_existing_objects_matched()
            status.expect_partial()  # the plan and progress records are not restored
        except (AssertionError, ValueError, tf.errors.OpError) as e:
            raise ResumeRefused(
                f"the checkpoint {path} does not fit this run's model and optimizer ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}): resume it with its own flags, or {AFRESH.format(run_dir)}."
            ) from None
        if not plan.finished(int(optimizer.iterations)):  # a finished run says only that (train.attempt)
            log.info(f"resumed from {path} (step {int(optimizer.iterations)})")
        break
    else:
        if unreadable:
            raise ResumeRefused(
                f"no checkpoint in {folder} can be read: {'; '.join(unreadable)}; {AFRESH.format(run_dir)}."
            )
        path = None
    try:
        tf.train.get_checkpoint_state(folder)  # what the manager reads when it opens
    except ValueError as e:  # an index that is empty or not text
        warn(
            f"the checkpoint index {folder}/checkpoint cannot be read ({e}): removed; the next save writes it"
        )
        os.remove(os.path.join(folder, "checkpoint"))
    return path
