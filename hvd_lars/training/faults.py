"""How training stops: every rank together, at an update boundary, keeping the last complete checkpoint
(docs/faults.md has the table of causes and what each gives).

- `FaultGuard`: a non-finite loss or variable on any rank stops every rank after the same update
  (`TrainingDiverged`, exit status 3); a stop signal (SIGTERM, SIGUSR1, Ctrl-C) or the launcher's end
  (`LauncherWatch`) on any rank stops every rank with a checkpoint of that step (`Preempted`, exit 75);
  a failed write or read (`note`, `FileFailure`) stops every rank with one line (exit 2). The decisions
  are one allreduce per update, so no rank enters a collective that another has left.
- `ProgressWatchdog`: a rank with no progress for `--hang_timeout_s` ends its process (exit 4).
- `RunDirClaim`: one job per run directory (`running.json`, refreshed while the job lives; a holder that
  is gone is taken over).
- `check_run_dir`: the run directory is writable and has room before training.
"""

import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import threading
import time
import weakref

import keras
import numpy as np
import tensorflow as tf

from hvd_lars.data.imagenet_preparation import COMMAND
from hvd_lars.parallel import collectives

# The names Open MPI, MPICH and Intel MPI give the launcher that starts a host's ranks itself.
MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "mpiexec.hydra")
SHELLS = ("sh", "dash", "bash")


def _cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        # The command name (field 2) may hold spaces and parentheses: fields after the last ')'.
        return int(f.read().rsplit(")", 1)[1].split()[1])


def watched(pid=None):
    """(mpirun's pid, the pid of the `sh -c` shell above it or None) when process `pid` (default this one)
    was started by an MPI launcher on this host, else None."""
    try:
        launcher = _parent(pid or os.getpid())
        if os.path.basename(_cmdline(launcher)[0]) not in MPI_LAUNCHERS:
            return None
        shell = _parent(launcher)
        args = _cmdline(shell)
    except (OSError, IndexError, ValueError):
        return None
    if len(args) >= 3 and os.path.basename(args[0]) in SHELLS and args[1] == "-c":
        return launcher, shell
    return launcher, None


class LauncherWatch:
    """Calls `on_stop(reason)` once, from a daemon thread, when this rank's MPI launcher is stopping or gone
    (see the module's docstring); checks every `period_s` seconds. A context manager, entered in the main
    thread (it takes Python's signal wakeup fd while inside)."""

    def __init__(self, on_stop, period_s=1.0):
        self.on_stop = on_stop
        self.period_s = period_s
        self._thread = None

    def __enter__(self):
        pids = watched()
        if pids is None:
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        # A Python handler, so that the signal reaches the wakeup fd; continuing is the kernel's doing.
        self._previous_cont = signal.signal(signal.SIGCONT, lambda signum, frame: None)
        self._thread = threading.Thread(
            target=self._watch, args=pids, name="hvd_lars.launcher_watch", daemon=True
        )
        self._thread.start()
        return self

    def _watch(self, launcher, shell):
        woke = time.monotonic()
        while True:
            readable, _, _ = select.select([self._read], [], [], self.period_s)
            now = time.monotonic()
            if readable:
                received = os.read(self._read, 64)
                if not received:
                    return  # __exit__ closed the pipe
                # Resumed from a stop, this thread was held far past its period; mpirun's SIGCONT finds it
                # on time.
                if signal.SIGCONT in received and now - woke < self.period_s + 1.0:
                    self.on_stop("mpirun is stopping the job")
                    return
            woke = now
            try:
                gone = os.getppid() != launcher or (shell is not None and _parent(launcher) != shell)
            except (OSError, IndexError, ValueError):
                gone = True
            if gone:
                self.on_stop("the launcher is gone")
                return

    def __exit__(self, *exc):
        if self._thread is None:
            return False
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGCONT, self._previous_cont)
        os.close(self._write)  # the thread reads end-of-file and returns
        self._thread.join()
        os.close(self._read)
        self._thread = None
        return False


