"""What a run records and says each epoch and at its end: summary.json, metrics.csv, tensorboard/, lines."""

import csv
import dataclasses
import datetime
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from hvd_lars.arguments import counted
from hvd_lars.metrics import top_k_correct
from hvd_lars.parallel import collectives
from hvd_lars.training import faults, plot_run
from hvd_lars.training.checkpoints import moving_statistics, read_json, strict

log = logging.getLogger(__name__)
KEY = "progress/.ATTRIBUTES/VARIABLE_VALUE"  # the record, as tf.train.Checkpoint(progress=variable) saves it


def git_sha(path=None):
    """The commit of the checkout of `path` (default: this package), "-dirty" if changed, or "unknown"."""
    git = ["git", "-C", path or os.path.dirname(os.path.abspath(__file__))]
    run = lambda *a: subprocess.run([*git, *a], capture_output=True, text=True, check=True, timeout=10).stdout
    try:
        sha, dirty = run("rev-parse", "HEAD"), run("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha.strip() + ("-dirty" if dirty.strip() else "")


def cpuinfo(path="/proc/cpuinfo"):
    """The first processor's fields of /proc/cpuinfo as {name: value}; {} where it cannot be read."""
    try:
        with open(path) as f:
            first = f.read().strip().split("\n\n")[0]
    except OSError:
        return {}
    return {name.strip(): value.strip() for name, _, value in (s.partition(":") for s in first.splitlines())}


def machine():
    """This machine in one line: CPU model, logical cores, memory, OS."""
    cpu = cpuinfo().get("model name") or platform.processor() or platform.machine()
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} logical cores, {gib:.0f} GiB, {platform.system()} {platform.release()}"


def provenance():
    """Dict with git_sha, date (UTC, ISO 8601), machine, python, tensorflow, keras, horovod versions."""
    try:
        from horovod import __version__ as horovod
    except ImportError:  # a single-process run needs no Horovod
        horovod = None
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    versions = dict(python=platform.python_version(), tensorflow=tf.__version__, keras=keras.__version__)
    return {"git_sha": git_sha(), "date": date, "machine": machine(), **versions, "horovod": horovod}


def _unreadable(path, error):
    if collectives.is_chief():
        os.replace(path, f"{path}.unreadable")
        log.warning(f"{path} cannot be read ({type(error).__name__}: {error}); renamed {path}.unreadable")


