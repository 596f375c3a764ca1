"""Training across 2 emulated hosts x 2 ranks (launch/emulated_cluster.sh): horovodrun, launch/horovodrun.sh,
launch/mpirun.sh with a hostfile, horovodrun --gloo. On 2 hosts x 1 rank, a host that dies or goes silent
ends the job within 60 s and leaves a checkpoint that loads (horovodrun, launch/horovodrun.sh, Slurm's srun
--mpi=pmix with a requeue).

Needs root; without it the tests fail with the reason, never skip. Every command runs the checkout under
test from the repository root (the hosts share the file system). Run directories live outside /tmp, since
each host has a /tmp of its own.
"""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hvd_lars import quiet_tensorflow
from tests.support import HOROVODRUN, REPO, python_shim
from tests.support.emulated_cluster import (
    SCRIPT,
    SUBNET,
    require_root,
    shared_folder,
    shell_command,
    wait_for_checkpoint,
)

PYTHON = sys.executable
SBATCH = os.path.join(REPO, "launch", "slurm", "train.sbatch")
RANKS_PER_HOST = 2
WORLD_SIZE = 4
# Grouped gradients: these runs are compared bit for bit. The overlapped reduction fills Horovod's fusion
# buffer in the order gradients arrive, which with the ring on 3+ ranks changes an element's summation order
# (results/archive/allreduce_order.md); one grouped allreduce fuses every gradient in one fixed order.
SMOKE = ["--flagfile=flags/smoke.flags", "--intra_op_threads=1", "--gradient_reduction=grouped"]
RANK_WEIGHTS = "tests/support/rank_weights_main.py"
LAUNCHERS = ["horovodrun", "launch/horovodrun.sh", "launch/mpirun.sh", "horovodrun --gloo"]
SMOKE_STEPS = 6  # flags/smoke.flags: 3 steps per epoch x 2 epochs
# Open MPI on the cluster network only (this machine's own interfaces are not reachable from the hosts).
# The launch scripts run with MPI_BIND=none: bound, both hosts' ranks sit on the same 2 cores.
MPI_NETWORK = {"OMPI_MCA_btl_tcp_if_include": SUBNET, "OMPI_MCA_oob_tcp_if_include": SUBNET}
# The MPI runs reduce in one order: identical weights. Gloo sums in another: float32 rounding carried
# through 6 LARS steps, so |Gloo - MPI| is bounded relative to how far training moved each tensor,
# |MPI - initial| (Euclidean norms; measured at most 5.1e-4 of it). A rank's gradient left out or counted
# twice changes the gradient's direction: a sizeable part of the movement.
GLOO_FRACTION_OF_MOVEMENT = 0.02
HOST_FAILURE_LIMIT_S = 60
# The host-failure jobs run one rank per host: the subject is a host, and 2 ranks start faster than 4.
FAILING_HOSTS = "node1:1,node2:1"
# An aborting mpirun sends its ranks SIGTERM and SIGKILL this many seconds apart (launch/env.sh: 10, time
# to checkpoint); ranks blocked on a dead or silent host cannot checkpoint.
ABORT_AT_ONCE = {"OMPI_MCA_odls_base_sigkill_timeout": "1"}
# A silent host: launch/env.sh's ssh keepalive (10 s x 3 probes, about 40 s of silence) made 3 s x 3 here,
# so that mpirun's session with node2 ends after about 12 s of silence and mpirun aborts.
SILENT_HOST_SSH = {"OMPI_MCA_plm_rsh_args": "-o ServerAliveInterval=3 -o ServerAliveCountMax=3"}
SILENT_HOST_LIMIT_S = 25
# Longer than that: a rank's watchdog that fires first makes mpirun abort the job, and an aborting mpirun
# waits for its daemon on the silent host (measured: still running 90 s later, 4 of 4 tries).
SILENT_HOST_HANG_TIMEOUT_S = 30
# 4 ranks on 2 cores: MPI's busy polling would take the cores from the ranks it waits for.
OVERSUBSCRIBED = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def _env(**extra):
    return dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", **OVERSUBSCRIBED, **extra)


