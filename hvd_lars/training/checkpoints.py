"""Checkpoints and what a start does with the run directory.

- `PeriodicCheckpoint`: rank 0 saves model and optimizer through `tf.train.CheckpointManager` every
  `--checkpoint_every_steps` updates and at epoch ends, the ranks' batch-norm statistics averaged first.
- The lineage (`Lineage`, `RunRecord`): a run id made at a fresh start and kept across every kill and
  resume, saved inside each checkpoint with the plan it was written under, and in every log file.
- `resume_or_begin`: rank 0 takes the newest readable checkpoint, compares its plan with this run's (a
  change `--allow_plan_change` does not name is refused in one line, every file left), restores it, or
  begins a new lineage; docs/design.md, "A start", gives the order.
- Files are set aside, never deleted: another lineage's under `earlier_runs/<run id>/` (`set_aside`, the
  newest `--keep_earlier_runs` kept), damaged ones under `damaged/` (`keep_damaged`), each named in a line.
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


def moving_statistics(model):
    """The model's non-trainable float variables (batch-norm moving mean and variance), without the
    dropout seed states, which stay per rank."""
    return [
        v
        for v in model.non_trainable_variables
        if "seed_generator" not in v.path and v.dtype.startswith("float")
    ]


DAMAGED = "damaged"


def warn(message):
    """One warning line of the run log (`[hvd_lars] warning: <message>`)."""
    log.warning(message)


def keep_damaged(path, run_dir, copy=False):
    """Moves (or, with `copy`, copies) the file `path` inside `run_dir` to the same relative path under
    `<run_dir>/damaged/` (with `.1`, `.2`, ... appended when that name is taken); returns the new path."""
    rel = os.path.relpath(path, run_dir)
    if rel.startswith(os.pardir):
        rel = os.path.basename(path)
    target = os.path.join(run_dir, DAMAGED, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    candidate, n = target, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{target}.{n}"
    (shutil.copy2 if copy else shutil.move)(path, candidate)
    return candidate


_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def strict(value):
    """`value` (nested dicts, lists, tuples, numbers, strings) with every non-finite float replaced by
    "NaN", "Infinity" or "-Infinity", so that `json.dump(..., allow_nan=False)` accepts it."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def _floats(value):
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value


def read_json(path):
    """The JSON file at `path`, with the strings "NaN", "Infinity" and "-Infinity" read back as floats.

    Raises:
        OSError: the file cannot be read. json.JSONDecodeError: it is not JSON.
    """
    with open(path) as f:
        return _floats(json.load(f))


FOLDER = "earlier_runs"
UNRECORDED = "unrecorded"
# The name of the record in a checkpoint, as tf.train.Checkpoint(run=variable) saves it.
RECORD_KEY = "run/.ATTRIBUTES/VARIABLE_VALUE"
_RUN_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")


def new_run_id():
    """A new run id, e.g. "20261201T142301Z-3fa9c2" (UTC start time, then 24 random bits)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


class LineageRefused(ValueError):
    """Rank 0 refused to start: the run directory's checkpoint belongs to another plan or run, or records
    neither (one line, exit status 2 from the main program; nothing is moved)."""


@dataclasses.dataclass
class Lineage:
    """The lineage a start continues or begins, as rank 0 decided it (`hvd_lars.training.resume`).

    Attributes:
        run_id: the run id; None until decided (and, on the other ranks, until `share`).
        restored: the checkpoint prefix restored, or None for a fresh start.
        error: rank 0's refusal (a `LineageRefused` or `CheckpointReadError`), raised on every rank by
            `share`.
    """

    run_id: str = None
    restored: str = None
    error: ValueError = None

    def owns(self, run_id):
        """Whether a file recorded with `run_id` (None: no run id) is this run's."""
        return run_id == self.run_id

    def share(self):
        """Rank 0's lineage on every rank (a collective); raises rank 0's refusal on every rank.

        Raises:
            LineageRefused, or `hvd_lars.training.checkpoints.CheckpointReadError` (both ValueErrors).
        """
        shared = collectives.broadcast_object(
            dataclasses.astuple(self) if collectives.is_chief() else None, name="hvd_lars.lineage"
        )
        self.run_id, self.restored, self.error = shared
        if self.error is not None:
            raise self.error


