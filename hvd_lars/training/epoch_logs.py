"""What a run records and says, epoch by epoch and at its end (the files: docs/training.md).

`ExactEvaluation` and `ImagesPerSecond` add to the epoch logs; `Progress` is what a checkpoint holds beyond
the model; `MetricsCSV`, `TensorBoardScalars` and `RunSummary` write metrics.csv, tensorboard/ and
summary.json, aligned across resumes (docs/design.md, "The run's own logs"); `EpochProgress` prints rank 0's
lines.
"""

import csv
import dataclasses
import datetime
import glob
import io
import json
import logging
import os
import platform
import subprocess
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError

from hvd_lars.metrics import top_k_correct
from hvd_lars.parallel import collectives
from hvd_lars.training import checkpoints, faults, plot_run
from hvd_lars.training.checkpoints import (
    UNRECORDED,
    events_suffix,
    moving_statistics,
    read_json,
    run_id_of_events,
    set_aside,
    strict,
)

log = logging.getLogger(__name__)


def git_sha(path=None):
    """The commit of the checkout holding `path` (default: this package), with "-dirty" when it has
    uncommitted changes; "unknown" outside a git checkout."""
    git = ["git", "-C", path or os.path.dirname(os.path.abspath(__file__))]
    run = lambda *a: subprocess.run([*git, *a], capture_output=True, text=True, check=True, timeout=10).stdout
    try:
        sha, dirty = run("rev-parse", "HEAD"), run("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha.strip() + ("-dirty" if dirty.strip() else "")


def cpuinfo(path="/proc/cpuinfo"):
    """The first processor's fields of /proc/cpuinfo as {name: value} ("model name", "flags", ...); {}
    where it cannot be read."""
    try:
        with open(path) as f:
            first = f.read().strip().split("\n\n")[0]
    except OSError:
        return {}
    return {name.strip(): value.strip() for name, _, value in (s.partition(":") for s in first.splitlines())}


def machine():
    """This machine in one line: CPU model, logical cores, memory, OS."""
    cpu = cpuinfo().get("model name") or platform.processor() or platform.machine()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} logical cores, {memory:.0f} GiB, {platform.system()} {platform.release()}"
    )


def provenance():
    """Dict with git_sha, date (UTC, ISO 8601), machine, python, tensorflow, keras, horovod versions."""
    try:
        import horovod

        horovod_version = horovod.__version__
    except ImportError:  # a single-process run needs no Horovod
        horovod_version = None
    return {
        "git_sha": git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "horovod": horovod_version,
    }


