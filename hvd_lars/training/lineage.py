"""The identity of a run's lineage: a run id made at its fresh start, recorded in each of its checkpoints
(with the plan it was written under) and in each of its logs, and the folder where a run directory keeps
the files of its earlier lineages.

A lineage is one run from its fresh start on, across every kill, pre-emption and resume. Its run id
(`new_run_id`: UTC time and 6 random hex digits) is written
- into every checkpoint, as the JSON string variable "run" of the `tf.train.Checkpoint` (`RunRecord`:
  {"run_id", "plan": the plan's resolved settings}), so it is written atomically with the weights and read
  back (`read_record`) before anything is restored;
- into summary.json ("run_id"), every metrics.csv row (column `run_id`) and the TensorBoard event files'
  names (`events_suffix`).
Files of another lineage found in a run directory are moved under `<run_dir>/earlier_runs/<their run id>/`
(`set_aside`), named in one line of the log; each start keeps the newest --keep_earlier_runs of those
folders (`keep_newest`) and removes the others, one line naming each. Files that record no run id are
kept under `UNRECORDED`.
"""

import dataclasses
import json
import logging
import math
import os
import re
import secrets
import shutil
import time

import tensorflow as tf

from hvd_lars.parallel import collectives

log = logging.getLogger(__name__)

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