class RunSummary(keras.callbacks.Callback):
    """`<run_dir>/summary.json` (docs/training.md), written each epoch; a resumed run keeps earlier epochs."""

    def __init__(self, run_dir, config, plan, start_step, threads=None, progress=None):
        super().__init__()
        self.path, self.progress = os.path.join(run_dir, "summary.json"), progress or Progress(plan)
        saved = (RunSummary.load(run_dir) or {}) if start_step else {}
        finished, self._rates = start_step // plan.steps_per_epoch, []  # images/s of this start's epochs
        sizes = ("world_size", "global_batch_size", "per_rank_batch_size", "accumulation_steps")
        self.summary = {
            "run_name": os.path.basename(os.path.normpath(run_dir)),
            "config": vars(config),
            "plan": dataclasses.asdict(plan),
            **{name: getattr(plan, name) for name in sizes},
            # A collective, at the same point on every rank: the distinct host names of all ranks.
            "hosts": sorted(set(collectives.gather_objects(socket.gethostname(), "hvd_lars.host_names"))),
            "local_size": collectives.local_size(),
            "cross_size": collectives.cross_size(),
            "threads": threads,
            "resumed_from_step": start_step,
            "epochs": [e for e in saved.get("epochs", []) if e["epoch"] <= finished],
            "images_per_second": None,
            "wall_time_s": 0.0,
            **{f"final_{split}_top{k}": None for split in ("test", "val") for k in (1, 5)},
            **collectives.broadcast_object(collectives.is_chief() and provenance(), name="provenance"),
        }
        self._update()

    @staticmethod
    def load(run_dir):
        """The summary dict saved in `run_dir`, or None: there is none, or it cannot be read (renamed)."""
        path = os.path.join(run_dir, "summary.json")
        try:
            saved = read_json(path) if os.path.exists(path) else None
            return saved if saved is None else {**saved, "epochs": list(saved["epochs"])}
        except (OSError, ValueError, TypeError, KeyError) as e:  # not JSON, or no object with an epochs list
            _unreadable(path, e)

    def record_stop(self, reason, step, message):
        self.summary["stopped"] = {"reason": reason, "step": step, "message": message}
        self._update()

    def on_epoch_end(self, epoch, logs=None):
        entry = {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()}}
        self._rates += [entry["images_per_second"]] if "images_per_second" in entry else []
        self.summary["epochs"] = [e for e in self.summary["epochs"] if e["epoch"] != entry["epoch"]] + [entry]
        self._update()

    def _update(self):
        self.steady = len(self._rates) > 1  # a start's first epoch includes tracing: left out if others
        s, rates = self.summary, self._rates[1:] if self.steady else self._rates
        s["images_per_second"] = sum(rates) / len(rates) if rates else None
        s["wall_time_s"] = self.progress.wall_time_s()
        for key in (f"{split}_top{k}" for split in ("test", "val") for k in (1, 5)):
            s[f"final_{key}"] = next((e[key] for e in reversed(s["epochs"]) if key in e), None)
        if collectives.is_chief():
            faults.write_atomically(self.path, lambda f: json.dump(strict(s), f, indent=2, allow_nan=False))

    def finish(self, checkpoint):
        """A collective: rank 0 plots the run and logs its last lines; raises `faults.FileFailure`."""
        if collectives.is_chief():
            run_dir = os.path.dirname(self.path)
            try:
                plot = plot_run.plot_run(run_dir)
            except Exception as e:  # a picture is not worth a finished run
                log.warning(f"no plot of this run ({type(e).__name__}: {e}); try `hvd-lars-plot {run_dir}`")
                plot = None
            for line in _end_lines(self.summary, run_dir, checkpoint, plot, self.steady):
                log.info(line)
        faults.agree(name="hvd_lars.summary_write")


def _end_lines(s, run_dir, checkpoint, plot, steady=True):
    epochs, rate, plan = s["epochs"], s["images_per_second"], s["plan"]
    over = "this start's epochs after its first" if steady else "this start's one epoch, tracing included"
    done = epochs[-1]["epoch"] if epochs else 0
    lines = [
        f"finished {s['run_name']}: {done} of {counted(plan['epochs'], 'epoch')} "
        f"({counted(plan['total_steps'], 'step')}) in {s['wall_time_s']:.0f} s, "
        + (f"{rate:.0f} images/s ({over})" if rate else "images/s not measured")
    ]
    for split, name in (("test", "test"), ("val", "validation")):
        done = [(e[f"{split}_top1"], e[f"{split}_top5"], e["epoch"]) for e in epochs if f"{split}_top1" in e]
        if done:
            (top1, top5, _), best, best5 = done[-1], max(done, key=lambda d: d[0]), max(d[1] for d in done)
            lines.append(
                f"final {name} top-1 {top1:.4f} (best {best[0]:.4f}, epoch {best[2]}), top-5 {top5:.4f} "
                f"(best {best5:.4f})"
            )
        elif split == "test":
            lines.append("final test top-1 not evaluated")
    logs = f"logs {run_dir}/{{summary.json, metrics.csv, tensorboard/}}"
    return [*lines, f"checkpoint {checkpoint or 'none written'}", logs, f"plot {plot or 'not written'}"]