class RunSummary(keras.callbacks.Callback):
    """Keeps `<run_dir>/summary.json` (keys: docs/training.md) up to date after every epoch; rank 0 writes
    it, every rank keeps `summary`. With a `job`, a resumed run keeps the epochs of its own lineage's
    summary.json (another run's is moved under earlier_runs/, one warning) and the time over its starts."""

    def __init__(self, run_dir, config, plan, start_step, threads=None, job=None):
        super().__init__()
        lineage, progress = (job.lineage, job.progress) if job is not None else (None, None)
        self.path = os.path.join(run_dir, "summary.json")
        saved = (RunSummary.load(run_dir) or {}) if start_step else {}
        if saved and lineage is not None and not lineage.owns(saved.get("run_id")):
            if collectives.is_chief():
                run_id = saved.get("run_id")
                kept = set_aside([self.path], run_dir, run_id)
                checkpoints.warn(
                    f"{self.path} belongs to another run ({run_id or UNRECORDED}): kept in {kept}, and "
                    "written anew"
                )
            saved = {}
        finished_epochs = start_step // plan.steps_per_epoch
        self.summary = {
            "run_name": os.path.basename(os.path.normpath(run_dir)),
            "run_id": lineage.run_id if lineage is not None else None,
            "config": vars(config),
            "plan": dataclasses.asdict(plan),
            "world_size": plan.world_size,
            "hosts": collectives.host_names(),  # a collective, at the same point on every rank
            "local_size": collectives.local_size(),
            "cross_size": collectives.cross_size(),
            "global_batch_size": plan.global_batch_size,
            "per_rank_batch_size": plan.per_rank_batch_size,
            "accumulation_steps": plan.accumulation_steps,
            "threads": threads,
            "resumed_from_step": start_step,
            "epochs": [e for e in saved.get("epochs", []) if e["epoch"] <= finished_epochs],
            "images_per_second": None,
            "wall_time_s": 0.0,
            "segments": progress.segments if progress is not None else 1,
            **{f"final_{split}_top{k}": None for split in ("test", "val") for k in (1, 5)},
            # Rank 0 asks git and reads the machine; the other ranks get its record.
            **collectives.broadcast_object(
                provenance() if collectives.is_chief() else None, name="hvd_lars.training.provenance"
            ),
        }
        self._attempt_epochs = []
        start = time.perf_counter()
        self._wall_time_s = progress.wall_time_s if progress else lambda: time.perf_counter() - start
        self._update()

    @staticmethod
    def load(run_dir):
        """The summary dict saved in `run_dir`, or None: there is none, or it is cut short, empty or of
        another format, and rank 0 moves it under `<run_dir>/damaged/` with a one-line warning."""
        path = os.path.join(run_dir, "summary.json")
        if not os.path.exists(path):
            return None
        try:
            saved = read_json(path)
        except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            problem = f"cut short, empty or not JSON ({type(e).__name__}: {e})"
        else:
            epochs = saved.get("epochs") if isinstance(saved, dict) else None
            if isinstance(epochs, list) and isinstance(saved.get("plan"), dict):
                if all(isinstance(e, dict) and isinstance(e.get("epoch"), int) for e in epochs):
                    return saved
            problem = 'not a summary (a "plan" object and an "epochs" list of numbered epochs)'
        if collectives.is_chief():
            kept = checkpoints.keep_damaged(path, run_dir)
            checkpoints.warn(f"{path} is {problem}; kept as {kept}, and written anew")
        return None

    def record_stop(self, reason, step, message):
        """Records why training stopped early ("stopped": reason, step, message) and writes the file."""
        self.summary["stopped"] = {"reason": reason, "step": step, "message": message}
        self._update()

    def on_epoch_end(self, epoch, logs=None):
        entry = {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()}}
        self._attempt_epochs.append(entry)
        self.summary["epochs"] = [e for e in self.summary["epochs"] if e["epoch"] != entry["epoch"]] + [entry]
        self._update()

    def _update(self):
        s = self.summary
        rates = [e["images_per_second"] for e in self._attempt_epochs if "images_per_second" in e]
        steady = rates[1:] or rates  # the first epoch of an attempt includes tracing
        s["images_per_second"] = sum(steady) / len(steady) if steady else None
        s["wall_time_s"] = self._wall_time_s()
        for split in ("test", "val"):
            evaluated = [e for e in s["epochs"] if f"{split}_top1" in e]
            if evaluated:
                s[f"final_{split}_top1"] = evaluated[-1][f"{split}_top1"]
                s[f"final_{split}_top5"] = evaluated[-1][f"{split}_top5"]
        if collectives.is_chief():
            faults.write_atomically(self.path, lambda f: json.dump(strict(s), f, indent=2, allow_nan=False))

    def finish(self, checkpoint):
        """The end of a run, on every rank (a collective): rank 0 writes `<run_dir>/run.png` and logs the
        summary lines. A plot that cannot be drawn is one warning.

        Raises:
            hvd_lars.training.faults.FileFailure: run.png could not be written (every rank).
        """
        if collectives.is_chief():
            run_dir = os.path.dirname(self.path)
            plot = os.path.join(run_dir, "run.png")
            try:
                figure = plot_run.make_figure(run_dir)
            except Exception as e:  # a picture is not worth a finished run
                checkpoints.warn(
                    f"no plot of this run ({type(e).__name__}: {e}); try `hvd-lars-plot {run_dir}`"
                )
                plot = None
            else:
                try:
                    plot_run.save(figure, plot)
                except OSError as e:  # the run is complete: hvd-lars-plot can draw it later
                    reason = f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)
                    faults.note(
                        f"could not write {plot}: {reason}. Free space or make it writable there, then draw "
                        f"it with `hvd-lars-plot {run_dir}` (the run itself is complete)."
                    )
                    plot = None
            for line in _end_lines(self.summary, run_dir, checkpoint, plot):
                log.info(line)
        faults.agree(name="hvd_lars.plot_write")


