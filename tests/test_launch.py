"""launch/horovodrun.sh and launch/mpirun.sh run smoke.flags on 2 ranks; bad arguments are refused."""

import json
import os
import socket
import subprocess

import pytest

from tests.support import REPO

LAUNCH = os.path.join(REPO, "launch")


def _launch(script, *args, env=None):
    return subprocess.run(
        [os.path.join(LAUNCH, script), *args], cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, **(env or {})),
    )  # fmt: skip


@pytest.mark.horovod
@pytest.mark.parametrize(
    "script, first",
    [("horovodrun.sh", "localhost:2"), ("mpirun.sh", "localhost")],
)
def test_two_ranks_run_smoke_flags(script, first, tmp_path):
    # One socket with two cores here: two ranks per socket, one thread each.
    result = _launch(
        script, first, "2", "flags/smoke.flags", f"--workdir={tmp_path}", env={"RANKS_PER_SOCKET": "2"}
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "global batch 32 = 2 ranks x per-rank batch 16" in result.stdout
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
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
    # One host: both ranks are local (tests/test_cluster.py covers 2 hosts).
    assert summary["hosts"] == [socket.gethostname()]
    assert summary["local_size"] == 2 and summary["cross_size"] == 1


@pytest.mark.horovod
@pytest.mark.parametrize("script", ["horovodrun.sh", "mpirun.sh"])
def test_usage_and_missing_flagfile(script):
    result = _launch(script)
    assert result.returncode == 2 and "Usage:" in result.stderr
    result = _launch(script, "localhost", "2", "flags/nope.flags")
    assert result.returncode == 2 and "flagfile 'flags/nope.flags' not found" in result.stderr


@pytest.mark.horovod  # a subprocess (the tier of tests that start processes); no Horovod ranks
@pytest.mark.parametrize("given", [None, "0", "1"])
def test_env_sh_leaves_tensorflows_onednn_choice_alone(given):
    # TensorFlow turns its oneDNN kernels on by itself on some CPUs and not on others (off on an AVX2-only
    # EPYC): set by the launch scripts, a job of theirs rounded differently from a bare horovodrun's.
    env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
    if given is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = given
    result = subprocess.run(
        ["bash", "-c", 'source launch/env.sh && echo "[${TF_ENABLE_ONEDNN_OPTS-unset}]"'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == f"[{given or 'unset'}]"
