"""Checkpoints and what a start does with the run directory (docs/design.md, "A start").

- `PeriodicCheckpoint`: rank 0 saves model and optimizer, the ranks' batch-norm statistics averaged first.
- `RunRecord`, `Lineage`: the run id and plan every checkpoint holds; the lineage a start continues.
- `resume_or_begin`: rank 0 restores the newest readable checkpoint of this plan, or begins a lineage.
- Files are set aside, never deleted: under `earlier_runs/<run id>/` (`set_aside`, the newest
  `--keep_earlier_runs` kept) or `damaged/` (`keep_damaged`), each named in a line.
- `strict`, `read_json`: JSON with non-finite numbers as the strings "NaN", "Infinity", "-Infinity".
"""

import dataclasses
import glob
import json
import logging
import math
import os
import re
import secrets
import shutil
import time

import keras
import tensorflow as tf

from hvd_lars import keras_internals
from hvd_lars.parallel import collectives
from hvd_lars.training import faults
from hvd_lars.training.plan import changed_settings, plan_changes, refuse_plan_changes

log = logging.getLogger(__name__)
warn = log.warning  # one warning line of the run log
CHECKPOINTS, DAMAGED, FOLDER, UNRECORDED = "checkpoints", "damaged", "earlier_runs", "unrecorded"
# What belongs to one lineage in a run directory (image_folder_index/ and damaged/ stay).
LINEAGE_FILES = (CHECKPOINTS, "metrics.csv", "tensorboard", "summary.json")
RECORD_KEY = "run/.ATTRIBUTES/VARIABLE_VALUE"  # the record, as tf.train.Checkpoint(run=variable) saves it
_RUN_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")
_READ_ERRORS = (tf.errors.OpError, ValueError, OSError)
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def moving_statistics(model):
    """The model's non-trainable float variables (batch-norm moving statistics), not the seed states."""
    return [
        v
        for v in model.non_trainable_variables
        if "seed_generator" not in v.path and v.dtype.startswith("float")
    ]


def _move(path, target, copy=False):
    candidate, n = target, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{target}.{n}"
    os.makedirs(os.path.dirname(candidate), exist_ok=True)
    (shutil.copy2 if copy else shutil.move)(path, candidate)
    return candidate


def keep_damaged(path, run_dir, copy=False):
    """Moves (or copies) the file `path` to its path relative to `run_dir` under `<run_dir>/damaged/`
    (`.1`, `.2`, ... appended where that name is taken); returns the new path."""
    rel = os.path.relpath(path, run_dir)
    rel = os.path.basename(path) if rel.startswith(os.pardir) else rel
    return _move(path, os.path.join(run_dir, DAMAGED, rel), copy)


def set_aside(paths, run_dir, run_id):
    """Moves each of `paths` (inside `run_dir`) to its relative path under `<run_dir>/earlier_runs/<run_id>/`
    (`.1`, `.2`, ... appended where that name is taken); returns that folder."""
    target = os.path.join(run_dir, FOLDER, run_id or UNRECORDED)
    for path in paths:
        _move(path, os.path.join(target, os.path.relpath(path, run_dir)))
    return target


def strict(value):
    """`value` (nested dicts, lists, tuples) with each non-finite float as "NaN", "Infinity" or
    "-Infinity", so that `json.dump(..., allow_nan=False)` accepts it."""
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


class LineageRefused(ValueError):
    """Rank 0 refused to start: no checkpoint can be read, or the one it would restore belongs to another
    plan or run or records neither (one line, exit status 2; nothing is moved)."""


@dataclasses.dataclass
class Lineage:
    """The lineage a start continues or begins: `run_id`, `restored` (the checkpoint prefix, or None for
    a fresh start) and `error` (rank 0's `LineageRefused`, raised on every rank by `share`)."""

    run_id: str = None
    restored: str = None
    error: ValueError = None

    def owns(self, run_id):
        """Whether a file recorded with `run_id` (None: no run id) is this run's."""
        return run_id == self.run_id

    def share(self):
        """Rank 0's lineage on every rank (a collective). Raises: rank 0's `LineageRefused`, on every rank."""
        shared = dataclasses.astuple(self) if collectives.is_chief() else None
        self.run_id, self.restored, self.error = collectives.broadcast_object(shared, name="hvd_lars.lineage")
        if self.error is not None:
            raise self.error


