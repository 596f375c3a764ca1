"""One job per run directory: while a job trains, rank 0 holds `<run_dir>/running.json`, and a second start
on that directory is refused before it moves, reads or writes anything of the run.

The claim names the host, the process and its start; rank 0 refreshes its modification time every
`HEARTBEAT_S` seconds and removes it when the job ends (also on an error or a pre-emption). A claim whose
holder is gone does not block a restart. It is stale: on the same host (and the same boot), as soon as its
process is gone; from an earlier start of the same Slurm job (a requeue), at once; from another host, once
its file was not refreshed for `STALE_S` seconds, measured against the file system's own clock (a file
written beside it), so hosts' clocks need not agree.

What this relies on, on a network file system shared by several hosts: an exclusive create (`O_EXCL`) and
`rename` that are atomic across clients (NFS v3 and later, Lustre, GPFS, BeeGFS), and modification times
set by the server. A job that is suspended (SIGSTOP, `scontrol suspend`) for longer than `STALE_S` stops
refreshing its claim and may be taken over by a start from another host.
"""

import json
import logging
import os
import socket
import threading
import time

from hvd_lars.parallel import collectives
from hvd_lars.training import faults, file_failures

log = logging.getLogger(__name__)

NAME = "running.json"
# Refresh period of the claim, and the age after which a claim of another host is taken as its job's end:
# 4 missed refreshes (a loaded file server, a slow checkpoint write on the holder's host).
HEARTBEAT_S = 30.0
STALE_S = 4 * HEARTBEAT_S


class RunDirInUse(ValueError):
    """Another live job holds the run directory (one line, exit status 2 from the main program)."""


# The ways training ends on every rank at once, each still able to run a collective.
ENDED_TOGETHER = (faults.Preempted, faults.TrainingDiverged, file_failures.FileFailure)


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
    path = os.path.join(run_dir, NAME)
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
    path = os.path.join(run_dir, NAME)
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
        path = os.path.join(self.run_dir, NAME)
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
