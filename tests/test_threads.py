"""hvd_lars.threads: threads per rank from the cores the process may use, read back from TensorFlow."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from hvd_lars.threads import describe_cores, parse_cpu_list, threads_per_rank


@pytest.mark.parametrize(
    "local_size, cores, usable, threads",
    [
        (1, [0], 2, 1),  # taskset -c 0
        (1, [0, 1], 2, 2),  # one rank alone on its node, unbound: every core
        (2, [0, 1], 2, 1),  # two unbound ranks share 2 cores
        (2, [1], 2, 1),  # two ranks bound one core each
        (2, range(8), 16, 8),  # one rank per 8-core socket, bound (mpirun ppr:1:socket:PE=8)
        (4, range(8), 16, 4),  # two ranks per socket bound to the whole socket (--bind-to socket)
        (4, range(16), 16, 4),  # four unbound ranks on 16 cores
        (3, range(16), 16, 5),  # 16 // 3
        (1, range(64), 2, 2),  # a cgroup quota of 2 CPUs under a 64-CPU mask
        (8, [0, 1], 2, 1),  # more ranks than cores: at least 1
    ],
)
def test_threads_per_rank(local_size, cores, usable, threads):
    assert threads_per_rank(local_size, cores, usable) == threads


def test_cpu_lists():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert describe_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(ValueError, match="'0-a'"):
        parse_cpu_list("0-a")
    with pytest.raises(ValueError, match="local_size=0"):
        threads_per_rank(0, [0], 2)


# One process as a rank starts: Horovod initialised, pools sized, a training pipeline built; prints what
# TensorFlow and tf.data applied (read back, not the request).
_RANK = """
import json
from hvd_lars import distributed
from hvd_lars.config import TrainConfig
from hvd_lars.data import pipeline
from hvd_lars.train import applied_threads, configure_threads
import tensorflow as tf
rank, size = distributed.init()
configure_threads(TrainConfig(), size)
ds = tf.data.Dataset.range(4).with_options(pipeline.options(True))
print("THREADS " + json.dumps(applied_threads(ds)))
"""


def _rank_threads(prefix=(), env=None):
    result = subprocess.run(
        [*prefix, sys.executable, "-c", _RANK], cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO, **(env or {})),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("THREADS ")][-1]
    return json.loads(line[len("THREADS ") :])


def test_a_rank_bound_to_one_core_runs_one_thread():
    threads = _rank_threads(["taskset", "-c", str(min(os.sched_getaffinity(0)))])
    assert (threads["intra_op"], threads["inter_op"], threads["input"]) == (1, 1, 1)


def test_one_rank_per_node_under_srun_gets_all_its_cores():
    # What srun sets for 1 task on each of 2 nodes of a job allocated 2 tasks per node: the job-level
    # count (SLURM_NTASKS_PER_NODE=2) is not this step's, and only Horovod's local_size() is trusted.
    cores = len(os.sched_getaffinity(0))
    slurm = {
        "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": str(cores),
    }  # fmt: skip
    threads = _rank_threads(env=slurm)
    assert (threads["intra_op"], threads["inter_op"], threads["input"]) == (cores, cores, cores)
