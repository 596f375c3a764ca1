"""One job per run directory: rank 0 holds a kernel lock on `<run_dir>/running.lock`: a second start on a live
run is refused on every rank, and a holder that ends in any way (SIGKILL included) leaves the lock free."""

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support import REPO
from tests.support.main_server import run_main
from tests.support.small_runs import KILLER

# Another process that tries the claim at each line "take" on its stdin and says what it got.
CLAIMANT = (
    "import sys\n"
    "from hvd_lars.training import faults\n"
    "for line in sys.stdin:\n"
    "    try:\n"
    "        claim = faults.RunDirClaim(sys.argv[1]).__enter__()\n"
    "        print('held', flush=True)\n"
    "    except ValueError as e:\n"
    "        print(e, flush=True)\n"
)
STARTED = r"\(started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+\)"


def _refusal(run_dir, pid):
    return (
        f"the run directory {re.escape(str(run_dir))} is in use by process {pid} on host "
        f"{re.escape(socket.gethostname())} {STARTED}: wait for it to end or stop it "
        r"\(a stopped job resumes with its own command\), or train in another directory \(--run_name, "
        r"--workdir\)\."
    )


def _free(run_dir):
    """Whether no process holds the lock of `run_dir` (tried from this process, then released)."""
    fd = os.open(os.path.join(run_dir, "running.lock"), os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


ENV = dict(os.environ, PYTHONPATH=REPO)


@pytest.mark.horovod
def test_the_claim_is_refused_while_its_holder_lives_and_free_once_it_ends(tmp_path):
    from hvd_lars.training import faults

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", CLAIMANT, str(run_dir)], cwd=REPO, env=ENV, **pipes)

    def take():
        other.stdin.write("take\n")
        other.stdin.flush()
        return other.stdout.readline().strip()

    try:
        with faults.RunDirClaim(str(run_dir)) as claim:
            holder = os.pread(claim._fd, 1024, 0).decode()
            assert re.fullmatch(
                f"process {os.getpid()} on host {re.escape(socket.gethostname())} {STARTED}\n", holder
            )
            assert re.fullmatch(_refusal(run_dir, os.getpid()), take())
        assert take() == "held"  # released at the end of the `with`
        with pytest.raises(ValueError) as refused:
            faults.RunDirClaim(str(run_dir)).__enter__()
        assert re.fullmatch(_refusal(run_dir, other.pid), str(refused.value))
        other.stdin.close()
        assert other.wait(timeout=60) == 0
    finally:
        other.kill()
    assert _free(run_dir)  # its holder ended


# flags/smoke.flags: 2 epochs of 4 updates, a checkpoint every 2.
FLAGS = [
    "--flagfile=flags/smoke.flags", "--precision=float32", "--steps_per_epoch=4", "--epochs=2",
    "--checkpoint_every_steps=2", "--noasync_checkpoints", "--max_eval_examples=32", "--verbose=0",
]  # fmt: skip


def _start_paused(workdir, until):
    """The first job: one process paused after update 3 (until the file `until` exists)."""
    pause = ["--pause_at_step=3", f"--pause_marker={workdir}/paused", f"--pause_until={until}"]
    log = open(workdir / "first.log", "w")
    command = [sys.executable, KILLER, *pause, *FLAGS, f"--workdir={workdir}"]
    job = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not os.path.exists(f"{workdir}/paused.rank0"):
        assert job.poll() is None and time.monotonic() < deadline, (workdir / "first.log").read_text()
        time.sleep(0.2)
    return job


@pytest.mark.horovod
def test_a_second_start_on_a_live_run_is_refused_on_every_rank_and_a_killed_holder_blocks_no_restart(
    tmp_path,
):
    first = _start_paused(tmp_path, tmp_path / "never")
    run_dir = tmp_path / "smoke"
    try:
        # The same run directory, 2 ranks under mpirun (the job submitted twice; its ranks served).
        second = run_main(
            ["mpirun", "-np", "2", sys.executable, "-m", "hvd_lars.main", *FLAGS, f"--workdir={tmp_path}"],
            cwd=REPO, env=ENV,
        )  # fmt: skip
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-3000:]
        # Refused on both ranks, said once, in one line; the first job holds on, untouched.
        lines = [line for line in second.stderr.splitlines() if "hvd_lars: error:" in line]
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert re.fullmatch("hvd_lars: error: " + _refusal(run_dir, first.pid), lines[0].strip()), lines
        assert first.poll() is None and not _free(run_dir)
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
    assert (run_dir / "running.lock").read_text().startswith(f"process {first.pid} on host ")
    restart = run_main([sys.executable, "-m", "hvd_lars.main", *FLAGS, f"--workdir={tmp_path}"], cwd=REPO)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "(step 2)" in restart.stdout  # resumed from the checkpoint of update 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["plan"]["total_steps"] == 8 and len(summary["epochs"]) == 2
    assert _free(run_dir)
