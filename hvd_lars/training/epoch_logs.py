"""The run's per-epoch logs, `metrics.csv` and TensorBoard scalars, aligned in any evaluation schedule
and across kills and resumes; and rank 0's printed lines of the same epochs (`EpochProgress`).

Both write what the epoch logs hold at the end of each epoch (after `ExactEvaluation`, the rate logger
and the images/s callback have added theirs) with the epoch (0-based, as Keras counts) and the step
(optimizer updates applied so far). A run resumed at step s first drops what its killed predecessor
wrote for steps after s (the epochs it will train again), so no epoch appears twice.

Why not Keras's own `CSVLogger` and `TensorBoard` (Keras 3.15):
- `CSVLogger` fixes its columns at the first epoch end. With evaluation every 2 epochs the first epoch
  has no `test_*` keys, so those columns never appear, and because no key starts with `val_` it adds a
  `val_` copy of every column, all `NA`. With `append=True` a resumed run keeps the old header but
  writes rows of its own columns under it (19 fields under 13 names: the `top1` column held the test
  loss), and rows of epochs trained twice stay in the file.
- `TensorBoard` writes `val_*` under the training tags in a second folder (`val_top1` as `epoch_top1`
  in `validation/`), replaces the logged `learning_rate` by the optimizer's rate read after the epoch
  (for a schedule: the next update's rate), and after a resume writes the repeated epochs again into a
  new events file, so TensorBoard shows two values at one step.
"""

import csv
import glob
import io
import json
import os
import sys
import time

import keras
import tensorflow as tf
from google.protobuf.message import DecodeError

from hvd_lars.parallel import collectives
from hvd_lars.training import faults, lineage
from hvd_lars.training.lineage import UNRECORDED, events_suffix, run_id_of_events, set_aside
from hvd_lars.training.run_summary import RunSummary

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


def _step(model):
    return int(model.optimizer.iterations.numpy())