def _end_lines(summary, run_dir, checkpoint, plot):
    """The run's last lines: epochs, steps, time, images/s; final and best top-1/top-5; where things are."""
    plan, epochs, rate = summary["plan"], summary["epochs"], summary["images_per_second"]
    over = "this start's epochs after its first" if summary["segments"] > 1 else "epochs after the first"
    lines = [
        f"finished {summary['run_name']}: {epochs[-1]['epoch'] if epochs else 0} of {plan['epochs']} epochs "
        f"({plan['total_steps']} steps) in {summary['wall_time_s']:.0f} s over {summary['segments']} "
        f"start(s), " + (f"{rate:.0f} images/s ({over})" if rate else "images/s not measured")
    ]
    for split, name in (("test", "test"), ("val", "validation")):
        evaluated = [e for e in epochs if f"{split}_top1" in e]
        if evaluated:
            final, best = evaluated[-1], max(evaluated, key=lambda e: e[f"{split}_top1"])
            lines.append(
                f"final {name} top-1 {final[f'{split}_top1']:.4f} (best {best[f'{split}_top1']:.4f}, epoch "
                f"{best['epoch']}), top-5 {final[f'{split}_top5']:.4f} (best "
                f"{max(e[f'{split}_top5'] for e in evaluated):.4f})"
            )
        elif split == "test":
            lines.append("final test top-1 not evaluated")
    return lines + [
        f"checkpoint {checkpoint or 'none written'}",
        f"logs {run_dir}/{{summary.json, metrics.csv, tensorboard/}}",
        f"plot {plot or 'not written'}",
    ]


