"""launch/slurm/train.sbatch under a real single-node Slurm; host lists with imitated SLURM_* variables."""

import json
import os
import re
import runpy
import time

import pytest

from tests.support import REPO, python_shim
from tests.support.slurm_cluster import SlurmCluster

# launch/slurm/hosts.py is a script the batch script runs, not a module.
_hosts = runpy.run_path(os.path.join(REPO, "launch", "slurm", "hosts.py"))
expand_hostlist, expand_tasks_per_node = _hosts["expand_hostlist"], _hosts["expand_tasks_per_node"]
hosts_from_environment = _hosts["hosts_from_environment"]

SBATCH = os.path.join(REPO, "launch", "slurm", "train.sbatch")


@pytest.mark.unit
@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node07", ["node07"]),
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("node[8-11],login1", ["node8", "node9", "node10", "node11", "login1"]),
        ("cn[098-100,200]", ["cn098", "cn099", "cn100", "cn200"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["node[01-03", "node]1[", "node[a-b]", "node[5-3]"])
def test_bad_hostlist_is_quoted(bad):
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


@pytest.mark.unit
def test_tasks_per_node_and_environment():
    assert expand_tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="describes 2 nodes, the node list 3"):
        expand_tasks_per_node("2(x2)", 3)
    env = {"SLURM_JOB_NODELIST": "cpu[001-004]", "SLURM_TASKS_PER_NODE": "2(x4)"}
    assert hosts_from_environment(env) == [("cpu001", 2), ("cpu002", 2), ("cpu003", 2), ("cpu004", 2)]
    env = {"SLURM_JOB_NODELIST": "a,b", "SLURM_NTASKS_PER_NODE": "2"}
    assert hosts_from_environment(env) == [("a", 2), ("b", 2)]
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST is not set"):
        hosts_from_environment({})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


def _sbatch(cluster, tmp_path, *flags, export=None):
    """Submits train.sbatch flags/smoke.flags on 2 ranks (placement: the script's own); returns the job id.
    By default tests/support/kill_at_step.py runs in place of the main program, for its --pause_at_step."""
    export = export or f"PYTHON={python_shim(tmp_path, 'tests/support/kill_at_step.py')}"
    cmd = [
        "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", f"--chdir={REPO}",
        f"--output={tmp_path}/slurm-%j.out", f"--export=ALL,{export},PYTHONPATH={REPO}",
        SBATCH, "flags/smoke.flags", f"--workdir={tmp_path}", *flags,
    ]  # fmt: skip
    return cluster.run(cmd).stdout.strip().split(";")[0]


def _log(tmp_path, job):
    log = tmp_path / f"slurm-{job}.out"
    return log.read_text() if log.exists() else ""


def _summary(tmp_path):
    return json.loads((tmp_path / "smoke" / "summary.json").read_text())


def _usr1_while_paused(cluster, tmp_path, step, *flags, timeout=300):
    """Submits a job whose ranks pause after update `step` until a stop signal reaches them; once both are
    paused (each wrote its marker: the job certainly trains) sends the batch script USR1, as
    --signal=B:USR1@120 makes Slurm do 120 s before the time limit. Returns the job id."""
    job = _sbatch(cluster, tmp_path, f"--pause_at_step={step}", f"--pause_marker={tmp_path}/paused", *flags)
    markers = [tmp_path / f"paused.rank{r}" for r in (0, 1)]
    deadline = time.time() + timeout
    while not all(m.exists() for m in markers):
        state = cluster.job_state(job)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), state + _log(tmp_path, job)[-3000:]
        assert time.time() < deadline, f"job {job} not paused after {timeout} s"
        time.sleep(0.2)
    assert cluster.job_state(job) == "RUNNING"
    cluster.run(["scancel", "--batch", "--signal=USR1", job])
    return job


@pytest.mark.system
def test_sbatch_through_horovodrun_trains_two_ranks_without_tensorflow_notices(cluster, tmp_path):
    # LAUNCHER=horovodrun: horovodrun's build check and the ranks print through the notice filter.
    from hvd_lars import quiet_tensorflow

    job = _sbatch(cluster, tmp_path, export="LAUNCHER=horovodrun")
    state = cluster.wait(job, timeout=300)
    log = _log(tmp_path, job)
    assert state == "COMPLETED", log[-3000:]
    assert "global batch 32 = 2 ranks x per-rank batch 16" in log
    assert quiet_tensorflow.kept(log.encode(), driver=False) == log.encode(), log[-3000:]
    summary = _summary(tmp_path)
    assert summary["world_size"] == 2 and summary["epochs"][-1]["epoch"] == 2


@pytest.mark.system
def test_usr1_before_the_time_limit_checkpoints_requeues_and_resumes_at_that_step(cluster, tmp_path):
    # No periodic checkpoints: the stop's checkpoint is the only one the requeued job can resume from.
    # Paused after update 5 (of 2 x 10) until the USR1 reaches the ranks: they stop at update 6.
    job = _usr1_while_paused(cluster, tmp_path, 5, "--steps_per_epoch=10", "--checkpoint_every_steps=0")
    cluster.wait(job, ("PENDING",), timeout=120)
    log = _log(tmp_path, job)
    match = re.search(r"stopped at step (\d+), checkpoint \S+/ckpt-(\d+)\.", log)
    assert match and match.group(1) == match.group(2) == "6", log[-3000:]
    # srun's status is 75 (hvd_lars.training.faults.EXIT_PREEMPTED), or 143 when --kill-on-bad-exit ended a
    # rank that had not yet exited after the first one exited 75; the USR1 the script passed on settles it.
    assert re.search(r"training stopped at a checkpoint \(status (75|143)\): requeueing", log)
    # The batch script requeued its own job and then exits: its step ends before the job starts again
    # (a real requeue waits minutes).
    cluster.start_requeued_now(job)
    state = cluster.wait(job, timeout=600)
    log = _log(tmp_path, job)
    assert state == "COMPLETED", state + log[-3000:]
    assert "(step 6)" in log and "restart 1" in log
    summary = _summary(tmp_path)
    assert summary["resumed_from_step"] == 6 and summary["epochs"][-1]["epoch"] == 2


@pytest.mark.system
def test_usr1_during_the_last_update_ends_the_job_without_a_requeue(cluster, tmp_path):
    # Paused after the plan's last update (6 of 6) when the USR1 comes: the run is complete, exit 0, and the
    # batch script does not requeue it.
    job = _usr1_while_paused(cluster, tmp_path, 6)
    state = cluster.wait(job, timeout=300)
    log = _log(tmp_path, job)
    assert state == "COMPLETED", state + log[-3000:]
    assert "stopped at a checkpoint" not in log and "restart 1" not in log, log[-3000:]
    assert "training finished its plan (status 0): not requeued" in log
    assert cluster.job_field(job, "Restarts") == "0"
    summary = _summary(tmp_path)
    assert summary["epochs"][-1]["epoch"] == 2 and summary["plan"]["total_steps"] == 6