class MetricsCSV(keras.callbacks.Callback):
    """`metrics.csv`: one row per epoch, every row with the header's columns.

    Columns: `epoch` (0-based), `step` (updates applied at the epoch's end), then every key any epoch
    has reported so far, sorted. When a new key appears (the first evaluated epoch adds `test_*`) the
    file is rewritten with the wider header and the earlier rows get an empty field there; an empty
    field means "not measured that epoch". The file is rewritten whole at each epoch end, to a
    temporary file renamed over it, so a killed job leaves the rows of its finished epochs and never a
    torn row. Non-finite values are written as Python prints them (`nan`, `inf`).

    Args:
        path: the CSV file.
        start_step: updates already applied (a resumed run's step); the rows of later epochs, written by
            a killed predecessor that got further than its last checkpoint, are dropped.
        steps_per_epoch: updates per epoch (to rebuild rows from summary.json's epochs).

    An existing file cut short, empty or of another format is moved under `<run_dir>/damaged/` with a
    one-line warning naming it, and its rows are rebuilt from the epochs of summary.json beside it.
    """

    FIXED = ("epoch", "step")

    def __init__(self, path, start_step=0, steps_per_epoch=1, lineage=None):
        super().__init__()
        self.path = path
        self.run_id = lineage.run_id if lineage is not None else None
        self.rows = []
        rows, known = [], os.path.exists(path)
        if known:
            try:
                rows = _read_rows(path)
            except ValueError as e:
                rows = self._rebuilt(path, str(e), steps_per_epoch)  # from summary.json: this run's
            else:
                rows = self._own(rows, lineage, steps_per_epoch) if lineage is not None else rows
        elif lineage is not None and start_step:
            rows = _rows_of_summary(os.path.dirname(os.path.abspath(path)), steps_per_epoch)
            known = bool(rows)
            if rows:
                lineage.warn(f"{path} is missing; rebuilt with the {len(rows)} epoch(s) of summary.json")
        for row in rows:
            if int(row["step"]) <= start_step:
                kept = {k: v for k, v in row.items() if v not in ("", None)}
                self.rows.append({**kept, "run_id": self.run_id} if self.run_id else kept)
        if known and lineage is not None:
            self._write()  # at once: the file holds this run's rows only, each with its run id

    def _own(self, rows, lineage, steps_per_epoch):
        """The rows of `lineage`; a file holding others is moved under earlier_runs/ (one warning) and
        this run's epochs it lacks are taken from its summary.json."""
        foreign = [r.get("run_id") or None for r in rows if not lineage.owns(r.get("run_id") or None)]
        if not foreign:
            return rows
        run_dir = os.path.dirname(os.path.abspath(self.path))
        kept = set_aside([self.path], run_dir, foreign[0])
        own = [r for r in rows if lineage.owns(r.get("run_id") or None)]
        # The epochs the other run's rows stood for come back from this run's summary.json.
        epochs = {int(r["epoch"]) for r in own}
        own += [r for r in _rows_of_summary(run_dir, steps_per_epoch) if int(r["epoch"]) not in epochs]
        lineage.warn(
            f"{self.path} holds {len(foreign)} row(s) of another run ({foreign[0] or UNRECORDED}): kept in "
            f"{kept}; written anew with this run's {len(own)} row(s)"
        )
        return sorted(own, key=lambda r: int(r["epoch"]))

    @staticmethod
    def _rebuilt(path, problem, steps_per_epoch):
        # The damaged file is kept aside; its epochs come back from summary.json beside it, which holds
        # the same epoch logs (its epochs count from 1).
        run_dir = os.path.dirname(os.path.abspath(path))
        kept = lineage.keep_damaged(path, run_dir)
        rows = _rows_of_summary(run_dir, steps_per_epoch)
        lineage.warn(
            f"{path} is {problem}; kept as {kept}, and rebuilt with the {len(rows)} epoch(s) of summary.json"
        )
        return rows

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch, "step": _step(self.model), **(logs or {})}
        if self.run_id:
            row["run_id"] = self.run_id
        self.rows = [r for r in self.rows if int(r["epoch"]) != epoch] + [row]
        self._write()

    def _write(self):
        fixed = [*self.FIXED, *(["run_id"] if any("run_id" in r for r in self.rows) else [])]
        keys = sorted({k for r in self.rows for k in r} - set(fixed))

        def write(f):
            writer = csv.DictWriter(f, fieldnames=[*fixed, *keys], restval="")
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: _text(v) for k, v in row.items()})

        faults.write_atomically(self.path, write)


def _rows_of_summary(run_dir, steps_per_epoch):
    """metrics.csv's rows of the epochs summary.json in `run_dir` holds (its epochs count from 1)."""
    saved = RunSummary.load(run_dir) or {}
    return [
        {**{k: v for k, v in e.items() if k != "epoch"}, "epoch": e["epoch"] - 1,
         "step": e["epoch"] * steps_per_epoch}
        for e in saved.get("epochs", [])
    ]  # fmt: skip


def _read_rows(path):
    """The rows of a metrics.csv (dicts of strings).

    Raises:
        ValueError: the file is empty, cut short (no line end after its last row, or a short row), or
            not such a CSV (no `epoch` and `step` columns, or a row whose epoch or step is no integer).
    """
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise ValueError("empty")
    if not data.endswith(b"\n"):
        raise ValueError("cut short (no line end after its last row)")
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise ValueError(f"not text ({e})") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if not reader.fieldnames or not {"epoch", "step"} <= set(reader.fieldnames):
        raise ValueError(f"not a metrics.csv (columns {reader.fieldnames}, no epoch and step)")
    rows = list(reader)
    for row in rows:
        if None in row or None in row.values():
            raise ValueError(f"cut short or torn (row {row})")
        try:
            int(row["epoch"]), int(row["step"])
        except ValueError:
            bad = f"epoch {row['epoch']!r}, step {row['step']!r}"
            raise ValueError(f"not a metrics.csv ({bad})") from None
    return rows