def _run(cmd, **env):
    result = subprocess.run(cmd, cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _summary(workdir):
    return json.loads((Path(workdir) / "smoke" / "summary.json").read_text())


def _assert_two_hosts(summary, per_host=RANKS_PER_HOST):
    assert summary["hosts"] == ["node1", "node2"]
    assert summary["world_size"] == 2 * per_host
    assert summary["local_size"] == per_host and summary["cross_size"] == 2
    # What TensorFlow applied on rank 0, read back: given by --intra_op_threads=1, or sized from the host's
    # 2 cores shared by its ranks (train.sbatch passes no thread flag).
    assert summary["threads"]["intra_op"] == 2 // per_host


def _weights(workdir):
    """Each rank's weights after training (tests/support/rank_weights_main.py), in rank order, and the
    run's initial weights (rank 0's as built, which the first batch broadcast)."""
    saved = [
        dict(np.load(Path(workdir) / "smoke" / "rank_weights" / f"rank{r}.npz")) for r in range(WORLD_SIZE)
    ]
    final = [{k: v for k, v in arrays.items() if not k.startswith("init_")} for arrays in saved]
    return final, {k.removeprefix("init_"): v for k, v in saved[0].items() if k.startswith("init_")}


def _restore_last_checkpoint(workdir):
    """Loads the run's last checkpoint into a fresh smoke model (every model variable must match; that
    restores the values exactly: tests/test_checkpoints.py); returns its step."""
    import tensorflow as tf

    from hvd_lars.models import get_model

    folder = Path(workdir) / "smoke" / "checkpoints"
    latest = tf.train.latest_checkpoint(str(folder))
    assert latest, f"no checkpoint in {folder}"
    model = get_model("small_cnn", num_classes=1000, input_shape=(32, 32, 3))
    tf.train.Checkpoint(model=model).restore(latest).expect_partial().assert_existing_objects_matched()
    return int(latest.rsplit("-", 1)[1])


def _script(verb, user=None, **env):
    # As another user the script comes on stdin: the checkout may be closed to them (a mktemp -d clone).
    cmd = [SCRIPT, verb] if user is None else ["runuser", "-u", user, "--", "bash", "-s", "--", verb]
    script = Path(SCRIPT).read_text() if user else None
    env = dict(os.environ, **env)
    return subprocess.run(cmd, input=script, cwd="/", env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.system
def test_script_refuses_non_root_and_bad_settings():
    require_root()  # to become another user
    result = _script("up", user="nobody")
    assert result.returncode == 1 and "must run as root" in result.stderr
    assert "you are nobody" in result.stderr
    for verb, env, status, message in [
        ("up", {"NODES": "0"}, 1, "NODES='0': expected a whole number of hosts from 1 to 99"),
        ("up", {"LINK_RATE": "fast"}, 1, "LINK_RATE='fast': expected a tc rate such as"),
        ("up", {"LINK_BURST_MS": "0"}, 1, "LINK_BURST_MS='0': expected a whole number of milliseconds"),
        ("restart", {}, 2, "Usage: launch/emulated_cluster.sh up|down|status"),
    ]:
        result = _script(verb, **env)
        assert result.returncode == status and message in result.stderr, (env, result.stderr)


@pytest.mark.system
def test_status_lists_hosts_addresses_and_links(cluster):
    result = _script("status")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:]}
    assert rows["node1"][1:5] == ["198.18.0.11", "hvdlars-n1", "up", "none"]
    assert rows["node2"][1:5] == ["198.18.0.12", "hvdlars-n2", "up", "none"]
    assert cluster.hosts[1].run("hostname").stdout.strip() == "node2"