class ExactEvaluation(keras.callbacks.Callback):
    """Every `every_epochs` epochs and at `last_epoch`, adds `<prefix>_loss` (mean cross-entropy),
    `<prefix>_top1` and `<prefix>_top5` (fractions) to the epoch logs, from counts summed over the ranks'
    shards, so that each image counts once; batch-norm statistics are averaged over the ranks first. A
    prediction is correct by `hvd_lars.metrics.top_k_correct`, the training metrics' rule. `prefix`:
    "test", or "val" for a validation split.

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
        self._counts = tf.function(self._batch_counts, reduce_retracing=True)

    def _batch_counts(self, images, labels):
        logits = tf.cast(self.model(images, training=False), tf.float32)
        labels = tf.cast(labels, tf.int32)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        correct = [
            tf.cast(top_k_correct(labels, logits, k), tf.float32) for k in (1, min(5, logits.shape[-1]))
        ]
        sums = [tf.reduce_sum(loss), *map(tf.reduce_sum, correct), tf.cast(tf.size(labels), tf.float32)]
        return tf.stack(sums)

    def on_epoch_end(self, epoch, logs=None):
        if not (epoch + 1 == self.last_epoch or (epoch + 1) % self.every_epochs == 0):
            return
        # One model for every rank: each rank's batch-norm moving statistics follow its own batches.
        collectives.average_variables(moving_statistics(self.model))
        total = np.zeros(4, dtype=np.float64)
        for images, labels in self.dataset:
            total += self._counts(images, labels).numpy()
            faults.heartbeat()
        # With the counts, whether a rank failed to read an evaluation file.
        loss, top1, top5, count = faults.agree("hvd_lars.eval_counts", total)
        if int(count) != self.num_examples:
            raise RuntimeError(
                f"evaluated {int(count)} {self.prefix} images across ranks, expected {self.num_examples}."
            )
        if logs is not None:
            logs[f"{self.prefix}_loss"] = loss / count
            logs[f"{self.prefix}_top1"] = top1 / count
            logs[f"{self.prefix}_top5"] = top5 / count


KEY = "progress/.ATTRIBUTES/VARIABLE_VALUE"


class Progress(keras.callbacks.Callback):
    """What a checkpoint records beyond the model (`variable`): the epoch's running metric sums, so that an
    epoch resumed mid-way reports the whole epoch's metrics, and the run's time over its starts."""

    def __init__(self, steps_per_epoch):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.variable = tf.Variable("", dtype=tf.string, trainable=False, name="progress")
        self.restored = {}
        self._pending = None
        self._begun = time.perf_counter()

    def resume(self, prefix):
        """Rank 0 reads the record of the checkpoint at `prefix` (None or "": a fresh start) and hands it to
        every rank (a collective)."""
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
        """Seconds of training and evaluation over the run's starts, each counted up to the checkpoint the
        next one resumed from."""
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
        # Here, not before: Keras builds the compiled metrics' variables in the first training step.
        if self._pending is None:
            return
        sums, self._pending, variables = self._pending, None, self.model.metrics_variables
        if len(sums) == len(variables):
            for variable, value in zip(variables, sums):
                variable.assign_add(value)


class ImagesPerSecond(keras.callbacks.Callback):
    """Adds `images_per_second` (of all ranks, per second of training) and `epoch_time_s` to the epoch
    logs; `images_per_batch`: the images of one micro-batch over all ranks."""

    def __init__(self, images_per_batch):
        super().__init__()
        self.images_per_batch = images_per_batch

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


class MetricsCSV(keras.callbacks.Callback):
    """`metrics.csv`: one row per epoch, `epoch` (from 0), `step` (updates applied), `run_id` (with a
    `lineage`), then every key any epoch reported, sorted; empty where not measured. Rewritten whole at each
    epoch's end (atomically), so a killed job leaves whole rows.

    A resumed run (`start_step` updates applied) drops the rows of later epochs. A file cut short, empty or
    of another format is moved under `<run_dir>/damaged/`, one of another run under earlier_runs/, and the
    rows are rebuilt from summary.json (`steps_per_epoch` gives their steps), with a one-line warning.
    """

    def __init__(self, path, start_step=0, steps_per_epoch=1, lineage=None):
        super().__init__()
        self.path = path
        self.run_id = lineage.run_id if lineage is not None else None
        run_dir = os.path.dirname(os.path.abspath(path))
        exists, rows, problem = os.path.exists(path), [], None
        if exists:
            try:
                rows = _read_rows(path)
            except ValueError as e:
                problem = f"{path} is {e}; kept as {checkpoints.keep_damaged(path, run_dir)}, and"
        elif lineage is not None and start_step:
            problem = f"{path} is missing;"
        owned = lambda row: lineage is None or lineage.owns(row.get("run_id") or None)
        foreign = [row.get("run_id") or UNRECORDED for row in rows if not owned(row)]
        if foreign:
            rows = [row for row in rows if owned(row)]
            kept = set_aside([path], run_dir, foreign[0])
            problem = f"{path} holds {len(foreign)} row(s) of another run ({foreign[0]}): kept in {kept};"
        if problem:
            epochs = {int(row["epoch"]) for row in rows}
            rows += [r for r in _rows_of_summary(run_dir, steps_per_epoch) if r["epoch"] not in epochs]
            rows.sort(key=lambda row: int(row["epoch"]))
            if rows or exists:
                checkpoints.warn(f"{problem} rebuilt with the {len(rows)} epoch(s) of summary.json")
        self.rows = []
        for row in rows:
            if int(row["step"]) <= start_step:
                kept = {k: v for k, v in row.items() if v not in ("", None)}
                self.rows.append({**kept, "run_id": self.run_id} if self.run_id else kept)
        if (exists or rows) and lineage is not None:
            self._write()  # at once: the file holds this run's rows only, each with its run id

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch, "step": int(self.model.optimizer.iterations.numpy()), **(logs or {})}
        if self.run_id:
            row["run_id"] = self.run_id
        self.rows = [r for r in self.rows if int(r["epoch"]) != epoch] + [row]
        self._write()

    def _write(self):
        fixed = ["epoch", "step", *(["run_id"] if any("run_id" in r for r in self.rows) else [])]
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
        ValueError: the file is empty, cut short or not such a CSV (saying which).
    """
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise ValueError("empty")
    if not data.endswith(b"\n"):
        raise ValueError("cut short (no line end after its last row)")
    try:
        reader = csv.DictReader(io.StringIO(data.decode(), newline=""))
    except UnicodeDecodeError as e:
        raise ValueError(f"not text ({e})") from None
    if not reader.fieldnames or not {"epoch", "step"} <= set(reader.fieldnames):
        raise ValueError(f"not a metrics.csv (columns {reader.fieldnames}, no epoch and step)")
    rows = list(reader)
    for row in rows:
        if None in row or None in row.values():
            raise ValueError(f"cut short or torn (row {row})")
        if not (row["epoch"].isdigit() and row["step"].isdigit()):
            raise ValueError(f"not a metrics.csv (epoch {row['epoch']!r}, step {row['step']!r})")
    return rows