class ExactEvaluation(keras.callbacks.Callback):
    """Adds `<prefix>_loss`, `_top1`, `_top5` of all ranks every `every_epochs` and at `last_epoch`."""

    def __init__(self, dataset, num_examples, every_epochs=1, last_epoch=None, prefix="test"):
        super().__init__()
        self.dataset, self.num_examples, self.prefix = dataset, num_examples, prefix
        self.every_epochs, self.last_epoch = every_epochs, last_epoch

    @tf.function(reduce_retracing=True)
    def _counts(self, images, labels):
        logits, labels = tf.cast(self.model(images, training=False), tf.float32), tf.cast(labels, tf.int32)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        top = [tf.cast(top_k_correct(labels, logits, k), tf.float32) for k in (1, 5)]
        return tf.stack([tf.reduce_sum(loss), *map(tf.reduce_sum, top), tf.cast(tf.size(labels), tf.float32)])

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 != self.last_epoch and (epoch + 1) % self.every_epochs:
            return
        collectives.average_variables(moving_statistics(self.model))
        total = np.zeros(4)
        for images, labels in self.dataset:
            total += self._counts(images, labels).numpy()
            faults.heartbeat()
        *sums, count = faults.agree("hvd_lars.eval_counts", total)
        if int(count) != self.num_examples:
            raise RuntimeError(f"ranks evaluated {count:.0f} {self.prefix} images, not {self.num_examples}.")
        for name, value in zip(("loss", "top1", "top5"), sums):
            logs[f"{self.prefix}_{name}"] = value / count


class Progress(keras.callbacks.Callback):
    """A checkpoint's `variable`: metric sums, run time; adds `epoch_time_s`, `images_per_second` to logs."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan
        self.variable = tf.Variable("", dtype=tf.string, trainable=False, name="progress")
        self.restored, self._pending, self._begun = {}, None, time.perf_counter()

    def resume(self, prefix):
        """Rank 0 reads checkpoint `prefix`'s record (None: a fresh start) for every rank (a collective)."""
        record = {}
        if collectives.is_chief() and prefix:
            reader = tf.train.load_checkpoint(prefix)
            record = json.loads(reader.get_tensor(KEY).decode() or "{}") if reader.has_tensor(KEY) else {}
        self.restored = collectives.broadcast_object(record, name="hvd_lars.progress.resume")
        self._begun = time.perf_counter()

    def wall_time_s(self):
        """Seconds of training and evaluation over the run's starts, each up to the checkpoint resumed."""
        return self.restored.get("wall_time_s", 0.0) + time.perf_counter() - self._begun

    def capture(self):
        """Puts the record of now into `variable` (every rank: a collective)."""
        sums = [float(keras.ops.convert_to_numpy(v)) for v in self.model.metrics_variables]
        mean = collectives.allreduce_sum(sums, name="hvd_lars.progress") / collectives.size()
        step, time_s = int(self.model.optimizer.iterations), self.wall_time_s()
        self.variable.assign(json.dumps({"step": step, "metric_sums": mean.tolist(), "wall_time_s": time_s}))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_began, self._batches = time.perf_counter(), 0
        step, sums = int(self.model.optimizer.iterations), self.restored.pop("metric_sums", None)
        if sums and step % self.plan.steps_per_epoch and step == self.restored.get("step"):
            self._pending = sums

    def on_train_batch_end(self, batch, logs=None):
        sums, variables, self._pending = self._pending or [], self.model.metrics_variables, None
        for variable, value in zip(variables, sums if len(sums) == len(variables) else []):
            variable.assign_add(value)
        self._batches += 1

    def on_epoch_end(self, epoch, logs=None):
        elapsed, images = time.perf_counter() - self._epoch_began, self._batches * self.plan.global_batch_size
        logs.update(images_per_second=images / self.plan.accumulation_steps / elapsed, epoch_time_s=elapsed)