class RunRecord:
    """The record a checkpoint holds under "run": `variable`, a string `tf.Variable` of {"run_id", "plan":
    `settings`} as JSON, set by `assign(run_id)`. Restores do not read it back: a run resumed under an
    allowed change of plan records its own plan."""

    def __init__(self, settings):
        self.settings = settings
        self.run_id = None
        self.variable = tf.Variable("", dtype=tf.string, trainable=False, name="run_record")

    def assign(self, run_id):
        self.run_id = run_id
        self.variable.assign(json.dumps({"run_id": run_id, "plan": self.settings}, sort_keys=True))


def read_record(prefix):
    """The record ({"run_id": str, "plan": dict}) of the checkpoint at `prefix`, or None where it has none.
    Raises `ValueError` for a record that is not one, `tf.errors.OpError` for a checkpoint it cannot read."""
    reader = tf.train.load_checkpoint(prefix)
    if not reader.has_tensor(RECORD_KEY):
        return None
    record = json.loads(reader.get_tensor(RECORD_KEY).decode())
    if not isinstance(record, dict) or not isinstance(record.get("plan"), dict) or "run_id" not in record:
        raise ValueError(f"a run record that is not one ({str(record)[:100]})")
    return record


def events_suffix(run_id):
    """The end of the names of run `run_id`'s TensorBoard event files (`filename_suffix`)."""
    return f".{run_id}"


def run_id_of_events(name):
    """The run id an event file's name ends with, or `UNRECORDED`."""
    found = _RUN_ID.search(name)
    return found.group(0) if found and name.endswith(found.group(0)) else UNRECORDED


def keep_newest(run_dir, keep):
    """Removes the folders of earlier runs under `<run_dir>/earlier_runs/` beyond the newest `keep` (by run
    id, `UNRECORDED` oldest; other names are left), one line each, and the folder once empty; returns the
    paths removed."""
    folder = os.path.join(run_dir, FOLDER)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    runs = [UNRECORDED] * (UNRECORDED in names) + sorted(n for n in names if _RUN_ID.fullmatch(n))
    removed = [os.path.join(folder, n) for n in runs[: max(len(runs) - keep, 0)]]
    for path in removed:
        shutil.rmtree(path)
        log.info(f"removed {path}, an earlier run: {_keeping(run_dir, keep)}")
    if removed and not os.listdir(folder):
        os.rmdir(folder)
    return removed


def _keeping(run_dir, keep):
    folder = os.path.join(run_dir, FOLDER)
    if not keep:
        return "--keep_earlier_runs=0 keeps no earlier run"
    runs = "the newest earlier run" if keep == 1 else f"the newest {keep} earlier runs"
    return f"{folder} keeps {runs} (--keep_earlier_runs={keep}; rm -r {folder} clears them)"


