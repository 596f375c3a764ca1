"""Which checkpoint a start takes, and what it does with the run directory: resume it, refuse it, or begin
a new lineage (`hvd_lars.training.lineage`). Rank 0 decides, before anything is written (`resume_or_begin`):

1. The candidate is the checkpoint the index names newest (`model_checkpoint_path`). Only when its files
   cannot be read (cut short, empty, missing: every tensor and its CRC32C is read) is the next one tried,
   in the order the index saved them, then any other `ckpt-<step>` of the folder from the highest step;
   the unreadable ones are moved under `<run_dir>/damaged/`, named in a warning.
2. Its record (the run id and the plan it was written under, saved inside it) is read before anything is
   restored, and its plan compared with this run's (`hvd_lars.training.plan.plan_changes`, by meaning): a
   change --allow_plan_change does not name is refused in one line, with the folder left as it was, and
   so is a checkpoint that records neither.
3. It is restored, every variable matched; under an allowed change of plan, the optimizer variables the
   new plan adds (gradient accumulators, the previous learning rate) keep their initial zeros. A
   checkpoint that does not fit the model belongs to another plan or run: refused, never called damaged.
4. Checkpoints of other lineages beside it are moved under `<run_dir>/earlier_runs/<their run id>/`, and
   the index is rewritten when it named what is gone.

A fresh start (--noresume, or nothing to resume) in a used run directory begins a new lineage: the earlier
run's checkpoints, metrics.csv, tensorboard/ and summary.json are moved under `earlier_runs/<its run id>/`,
named in one line with what is kept there; nothing of it is mixed into the new run's files. Every start
that is not refused then keeps the newest --keep_earlier_runs runs of `earlier_runs/` and removes the
others, one line naming each (`lineage.keep_newest`).
"""

import glob
import os

import tensorflow as tf

from hvd_lars.training import lineage
from hvd_lars.training.checkpoints import CheckpointReadError, set_aside_damaged_index
from hvd_lars.training.lineage import Lineage, LineageRefused, read_json
from hvd_lars.training.plan import changed_settings, plan_changes, refuse_plan_changes

CHECKPOINTS = "checkpoints"
# What belongs to one lineage in a run directory (image_folder_index/ describes the data, damaged/ keeps
# files that could not be read: both stay).
LINEAGE_FILES = (CHECKPOINTS, "metrics.csv", "tensorboard", "summary.json")


def resume_or_begin(model, optimizer, build, run_dir, plan, config):
    """Rank 0's start: restores the checkpoint the run continues into `model` and `optimizer`, or begins a
    new lineage, then keeps the newest `config.keep_earlier_runs` earlier runs (`lineage.keep_newest`); a
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
    lineage.keep_newest(run_dir, config.keep_earlier_runs)
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
                f"{os.path.join(run_dir, lineage.DAMAGED)}; start afresh (--noresume or another --run_name)."
            )
        return begin(run_dir, "nothing to resume", config.keep_earlier_runs)
    record = lineage.read_record(path)
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
    lineage.say(f"resumed from {path} (step {int(optimizer.iterations)})")
    return Lineage(run_id=run_id, restored=path)


def begin(run_dir, why, keep):
    """A new lineage in `run_dir`: what an earlier one left there (`LINEAGE_FILES`) is moved under
    `earlier_runs/<its run id>/`, named in one line of the log with what `keep` (--keep_earlier_runs) keeps
    there; returns the new `Lineage`."""
    present = [os.path.join(run_dir, name) for name in LINEAGE_FILES]
    present = [p for p in present if os.path.isfile(p) or (os.path.isdir(p) and os.listdir(p))]
    if present:
        names = ", ".join(os.path.basename(p) + ("/" if os.path.isdir(p) else "") for p in present)
        kept = lineage.set_aside(present, run_dir, _earlier_run_id(run_dir))
        lineage.say(
            f"{why}: a new run begins in {run_dir}; the earlier run's {names} are "
            f"{'kept in' if keep else 'moved to'} {kept}; " + lineage.keeping(run_dir, keep)
        )
    return Lineage(run_id=lineage.new_run_id())


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
        lineage.read_record(path)
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
        kept = [lineage.keep_damaged(p, run_dir) for p in sorted(glob.glob(f"{glob.escape(path)}.*"))]
        older = "no older one is left" if last and k == len(unreadable) - 1 else "an older one is tried"
        lineage.warn(
            f"the checkpoint {path} cannot be restored: {problem}; its files "
            f"({', '.join(os.path.basename(k) for k in kept)}) are kept under "
            f"{os.path.join(run_dir, lineage.DAMAGED, CHECKPOINTS)} and {older}"
        )


def _set_aside_other_lineages(folder, path, run_id, run_dir):
    """Moves the checkpoints of `folder` that record another run id than `run_id` under
    `earlier_runs/<their run id>/checkpoints/`, one line per run."""
    others = {}
    for prefix in candidates(folder):
        if prefix == path or not os.path.exists(f"{prefix}.index"):
            continue
        try:
            record = lineage.read_record(prefix)
        except (tf.errors.OpError, ValueError, OSError, UnicodeDecodeError):
            continue  # unreadable: left where it is, and set aside if a later start ever tries it
        if record is not None and record["run_id"] != run_id:
            others.setdefault(record["run_id"], []).append(prefix)
    for other, prefixes in sorted(others.items()):
        files = [f for p in prefixes for f in sorted(glob.glob(f"{glob.escape(p)}.*"))]
        kept = lineage.set_aside(files, run_dir, other)
        steps = ", ".join(os.path.basename(p) for p in sorted(prefixes, key=_number))
        lineage.say(f"checkpoints of another run ({steps}, run {other}) lay beside {path}: kept in {kept}")


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
    readable checkpoint, else `lineage.UNRECORDED`."""
    try:
        saved = read_json(os.path.join(run_dir, "summary.json"))
        if isinstance(saved, dict) and isinstance(saved.get("run_id"), str):
            return saved["run_id"]
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    for prefix in candidates(os.path.join(run_dir, CHECKPOINTS)):
        try:
            record = lineage.read_record(prefix)
        except (tf.errors.OpError, ValueError, OSError, UnicodeDecodeError):
            continue
        return record["run_id"] if record else lineage.UNRECORDED
    return lineage.UNRECORDED
