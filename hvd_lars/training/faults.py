"""Every rank stops together at an update boundary, keeping the last complete checkpoint (docs/faults.md)."""

import contextlib
import fcntl
import logging
import os
import re
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref

import keras
import numpy as np
import tensorflow as tf

from hvd_lars.data.imagenet_preparation import COMMAND
from hvd_lars.parallel import collectives

log = logging.getLogger(__name__)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): stopped at a checkpoint on request, to be started again
EXIT_DIVERGED = 3  # the same flags would diverge again: not a retry
EXIT_HUNG = 4  # no progress for --hang_timeout_s (ProgressWatchdog)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "mpiexec.hydra")  # Open MPI, MPICH, Intel MPI
LOCK_FILE = "running.lock"  # RunDirClaim's, in the run directory
_AGAIN = b"hvd_lars: interrupted again: ending now; the last complete checkpoint is kept.\n"  # 2nd Ctrl-C
_RESUME = "then start the same command again: it resumes from the last complete checkpoint."
_noted = None
_last_progress = time.monotonic()
_CHECKS = weakref.WeakKeyDictionary()  # model -> (ids of its variables, their traced finite check)


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # gone


def _cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def watched():
    """(pid of this process's MPI launcher, pid of the `sh -c` shell above it or None), or None: none."""
    try:
        launcher = _parent(os.getpid())
        if os.path.basename(_cmdline(launcher)[0]) not in MPI_LAUNCHERS:
            return None
        shell = _parent(launcher)
        args = _cmdline(shell)
    except (OSError, IndexError):
        return None
    shelled = args[1:2] == ["-c"] and os.path.basename(args[0]) in ("sh", "dash", "bash")
    return launcher, shell if shelled else None


class StopSignals:
    """In the main thread: `received` names the first `STOP_SIGNALS` or launcher stop; a 2nd SIGINT exits."""

    def __init__(self):
        self.received = self._launcher_stop = self._thread = None
        self._previous = {}

    def _handler(self, signum, frame):
        if self.received is None:
            self.received = self._launcher_stop or signal.Signals(signum).name
        elif signum == signal.SIGINT:
            os.write(2, _AGAIN)  # as is: a signal handler must not wait for the logging module's locks
            os._exit(128 + signal.SIGINT)

    def __enter__(self):
        try:
            self._previous = {s: signal.signal(s, self._handler) for s in STOP_SIGNALS}
        except ValueError:  # not the main thread
            return self
        if (pids := watched()) is not None:
            self._read, self._write = os.pipe()
            os.set_blocking(self._write, False)
            self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
            self._previous[signal.SIGCONT] = signal.signal(signal.SIGCONT, lambda signum, frame: None)
            self._thread = threading.Thread(target=self._watch, args=pids, daemon=True)
            self._thread.start()
        return self

    def _watch(self, launcher, shell):
        woke = time.monotonic()
        while True:
            readable, _, _ = select.select([self._read], [], [], 1.0)
            now, received = time.monotonic(), os.read(self._read, 64) if readable else b"-"
            if not received:
                return  # __exit__ closed the pipe
            if signal.SIGCONT in received and now - woke < 2.0:
                self._launcher_stop = "mpirun is stopping the job"
            elif os.getppid() != launcher or (shell is not None and _parent(launcher) != shell):
                self._launcher_stop = "the launcher is gone"
            else:
                woke = now
                continue
            return os.kill(os.getpid(), signal.SIGTERM)

    def __exit__(self, *exc):
        if self._thread is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._write)  # the thread reads end-of-file and returns
            self._thread.join()
            os.close(self._read)
            self._thread = None
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}


class FileFailure(OSError):
    """A write of the run or a read of its data failed on a rank; the message says which, why, what to do."""


def note(message=None):
    """Keeps `message` as this rank's failure unless one is kept; returns the failure kept, or None."""
    global _noted
    _noted = _noted or message
    return _noted


def write_failure(path, error):
    """The message of a failed write of `path` (an `OSError` or `tf.errors.OpError` `error`)."""
    if getattr(error, "strerror", None):
        reason = f"[Errno {error.errno}] {error.strerror}"
    else:  # TensorFlow's: one line, without the name of its function and op
        reason = re.sub(r"\{\{function_node [^}]*\}\}|\[Op:\w+\]", "", " ".join(str(error).split())).strip()
    fix = "Free space or make it writable there (or choose another --workdir)"
    return f"could not write {path}: {reason}. {fix}, {_RESUME}"


def note_unreadable(path, split):
    """Notes a `split` ("training" or "evaluation") image or record file that cannot be read or decoded."""
    if ".tfrecord" in os.path.basename(path):
        what, fix = "record file", f"Restore it from a copy or prepare the data set again with {COMMAND}"
        skip = "leave out the records it cannot give"
    else:
        what, fix, skip = "image file", "Repair or remove it", "leave such training files out"
    skip = f" (or pass --skip_corrupt to {skip})" if split == "training" else ""
    note(f"cannot read or decode the {split} {what} {path}. {fix}{skip}, {_RESUME}")


