"""Whichever process of a job is signalled, every rank stops at the next update with a pre-emption checkpoint
and every process of the job exits: real horovodrun (MPI and Gloo) and mpirun, started in a session of their
own as a terminal or a scheduler starts them; the signal goes to the launcher's pid (kill, timeout, a
supervisor) or to its whole process group (Ctrl-C, after which the same program resumes)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import HOROVODRUN, REPO, TWO_RANKS
from tests.support.main_server import run_main
from tests.support.small_runs import KILLER

# flags/smoke.flags on 2 ranks at 8x8 pixels: 2 epochs of 4 updates, a checkpoint every 2, evaluated after
# the last epoch only; the stop lands after update 5.
FLAGS = [
    "--flagfile=flags/smoke.flags", "--precision=float32", "--image_size=8", "--steps_per_epoch=4",
    "--epochs=2", "--checkpoint_every_steps=2", "--noasync_checkpoints", "--max_eval_examples=32",
    "--eval_every_epochs=2", "--verbose=0",
]  # fmt: skip
PAUSE_AT = 5
LAUNCHERS = {
    "horovodrun": [HOROVODRUN, "-np", "2", "-H", "localhost:2"],
    "horovodrun --gloo": [HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2"],
    "mpirun": ["mpirun", "-np", "2", "--oversubscribe"],
}


def _env():
    # Open MPI's own grace before it kills the ranks (launch/env.sh and the Makefile set it), and no
    # OMPI_MCA value of the calling environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA")}
    return dict(env, PYTHONPATH=REPO, OMPI_MCA_odls_base_sigkill_timeout="10")


def _program(workdir, pause=False):
    pausing = [KILLER, f"--pause_at_step={PAUSE_AT}", f"--pause_marker={workdir}/paused"]
    return [sys.executable, *(pausing if pause else ["-m", "hvd_lars.main"]), *FLAGS, f"--workdir={workdir}"]


@pytest.mark.horovod
@pytest.mark.parametrize(
    "launcher, signum, to_group, reason",
    [
        # horovodrun's `sh -c mpirun` shell ends; mpirun and the ranks would train on unwatched.
        ("horovodrun", signal.SIGTERM, False, "the launcher is gone"),
        # Ctrl-C in the terminal: the whole group; mpirun begins its kill sequence with SIGCONT.
        ("horovodrun", signal.SIGINT, True, "mpirun is stopping the job"),
        ("mpirun", signal.SIGTERM, False, "mpirun is stopping the job"),
        ("horovodrun --gloo", signal.SIGTERM, False, "SIGTERM"),
    ],
)
def test_a_signal_to_the_launcher_stops_every_rank_at_a_checkpoint(
    tmp_path, launcher, signum, to_group, reason
):
    # The job paused after update `PAUSE_AT` on both ranks, then its launcher's pid or group signalled.
    log = open(tmp_path / "job.log", "w")  # not a pipe: ranks that outlive the launcher never block on it
    command = LAUNCHERS[launcher] + _program(tmp_path, pause=True)
    job = subprocess.Popen(
        command, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not all(os.path.exists(f"{tmp_path}/paused.rank{r}") for r in range(2)):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()
            time.sleep(0.2)
        (os.killpg if to_group else os.kill)(job.pid, signum)
        deadline = time.monotonic() + 60
        while True:  # until no process of the job's group is left, 60 s at most
            job.poll()  # the launcher reaped: a zombie still counts as a member of the group
            try:
                os.killpg(job.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, (tmp_path / "job.log").read_text()  # 60 s after the signal
            time.sleep(0.2)
        job.wait(timeout=60)
    finally:
        log.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    out = (tmp_path / "job.log").read_text()
    run_dir = tmp_path / "smoke"
    # Both ranks, each its own line.
    line = f"reached 2 of 2 rank(s) (this one: {reason}); stopped at step {PAUSE_AT + 1}, checkpoint "
    assert out.count(line) == 2, out[-3000:]
    assert (run_dir / "checkpoints" / f"ckpt-{PAUSE_AT + 1}.index").exists()
    assert "<stderr>:Traceback" not in out, out[-3000:]
    with open(run_dir / "summary.json") as f:
        stopped = json.load(f)["stopped"]
    assert stopped["reason"] == "Preempted" and stopped["step"] == PAUSE_AT + 1, stopped
    if to_group:
        # Ctrl-C, then the same program and flags again (ranks forked from the server, under horovodrun's
        # mpirun command without its build check): it resumes from the stop's checkpoint and finishes (and
        # ends tensor for tensor as the uninterrupted run, as after every stop: tests/test_resume.py).
        resumed = run_main(TWO_RANKS + _program(tmp_path), cwd=REPO, env=_env())
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        assert f"(step {PAUSE_AT + 1})" in resumed.stdout
        with open(run_dir / "summary.json") as f:
            assert [e["epoch"] for e in json.load(f)["epochs"]] == [1, 2]  # each once