_RESUME = "then start the same command again: it resumes from the last complete checkpoint."
_noted = None


class FileFailure(OSError):
    """A write of the run or a read of its data failed on some rank; the message names the file, why, and
    what to do."""


def note(message):
    """Keeps `message` (str) as this rank's failure, unless one is kept already (the first one is the
    cause; later ones follow from it)."""
    global _noted
    if _noted is None:
        _noted = message


def noted():
    """This rank's failure message, or None."""
    return _noted


def write_failure(path, error):
    """The message of a failed write of `path` (an `OSError` or `tf.errors.OpError` `error`)."""
    if getattr(error, "strerror", None):
        reason = f"[Errno {error.errno}] {error.strerror}"
    else:  # TensorFlow's: one line, without the name of its function and op
        reason = re.sub(r"\{\{function_node [^}]*\}\}|\[Op:\w+\]", "", " ".join(str(error).split())).strip()
    return (
        f"could not write {path}: {reason}. Free space or make it writable there (or choose another "
        f"--workdir), {_RESUME}"
    )


def note_unreadable(path, split):
    """Notes a `split` ("training" or "evaluation") file at `path` that cannot be read or decoded: an image,
    or a record file of prepared data (tensorflow-datasets' `*.tfrecord-NNNNN-of-NNNNN`) that cannot be
    read to its end."""
    if ".tfrecord" in os.path.basename(path):
        what, fix = "record file", f"Restore it from a copy or prepare the data set again with {COMMAND}"
        skip = " (or pass --skip_corrupt to leave out the records it cannot give)"
    else:
        what, fix = "image file", "Repair or remove it"
        skip = " (or pass --skip_corrupt to leave such training files out)"
    skip = skip if split == "training" else ""
    note(f"cannot read or decode the {split} {what} {path}. {fix}{skip}, {_RESUME}")


def write_atomically(path, write, mode="w"):
    """Writes the file `path` through `write(file)` into `<path>.tmp`, then renames it over `path`, so the
    file is whole or as it was. On an `OSError` the temporary file is removed and the failure noted.

    Returns:
        True when `path` was written.
    """
    tmp = f"{path}.tmp"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"newline": ""})) as f:
            write(f)
        os.replace(tmp, path)
        return True
    except OSError as e:
        remove_quietly(tmp)
        note(write_failure(path, e))
        return False


def remove_quietly(*paths):
    """Removes the files `paths` that exist; a failure to remove one is ignored (it is left behind)."""
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def vote():
    """This rank's vote for an allreduce: 1.0 when it noted a failure, else 0.0."""
    return 0.0 if _noted is None else 1.0


def raise_noted():
    """Raises `FileFailure` on every rank with the failure of the lowest rank that noted one; call it on
    every rank once a vote found one (a collective: one gather). The failure is then forgotten."""
    global _noted
    messages = collectives.gather_objects(_noted, name="hvd_lars.file_failure")
    _noted = None
    rank, message = next((r, m) for r, m in enumerate(messages) if m)
    where = f"rank {rank} of {len(messages)}: " if len(messages) > 1 else ""
    raise FileFailure(where + message)


def agree(name="hvd_lars.file_failure_vote"):
    """A collective: raises `FileFailure` on every rank when any rank noted a failure (`raise_noted`)."""
    if collectives.allreduce_sum([vote()], name=name)[0]:
        raise_noted()


log = logging.getLogger(__name__)

