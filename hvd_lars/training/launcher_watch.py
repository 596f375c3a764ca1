"""Noticing that the launcher above a rank is stopping or gone, so that the rank stops as on SIGTERM.

Two gaps between a signal to the job's launcher and its ranks, under Open MPI 4.1 (checked with 4.1.4) and
Horovod 0.28.1:
- `horovodrun` replaces itself with `/bin/sh -c 'mpirun ...'`, and Debian's dash keeps that shell as
  mpirun's parent. A SIGTERM to the process the user started (horovodrun, `make train`, a launch script,
  `timeout`) ends only the shell; mpirun, re-parented, and the ranks train on. So a rank acts when its
  mpirun is gone, or when mpirun was started by a `sh -c` (a shell running one command) and that shell is
  gone. An interactive shell or a script above mpirun is not watched: `nohup ... &` outlives its terminal
  on purpose.
- mpirun, on SIGTERM or SIGINT, sends its ranks SIGCONT, waits `odls_base_sigkill_timeout` seconds
  (default 1), sends SIGTERM, waits again and sends SIGKILL: a rank whose update and checkpoint take
  longer than that is killed before its checkpoint. So a SIGCONT that reaches a running rank (not one
  resumed from a stop: Slurm's suspend, Ctrl-Z) is taken as the start of that sequence, and the stop
  begins at once. launch/env.sh and the Makefile raise the timeout to give the checkpoint time.
Linux only (reads /proc); elsewhere, or outside an MPI launcher, nothing is watched.
"""

import os
import select
import signal
import threading
import time

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
