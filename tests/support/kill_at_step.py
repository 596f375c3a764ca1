"""The main program with the faults of the flags below injected, for the resume and fault tests (each fault's
class says what it does). KILL is a crash or a dying host (no clean-up); TERM and USR1 are Slurm's pre-emption
and its warning before the time limit. The faults run right after the checkpoint callback's own batch end, so
a checkpoint due at that update (a background write included) is complete before a signal.

Usage: python tests/support/kill_at_step.py [FAULT FLAGS] [every flag of python -m hvd_lars.main]
"""

import functools
import os
import signal
import threading
import time

import keras
from absl import flags

from hvd_lars import main
from hvd_lars.parallel import collectives
from hvd_lars.training import checkpoints, faults, train

flags.DEFINE_integer("kill_at_step", 0, "Signal this process once this many updates are applied (0: never).")
flags.DEFINE_enum("kill_signal", "KILL", ["KILL", "TERM", "USR1"], "The signal sent.")
flags.DEFINE_integer("kill_rank", -1, "Only this rank signals itself (-1: every rank).")
flags.DEFINE_string("kill_record", "", "File that receives the time (time.time()) of the signal.")
flags.DEFINE_integer("pause_at_step", 0, "Pause every rank after this update (0: never); see PauseAtStep.")
flags.DEFINE_string("pause_marker", "", "The pause writes <this>.rank<r> once it has begun.")
flags.DEFINE_string("pause_until", "", "The pause also ends when this file exists.")
flags.DEFINE_list("stop_schedule", [], "STEP:SIGNAL:RANK stops; each start takes the next (ScheduledStop).")
flags.DEFINE_string("stop_record", "", "--stop_schedule: FILE.rank<r> lists the stops taken.")
flags.DEFINE_integer("fill_disk_at_step", 0, "Rank 0 fills --workdir's disk after this update (0: never).")


class FillDisk(keras.callbacks.Callback):
    """After update `step`, writes the file `path` until its file system is full (as a disk that other
    programs fill while training runs)."""

    def __init__(self, step, path):
        super().__init__()
        self.step, self.path = step, path

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) == self.step:
            with open(self.path, "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 2**16)
                except OSError:
                    pass


class KillAtStep(keras.callbacks.Callback):
    """Sends `signum` to this process at the end of the batch whose update brings the optimizer to `step`
    updates (with gradient accumulation: the micro-batch that applies it), once."""

    def __init__(self, step, signum=signal.SIGKILL, record=""):
        super().__init__()
        self.step, self.signum, self.record, self._sent = step, signum, record, False

    def on_train_batch_end(self, batch, logs=None):
        if not self._sent and int(self.model.optimizer.iterations) >= self.step:
            self._sent = True
            for checkpointer in _checkpointers:
                checkpointer.manager.sync()  # rank 0's background write done
            if self.record:
                with open(self.record, "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getpid(), self.signum)


class ScheduledStop(KillAtStep):
    """The first stop of `schedule` ([(step, signum, rank)]) that no earlier start took (`record`.rank<r>
    lists them) and that comes after the update this start resumed from, by the rank it names (-1: every
    rank); none when none is left. Every rank keeps its own record, so all choose the same stop."""

    def __init__(self, schedule, record):
        super().__init__(step=None)
        self.schedule = schedule
        self.path = f"{record}.rank{collectives.init()[0]}"

    def on_train_begin(self, logs=None):
        if self.step is not None:
            return  # chosen at this process's first fit
        taken = open(self.path).read().split() if os.path.exists(self.path) else []
        start = int(self.model.optimizer.iterations)
        left = [(k, stop) for k, stop in enumerate(self.schedule) if str(k) not in taken and stop[0] > start]
        if not left:
            self.step, self._sent = float("inf"), True
            return
        k, (self.step, self.signum, rank) = left[0]
        self._sent = rank not in (-1, collectives.rank())
        with open(self.path, "a") as f:
            f.write(f"{k}\n")


class PauseAtStep(keras.callbacks.Callback):
    """After update `step` (the batch that brings the optimizer's counter to exactly `step`), writes
    `marker`.rank<r> (when given) and waits until this process receives a stop signal (SIGTERM, SIGUSR1)
    or the file `until` exists. The signal is passed on to the handler in force (the training's
    `faults.StopSignals`), so training then stops at the next update boundary as it would have anyway."""

    def __init__(self, step, marker="", until="", limit_s=600.0):
        super().__init__()
        self.step, self.marker, self.until, self.limit_s = step, marker, until, limit_s

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) != self.step or getattr(self, "_done", False):
            return
        self._done = True
        got = threading.Event()
        previous = {}

        def handler(signum, frame):
            got.set()
            before = previous[signum]
            if callable(before):
                before(signum, frame)

        for s in faults.STOP_SIGNALS:
            previous[s] = signal.signal(s, handler)
        try:
            if self.marker:
                path = f"{self.marker}.rank{collectives.rank()}"
                with open(path + ".tmp", "w") as f:
                    f.write(f"{self.step}\n")
                os.replace(path + ".tmp", path)  # the marker appears complete
            deadline = time.monotonic() + self.limit_s
            while not got.is_set() and not (self.until and os.path.exists(self.until)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"paused after update {self.step} for {self.limit_s} s: no signal")
                faults.heartbeat()  # a pause is not a hang (--hang_timeout_s)
                got.wait(0.05)
        finally:
            for s, before in previous.items():
                signal.signal(s, before)


_checkpointers = []
_faults = []  # the faults of this process, run after the checkpoint callback's batch end


class _RecordedPeriodicCheckpoint(checkpoints.PeriodicCheckpoint):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _checkpointers.append(self)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        for fault in _faults:
            fault.set_model(self.model)
            fault.on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        for fault in _faults:
            fault.on_train_batch_end(batch, logs)


def _run_with_fault(config, extra_callbacks=(), run=None):
    f = flags.FLAGS
    if f.kill_at_step and f.kill_rank in (-1, collectives.init()[0]):
        _faults.append(KillAtStep(f.kill_at_step, getattr(signal, f"SIG{f.kill_signal}"), f.kill_record))
    if f.stop_schedule:
        stops = [entry.split(":") for entry in f.stop_schedule]  # STEP:SIGNAL:RANK
        stops = [(int(step), getattr(signal, f"SIG{name}"), int(rank)) for step, name, rank in stops]
        _faults.append(ScheduledStop(stops, f.stop_record))
    if f.pause_at_step:
        _faults.append(PauseAtStep(f.pause_at_step, f.pause_marker, f.pause_until))
    if f.fill_disk_at_step and collectives.init()[0] == 0:
        _faults.append(FillDisk(f.fill_disk_at_step, os.path.join(config.workdir, "filler")))
    return run(config, extra_callbacks=extra_callbacks)


if __name__ == "__main__":
    # The main program looks both up when it runs, so it picks up the faulty ones.
    main.run_training = functools.partial(_run_with_fault, run=main.run_training)
    train.PeriodicCheckpoint = _RecordedPeriodicCheckpoint
    main.main()