def agree(name="hvd_lars.file_failure_vote", counts=()):
    """A collective (a `name` per call site): `counts` summed over ranks; `FileFailure` if any was noted."""
    global _noted
    sums = collectives.allreduce_sum([*counts, _noted is not None], name=name)
    if not sums[-1]:
        return sums[:-1]
    messages = collectives.gather_objects(_noted, name="hvd_lars.file_failure")
    _noted = None
    rank, message = next((r, m) for r, m in enumerate(messages) if m)
    raise FileFailure((f"rank {rank} of {len(messages)}: " if len(messages) > 1 else "") + message)


def write_atomically(path, write):
    """Writes the text file `path` whole through `write(file)`, or leaves it as it was (an OSError noted)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", newline="") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:
        remove_quietly(tmp)
        note(write_failure(path, e))


def remove_quietly(*paths):
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path)


class Stopped(Exception):
    """Training stopped on every rank at update `step`; the message says why and what to do."""

    def __init__(self, message, step):
        super().__init__(message)
        self.step = step


class Preempted(Stopped):
    """A rank was asked to stop; training stopped at update `step`, its checkpoint written."""


class TrainingDiverged(Stopped, RuntimeError):
    """The loss or the variables became non-finite at update `step`."""


class FaultGuard(keras.callbacks.Callback):
    """Every rank, each update: `FileFailure`, `TrainingDiverged`, or `Preempted` (`checkpoint` saved)."""

    def __init__(self, signals, checkpoint, accumulation_steps=1, total_steps=None):
        super().__init__()
        self.signals, self.checkpoint, self.accumulation_steps = signals, checkpoint, accumulation_steps
        self.total_steps = float("inf") if total_steps is None else total_steps
        self._rate = self._pending = None  # _pending: (step, ranks signalled) once the ranks agreed to stop

    def on_train_begin(self, logs=None):
        variables = [*self.model.variables, *self.model.optimizer.variables]
        variables = [v.value for v in variables if "float" in str(v.dtype)]
        key = tuple(id(v) for v in variables)
        if _CHECKS.get(self.model, (None,))[0] != key:
            check = lambda: tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in variables])
            _CHECKS[self.model] = (key, tf.function(check, autograph=False))
        self._finite = _CHECKS[self.model][1]
        self._scaled = isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer)

    def on_train_batch_begin(self, batch, logs=None):
        if (batch + 1) % self.accumulation_steps == 0:
            self._rate = self.model.optimizer.learning_rate  # that of the update this micro-batch applies

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.accumulation_steps:
            return
        loss = None if self._scaled else (logs or {}).get("loss")
        finite = bool(self._finite()) and (loss is None or bool(np.isfinite(float(loss))))
        diverged, signalled = agree("hvd_lars.fault_guard", [not finite, self.signals.received is not None])
        step = int(self.model.optimizer.iterations)
        if diverged:
            rate = float(keras.ops.convert_to_numpy(self._rate))
            self.checkpoint.finish()  # a background write under way completes and is named
            kept = self.checkpoint.manager.latest_checkpoint if collectives.is_chief() else None
            kept = f"the last finite checkpoint, {kept}, is kept" if kept else "no checkpoint was written yet"
            raise TrainingDiverged(
                f"training diverged at step {step} (learning rate {rate:.6g}): non-finite loss or variables "
                f"on {int(diverged)} of {collectives.size()} rank(s); {kept}. Lower --peak_learning_rate "
                "(or --base_learning_rate) or lengthen --warmup_epochs, and train afresh under another "
                "--run_name.",
                step,
            )
        if signalled and not self._pending:
            self._pending = (step, int(signalled))
            if batch + 1 != (self.params or {}).get("steps"):
                self._stop()

    def _stop(self):
        step, signalled = self._pending
        self.checkpoint.save()  # this update's, complete on disk before any rank exits
        self.checkpoint.finish()
        path = self.checkpoint.manager.latest_checkpoint if collectives.is_chief() else "written by rank 0"
        raise Preempted(
            f"preempted: a stop request (SIGTERM, SIGUSR1, Ctrl-C, the launcher's stop) reached {signalled} "
            f"of {collectives.size()} rank(s) (this one: {self.signals.received or 'none'}); stopped at "
            f"step {step}, checkpoint {path}. Start the same command again to resume from step {step} (exit "
            f"status {EXIT_PREEMPTED}: requeue).",
            step,
        )

    def after_epoch(self):
        """The callback to place last: it stops training after an epoch whose last update found a signal."""
        guard = self

        class StopAfterEpoch(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                agree()  # a write of this epoch's logs or checkpoint, a read of its evaluation
                if guard._pending and guard._pending[0] < guard.total_steps:  # else training ends anyway
                    guard._stop()

        return StopAfterEpoch()


def checkpoint_bytes(variables):
    """Bytes the values of `variables` take in a checkpoint: sizes times dtype widths (without its index)."""
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def run_dir_problem(run_dir, needed_bytes):
    """Why training cannot write to `run_dir` (which it creates) or lacks `needed_bytes` there, or None."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir) as f:
            f.write(b"0")
    except OSError as e:
        return f"cannot write the run directory {run_dir}: {e}. Choose a writable --workdir."
    if (free := shutil.disk_usage(run_dir).free) < needed_bytes:
        return (
            f"the run directory {run_dir} has {free / 2**20:.1f} MiB free, but training needs "
            f"{needed_bytes / 2**20:.1f} MiB there for its checkpoints. Free space, lower "
            "--keep_checkpoints, or choose another --workdir."
        )