class PeriodicCheckpoint(keras.callbacks.Callback):
    """Rank 0 saves `manager`'s checkpoint every `every_steps` updates and at each epoch end, numbered by
    the update count; the manager replaces its index last, so the index names a complete checkpoint.

    Args:
        manager: `tf.train.CheckpointManager`.
        every_steps: int >= 0; 0 saves at epoch ends only.
        accumulation_steps: micro-batches per update; saves happen only at update boundaries.
        at_epoch_end: save at each epoch end (after evaluation); without it, at the end of each `fit`.
        asynchronous: rank 0 copies the variables and trains on while TensorFlow writes the files; the
            write is waited for before the next save and at the end of `fit`.
        progress: the `epoch_logs.Progress` the checkpoint holds, captured before each save, or None.
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
        """Saves the checkpoint of the current update, once per update; a collective that raises
        `faults.FileFailure` on every rank when the write fails or a rank noted a failure before."""
        step = int(self.model.optimizer.iterations)
        # Every rank: the checkpoint holds all ranks' statistics, so a resumed run goes on as the
        # uninterrupted one does.
        collectives.average_variables(moving_statistics(self.model), name="hvd_lars.checkpoint_statistics")
        if self.progress is not None:
            self.progress.capture()
        if step != self._last_saved and collectives.is_chief() and not faults.note():
            faults.note(self._wait() or self._write(step))
        faults.agree("hvd_lars.checkpoint_error")
        self._last_saved = step
        faults.heartbeat()

    def _write(self, step):
        self._pending_step = step
        try:
            self.manager.save(checkpoint_number=step, options=self.options)
        except (OSError, tf.errors.OpError) as e:
            return self._error(e)
        return None

    def _error(self, e):
        # Rank 0: the message, once the failed checkpoint's files are gone (the index never named them).
        step, folder = self._pending_step, self.manager.directory
        prefix = os.path.join(folder, f"ckpt-{step}")
        if prefix not in self.manager.checkpoints:
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
        # TensorFlow's background writer keeps its exception (a private attribute, TF 2.21) until the next
        # save, and sync() does not raise it: the missing files show the failure.
        writer = getattr(self.manager._checkpoint, "_async_checkpointer_impl", None)
        reason = getattr(writer, "_async_error", None)
        if reason is not None:
            writer._async_error = None
        return self._error(reason or "its files are missing after the write")

    def sync(self):
        """Waits for rank 0's background write, if any (no collective); `faults.FileFailure` if it failed."""
        error = self._wait()
        if error:
            raise faults.FileFailure(error)

    def finish(self):
        """`sync` as a collective: raises `faults.FileFailure` on every rank when rank 0's last write
        failed or any rank noted a failure."""
        faults.note(self._wait())
        faults.agree("hvd_lars.checkpoint_error")

    def on_train_batch_end(self, batch, logs=None):
        # The epoch's last update is saved by on_epoch_end, after evaluation, which a kill then repeats.
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


def _set_aside_damaged_index(folder, run_dir):
    # An index cut short, empty or naming another folder's files is moved under damaged/; the manager
    # then rebuilds it.
    index = os.path.join(folder, "checkpoint")
    if not os.path.exists(index):
        return
    try:
        state = tf.train.get_checkpoint_state(folder)  # None: it does not parse
        paths = [state.model_checkpoint_path, *state.all_model_checkpoint_paths] if state else []
        ok = state is not None and all(os.path.dirname(os.path.abspath(p)) == folder for p in paths)
    except (OSError, ValueError):  # ValueError: it names no checkpoint, or is not text
        ok = False
    if not ok:
        kept = keep_damaged(index, run_dir)
        warn(
            f"the checkpoint index {index} is cut short, empty or another run's (kept as {kept}); "
            "rebuilt from the checkpoint files in its folder"
        )


def open_manager(checkpoint, directory, max_to_keep, run_dir=None, wait_s=120):
    """`tf.train.CheckpointManager(checkpoint, directory, max_to_keep)`, also where its index is damaged:
    rank 0 sets that aside first, the other ranks wait up to `wait_s` seconds for it."""
    folder = os.path.abspath(directory)
    if collectives.is_chief() and os.path.isdir(folder):
        _set_aside_damaged_index(folder, run_dir or os.path.dirname(folder))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return tf.train.CheckpointManager(checkpoint, directory, max_to_keep=max_to_keep)
        except ValueError:  # "Invalid checkpoint state": an empty index that rank 0 is setting aside
            if collectives.is_chief() or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def resume_or_begin(model, optimizer, build, run_dir, plan, config):
    """Rank 0's start: restores the checkpoint the run continues into `model` and `optimizer` (not built;
    `build()` builds it) if its plan fits `plan` under `config` (`TrainConfig`), or begins a new lineage,
    then `keep_newest`. A refusal comes back in the `Lineage` (`share` raises it) and changes nothing."""
    try:
        started = _resume_or_begin(model, optimizer, build, run_dir, plan, config)
    except LineageRefused as e:
        return Lineage(error=e)
    keep_newest(run_dir, config.keep_earlier_runs)
    return started