# EX_TEMPFAIL of sysexits.h ("temporary failure; the user is invited to retry"): the job stopped cleanly
# at a checkpoint because it was asked to and should be started again. Not 143 (128 + SIGTERM), which is
# what a process killed by SIGTERM before it could save reports.
EXIT_PREEMPTED = 75
# Training diverged: starting again with the same flags would diverge again; not a retry.
EXIT_DIVERGED = 3
# No progress for --hang_timeout_s: the process ended itself (ProgressWatchdog); restart from the checkpoint
# once the cause (a silent host or link, a hung file system) is gone.
EXIT_HUNG = 4
# The signals that ask training to stop at the next update boundary and checkpoint: a scheduler's or a
# container's stop, Slurm's time-limit warning (launch/slurm/train.sbatch), Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class TrainingDiverged(RuntimeError):
    """The loss or the weights became non-finite; `step` (the update that made them so) and
    `learning_rate` (that update's rate) are attributes."""

    def __init__(self, message, step, learning_rate):
        super().__init__(message)
        self.step = step
        self.learning_rate = learning_rate


class Preempted(Exception):
    """Training stopped at update `step` because a rank received `signal_name`; `checkpoint` is the path of
    the checkpoint rank 0 wrote at that step (None on the other ranks)."""

    def __init__(self, message, step, signal_name, checkpoint):
        super().__init__(message)
        self.step = step
        self.signal_name = signal_name
        self.checkpoint = checkpoint


