"""What a run records and says, epoch by epoch and at its end.

- `ExactEvaluation`: every evaluation image counted once over all ranks, batch-norm statistics averaged
  first. `ImagesPerSecond`: images of all ranks per second of training.
- `MetricsCSV`, `TensorBoardScalars`: metrics.csv and TensorBoard scalars, aligned in any evaluation
  schedule and across kills and resumes (a resumed run first drops what its predecessor wrote after the
  checkpoint it resumes from). Keras's `CSVLogger` and `TensorBoard` do neither (docs/design.md).
- `EpochProgress`: rank 0's lines, within and at the end of each epoch.
- `Progress`: what a checkpoint records beyond the model (the epoch's running metric sums, the run's
  time over its starts), so a resumed run records what an uninterrupted one does.
- `RunSummary`: summary.json (flags, plan, provenance, epochs), written atomically by rank 0 after every
  epoch, and the run's last lines and plot.
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


def git_sha(path=None):
    """The commit of the repository holding `path` (default: this package), with "-dirty" when the work
    tree has uncommitted changes; "unknown" outside a git checkout."""
    path = path or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def cpuinfo(path="/proc/cpuinfo"):
    """The first processor's fields of /proc/cpuinfo as {name: value} ("model name", "vendor_id",
    "cpu family", "model", "stepping", "flags", ...); {} where the file cannot be read."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the end of the first processor's block
                    continue
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def machine():
    """A one-line description of this machine: CPU model, logical cores, memory, OS."""
    cpu = cpuinfo().get("model name") or platform.processor() or platform.machine()
    memory = ""
    try:
        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    return f"{cpu}, {os.cpu_count()} logical cores{memory}, {platform.system()} {platform.release()}"


def provenance():
    """Dict with git_sha, date (UTC, ISO 8601), machine, python, tensorflow, keras, horovod versions."""
    try:
        import horovod  # optional: a single-process run works without it

        horovod_version = horovod.__version__
    except ImportError:
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


log = logging.getLogger(__name__)