def _resume_or_begin(model, optimizer, build, run_dir, plan, config):
    folder = os.path.abspath(os.path.join(run_dir, CHECKPOINTS))
    if not config.resume:
        return _begin(run_dir, "--noresume", config.keep_earlier_runs)
    if os.path.isdir(folder):
        _set_aside_damaged_index(folder, run_dir)
    path, unreadable = None, []
    for candidate in candidates(folder):
        problem = _unreadable_problem(candidate)
        if problem is None:
            path = candidate
            break
        unreadable.append((candidate, problem))
    if path is None and unreadable:
        _set_aside_damaged(unreadable, run_dir, last=True)
        problems = "; ".join(f"{p} ({why})" for p, why in unreadable)
        raise LineageRefused(
            f"no checkpoint in {folder} can be restored: {problems}. The files are kept under "
            f"{os.path.join(run_dir, DAMAGED)}; start afresh (--noresume or another --run_name)."
        )
    if path is None:
        return _begin(run_dir, "nothing to resume", config.keep_earlier_runs)
    record = read_record(path)
    if record is None:
        raise LineageRefused(
            f"the checkpoint {path} holds no run record (the run id and plan every checkpoint of hvd_lars "
            "holds): its plan cannot be checked. Start afresh with --noresume or another --run_name."
        )
    refusal = refuse_plan_changes(plan_changes(record["plan"], plan, config.allow_plan_change), run_dir, path)
    if refusal:
        raise LineageRefused(refusal)
    _restore(model, optimizer, build, path, partial=changed_settings(record["plan"], plan))
    _set_aside_damaged(unreadable, run_dir)  # only once nothing is refused: a refusal leaves every file
    _set_aside_other_lineages(folder, path, record["run_id"], run_dir)
    _name_in_index(folder, path)
    log.info(f"resumed from {path} (step {int(optimizer.iterations)})")
    return Lineage(run_id=record["run_id"], restored=path)


def _begin(run_dir, why, keep):
    # A new lineage: what an earlier one left (LINEAGE_FILES) goes under earlier_runs/<its run id>/.
    present = [os.path.join(run_dir, name) for name in LINEAGE_FILES]
    present = [p for p in present if os.path.isfile(p) or (os.path.isdir(p) and os.listdir(p))]
    if present:
        names = ", ".join(os.path.basename(p) + ("/" if os.path.isdir(p) else "") for p in present)
        kept = set_aside(present, run_dir, _earlier_run_id(run_dir))
        log.info(
            f"{why}: a new run begins in {run_dir}; the earlier run's {names} are "
            f"{'kept in' if keep else 'moved to'} {kept}; " + _keeping(run_dir, keep)
        )
    return Lineage(run_id=time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3))


def _number(path):
    found = re.search(r"-(\d+)$", path)
    return int(found.group(1)) if found else -1


def candidates(folder):
    """The checkpoint prefixes of `folder` in the order a start tries them: the index's newest, the others
    it lists from the last saved, then every other `ckpt-<step>` of the folder from the highest step."""
    if not os.path.isdir(folder):
        return []
    state = tf.train.get_checkpoint_state(folder)
    named = [state.model_checkpoint_path, *reversed(state.all_model_checkpoint_paths)] if state else []
    listed = list(dict.fromkeys(os.path.abspath(p) for p in named if _number(p) >= 0))
    on_disk = {os.path.join(folder, n[: -len(".index")]) for n in os.listdir(folder) if n.endswith(".index")}
    return listed + sorted({p for p in on_disk if _number(p) >= 0} - set(listed), key=_number, reverse=True)