def _text(value):
    if isinstance(value, str):
        return value
    number = float(keras.ops.convert_to_numpy(value))
    return str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)


class TensorBoardScalars(keras.callbacks.Callback):
    """TensorBoard scalars in `log_dir`: each epoch-log key under one tag (its own name: `loss`, `top1`,
    `test_top1`, `val_top1`, `learning_rate`, `images_per_second`, ...; plus `epoch`, counted from 1), at
    the step (updates applied) of the epoch's end, written with `tf.summary`.

    A resumed run first removes from the event files in `log_dir` every scalar written at a step after
    `start_step` (rewriting those files without them, to a temporary file renamed over each), so the
    epochs it trains again appear once. An events file cut short by a kill keeps its complete records; one
    that is not an event file is moved under `<run_dir>/damaged/`, with a one-line warning naming it.

    With a `lineage`, the event files' names end with its run id (`lineage.events_suffix`); files of
    another run found in `log_dir`, or of none, are moved under `<run_dir>/earlier_runs/<their run id>/`
    (one warning).

    Args:
        log_dir: folder of the event files.
        start_step: updates already applied (0 for a fresh run: any scalars there are dropped).
        lineage: the run's `hvd_lars.training.lineage.Lineage`, or None.
    """

    def __init__(self, log_dir, start_step=0, lineage=None):
        super().__init__()
        self.log_dir = log_dir
        self._writer = None
        self._suffix = events_suffix(lineage.run_id) if lineage is not None else None
        if lineage is not None:
            _own_event_files(log_dir, lineage)
        prune_events(log_dir, start_step)

    def on_epoch_end(self, epoch, logs=None):
        step = _step(self.model)
        try:
            if self._writer is None:
                self._writer = tf.summary.create_file_writer(self.log_dir, filename_suffix=self._suffix)
            with self._writer.as_default():
                tf.summary.scalar("epoch", epoch + 1, step=step)
                for key, value in sorted((logs or {}).items()):
                    tf.summary.scalar(key, float(keras.ops.convert_to_numpy(value)), step=step)
            self._writer.flush()
        except (OSError, tf.errors.OpError) as e:
            faults.note(faults.write_failure(self.log_dir, e))


def _own_event_files(log_dir, lineage):
    """Moves the event files in `log_dir` of other runs under earlier_runs/ (one warning per run)."""
    run_dir = os.path.dirname(os.path.abspath(log_dir))
    foreign = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        run_id = run_id_of_events(os.path.basename(path))
        if not lineage.owns(run_id):
            foreign.setdefault(run_id, []).append(path)
    for run_id, paths in sorted(foreign.items()):
        kept = set_aside(paths, run_dir, run_id)
        lineage.warn(
            f"{len(paths)} TensorBoard event file(s) of another run ({run_id}) in {log_dir}: kept in {kept}"
        )


def prune_events(log_dir, last_step):
    """Removes the summaries written at steps after `last_step` from the event files in `log_dir` (not
    its sub-folders); returns how many were removed. Files without such summaries are left untouched."""
    run_dir = os.path.dirname(os.path.abspath(log_dir))
    removed = 0
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        kept, dropped, problem = [], 0, None
        try:
            for record in tf.data.TFRecordDataset(path):
                event = tf.compat.v1.Event.FromString(record.numpy())
                if event.HasField("summary") and event.step > last_step:
                    dropped += 1
                else:
                    kept.append(record.numpy())
        except tf.errors.DataLossError:
            # A record cut short by a kill: the complete ones before it are kept. Nothing readable at
            # all: not an event file.
            problem = "cut short" if kept else "not an event file (no readable record)"
        except DecodeError:
            problem = "not an event file (a record that is no tf.Event)"
        if problem:
            dropped += 1
            saved = lineage.keep_damaged(path, run_dir, copy=bool(kept))
            what = f"rewritten with its {len(kept)} complete record(s)" if kept else "left out"
            lineage.warn(f"the TensorBoard event file {path} is {problem}; kept as {saved}, {what}")
            if not kept:
                continue
        if not dropped:
            continue
        tmp = os.path.join(log_dir, f"pruning.{os.path.basename(path)}")
        try:
            with tf.io.TFRecordWriter(tmp) as writer:
                for record in kept:
                    writer.write(record)
            os.replace(tmp, path)
        except (OSError, tf.errors.OpError) as e:
            faults.remove_quietly(tmp)
            faults.note(faults.write_failure(path, e))
            continue
        removed += dropped
    return removed


