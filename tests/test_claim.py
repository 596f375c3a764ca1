"""One job per run directory: a second start on a live run is refused on every rank and leaves the first
untouched; a claim whose holder is gone is taken over with one line, and the restart resumes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support import REPO

KILLER = os.path.join(REPO, "tests", "support", "kill_at_step.py")


def _claim_of(pid, **changes):
    from hvd_lars.training import faults

    return {**faults.holder(), "pid": pid, "process_start": faults._stat(pid, 19), **changes}


def _write(run_dir, record, age_s=0.0):
    path = run_dir / "running.json"
    path.write_text(json.dumps(record) if isinstance(record, dict) else record)
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


@pytest.mark.unit
def test_a_claim_is_taken_released_and_refused_while_its_holder_lives(tmp_path):
    from hvd_lars.training import faults

    run_dir = tmp_path / "run"
    assert faults.take(str(run_dir)) is None
    record = json.loads((run_dir / "running.json").read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    faults.release(str(run_dir))
    assert not (run_dir / "running.json").exists()

    # A live process of this host holds it (the parent of this one): refused, naming it, the claim kept.
    holder = os.getppid()
    path = _write(run_dir, _claim_of(holder, started="2026-12-06 10:00:00 UTC"))
    before = path.read_text()
    with pytest.raises(faults.RunDirInUse) as refused:
        faults.take(str(run_dir))
    assert str(refused.value).startswith(
        f"the run directory {run_dir} is in use by process {holder} on host {socket.gethostname()} "
        f"(started 2026-12-06 10:00:00 UTC): it holds {path}. Wait for that job to end or stop it"
    )
    assert path.read_text() == before
    # Another host's claim, refreshed 10 s ago: refused too.
    _write(run_dir, _claim_of(holder, host="node7", boot="x"), age_s=10)
    with pytest.raises(faults.RunDirInUse, match="in use by process .* on host node7"):
        faults.take(str(run_dir))
    # release() leaves a claim of another process alone.
    faults.release(str(run_dir))
    assert path.exists()


@pytest.mark.unit
def test_a_claim_whose_holder_is_gone_is_taken_over_with_one_line(tmp_path):
    from hvd_lars.training import faults

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # The same host: its process is gone (the pid is in use again, by a process of another start time).
    gone = os.getppid()
    _write(run_dir, _claim_of(gone, process_start=12345, started="then"))
    line = faults.take(str(run_dir))
    assert line == (
        f"took over the run directory {run_dir} from process {gone} on host {socket.gethostname()} "
        "(started then): its process is gone."
    )
    assert json.loads((run_dir / "running.json").read_text())["pid"] == os.getpid()
    # Another host's claim not refreshed for longer than STALE_S, measured on the file system's clock.
    _write(run_dir, _claim_of(1, host="node7", boot="x", started="then"), age_s=faults.STALE_S + 30)
    line = faults.take(str(run_dir))
    assert line.startswith(
        f"took over the run directory {run_dir} from process 1 on host node7 (started then): "
    )
    assert f"its claim was last refreshed {faults.STALE_S + 30:.0f} s ago" in line
    # A claim cut short (a crash while it was written) blocks only until it is as old.
    _write(run_dir, '{"host": "no', age_s=5)
    with pytest.raises(faults.RunDirInUse):
        faults.take(str(run_dir))
    _write(run_dir, '{"host": "no', age_s=faults.STALE_S + 1)
    taken = faults.take(str(run_dir))
    assert taken.startswith(f"took over the run directory {run_dir} from an earlier job: ")
    assert not [n for n in os.listdir(run_dir) if n != "running.json"]


@pytest.mark.unit
def test_a_requeued_slurm_job_takes_over_its_earlier_start_on_any_node(tmp_path, monkeypatch):
    from hvd_lars.training import faults

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    # The first start's rank 0 on node7, killed 10 s ago before it could remove its claim.
    earlier = _claim_of(1, host="node7", boot="x", started="then", slurm_job="77", slurm_restart="0")
    _write(run_dir, earlier, age_s=10)
    assert faults.take(str(run_dir)) == (
        f"took over the run directory {run_dir} from process 1 on host node7 (started then): it was an "
        "earlier start (restart 0) of this Slurm job."
    )
    # Another job, or another step of this start, on another node: refused.
    for other in (dict(slurm_job="78", slurm_restart="1"), dict(slurm_job="77", slurm_restart="1")):
        _write(run_dir, {**earlier, **other}, age_s=10)
        with pytest.raises(faults.RunDirInUse, match="on host node7"):
            faults.take(str(run_dir))


# flags/smoke.flags: 3 epochs of 4 updates, a checkpoint every 2.
FLAGS = [
    "--flagfile=flags/smoke.flags", "--precision=float32", "--steps_per_epoch=4", "--epochs=3",
    "--checkpoint_every_steps=2", "--noasync_checkpoints", "--max_eval_examples=32",
    "--verbose=0",
]  # fmt: skip


def _env():
    return dict(os.environ, PYTHONPATH=REPO)


def _start_paused(workdir, until):
    """The first job: one process paused after update 3 until the file `until` exists."""
    pause = ["--pause_at_step=3", f"--pause_marker={workdir}/paused", f"--pause_until={until}"]
    log = open(workdir / "first.log", "w")
    job = subprocess.Popen(
        [sys.executable, KILLER, *pause, *FLAGS, f"--workdir={workdir}"],
        cwd=REPO,
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while not os.path.exists(f"{workdir}/paused.rank0"):
        assert job.poll() is None and time.monotonic() < deadline, (workdir / "first.log").read_text()
        time.sleep(0.2)
    return job


@pytest.mark.horovod
def test_a_second_start_on_a_live_run_is_refused_on_every_rank_and_the_first_finishes_alone(tmp_path):
    until = tmp_path / "go_on"
    first = _start_paused(tmp_path, until)
    try:
        # The same run directory, 2 ranks under mpirun (the job submitted twice).
        second = subprocess.run(
            ["mpirun", "-np", "2", sys.executable, "-m", "hvd_lars.main", *FLAGS, f"--workdir={tmp_path}"],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-3000:]
        run_dir = tmp_path / "smoke"
        line = (
            f"hvd_lars: error: the run directory {run_dir} is in use by process {first.pid} on host "
            f"{socket.gethostname()}"
        )
        # Refused on both ranks, said once.
        assert second.stderr.count(line) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        until.write_text("")
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        first.kill()
    run_dir = tmp_path / "smoke"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["plan"]["total_steps"] == 12 and len(summary["epochs"]) == 3
    assert not (run_dir / "earlier_runs").exists() and not (run_dir / "running.json").exists()


@pytest.mark.horovod
def test_a_killed_holder_never_blocks_the_restart_which_resumes(tmp_path):
    first = _start_paused(tmp_path, tmp_path / "never")
    first.send_signal(signal.SIGKILL)
    first.wait()
    run_dir = tmp_path / "smoke"
    assert json.loads((run_dir / "running.json").read_text())["pid"] == first.pid
    restart = subprocess.run(
        [sys.executable, "-m", "hvd_lars.main", *FLAGS, f"--workdir={tmp_path}"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert (
        f"[hvd_lars] took over the run directory {run_dir} from process {first.pid} on host "
        f"{socket.gethostname()}" in restart.stdout
    )
    assert "its process is gone." in restart.stdout
    assert "(step 2)" in restart.stdout  # resumed from the checkpoint of update 2
    assert not (run_dir / "running.json").exists()