def _unreadable_problem(path):
    # Why the checkpoint at `path` cannot be read, or None: every tensor is read (TensorFlow checks each
    # one's CRC32C) and its record parsed.
    if not os.path.exists(f"{path}.index"):
        return "its index file is missing"
    try:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
        read_record(path)
    except (*_READ_ERRORS, IndexError) as e:
        return f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def _restore(model, optimizer, build, path, partial):
    # Every variable matched, or with `partial` (an allowed change of plan) the model's and those of the
    # optimizer the checkpoint has: the model is checked first, then `build()` makes the optimizer's
    # variables, which take the checkpoint's values as they are made (deferred restoration).
    try:
        status = tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
        status.assert_existing_objects_matched()
        build()
        if not partial:
            status.assert_existing_objects_matched()
        status.expect_partial()  # the record ("run") is not restored
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        raise LineageRefused(
            f"the checkpoint {path} does not fit this run's model and optimizer ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}): it belongs to another plan or another run. Resume it with "
            "its own flags, or start afresh with --noresume or another --run_name."
        ) from None


def _set_aside_damaged(unreadable, run_dir, last=False):
    for k, (path, problem) in enumerate(unreadable):
        kept = [keep_damaged(p, run_dir) for p in sorted(glob.glob(f"{glob.escape(path)}.*"))]
        older = "no older one is left" if last and k == len(unreadable) - 1 else "an older one is tried"
        warn(
            f"the checkpoint {path} cannot be restored: {problem}; its files "
            f"({', '.join(os.path.basename(k) for k in kept)}) are kept under "
            f"{os.path.join(run_dir, DAMAGED, CHECKPOINTS)} and {older}"
        )


def _set_aside_other_lineages(folder, path, run_id, run_dir):
    # Checkpoints recording another run id go under earlier_runs/<their run id>/; unreadable ones stay.
    others = {}
    for prefix, record in _records(folder):
        if prefix != path and record is not None and record["run_id"] != run_id:
            others.setdefault(record["run_id"], []).append(prefix)
    for other, prefixes in sorted(others.items()):
        kept = set_aside(
            [f for p in prefixes for f in sorted(glob.glob(f"{glob.escape(p)}.*"))], run_dir, other
        )
        steps = ", ".join(os.path.basename(p) for p in sorted(prefixes, key=_number))
        log.info(f"checkpoints of another run ({steps}, run {other}) lay beside {path}: kept in {kept}")


def _name_in_index(folder, path):
    # The index names `path` newest, after the others it listed that are still there (CheckpointState's
    # text format, names relative).
    state = tf.train.get_checkpoint_state(folder)
    listed = [p for p in (state.all_model_checkpoint_paths if state else []) if os.path.exists(f"{p}.index")]
    names = [os.path.basename(p) for p in listed if os.path.abspath(p) != path] + [os.path.basename(path)]
    lines = [f'model_checkpoint_path: "{names[-1]}"', *(f'all_model_checkpoint_paths: "{n}"' for n in names)]
    index = os.path.join(folder, "checkpoint")
    with open(f"{index}.tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(f"{index}.tmp", index)


def _earlier_run_id(run_dir):
    # The run id of the lineage that left files in `run_dir`: summary.json's, else that of the newest
    # readable checkpoint, else UNRECORDED.
    try:
        saved = read_json(os.path.join(run_dir, "summary.json"))
        if isinstance(saved, dict) and isinstance(saved.get("run_id"), str):
            return saved["run_id"]
    except (OSError, ValueError):
        pass
    for _, record in _records(os.path.join(run_dir, CHECKPOINTS)):
        return record["run_id"] if record else UNRECORDED
    return UNRECORDED


def _records(folder):
    # (prefix, its record or None) of each readable checkpoint of `folder`, in the order of `candidates`.
    for prefix in candidates(folder):
        try:
            yield prefix, read_record(prefix)
        except _READ_ERRORS:
            pass