def _text(value):
    if isinstance(value, str):
        return value
    number = float(keras.ops.convert_to_numpy(value))
    return str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)


class TensorBoardScalars(keras.callbacks.Callback):
    """TensorBoard scalars in `log_dir`: each epoch-log key under its own name (and `epoch`, from 1) at the
    step of the epoch's end. A resumed run first drops the scalars after `start_step` (`prune_events`). With
    a `lineage`, the event files' names end with its run id, and other runs' files are moved under
    earlier_runs/ (one warning per run)."""

    def __init__(self, log_dir, start_step=0, lineage=None):
        super().__init__()
        self.log_dir = log_dir
        self._writer = None
        self._suffix = events_suffix(lineage.run_id) if lineage is not None else None
        foreign = {}
        for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
            run_id = run_id_of_events(os.path.basename(path))
            if lineage is not None and not lineage.owns(run_id):
                foreign.setdefault(run_id, []).append(path)
        for run_id, paths in sorted(foreign.items()):
            kept = set_aside(paths, os.path.dirname(os.path.abspath(log_dir)), run_id)
            what = f"{len(paths)} TensorBoard event file(s) of another run ({run_id})"
            checkpoints.warn(f"{what} in {log_dir}: kept in {kept}")
        prune_events(log_dir, start_step)

    def on_epoch_end(self, epoch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
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


def prune_events(log_dir, last_step):
    """Removes the summaries of steps after `last_step` from the event files in `log_dir`, each rewritten
    through a temporary file; returns how many were removed. A file cut short keeps its whole records; one
    that is no event file is moved under `<run_dir>/damaged/`, with a one-line warning."""
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
        except tf.errors.DataLossError:  # a record cut short by a kill
            problem = "cut short" if kept else "not an event file (no readable record)"
        except DecodeError:
            problem = "not an event file (a record that is no tf.Event)"
        if problem:
            dropped += 1
            saved = checkpoints.keep_damaged(path, run_dir, copy=bool(kept))
            what = f"rewritten with its {len(kept)} complete record(s)" if kept else "left out"
            checkpoints.warn(f"the TensorBoard event file {path} is {problem}; kept as {saved}, {what}")
        if not dropped or (problem and not kept):
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
    """Rank 0's lines: each epoch's header, a progress line every `every_s` seconds (0: every micro-batch;
    None: none) and Keras's epoch-end line, as plain lines that read alike in a terminal, a batch log and
    through a launcher's pipe:

        Epoch 3/12
        120/469 - 31s - 1995 images/s - loss: 0.6421 - 1:30 left
        469/469 - 118s - 251ms/step - loss: 0.5873 - top1: 0.7890 - ... - test_top1: 0.8012

    A progress line: micro-batches done of `batches_per_epoch` (an epoch resumed mid-way counted from where
    it resumed), seconds since the epoch began, images/s of all ranks (`images_per_batch` a micro-batch)
    since the previous line, rank 0's running mean loss, and the time left at that rate. Place it last.
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
        sys.stdout.write(" - ".join(line) + "\n")  # the stream of Keras's epoch lines
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