class EpochProgress(keras.callbacks.ProgbarLogger):
    """Rank 0's lines: each epoch's header, a progress line every `every_s` seconds within it, and Keras's
    epoch-end line (its `fit(verbose=2)` line). Plain lines, no bar or carriage return, so they read alike in
    a terminal, in a batch log and through a launcher's pipe (horovodrun, mpirun, srun):

        Epoch 3/12
        120/469 - 31s - 1995 images/s - loss: 0.6421 - 1:30 left
        240/469 - 61s - 2003 images/s - loss: 0.6133 - 59s left
        469/469 - 118s - 251ms/step - loss: 0.5873 - top1: 0.7890 - ... - test_top1: 0.8012

    A progress line gives the micro-batches done of the epoch's (counted as the end line counts them, from
    where an epoch resumed mid-way resumed), the seconds since the epoch began, the images/s of all ranks
    since the previous line, rank 0's running mean loss of the epoch and the time left at that rate. The
    header names the run's epoch and epoch count also in a `fit` of one epoch. Place it last, as Keras
    places its own; `fit`'s own `verbose` is not read.

    Args:
        epochs: the run's epochs.
        batches_per_epoch: micro-batches per epoch (steps per epoch x accumulation steps).
        images_per_batch: images of one micro-batch on all ranks.
        every_s: seconds between progress lines (0: after every micro-batch); None: the epoch's lines only.
        clock: seconds of a monotonic clock.
    """

    def __init__(self, epochs, batches_per_epoch, images_per_batch=0, every_s=None, clock=time.monotonic):
        super().__init__()
        self.run_epochs = epochs
        self.batches_per_epoch = batches_per_epoch
        self.images_per_batch = images_per_batch
        self.every_s = every_s
        self.clock = clock
        self._done = 0
        self._began = self._last = (0.0, 0)  # (clock, micro-batches done)

    def set_params(self, params):
        super().set_params({**params, "verbose": 2})  # lines, never Keras's bar
        self.epochs = self.run_epochs
        # A fit of fewer steps than an epoch finishes an epoch resumed mid-way.
        self._done = self.batches_per_epoch - params["steps"] if params.get("steps") else 0
        self.target = self.batches_per_epoch

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._began = self._last = (self.clock(), self._done)

    def _update_progbar(self, batch, logs=None):
        super()._update_progbar(batch + self._done, logs)
        done, now = batch + self._done + 1, self.clock()
        then, before = self._last
        if self.every_s is None or now - then < self.every_s or done in (before, self.batches_per_epoch):
            return
        self._last = (now, done)
        per_second = (done - before) / max(now - then, 1e-9)
        loss = (logs or {}).get("loss")
        line = [
            f"{done}/{self.batches_per_epoch}",
            f"{now - self._began[0]:.0f}s",
            f"{per_second * self.images_per_batch:.0f} images/s",
            *([f"loss: {_keras_number(float(loss))}"] if loss is not None else []),
            f"{_duration((self.batches_per_epoch - done) / per_second)} left",
        ]
        # The stream of Keras's epoch lines, in their order.
        sys.stdout.write(" - ".join(line) + "\n")
        sys.stdout.flush()

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._done = 0  # the next epoch of this fit is whole


def _keras_number(value):
    # As Keras's epoch line writes a metric.
    return f"{value:.4f}" if value > 1e-3 else f"{value:.4e}"


def _duration(seconds):
    """42 -> '42s', 90 -> '1:30', 3725 -> '1:02:05' (as Keras's progress bar writes its ETA)."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