class StopSignals:
    """Context manager: while inside, SIGTERM, SIGUSR1 and SIGINT are recorded (`received`, the first one's
    name) instead of ending the process, and so is an MPI launcher stopping or gone (`LauncherWatch`); the
    previous handlers come back on exit. A second SIGINT (Ctrl-C pressed again) ends the process at once
    with status 130, keeping the last complete checkpoint. Outside the main thread, where Python cannot
    install handlers, it records nothing and the signals keep their defaults."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = signals
        self.received = None
        self._previous = {}
        self._launcher_stop = None
        self._watch = LauncherWatch(self._on_launcher_stop)

    def _handler(self, signum, frame):
        if self.received is None:
            self.received = self._launcher_stop or signal.Signals(signum).name
        elif signum == signal.SIGINT:
            # Written as is: a signal handler must not wait for the logging module's locks.
            os.write(
                2,
                b"hvd_lars: interrupted again: ending now, without waiting for this update's checkpoint; the "
                b"last complete checkpoint is kept.\n",
            )
            os._exit(128 + signal.SIGINT)

    def _on_launcher_stop(self, reason):
        # As a SIGTERM to this process: whatever waits for one (a test's pause) sees it too.
        self._launcher_stop = reason
        os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self):
        for s in self.signals:
            try:
                self._previous[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread
                break
        if self._previous:  # the watch stops training through the handlers
            self._watch.__enter__()
        return self

    def __exit__(self, *exc):
        self._watch.__exit__(*exc)
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
        return False


# model -> (the ids of the variables checked, their traced check): traced once per model and variable list,
# not at every fit. Tracing the check of ResNet-50's 1,000 variables took 2.5-5 s, paid by every `fit` call
# (each attempt of an elastic job, a loop that fits per epoch: results/archive/fit_overhead.md).
_CHECKS = weakref.WeakKeyDictionary()


def _all_finite(model, variables):
    """A traced function returning True when every value of `variables` (live tf.Variables) is finite;
    the same function for the same model and variables."""
    key = tuple(id(v) for v in variables)
    cached = _CHECKS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]

    @tf.function(autograph=False)
    def check():
        return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in variables])

    _CHECKS[model] = (key, check)
    return check


class FaultGuard(keras.callbacks.Callback):
    """At every update boundary, on every rank: stops training on all ranks when any rank's loss or model
    or optimizer variables (weights, batch-norm statistics, slots) are non-finite (`TrainingDiverged`), or
    when any rank received a stop signal (rank 0 then saves a checkpoint through `checkpoint.save()` and
    every rank raises `Preempted`; at an epoch's last update, after the epoch's own callbacks).

    Batch-norm moving variances overflow first (they hold squared activations): a run diverging at a
    huge rate had infinite moving variances one update before its weights or loss became non-finite.

    Place it before the checkpoint, evaluation and logging callbacks, so that nothing of a diverged update
    is saved, and `after_epoch()` after all of them. Under a `LossScaleOptimizer` the loss is not checked (a
    non-finite scaled loss is how the loss scaler finds overflows; it skips that update), the variables
    are.

    Args:
        signals: `StopSignals` in force while training.
        checkpoint: `hvd_lars.training.checkpoints.PeriodicCheckpoint` (its `save()` is a collective).
        accumulation_steps: micro-batches per update; checks run only at update boundaries.
        total_steps: the run's last update (a signal that arrives during it does not stop a finished run).
    """

    def __init__(self, signals, checkpoint, accumulation_steps=1, total_steps=None):
        super().__init__()
        self.total_steps = float("inf") if total_steps is None else total_steps
        self.signals = signals
        self.checkpoint = checkpoint
        self.accumulation_steps = accumulation_steps
        self._finite = None
        self._rate = None
        self._pending = None  # (step, ranks signalled) once the ranks agreed to stop

    def on_train_begin(self, logs=None):
        # Weights, batch-norm moving statistics and optimizer slots: all of it goes into a checkpoint.
        variables = list(self.model.variables) + list(self.model.optimizer.variables)
        self._finite = _all_finite(self.model, [v.value for v in variables if "float" in str(v.dtype)])
        self._scaled = isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer)

    def _boundary(self, batch):
        return (batch + 1) % self.accumulation_steps == 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._boundary(batch):
            # The rate of the update this micro-batch applies (a schedule's is a function of the counter).
            self._rate = self.model.optimizer.learning_rate

    def on_train_batch_end(self, batch, logs=None):
        if not self._boundary(batch):
            return
        finite = bool(self._finite())
        if not self._scaled and logs and "loss" in logs:
            finite = finite and bool(np.isfinite(float(logs["loss"])))
        # Votes of all ranks: how many saw non-finite values, how many received a stop signal, how many
        # failed to write or read a file (`note`).
        diverged, signalled, failed = collectives.allreduce_sum(
            [0.0 if finite else 1.0, 1.0 if self.signals.received else 0.0, vote()],
            name="hvd_lars.fault_guard",
        )
        if failed:
            raise_noted()
        step = int(self.model.optimizer.iterations)
        if diverged:
            rate = float(keras.ops.convert_to_numpy(self._rate))
            self.checkpoint.finish()  # a background write under way completes and is named
            kept = self.checkpoint.manager.latest_checkpoint if collectives.is_chief() else None
            kept = f"the last finite checkpoint, {kept}, is kept" if kept else "no checkpoint was written yet"
            raise TrainingDiverged(
                f"training diverged at step {step} (learning rate {rate:.6g}): non-finite loss or variables "
                f"on {int(diverged)} of {collectives.size()} rank(s); {kept}. Lower --peak_learning_rate "
                "(or --base_learning_rate) or lengthen --warmup_epochs, and start afresh (--noresume or "
                "another --run_name).",
                step,
                rate,
            )
        if signalled and not self._pending:
            self._pending = (step, int(signalled))
            if batch + 1 != (self.params or {}).get("steps"):
                self._stop()
            # At the epoch's last update: the epoch ends first (evaluation, its checkpoint of this step, its
            # logs), so that the resumed run, which starts with the next epoch, misses none of it; the
            # callback from `after_epoch()` then stops training.

    def _stop(self):
        step, signalled = self._pending
        # This update's checkpoint (already written at an epoch end: save() does not repeat it), complete
        # on disk before any rank exits, also when it is written in the background.
        self.checkpoint.save()
        self.checkpoint.finish()
        path = self.checkpoint.manager.latest_checkpoint if collectives.is_chief() else "written by rank 0"
        name = self.signals.received
        raise Preempted(
            f"preempted: a stop request (SIGTERM, SIGUSR1, Ctrl-C, the launcher's stop) reached {signalled} "
            f"of {collectives.size()} rank(s) (this one: {name or 'none'}); stopped at step {step}, "
            f"checkpoint {path}. Start the same command again to resume from step {step} (exit status "
            f"{EXIT_PREEMPTED}: requeue).",
            step,
            name,
            path,
        )

    def after_epoch(self):
        """The callback to place last (after checkpoints, evaluation and loggers): it stops training at the
        end of an epoch whose last update found a stop signal."""
        guard = self

        class StopAfterEpoch(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                agree()  # a write of this epoch's logs or checkpoint, a read of its evaluation
                # After the last update of the run there is nothing left to resume: training ends normally.
                if guard._pending and guard._pending[0] < guard.total_steps:
                    guard._stop()

        return StopAfterEpoch()


def checkpoint_bytes(variables):
    """Bytes the values of `variables` (Keras or tf variables) take in a checkpoint: their sizes times their
    dtypes' widths (the checkpoint adds an index of a few KiB)."""
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def run_dir_problem(run_dir, needed_bytes):
    """Why training cannot write to `run_dir` (str), or None: it cannot be created, a file cannot be
    written in it, or its file system has fewer than `needed_bytes` (int) free. Creates `run_dir`."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, f".write_test.{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as e:
        return f"cannot write the run directory {run_dir}: {e}. Choose a writable --workdir."
    free = shutil.disk_usage(run_dir).free
    if free < needed_bytes:
        return (
            f"the run directory {run_dir} has {free / 2**20:.1f} MiB free, but training needs "
            f"{needed_bytes / 2**20:.1f} MiB there for its checkpoints. Free space, lower "
            "--keep_checkpoints, or choose another --workdir."
        )
    return None


def check_run_dir(run_dir, checkpoint_size, keep_checkpoints):
    """Refuses to train when rank 0 cannot write `run_dir` or lacks room for `keep_checkpoints` + 1
    checkpoints of `checkpoint_size` bytes (the manager writes a new one before deleting the oldest).

    A collective: rank 0 decides, every rank raises the same error.

    Raises:
        ValueError: naming the path, the free and the needed space.
    """
    needed = (keep_checkpoints + 1) * checkpoint_size
    problem = run_dir_problem(run_dir, needed) if collectives.is_chief() else None
    problem = collectives.broadcast_object(problem, name="hvd_lars.run_dir_check")
    if problem:
        raise ValueError(problem)


_last_progress = time.monotonic()


def heartbeat():
    """Records that this rank made progress now (an update, an evaluation batch, a checkpoint written or
    waited for); `ProgressWatchdog` measures from the latest. Cheap: one clock read."""
    global _last_progress
    _last_progress = time.monotonic()


class ProgressWatchdog(keras.callbacks.Callback):
    """Ends this process when it has made no progress (`heartbeat`) for `timeout_s` seconds.

    Why: when a host or its link goes silent (power, cable, a switch port), its processes send neither
    data nor a reset, and the other ranks wait inside a collective. Open MPI's TCP transport waits for
    the kernel's retransmission limit (about 15 minutes with Linux's tcp_retries2=15) and Horovod's stall
    shutdown cannot act while its background thread is itself blocked in that collective, so the job
    would hang. (Gloo's own timeout, HOROVOD_GLOO_TIMEOUT_SECONDS, ends such a wait by itself.) This
    rank's process exits with `EXIT_HUNG` after a message naming the wait and the last update; its
    launcher then ends the job, and the last complete checkpoint stays.

    Progress is reported by this callback at every training batch's end and epoch boundary, by
    `hvd_lars.training.epoch_logs.ExactEvaluation` at every evaluation batch, and by the checkpoint callback
    around each write, so `timeout_s` must exceed the longest wait of a rank on another's lone work
    outside those: rank 0 listing an image folder, one checkpoint write on a slow disk, the start of a
    new elastic worker.

    Use as a context manager around training (the thread is started on entry and stopped on exit,
    whatever happens), and as a Keras callback in `fit`.

    Time the process spends stopped (SIGSTOP, `scontrol suspend`) is not counted: the watchdog's thread
    notices that it did not run itself for longer than 2 checks + 1 s and discounts that gap.

    Args:
        timeout_s: float seconds > 0, or 0 / None for no watchdog.
        exit: the function called to end the process (default `os._exit`); its argument is `EXIT_HUNG`.
    """

    def __init__(self, timeout_s, exit=os._exit):
        super().__init__()
        if timeout_s is not None and (timeout_s < 0 or timeout_s != timeout_s):
            raise ValueError(f"hang timeout must be >= 0 seconds (0: off), got {timeout_s!r}.")
        self.timeout_s = timeout_s or 0
        self._exit = exit
        self._stop = threading.Event()
        self._thread = None
        self.fired = False

    def __enter__(self):
        heartbeat()
        if self.timeout_s:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="hvd_lars.watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return False

    def _watch(self):
        global _last_progress
        period = min(5.0, self.timeout_s / 4)
        woke = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            if now - woke > 2 * period + 1.0:
                # This thread itself did not run for that long: the whole process was stopped (SIGSTOP,
                # Slurm's `scontrol suspend`, a paused VM), not waiting on a peer. The stopped time is not
                # time without progress (the monotonic clock counts it).
                _last_progress += now - woke - period
            woke = now
            idle = now - _last_progress
            if idle <= self.timeout_s:
                continue
            step = "?"
            try:
                step = int(self.model.optimizer.iterations) if self.model is not None else "?"
            except Exception:  # noqa: BLE001 - the message must go out whatever the state
                pass
            log.error(
                f"rank {collectives.rank()} of {collectives.size()}: no progress for {idle:.0f} s "
                f"(--hang_timeout_s={self.timeout_s:g}) after update {step}: a peer or its link has gone "
                "silent, or a collective waits for a rank that never comes. Ending this process (exit "
                f"status {EXIT_HUNG}) so that the launcher ends the job; the last complete checkpoint is "
                "kept.",
                extra={"every_rank": True},
            )
            self.fired = True
            self._exit(EXIT_HUNG)
            return

    def on_train_begin(self, logs=None):
        heartbeat()

    def on_train_batch_end(self, batch, logs=None):
        heartbeat()

    def on_epoch_begin(self, epoch, logs=None):
        heartbeat()

    def on_epoch_end(self, epoch, logs=None):
        heartbeat()


log = logging.getLogger(__name__)

CLAIM_FILE = "running.json"
# Refresh period of the claim, and the age after which a claim of another host is taken as its job's end:
# 4 missed refreshes (a loaded file server, a slow checkpoint write on the holder's host).
HEARTBEAT_S = 30.0
STALE_S = 4 * HEARTBEAT_S


class RunDirInUse(ValueError):
    """Another live job holds the run directory (one line, exit status 2 from the main program)."""


# The ways training ends on every rank at once, each still able to run a collective.
ENDED_TOGETHER = (Preempted, TrainingDiverged, FileFailure)


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid):
    """The start time of process `pid` in clock ticks since boot (Linux), or None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def holder():
    """This process as a claim records it (with the Slurm job and restart it runs in, if any)."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "pid": pid,
        "process_start": _process_start(pid),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
    }


def _file_system_now(run_dir):
    """The file system's current time, as the modification time of a file written in `run_dir` now."""
    probe = os.path.join(run_dir, f".clock.{os.getpid()}")
    with open(probe, "w"):
        pass
    try:
        return os.stat(probe).st_mtime
    finally:
        os.remove(probe)


def why_stale(claim, age_s):
    """Why the holder of `claim` (a dict as `holder()` makes it) whose file was last refreshed `age_s`
    seconds ago is gone, or None where it may still run."""
    me = holder()
    here = claim.get("host") == me["host"] and claim.get("boot") == me["boot"]
    if here and _process_start(claim.get("pid")) != claim.get("process_start"):
        return "its process is gone"
    # Slurm starts a requeued job only once every process of its earlier start has ended.
    if me["slurm_job"] and claim.get("slurm_job") == me["slurm_job"]:
        if claim.get("slurm_restart") != me["slurm_restart"]:
            return f"it was an earlier start (restart {claim.get('slurm_restart')}) of this Slurm job"
    if age_s > STALE_S:
        return f"its claim was last refreshed {age_s:.0f} s ago (every {HEARTBEAT_S:.0f} s while it runs)"
    return None


def _describe(claim):
    return f"process {claim.get('pid')} on host {claim.get('host')} (started {claim.get('started')})"


def take(run_dir):
    """Claims `run_dir` (str) for this process; returns the line to print when a stale claim was taken over,
    else None.

    Raises:
        RunDirInUse: a live job holds it, naming its host and process and what to do.
        OSError: the claim cannot be written.
    """
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CLAIM_FILE)
    mine = json.dumps(holder())
    taken_over = None
    for _ in range(3):  # another start may take over or claim between the reads below
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(mine)
            return taken_over
        try:
            with open(path) as f:
                text = f.read()
            age = _file_system_now(run_dir) - os.stat(path).st_mtime
        except FileNotFoundError:
            continue  # its holder just ended
        try:
            claim = json.loads(text)
        except ValueError:
            claim = {}  # being written, or cut short by a crash: stale once it is not refreshed
        reason = why_stale(claim, age)
        if reason is None:
            raise RunDirInUse(
                f"the run directory {run_dir} is in use by {_describe(claim)}: it holds {path}. Wait for "
                "that job to end or stop it (a stopped job resumes with its own command), or train in "
                "another directory (--run_name, --workdir)."
            )
        # Set aside under a name of this process's own, then check it is still the claim judged stale.
        aside = f"{path}.stale.{os.getpid()}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        with open(aside) as f:
            if f.read() != text:  # another start claimed it meanwhile: give it back
                os.rename(aside, path)
                continue
        os.remove(aside)
        was = _describe(claim) if claim else "an earlier job"
        taken_over = f"took over the run directory {run_dir} from {was}: {reason}."
    raise RunDirInUse(f"the run directory {run_dir} is claimed and released by other starts meanwhile")