class RunSummary(keras.callbacks.Callback):
    """Keras callback keeping `<run_dir>/summary.json` up to date (rank 0 writes; every rank keeps it).

    Keys: run_name, run_id (the lineage, `hvd_lars.training.checkpoints`), config, plan (the `Plan`, with its
    resolved settings), world_size, hosts (sorted host names of all ranks), local_size (ranks on
    rank 0's host), cross_size (hosts), global_batch_size, per_rank_batch_size, accumulation_steps,
    threads (the thread settings read back from TensorFlow, `hvd_lars.training.train.applied_threads`),
    resumed_from_step, epochs (list of per-epoch logs with "epoch" counted from 1), images_per_second (mean
    over this attempt's epochs after its first, which includes graph tracing), wall_time_s (training and
    evaluation time, seconds: with a `progress`, summed over the run's segments, each counted up to the
    checkpoint the next resumed from, `hvd_lars.training.epoch_logs`; else this attempt's), segments (the
    starts that trained the run: 1 uninterrupted), final_test_top1 / final_test_top5 (fractions, last
    evaluated epoch), final_val_top1 / final_val_top5 (the same on the validation split; None without
    one), stopped (only when training stopped early: reason "TrainingDiverged" or "Preempted", step,
    message), git_sha, date, machine and software versions.

    Args:
        run_dir: the run directory (its name is the run's name).
        threads: the thread settings read back from TensorFlow, or None.
        job: the training job, or None: its `lineage` (`hvd_lars.training.checkpoints.Lineage`: a resumed
            run keeps the epochs of a summary.json of its own lineage; one of another lineage is moved
            under `earlier_runs/<its run id>/`, with one line saying so) and `progress` (`Progress`: its
            time over segments).
    """

    def __init__(self, run_dir, config, plan, start_step, threads=None, job=None):
        super().__init__()
        lineage, progress = (job.lineage, job.progress) if job is not None else (None, None)
        self.path = os.path.join(run_dir, "summary.json")
        finished_epochs = start_step // plan.steps_per_epoch
        previous = []
        if start_step:
            saved = RunSummary.load(run_dir) or {}
            if saved and lineage is not None and not lineage.owns(saved.get("run_id")):
                saved = self._set_aside(run_dir, saved.get("run_id"))
            previous = [e for e in saved.get("epochs", []) if e["epoch"] <= finished_epochs]
        self.summary = {
            "run_name": os.path.basename(os.path.normpath(run_dir)),
            "run_id": lineage.run_id if lineage is not None else None,
            "config": vars(config),
            "plan": dataclasses.asdict(plan),
            "world_size": plan.world_size,
            # A collective: every rank builds its RunSummary at the same point of the run.
            "hosts": collectives.host_names(),
            "local_size": collectives.local_size(),
            "cross_size": collectives.cross_size(),
            "global_batch_size": plan.global_batch_size,
            "per_rank_batch_size": plan.per_rank_batch_size,
            "accumulation_steps": plan.accumulation_steps,
            "threads": threads,
            "resumed_from_step": start_step,
            "epochs": previous,
            "images_per_second": None,
            "wall_time_s": 0.0,
            "segments": progress.segments if progress is not None else 1,
            "final_test_top1": None,
            "final_test_top5": None,
            "final_val_top1": None,
            "final_val_top5": None,
            # Once per run: rank 0 asks git and reads the machine; the other ranks get its record.
            **collectives.broadcast_object(
                provenance() if collectives.is_chief() else None, name="hvd_lars.training.provenance"
            ),
        }
        self._attempt_epochs = []
        start = time.perf_counter()
        self._wall_time_s = progress.wall_time_s if progress else lambda: time.perf_counter() - start
        self._update()

    def _set_aside(self, run_dir, run_id):
        if collectives.is_chief():
            kept = set_aside([self.path], run_dir, run_id)
            checkpoints.warn(
                f"{self.path} belongs to another run ({run_id or UNRECORDED}): kept in {kept}, and "
                "written anew"
            )
        return {}

    @staticmethod
    def load(run_dir):
        """The summary dict saved in `run_dir` (`read_json`), or None if there is none. A file cut short,
        empty or of another format (not a JSON object with a "plan" object and an "epochs" list) counts as
        none: rank 0 moves it under `<run_dir>/damaged/` with a one-line warning naming it (the epochs it
        held are taken up again from the next epoch's end on; metrics.csv keeps them)."""
        path = os.path.join(run_dir, "summary.json")
        if not os.path.exists(path):
            return None
        try:
            saved = read_json(path)
            problem = None
            if not isinstance(saved, dict) or not isinstance(saved.get("plan"), dict):
                problem = 'not a summary (no "plan" object)'
            elif not isinstance(saved.get("epochs"), list) or not all(
                isinstance(e, dict) and isinstance(e.get("epoch"), int) for e in saved["epochs"]
            ):
                problem = 'not a summary (no "epochs" list of numbered epochs)'
        except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            problem = f"cut short, empty or not JSON ({type(e).__name__}: {e})"
        if problem is None:
            return saved
        if collectives.is_chief():
            kept = checkpoints.keep_damaged(path, run_dir)
            checkpoints.warn(f"{path} is {problem}; kept as {kept}, and written anew")
        return None

    def record_stop(self, reason, step, message):
        """Records why training stopped early under "stopped" ({"reason", "step", "message"}) and writes
        the file (rank 0)."""
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
        steady = rates[1:] or rates
        s["images_per_second"] = sum(steady) / len(steady) if steady else None
        s["wall_time_s"] = self._wall_time_s()
        for split in ("test", "val"):
            evaluated = [e for e in s["epochs"] if f"{split}_top1" in e]
            if evaluated:
                s[f"final_{split}_top1"] = evaluated[-1][f"{split}_top1"]
                s[f"final_{split}_top5"] = evaluated[-1][f"{split}_top5"]
        if collectives.is_chief():
            write = lambda f: json.dump(strict(s), f, indent=2, allow_nan=False)
            faults.write_atomically(self.path, write)

    def finish(self, checkpoint):
        """The end of a run, on every rank (a collective): rank 0 draws `<run_dir>/run.png` (`plot_run`) and
        prints the summary (`describe_end`). A plot that cannot be drawn is one warning line; a plot that
        cannot be written is a failed write (`faults.note`): every rank raises it.

        Args:
            checkpoint: path of the run's last checkpoint (str), or None.

        Raises:
            hvd_lars.training.faults.FileFailure: run.png could not be written (every rank).
        """
        if collectives.is_chief():
            run_dir = os.path.dirname(self.path)
            for line in describe_end(self.summary, run_dir, checkpoint, _draw(run_dir)):
                log.info(line)
        faults.agree(name="hvd_lars.plot_write")


