"""One job per run directory: rank 0 holds a kernel lock on `<run_dir>/running.lock`: a second start on a live
run is refused on every rank, and a holder that ends in any way (SIGKILL included) leaves the lock free."""

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.support import REPO
from tests.support.main_server import run_main, shared
from tests.support.small_runs import KILLER

HOST = re.escape(socket.gethostname())
STARTED = r"\(started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+\)"
# flags/smoke.flags: 1 epoch of 4 updates (warmup 2), a checkpoint every 2.
FLAGS = [
    "--flagfile=flags/smoke.flags", "--precision=float32", "--steps_per_epoch=4", "--epochs=1",
    "--warmup_epochs=0.5", "--checkpoint_every_steps=2", "--noasync_checkpoints", "--max_eval_examples=32",
    "--verbose=0",
]  # fmt: skip


def _refusal(run_dir, pid):
    return (
        f"the run directory {re.escape(str(run_dir))} is in use by process {pid} on host {HOST} {STARTED}: "
        r"wait for it to end or stop it \(a stopped job resumes with its own command\), or train in another "
        r"directory \(--run_name, --workdir\)\."
    )


def _free(run_dir):
    """Whether no other process holds the lock of `run_dir` (tried from this process, then released)."""
    fd = os.open(os.path.join(run_dir, "running.lock"), os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.mark.horovod
def test_a_second_start_on_a_live_run_is_refused_on_every_rank_and_a_killed_holder_blocks_no_restart(
    tmp_path,
):
    from hvd_lars.training import faults

    # The first job: one process (forked from the server, its client the launcher's child) paused after
    # update 3, holding the run.
    pause = ["--pause_at_step=3", f"--pause_marker={tmp_path}/paused"]
    log = open(tmp_path / "first.log", "w")
    command = shared().rank_command([KILLER, *pause, *FLAGS, f"--workdir={tmp_path}"])
    env = dict(os.environ, PYTHONPATH=REPO)
    first = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "smoke"
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{tmp_path}/paused.rank0"):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.2)
        holder = (run_dir / "running.lock").read_text()
        pid = int(re.fullmatch(rf"process (\d+) on host {HOST} {STARTED}\n", holder)[1])
        with open(f"/proc/{pid}/status") as f:  # the served process itself, not its client
            assert f"\nPPid:\t{shared().process.pid}\n" in f.read()
        with pytest.raises(ValueError) as refused:
            faults.RunDirClaim(str(run_dir)).__enter__()
        assert re.fullmatch(_refusal(run_dir, pid), str(refused.value))
        # The same run directory, 2 ranks under mpirun (the job submitted twice; its ranks served).
        second = run_main(
            ["mpirun", "-np", "2", sys.executable, "-m", "hvd_lars.main", *FLAGS, f"--workdir={tmp_path}"],
            cwd=REPO, env=env,
        )  # fmt: skip
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-3000:]
        # Refused on both ranks, said once, in one line; the first job holds on, untouched.
        lines = [line for line in second.stderr.splitlines() if "hvd_lars: error:" in line]
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert re.fullmatch("hvd_lars: error: " + _refusal(run_dir, pid), lines[0].strip()), lines
        assert first.poll() is None and not _free(run_dir)
        first.kill()  # SIGKILL: its served process ends with it
        first.wait()
        deadline = time.monotonic() + 60
        while not _free(run_dir):  # the event, polled
            assert time.monotonic() < deadline, f"process {pid} holds the run 60 s after its client's end"
            time.sleep(0.05)
    finally:
        first.kill()
        log.close()
    # A claim held by a process that lives on is free again once released (this process, then a restart).
    with faults.RunDirClaim(str(run_dir)) as claim:
        record = os.pread(claim._fd, 1024, 0).decode()
        assert re.fullmatch(f"process {os.getpid()} on host {HOST} {STARTED}\n", record)
    restart = run_main([sys.executable, "-m", "hvd_lars.main", *FLAGS, f"--workdir={tmp_path}"], cwd=REPO)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "(step 2)" in restart.stdout  # resumed from the checkpoint of update 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["plan"]["total_steps"] == 4 and len(summary["epochs"]) == 1
    assert _free(run_dir)