def release(run_dir):
    """Removes this process's claim of `run_dir`, if it still holds it."""
    path = os.path.join(run_dir, CLAIM_FILE)
    try:
        with open(path) as f:
            claim = json.load(f)
        if claim.get("pid") == os.getpid() and claim.get("host") == socket.gethostname():
            os.remove(path)
    except (OSError, ValueError):
        pass


class RunDirClaim:
    """Context manager, on every rank: rank 0 claims `run_dir` (`take`) and refreshes the claim while inside;
    every rank raises rank 0's refusal. A collective on entry.

    Raises:
        RunDirInUse: on every rank, when another live job holds the directory.
    """

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        outcome = None
        if collectives.is_chief():
            try:
                line = take(self.run_dir)
                if line:
                    log.info(line)
            except (RunDirInUse, OSError) as e:
                outcome = str(e)
        outcome = collectives.broadcast_object(outcome, name="hvd_lars.run_dir_claim")
        if outcome is not None:
            raise RunDirInUse(outcome)
        if collectives.is_chief():
            self._thread = threading.Thread(target=self._refresh, name="hvd_lars.claim", daemon=True)
            self._thread.start()
        return self

    def _refresh(self):
        path = os.path.join(self.run_dir, CLAIM_FILE)
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(path)
            except OSError:
                pass  # a full or lost disk: the run's own writes report it

    def __exit__(self, exc_type, exc, tb):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            release(self.run_dir)
        if exc_type is None or issubclass(exc_type, ENDED_TOGETHER):
            # No rank exits before the claim is gone: a launcher that kills the others when one exits
            # (srun --kill-on-bad-exit, after a pre-emption's status 75) would leave it behind.
            collectives.barrier()
        return False