def _draw(run_dir):
    """Writes run.png into `run_dir`; returns its path, or None when it was not written."""
    out = os.path.join(run_dir, "run.png")
    try:
        figure = plot_run.make_figure(run_dir)
    except Exception as e:  # a picture is not worth a finished run: any failure to draw one is a warning
        checkpoints.warn(f"no plot of this run ({type(e).__name__}: {e}); try `hvd-lars-plot {run_dir}`")
        return None
    try:
        plot_run.save(figure, out)
        return out
    except OSError as e:  # the run is complete: a second start trains nothing, hvd-lars-plot draws it
        reason = f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)
        faults.note(
            f"could not write {out}: {reason}. Free space or make it writable there, then draw it with "
            f"`hvd-lars-plot {run_dir}` (the run itself is complete)."
        )
        return None


def describe_end(summary, run_dir, checkpoint, plot):
    """The run's last lines (list of str) from its summary dict: epochs, steps, wall time and images/s; final
    and best test (and validation) top-1/top-5; where the checkpoint, logs and plot are (paths, or None)."""
    plan, epochs = summary["plan"], summary["epochs"]
    rate = summary["images_per_second"]
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
    lines.append(f"checkpoint {checkpoint or 'none written'}")
    lines.append(f"logs {run_dir}/{{summary.json, metrics.csv, tensorboard/}}")
    lines.append(f"plot {plot or 'not written'}")
    return lines


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
        collectives.average_variables(moving_statistics(self.model))
        # With the counts, whether a rank failed to read an evaluation file (`faults.note`).
        counts = [*self._counts(), faults.vote()]
        loss, top1, top5, count, failed = collectives.allreduce_sum(counts, name="hvd_lars.eval_counts")
        if failed:
            faults.raise_noted()
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
                checkpoints.warn(f"{path} is missing; rebuilt with the {len(rows)} epoch(s) of summary.json")
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
        checkpoints.warn(
            f"{self.path} holds {len(foreign)} row(s) of another run ({foreign[0] or UNRECORDED}): kept in "
            f"{kept}; written anew with this run's {len(own)} row(s)"
        )
        return sorted(own, key=lambda r: int(r["epoch"]))

    @staticmethod
    def _rebuilt(path, problem, steps_per_epoch):
        # The damaged file is kept aside; its epochs come back from summary.json beside it, which holds
        # the same epoch logs (its epochs count from 1).
        run_dir = os.path.dirname(os.path.abspath(path))
        kept = checkpoints.keep_damaged(path, run_dir)
        rows = _rows_of_summary(run_dir, steps_per_epoch)
        checkpoints.warn(
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

    With a `lineage`, the event files' names end with its run id (`checkpoints.events_suffix`); files of
    another run found in `log_dir`, or of none, are moved under `<run_dir>/earlier_runs/<their run id>/`
    (one warning).

    Args:
        log_dir: folder of the event files.
        start_step: updates already applied (0 for a fresh run: any scalars there are dropped).
        lineage: the run's `hvd_lars.training.checkpoints.Lineage`, or None.
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
        checkpoints.warn(
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
            saved = checkpoints.keep_damaged(path, run_dir, copy=bool(kept))
            what = f"rewritten with its {len(kept)} complete record(s)" if kept else "left out"
            checkpoints.warn(f"the TensorBoard event file {path} is {problem}; kept as {saved}, {what}")
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
