"""summary.json of a run: flags, plan, provenance and per-epoch metrics, rewritten after every epoch, and
the run's last lines (the summary printed and the plot `run.png` written at its end).

Written by rank 0 only, atomically (temporary file + rename), so a killed job leaves the summary of its
last finished epoch; a resumed run keeps the epochs the interrupted one finished and appends its own.

The file is strict JSON (`lineage.strict`: a non-finite number, such as the loss of a diverged run, is
written as the string "NaN", "Infinity" or "-Infinity"); read it with `lineage.read_json`.
"""

import dataclasses
import datetime
import json
import logging
import os
import platform
import subprocess
import time

import keras
import tensorflow as tf

from hvd_lars.parallel import collectives
from hvd_lars.training import faults, lineage, plot_run
from hvd_lars.training.lineage import UNRECORDED, read_json, set_aside, strict


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


def record():
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

    Keys: run_name, run_id (the lineage, `hvd_lars.training.lineage`), config, plan (the `Plan`, with its
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
        progress: the run's `hvd_lars.training.epoch_logs.Progress` (its time over segments), or None.
        lineage: the run's `hvd_lars.training.lineage.Lineage`, or None (no run id). A resumed run keeps the
            epochs of a summary.json of its own lineage; one of another lineage is moved under
            `earlier_runs/<its run id>/`, with one line saying so.
    """

    def __init__(
        self, run_dir, run_name, config, plan, start_step, threads=None, lineage=None, progress=None
    ):
        super().__init__()
        self.path = os.path.join(run_dir, "summary.json")
        finished_epochs = start_step // plan.steps_per_epoch
        previous = []
        if start_step:
            saved = RunSummary.load(run_dir) or {}
            if saved and lineage is not None and not lineage.owns(saved.get("run_id")):
                saved = self._set_aside(run_dir, saved.get("run_id"))
            previous = [e for e in saved.get("epochs", []) if e["epoch"] <= finished_epochs]
        self.summary = {
            "run_name": run_name,
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
                record() if collectives.is_chief() else None, name="hvd_lars.training.provenance"
            ),
        }
        self._attempt_epochs = []
        start = time.perf_counter()
        self._wall_time_s = progress.wall_time_s if progress else lambda: time.perf_counter() - start
        self._update()

    def _set_aside(self, run_dir, run_id):
        if collectives.is_chief():
            kept = set_aside([self.path], run_dir, run_id)
            lineage.warn(
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
            kept = lineage.keep_damaged(path, run_dir)
            lineage.warn(f"{path} is {problem}; kept as {kept}, and written anew")
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
        cannot be written is a failed write (`file_failures`): every rank raises it.

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
        lineage.warn(f"no plot of this run ({type(e).__name__}: {e}); try `hvd-lars-plot {run_dir}`")
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