class RunRecord:
    """The record a checkpoint carries: which run (`run_id`) and which plan (`settings`) it belongs to.

    `variable` (a string `tf.Variable` holding the record as JSON) is what the run's `tf.train.Checkpoint`
    holds under "run"; `assign(run_id)` sets it. Restores never read it back into the variable: a run
    resumed under an allowed change of plan records its own plan from then on.
    """

    def __init__(self, settings):
        self.settings = settings
        self.run_id = None
        self.variable = tf.Variable("", dtype=tf.string, trainable=False, name="run_record")

    def assign(self, run_id):
        self.run_id = run_id
        self.variable.assign(json.dumps({"run_id": run_id, "plan": self.settings}, sort_keys=True))


def read_record(prefix):
    """The record ({"run_id": str, "plan": {name: value}}) of the checkpoint at `prefix`, or None when it
    has none (it was not written by this package's training application).

    Raises:
        ValueError: the record is there and is not such JSON (the checkpoint is damaged).
        tf.errors.OpError: the checkpoint cannot be read.
    """
    reader = tf.train.load_checkpoint(prefix)
    if not reader.has_tensor(RECORD_KEY):
        return None
    record = json.loads(reader.get_tensor(RECORD_KEY).decode())
    if not isinstance(record, dict) or not isinstance(record.get("plan"), dict) or "run_id" not in record:
        raise ValueError(f"a run record that is not one ({str(record)[:100]})")
    return record


def events_suffix(run_id):
    """The end of the names of the TensorBoard event files of run `run_id` (`filename_suffix`)."""
    return f".{run_id}"


def run_id_of_events(name):
    """The run id an event file's name ends with, or `UNRECORDED`."""
    found = _RUN_ID.search(name)
    return found.group(0) if found and name.endswith(found.group(0)) else UNRECORDED


def set_aside(paths, run_dir, run_id):
    """Moves each of `paths` (files or folders inside `run_dir`) to the same relative path under
    `<run_dir>/earlier_runs/<run_id>/` (a name taken there gets `.1`, `.2`, ... appended); returns
    that folder."""
    target = os.path.join(run_dir, FOLDER, run_id or UNRECORDED)
    for path in paths:
        rel = os.path.relpath(path, run_dir)
        destination, n = os.path.join(target, rel), 0
        while os.path.exists(destination):
            n += 1
            destination = f"{os.path.join(target, rel)}.{n}"
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        shutil.move(path, destination)
    return target


def keep_newest(run_dir, keep):
    """Removes the folders of earlier runs under `<run_dir>/earlier_runs/` beyond the newest `keep`, in the
    order of their run ids (their start times; `UNRECORDED` counts as the oldest), one line naming each;
    the folder itself too once it is empty. Other names there are left.

    Returns:
        list of the paths removed.
    """
    folder = os.path.join(run_dir, FOLDER)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    runs = [n for n in names if n == UNRECORDED or _RUN_ID.fullmatch(n)]
    runs.sort(key=lambda n: (n != UNRECORDED, n))
    removed = [os.path.join(folder, n) for n in runs[: max(len(runs) - keep, 0)]]
    for path in removed:
        shutil.rmtree(path)
        say(f"removed {path}, an earlier run: {keeping(run_dir, keep)}")
    if removed and not os.listdir(folder):
        os.rmdir(folder)
    return removed


def keeping(run_dir, keep):
    """What `keep_newest` keeps and how to clear it, for the log."""
    folder = os.path.join(run_dir, FOLDER)
    if not keep:
        return "--keep_earlier_runs=0 keeps no earlier run"
    runs = "the newest earlier run" if keep == 1 else f"the newest {keep} earlier runs"
    return f"{folder} keeps {runs} (--keep_earlier_runs={keep}; rm -r {folder} clears them)"