@pytest.fixture(scope="module")
def mpi_run(cluster):
    """horovodrun -np 4 -H node1:2,node2:2 (MPI) on smoke.flags, each rank saving its final weights: the
    reference of every launcher; with the bytes each host's link carried meanwhile."""
    workdir = shared_folder("mpi_run")
    before = [h.link_bytes() for h in cluster.hosts]
    hosts = cluster.host_list(RANKS_PER_HOST)
    command = [HOROVODRUN, "-np", str(WORLD_SIZE), "-H", hosts, PYTHON, RANK_WEIGHTS, *SMOKE]
    result = _run([*command, f"--workdir={workdir}"])
    after = [h.link_bytes() for h in cluster.hosts]
    traffic = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    yield workdir, result.stdout, traffic
    shutil.rmtree(workdir, ignore_errors=True)


def _launch(launcher, cluster, workdir):
    """Runs smoke.flags on 4 ranks of 2 hosts through `launcher` (each rank saving its final weights);
    returns its standard output and error."""
    if launcher == "horovodrun --gloo":
        # Gloo's rendezvous address must be on the cluster network: launch from node1, as from a cluster's
        # first node (from this machine horovodrun offers its own eth0). Gloo resolves host names.
        command = [HOROVODRUN, "--gloo", "-np", str(WORLD_SIZE), "-H", cluster.host_list(RANKS_PER_HOST),
                   PYTHON, RANK_WEIGHTS, *SMOKE, f"--workdir={workdir}"]  # fmt: skip
        env = {"PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
        result = cluster.hosts[0].run(shell_command(command, env=env), timeout=300, check=False)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout + result.stderr
    # launch/horovodrun.sh takes a host list; launch/mpirun.sh a hostfile, on the cluster network only.
    hosts, network = cluster.host_list(RANKS_PER_HOST), {}
    if launcher == "launch/mpirun.sh":
        hosts, network = workdir / "hostfile", MPI_NETWORK
        hosts.write_text("".join(f"{h.name} slots={RANKS_PER_HOST}\n" for h in cluster.hosts))
    command = [os.path.join(REPO, launcher), str(hosts), str(WORLD_SIZE), "flags/smoke.flags"]
    flags = [f"--workdir={workdir}", "--gradient_reduction=grouped"]  # threads: the script's placement
    shim = python_shim(workdir, RANK_WEIGHTS)  # the launch script's `python -m hvd_lars.main`
    os.symlink(HOROVODRUN, workdir / "horovodrun")  # the one launch/horovodrun.sh finds beside $PYTHON
    result = _run([*command, *flags], RANKS_PER_SOCKET="2", MPI_BIND="none", PYTHON=shim, **network)
    return result.stdout + result.stderr


@pytest.mark.system
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_trains_across_two_hosts_to_the_same_weights(cluster, mpi_run, shared_dir, launcher):
    """Every rank ends with rank 0's weights bit for bit; the MPI launchers with horovodrun's, Gloo within
    float32 rounding of another summation order; the run's summary names both hosts."""
    if launcher == "horovodrun":
        workdir, output, traffic = mpi_run
    else:
        workdir, output = shared_dir, _launch(launcher, cluster, shared_dir)
    assert "global batch 32 = 4 ranks x per-rank batch 8" in output
    _assert_two_hosts(_summary(workdir))
    (weights, initial), ((reference, *_), reference_initial) = _weights(workdir), _weights(mpi_run[0])
    for r in range(1, WORLD_SIZE):
        assert weights[r].keys() == weights[0].keys()
        for name in weights[0]:
            np.testing.assert_array_equal(weights[r][name], weights[0][name], err_msg=f"rank {r}, {name}")
    assert weights[0].keys() == reference.keys() and initial.keys() == reference.keys()
    for name in reference:
        np.testing.assert_array_equal(initial[name], reference_initial[name], err_msg=name)
        if launcher != "horovodrun --gloo":
            np.testing.assert_array_equal(weights[0][name], reference[name], err_msg=name)
        else:
            moved = np.linalg.norm(reference[name] - initial[name])
            apart = np.linalg.norm(weights[0][name] - reference[name])
            assert moved > 0, f"{name} did not move in training"
            assert apart <= GLOO_FRACTION_OF_MOVEMENT * moved, (name, apart, moved)
    if launcher == "launch/horovodrun.sh":
        # Not one TensorFlow start-up notice of horovodrun's build check, nor of the ranks (whose output
        # horovodrun passes on); TF_CPP_MIN_LOG_LEVEL=2 leaves them: they are the filter's to drop.
        assert quiet_tensorflow.kept(output.encode(), driver=False) == output.encode(), output[-3000:]
    if launcher == "horovodrun":
        # Allreduce between 2 hosts: each host must send the other at least its partial sum of every
        # float32 gradient, every step, and receive as much (traffic of ssh and setup only adds to that).
        gradient_bytes = 4 * sum(w.size for name, w in reference.items() if name.startswith("t"))
        for host, (sent, received) in zip(("node1", "node2"), traffic):
            assert sent >= SMOKE_STEPS * gradient_bytes, f"{host} sent {sent} B"
            assert received >= SMOKE_STEPS * gradient_bytes, f"{host} received {received} B"


@contextlib.contextmanager
def _job_to_its_first_checkpoint(cluster, workdir, cmd, env):
    """Starts `cmd` (100 updates per epoch, a checkpoint every 2; output in workdir/job.log) and yields (the
    job, the step of its first checkpoint) once a rank of it runs on node2. Afterwards the job is killed,
    and node2 (its link up again, what is left there killed) boots again."""
    node2 = cluster.hosts[1]
    with open(workdir / "job.log", "w") as log:
        job = subprocess.Popen([*cmd, "--steps_per_epoch=100", "--checkpoint_every_steps=2"], cwd=REPO,
                               env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            saved = wait_for_checkpoint(workdir, alive=lambda: job.poll() is None)
            assert node2.processes_running("hvd_lars.main"), "no rank runs on node2"
            yield job, saved
        finally:
            job.kill()
            node2.set_link(up=True)
            node2.kill()
            cluster.up()


def _wait(job, timeout):
    """The job's exit status, or None while it still runs `timeout` s later."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        return job.wait(timeout=timeout)


@pytest.mark.system
def test_horovodrun_job_ends_when_a_host_dies(cluster, shared_dir):
    cmd = [HOROVODRUN, "-np", "2", "-H", FAILING_HOSTS, PYTHON, "-m", "hvd_lars.main", *SMOKE,
           f"--workdir={shared_dir}"]  # fmt: skip
    with _job_to_its_first_checkpoint(cluster, shared_dir, cmd, _env(**ABORT_AT_ONCE)) as (job, saved):
        killed_at = time.time()
        cluster.hosts[1].kill()
        status, ended_after = _wait(job, HOST_FAILURE_LIMIT_S), time.time() - killed_at
    output = (shared_dir / "job.log").read_text()[-3000:]
    assert status is not None, f"horovodrun still running {ended_after:.0f} s after node2 died\n{output}"
    assert status != 0, output
    assert _restore_last_checkpoint(shared_dir) >= saved


@pytest.mark.system
def test_launch_script_job_ends_when_a_host_goes_silent(cluster, shared_dir):
    # node2's link goes down mid-training: no packet, no reset, its ranks alive and blocked. Unhelped,
    # mpirun waited on (still running 240 s later). launch/env.sh's ssh keepalive ends mpirun's session
    # with node2 and so the job; node2's own ranks end through the progress watchdog. The job runs with a
    # shorter keepalive of the same kind, given as a user overrides launch/env.sh's.
    default = subprocess.run(
        ["bash", "-c", 'unset OMPI_MCA_plm_rsh_args; source launch/env.sh; echo "$OMPI_MCA_plm_rsh_args"'],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert default.stdout.strip() == "-o ServerAliveInterval=10 -o ServerAliveCountMax=3", default.stderr
    cmd = [os.path.join(REPO, "launch", "horovodrun.sh"), FAILING_HOSTS, "2", "flags/smoke.flags",
           "--intra_op_threads=1", f"--workdir={shared_dir}",
           f"--hang_timeout_s={SILENT_HOST_HANG_TIMEOUT_S}"]  # fmt: skip
    env = _env(**SILENT_HOST_SSH, **ABORT_AT_ONCE, MPI_BIND="none")
    node2 = cluster.hosts[1]
    with _job_to_its_first_checkpoint(cluster, shared_dir, cmd, env) as (job, saved):
        silent_at = time.time()
        node2.set_link(up=False)
        status, ended_after = _wait(job, SILENT_HOST_LIMIT_S), time.time() - silent_at
        # node2's ranks, cut off, end by themselves once --hang_timeout_s has passed without progress.
        deadline = silent_at + SILENT_HOST_HANG_TIMEOUT_S + 30
        while node2.processes_running("hvd_lars.main") and time.time() < deadline:
            time.sleep(0.5)
        left_on_node2, ranks_ended_after = node2.processes_running("hvd_lars.main"), time.time() - silent_at
    output = (shared_dir / "job.log").read_text()[-3000:]
    assert status is not None, f"the job still ran {ended_after:.0f} s after node2 went silent\n{output}"
    assert status != 0, output
    assert not left_on_node2, f"node2's ranks {left_on_node2} ran {ranks_ended_after:.0f} s later"
    assert _restore_last_checkpoint(shared_dir) >= saved


@pytest.mark.system
def test_slurm_job_on_two_nodes_requeues_and_survives_a_host_failure(cluster, slurm, shared_dir):
    """sbatch --nodes=2 --ntasks-per-node=1 train.sbatch flags/smoke.flags (10 updates per epoch: node2
    dies well before the end): 2 ranks through srun --mpi=pmix; node2 dying ends the attempt within 60 s
    (Slurm requeues it for node failure); once node2 is back the job resumes from its last checkpoint and
    completes."""
    out = shared_dir / "slurm.out"
    export = f"ALL,PYTHONPATH={REPO},OMPI_MCA_mpi_yield_when_idle=1"
    cmd = [
        "sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--chdir={REPO}", f"--output={out}",
        f"--export={export}", SBATCH, "flags/smoke.flags", f"--workdir={shared_dir}", "--steps_per_epoch=10",
    ]  # fmt: skip
    job = slurm.run(cmd).stdout.strip().split(";")[0]
    # A requeue by a stop signal, resumed at the step it stopped at: tests/test_slurm.py.
    second = wait_for_checkpoint(
        shared_dir, lambda: slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING")
    )
    killed_at = time.time()
    cluster.hosts[1].kill()
    while slurm.job_field(job, "Restarts") != "1" and time.time() - killed_at < HOST_FAILURE_LIMIT_S + 30:
        time.sleep(0.2)
    ended_after = time.time() - killed_at
    cluster.up()
    slurm.start_slurmd("node2")  # ReturnToService=2: the node rejoins when its slurmd registers
    slurm.start_requeued_now(job)
    try:
        state = slurm.wait(job, timeout=300)
    except TimeoutError as e:
        state = str(e)
    log = out.read_text()
    assert ended_after < HOST_FAILURE_LIMIT_S, f"attempt 1 still running {ended_after:.0f} s after node2 died"
    assert "DUE TO NODE FAILURE" in log
    assert "requeue job JobId=" in (Path(slurm.dir) / "slurmctld.log").read_text()
    node_logs = "".join(p.read_text()[-1500:] for p in sorted(Path(slurm.dir).glob("slurm*.log")))
    assert state == "COMPLETED", log[-3000:] + node_logs
    assert "restart 1" in log and log.count("resumed from") == 1
    summary = _summary(shared_dir)
    _assert_two_hosts(summary, per_host=1)
    assert summary["resumed_from_step"] >= second and summary["epochs"][-1]["epoch"] == 2