def check_run_dir(run_dir, checkpoint_size, keep_checkpoints):
    """A collective: `ValueError` where `run_dir` lacks room for `keep_checkpoints` + 1 checkpoints."""
    needed = (keep_checkpoints + 1) * checkpoint_size
    problem = run_dir_problem(run_dir, needed) if collectives.is_chief() else None
    if problem := collectives.broadcast_object(problem, name="hvd_lars.run_dir_check"):
        raise ValueError(problem)


def heartbeat():
    """Records that this rank made progress now; `ProgressWatchdog` measures from the latest."""
    global _last_progress
    _last_progress = time.monotonic()


class ProgressWatchdog(keras.callbacks.Callback):
    """Context manager, callback: `exit(EXIT_HUNG)` after `timeout_s` s (0: never) with no `heartbeat`."""

    def __init__(self, timeout_s, exit=os._exit):
        super().__init__()
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError(f"hang timeout must be >= 0 seconds (0: off), got {timeout_s!r}.")
        self.timeout_s, self._exit, self.fired = timeout_s or 0, exit, False
        self._stop, self._thread = threading.Event(), None

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

    def _watch(self):
        global _last_progress
        period = min(5.0, self.timeout_s / 4)
        woke = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            if now - woke > 2 * period + 1.0:  # this thread did not run either: the process was stopped
                _last_progress += now - woke - period
            if (idle := now - _last_progress) > self.timeout_s:
                break
            woke = now
        else:
            return
        try:
            step = int(self.model.optimizer.iterations)
        except Exception:  # the message must go out whatever the state
            step = "?"
        log.error(
            f"rank {collectives.rank()} of {collectives.size()}: no progress for {idle:.0f} s "
            f"(--hang_timeout_s={self.timeout_s:g}) after update {step}: a peer or its link has gone "
            "silent, or a collective waits for a rank that never comes. Ending this process (exit "
            f"status {EXIT_HUNG}) so that the launcher ends the job; the last complete checkpoint is kept.",
            extra={"every_rank": True},
        )
        self.fired = True
        self._exit(EXIT_HUNG)

    def on_train_batch_end(self, *args, **kwargs):
        heartbeat()

    on_train_begin = on_epoch_begin = on_epoch_end = on_train_batch_end


class RunDirClaim:
    """Context manager, a collective: rank 0 locks `<run_dir>/running.lock`; ValueError: another holds it. A
    start that ends in an exception with nothing of its run written leaves no run directory behind."""

    def __init__(self, run_dir):
        self.run_dir, self._fd = run_dir, None

    def __enter__(self):
        problem = None
        if collectives.is_chief():
            try:
                self._fd = self._take(os.path.join(self.run_dir, LOCK_FILE))
            except ValueError as e:
                problem = str(e)
            except OSError as e:  # no POSIX locks there: an NFSv3 mount without lockd, Lustre without flock
                problem = f"cannot lock the run directory {self.run_dir}: {e}. Choose another --workdir."
        if (problem := collectives.broadcast_object(problem, name="hvd_lars.run_dir_claim")) is not None:
            raise ValueError(problem)
        return self

    def _take(self, path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 1024, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if not isinstance(e, (BlockingIOError, PermissionError)):  # EAGAIN or EACCES: another holds it
                raise
            raise ValueError(
                f"the run directory {self.run_dir} is in use by {holder}: wait for it to end or stop it (a "
                "stopped job resumes with its own command), or train in another directory (--run_name, "
                "--workdir)."
            ) from None
        os.ftruncate(fd, 0)
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.pwrite(fd, f"process {os.getpid()} on host {socket.gethostname()} (started {when})\n".encode(), 0)
        return fd

    def __exit__(self, kind, *_):
        if self._fd is not None:
            with contextlib.suppress(OSError):  # the error that ended the start is the one to report
                if kind is not None and os.listdir(self.run_dir) == [LOCK_FILE]:  # refused before it began
                    os.remove(os.path.join(self.run_dir, LOCK_FILE))
                    os.rmdir(self.run_dir)
            os.close(self._fd)  # releases the lock
            self._fd = None