class MetricsCSV(keras.callbacks.Callback):
    """`metrics.csv`: a row per epoch; a resumed run keeps the rows up to `start_step`, renames unreadable."""

    def __init__(self, path, start_step=0):
        super().__init__()
        self.path, self.rows = path, []
        try:
            with open(path) as f:
                text = f.read()
            if not text.endswith("\n"):  # written whole, it ends with its last row's line end
                raise ValueError("empty or cut short")
            rows = [{k: v for k, v in row.items() if k and v} for row in csv.DictReader(text.splitlines())]
            self.rows = [row for row in rows if int(row["epoch"]) >= 0 and int(row["step"]) <= start_step]
        except (OSError, ValueError, KeyError) as e:  # UnicodeDecodeError is a ValueError
            if os.path.exists(path):
                _unreadable(path, e)

    def on_epoch_end(self, epoch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        row = {"epoch": epoch, "step": step, **{k: float(v) for k, v in (logs or {}).items()}}
        self.rows = [r for r in self.rows if int(r["epoch"]) != epoch] + [row]
        keys = ["epoch", "step", *sorted({k for r in self.rows for k in r} - {"epoch", "step"})]
        lines = [keys, *([r.get(k, "") for k in keys] for r in self.rows)]
        faults.write_atomically(self.path, lambda f: csv.writer(f).writerows(lines))


class TensorBoardScalars(keras.callbacks.Callback):
    """Scalars in `log_dir`: each epoch-log key (and `epoch`, from 1) at the epoch's last update."""

    def __init__(self, log_dir):
        super().__init__()
        self.log_dir, self._writer = log_dir, None

    def on_epoch_end(self, epoch, logs=None):
        try:
            self._writer = self._writer or tf.summary.create_file_writer(self.log_dir)
            with self._writer.as_default(step=int(self.model.optimizer.iterations)):
                for key, value in sorted({"epoch": epoch + 1, **(logs or {})}.items()):
                    tf.summary.scalar(key, float(value))
            self._writer.flush()
        except (OSError, tf.errors.OpError) as e:
            faults.note(faults.write_failure(self.log_dir, e))


class EpochProgress(keras.callbacks.ProgbarLogger):
    """Rank 0's lines (docs/training.md): progress every `every_s` seconds (0: each batch; None: never)."""

    def __init__(self, epochs, batches_per_epoch, images_per_batch=0, every_s=None, clock=time.monotonic):
        super().__init__()
        self.run_epochs, self.batches_per_epoch = epochs, batches_per_epoch
        self.images_per_batch, self.every_s, self.clock = images_per_batch, every_s, clock

    def set_params(self, params):
        super().set_params({**params, "verbose": 2})  # lines, never Keras's bar
        self.epochs, self.target = self.run_epochs, self.batches_per_epoch
        self._done = self.batches_per_epoch - (params.get("steps") or self.batches_per_epoch)

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._began = self._last = (self.clock(), self._done)  # (clock, micro-batches done)

    def _update_progbar(self, batch, logs=None):
        super()._update_progbar(batch + self._done, logs)
        (then, before), done, now = self._last, batch + self._done + 1, self.clock()
        if self.every_s is None or now - then < self.every_s or done in (before, self.batches_per_epoch):
            return
        self._last, per_second = (now, done), (done - before) / max(now - then, 1e-9)
        left = _duration((self.batches_per_epoch - done) / per_second)
        x = float((logs or {}).get("loss", "nan"))  # written as Keras's epoch line writes it
        loss = f"{x:.4f}" if x > 1e-3 else f"{x:.4e}"
        rate = f"{now - self._began[0]:.0f}s - {per_second * self.images_per_batch:.0f} images/s"
        sys.stdout.write(f"{done}/{self.batches_per_epoch} - {rate} - loss: {loss} - {left} left\n")
        sys.stdout.flush()  # one write of the whole line: a launcher's pipe prefixes each piece it reads


def _duration(seconds):
    """42 -> '42s', 90 -> '1:30', 3725 -> '1:02:05' (as Keras's progress bar writes its ETA)."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}" if m else f"{s}s"
