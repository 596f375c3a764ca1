"""launch/horovodrun.sh and launch/mpirun.sh run smoke.flags on 2 ranks; bad arguments are refused."""

import json
import os
import socket
import subprocess

import pytest

from tests.support import REPO

LAUNCH = os.path.join(REPO, "launch")


def _launch(script, *args, env=None):
    command = [os.path.join(LAUNCH, script), *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.horovod
@pytest.mark.parametrize(
    "script, first",
    [("horovodrun.sh", "localhost:2"), ("mpirun.sh", "localhost")],
)
def test_two_ranks_run_smoke_flags(script, first, tmp_path):
    # No placement given: one socket of two cores here, so two ranks on it, one core each (launch/env.sh).
    result = _launch(script, first, "2", "flags/smoke.flags", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "global batch 32 = 2 ranks x per-rank batch 16" in result.stdout
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["plan"]["total_steps"] == 6 and len(summary["epochs"]) == 2
    # Both launchers bind each rank to its own core; each rank sizes its pools from that core (read back
    # from TensorFlow and tf.data, not a flag: the scripts pass none).
    cores = sorted(os.sched_getaffinity(0))[:2]
    assert summary["world_size"] == 2 and summary["threads"] == {
        "intra_op": 1, "inter_op": 1, "input": 1, "omp_num_threads": "1",
        "cores_per_rank": [[c] for c in cores],
    }  # fmt: skip
    host = socket.gethostname()
    assert (
        f"cores per rank: rank 0 on {host}: CPUs {cores[0]} (bound), 1 intra-op / 1 inter-op / 1 input "
        f"threads; rank 1 on {host}: CPUs {cores[1]} (bound)"
    ) in result.stdout
    assert summary["hosts"] == [host] and summary["local_size"] == 2 and summary["cross_size"] == 1


@pytest.mark.horovod
@pytest.mark.parametrize("script", ["horovodrun.sh", "mpirun.sh"])
def test_usage_and_missing_flagfile(script):
    result = _launch(script)
    assert result.returncode == 2 and "Usage:" in result.stderr
    result = _launch(script, "localhost", "2", "flags/nope.flags")
    assert result.returncode == 2 and "flagfile 'flags/nope.flags' not found" in result.stderr


PLACEMENT_VARIABLES = (
    "RANKS_PER_SOCKET", "THREADS_PER_RANK", "OMP_NUM_THREADS", "MPI_BIND", "MPI_OVERSUBSCRIBE",
    "SOCKETS_PER_NODE", "CORES_PER_SOCKET", "SLURM_CPUS_PER_TASK", "TF_ENABLE_ONEDNN_OPTS",
)  # fmt: skip


def _machine(sockets, cores, **env):
    """This environment without placement settings, on a machine of `sockets` x `cores`, with `env`."""
    clean = {k: v for k, v in os.environ.items() if k not in PLACEMENT_VARIABLES}
    return dict(clean, SOCKETS_PER_NODE=str(sockets), CORES_PER_SOCKET=str(cores), **env)


@pytest.mark.horovod  # subprocesses (bash), no Horovod ranks
@pytest.mark.parametrize(
    "sockets, cores, hosts, ranks, env, want",
    [
        # This machine's kind: 1 socket of 2 cores, 2 ranks: two per socket, one core each, bound.
        (1, 2, "localhost", 2, {}, (2, 1, 1, "core", False)),
        # A 2-socket node of 24-core sockets: the paper's layout, one rank per socket with all its cores.
        (2, 24, "localhost", 2, {}, (1, 24, 24, "core", False)),
        (2, 24, "hostfile:node01 slots=2\nnode02 slots=2\n", 4, {}, (1, 24, 24, "core", False)),
        (2, 24, "node01:4,node02:4", 8, {}, (2, 12, 12, "core", False)),
        (2, 24, "hostfile:node01:4\nnode02:4\n", 8, {}, (2, 12, 12, "core", False)),  # Hydra's form
        (2, 24, "hostfile:# no slots given\nnode01\nnode02\nnode03\n", 6, {}, (1, 24, 24, "core", False)),
        # More ranks than cores: they cannot have cores of their own.
        (1, 2, "localhost", 4, {}, (4, 1, 1, "none", True)),
        # What the user exports wins; Slurm's --cpus-per-task sets the cores per rank.
        (1, 2, "localhost", 2, {"RANKS_PER_SOCKET": "1", "THREADS_PER_RANK": "2"}, (1, 2, 2, "core", False)),
        (2, 24, "localhost", 2, {"SLURM_CPUS_PER_TASK": "6"}, (1, 6, 6, "core", False)),
        # TensorFlow's own oneDNN choice differs by CPU (off on an AVX2-only EPYC): env.sh leaves it alone.
        (1, 2, "localhost", 2, {"TF_ENABLE_ONEDNN_OPTS": "0"}, (2, 1, 1, "core", False)),
    ],
)
def test_placement_comes_from_the_hosts_sockets_and_slots(tmp_path, sockets, cores, hosts, ranks, env, want):
    if hosts.startswith("hostfile:"):
        (tmp_path / "hostfile").write_text(hosts[len("hostfile:") :])
        hosts = str(tmp_path / "hostfile")
    # What launch/env.sh decides for `ranks` ranks over `hosts` (a hostfile, a host list or localhost).
    script = (
        'source launch/env.sh && hvd_lars_place "$(hvd_lars_ranks_per_host "$HOSTS" "$RANKS")" && '
        'echo "$RANKS_PER_SOCKET $THREADS_PER_RANK $OMP_NUM_THREADS ${MPI_BIND:-core} '
        '${MPI_OVERSUBSCRIBE:-0} ${TF_ENABLE_ONEDNN_OPTS-unset}"'
    )
    machine = _machine(sockets, cores, HOSTS=hosts, RANKS=str(ranks), **env)
    result = subprocess.run(
        ["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, env=machine
    )
    assert result.returncode == 0, result.stderr
    per_socket, threads, omp, bind, oversubscribe, onednn = result.stdout.split()
    got = (int(per_socket), int(threads), int(omp), bind, oversubscribe == "1", onednn)
    assert got == (*want, env.get("TF_ENABLE_ONEDNN_OPTS", "unset"))


@pytest.mark.horovod  # subprocesses (the launch scripts), no Horovod ranks
@pytest.mark.parametrize(
    "family, sockets, cores, want",
    [
        ("openmpi", 1, 2, ["--map-by", "ppr:2:socket:PE=1", "--bind-to", "core"]),
        ("openmpi", 2, 16, ["--map-by", "ppr:1:socket:PE=16", "--bind-to", "core"]),
        ("mpich", 1, 2, ["-map-by", "socket", "-bind-to", "core:1"]),
        ("mpich", 2, 16, ["-map-by", "socket", "-bind-to", "core:16"]),
    ],
)
def test_mpirun_sh_places_two_ranks_by_the_machine_under_open_mpi_and_hydra(
    tmp_path, family, sockets, cores, want
):
    # An `mpirun` that says which MPI it is and writes the arguments it was given, one per line.
    version = {"openmpi": "mpirun (Open MPI) 4.1.4", "mpich": "HYDRA build details:\n    Version: 4.0.2"}
    (tmp_path / "mpirun").write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then printf "{version[family]}\\n"; exit 0; fi\n'
        f'printf "%s\\n" "$@" > {tmp_path}/args\n'
    )
    (tmp_path / "mpirun").chmod(0o755)
    machine = _machine(sockets, cores, PATH=f"{tmp_path}:{os.environ['PATH']}")
    result = _launch("mpirun.sh", "localhost", "2", "flags/smoke.flags", env=machine)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    start = args.index(want[0])
    assert args[start : start + len(want)] == want, args
    assert args[args.index("-m") + 1 :][:2] == ["hvd_lars.main", "--flagfile=flags/smoke.flags"]