def say(message):
    """One line of the run log: `[hvd_lars] <message>`."""
    log.info(message)


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
        kept = keep_damaged(index, run_dir)
        warn(
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


CHECKPOINTS = "checkpoints"
# What belongs to one lineage in a run directory (image_folder_index/ describes the data, damaged/ keeps
# files that could not be read: both stay).
LINEAGE_FILES = (CHECKPOINTS, "metrics.csv", "tensorboard", "summary.json")


def resume_or_begin(model, optimizer, build, run_dir, plan, config):
    """Rank 0's start: restores the checkpoint the run continues into `model` and `optimizer`, or begins a
    new lineage, then keeps the newest `config.keep_earlier_runs` earlier runs (`keep_newest`); a
    refusal is returned in the `Lineage` (`Lineage.share` raises it on every rank), and changes nothing.

    Args:
        model: the compiled model; optimizer: its optimizer, not built yet; build: builds it (callable).
        plan: this run's `Plan` (its `settings` are compared with the checkpoint's).
        config: `TrainConfig` (`resume`, `allow_plan_change`, `keep_earlier_runs`).

    Returns:
        `Lineage`.
    """
    try:
        started = _resume_or_begin(model, optimizer, build, run_dir, plan, config)
    except (LineageRefused, CheckpointReadError) as e:
        return Lineage(error=e)
    keep_newest(run_dir, config.keep_earlier_runs)
    return started


def _resume_or_begin(model, optimizer, build, run_dir, plan, config):
    folder = os.path.abspath(os.path.join(run_dir, CHECKPOINTS))
    if not config.resume:
        return begin(run_dir, "--noresume", config.keep_earlier_runs)
    if os.path.isdir(folder):
        set_aside_damaged_index(folder, run_dir)
    path, unreadable = None, []
    for candidate in candidates(folder):
        problem = unreadable_problem(candidate)
        if problem is None:
            path = candidate
            break
        unreadable.append((candidate, problem))
    if path is None:
        if unreadable:
            _set_aside_damaged(unreadable, run_dir, last=True)
            problems = "; ".join(f"{p} ({why})" for p, why in unreadable)
            raise CheckpointReadError(
                f"no checkpoint in {folder} can be restored: {problems}. The files are kept under "
                f"{os.path.join(run_dir, DAMAGED)}; start afresh (--noresume or another --run_name)."
            )
        return begin(run_dir, "nothing to resume", config.keep_earlier_runs)
    record = read_record(path)
    if record is None:
        raise LineageRefused(
            f"the checkpoint {path} holds no run record (the run id and plan every checkpoint of hvd_lars "
            "holds): its plan cannot be checked. Start afresh with --noresume or another --run_name."
        )
    run_id = record["run_id"]
    refusal = refuse_plan_changes(plan_changes(record["plan"], plan, config.allow_plan_change), run_dir, path)
    if refusal:
        raise LineageRefused(refusal)
    _restore(model, optimizer, build, path, partial=changed_settings(record["plan"], plan))
    _set_aside_damaged(unreadable, run_dir)  # only once nothing is refused: a refusal leaves every file
    _set_aside_other_lineages(folder, path, run_id, run_dir)
    _name_in_index(folder, path)
    say(f"resumed from {path} (step {int(optimizer.iterations)})")
    return Lineage(run_id=run_id, restored=path)


def begin(run_dir, why, keep):
    """A new lineage in `run_dir`: what an earlier one left there (`LINEAGE_FILES`) is moved under
    `earlier_runs/<its run id>/`, named in one line of the log with what `keep` (--keep_earlier_runs) keeps
    there; returns the new `Lineage`."""
    present = [os.path.join(run_dir, name) for name in LINEAGE_FILES]
    present = [p for p in present if os.path.isfile(p) or (os.path.isdir(p) and os.listdir(p))]
    if present:
        names = ", ".join(os.path.basename(p) + ("/" if os.path.isdir(p) else "") for p in present)
        kept = set_aside(present, run_dir, _earlier_run_id(run_dir))
        say(
            f"{why}: a new run begins in {run_dir}; the earlier run's {names} are "
            f"{'kept in' if keep else 'moved to'} {kept}; " + keeping(run_dir, keep)
        )
    return Lineage(run_id=new_run_id())


def _number(path):
    try:
        return int(os.path.basename(path).rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def candidates(folder):
    """The checkpoint prefixes of `folder` in the order a start tries them: the index's newest, the others
    it lists from the last saved, then every other `ckpt-<step>.index` of the folder from the highest step."""
    if not os.path.isdir(folder):
        return []
    listed = []
    state = tf.train.get_checkpoint_state(folder)
    if state is not None:
        named = [state.model_checkpoint_path, *reversed(state.all_model_checkpoint_paths)]
        for p in named:
            p = os.path.abspath(p if os.path.isabs(p) else os.path.join(folder, p))
            if _number(p) >= 0 and p not in listed:
                listed.append(p)
    on_disk = {os.path.join(folder, n[: -len(".index")]) for n in os.listdir(folder) if n.endswith(".index")}
    return listed + sorted({p for p in on_disk if _number(p) >= 0} - set(listed), key=_number, reverse=True)


def unreadable_problem(path):
    """Why the checkpoint at prefix `path` cannot be read, or None: every tensor is read (TensorFlow checks
    each one's CRC32C) and its record, if any, parsed. Changes nothing."""
    if not os.path.exists(f"{path}.index"):
        return "its index file is missing"
    try:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
        read_record(path)
    except (tf.errors.OpError, ValueError, IndexError, OSError, UnicodeDecodeError) as e:
        return f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def _restore(model, optimizer, build, path, partial):
    """Restores `path` into `model` and `optimizer` (not built yet): every variable of both matched, or,
    with `partial` (an allowed change of plan), every variable of the model and those of the optimizer the
    checkpoint has, the others (the new plan's gradient accumulators, previous learning rate) left at their
    initial zeros. `build()` builds the optimizer: its variables take the checkpoint's values as they are
    made (TensorFlow's deferred restoration), so that the model can be checked alone first.

    Raises:
        LineageRefused: the checkpoint does not fit the model or the optimizer (another plan or run).
    """
    try:
        status = tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
        status.assert_existing_objects_matched()  # the model's variables and the update counters
        build()
        if not partial:
            status.assert_existing_objects_matched()  # and now every optimizer variable too
        status.expect_partial()  # the record ("run") is not restored: this run records its own plan
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
    """Moves the checkpoints of `folder` that record another run id than `run_id` under
    `earlier_runs/<their run id>/checkpoints/`, one line per run."""
    others = {}
    for prefix in candidates(folder):
        if prefix == path or not os.path.exists(f"{prefix}.index"):
            continue
        try:
            record = read_record(prefix)
        except (tf.errors.OpError, ValueError, OSError, UnicodeDecodeError):
            continue  # unreadable: left where it is, and set aside if a later start ever tries it
        if record is not None and record["run_id"] != run_id:
            others.setdefault(record["run_id"], []).append(prefix)
    for other, prefixes in sorted(others.items()):
        files = [f for p in prefixes for f in sorted(glob.glob(f"{glob.escape(p)}.*"))]
        kept = set_aside(files, run_dir, other)
        steps = ", ".join(os.path.basename(p) for p in sorted(prefixes, key=_number))
        say(f"checkpoints of another run ({steps}, run {other}) lay beside {path}: kept in {kept}")


def _name_in_index(folder, path):
    """Rewrites the index of `folder` when it does not name `path` newest or lists files that are gone:
    `path` newest, after the other checkpoints it listed that are still there (in their order)."""
    state = tf.train.get_checkpoint_state(folder)
    listed = []
    if state is not None:
        listed = [
            p if os.path.isabs(p) else os.path.join(folder, p) for p in state.all_model_checkpoint_paths
        ]
        newest = state.model_checkpoint_path
        newest = newest if os.path.isabs(newest) else os.path.join(folder, newest)
        if os.path.abspath(newest) == path and all(os.path.exists(f"{p}.index") for p in listed):
            return
    kept = [
        os.path.basename(p) for p in listed if os.path.exists(f"{p}.index") and os.path.abspath(p) != path
    ]
    # The index format tf.train.CheckpointManager reads (a CheckpointState text proto), names relative.
    lines = [f'model_checkpoint_path: "{os.path.basename(path)}"']
    lines += [f'all_model_checkpoint_paths: "{name}"' for name in [*kept, os.path.basename(path)]]
    index = os.path.join(folder, "checkpoint")
    with open(f"{index}.tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(f"{index}.tmp", index)


def _earlier_run_id(run_dir):
    """The run id of the lineage that left files in `run_dir`: summary.json's, else that of the newest
    readable checkpoint, else `UNRECORDED`."""
    try:
        saved = read_json(os.path.join(run_dir, "summary.json"))
        if isinstance(saved, dict) and isinstance(saved.get("run_id"), str):
            return saved["run_id"]
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    for prefix in candidates(os.path.join(run_dir, CHECKPOINTS)):
        try:
            record = read_record(prefix)
        except (tf.errors.OpError, ValueError, OSError, UnicodeDecodeError):
            continue
        return record["run_id"] if record else UNRECORDED
    return UNRECORDED
