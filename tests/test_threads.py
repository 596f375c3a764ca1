"""hvd_lars.training.threads: threads per rank from the cores the process may use, read back from
TensorFlow; the Horovod and Open MPI defaults the main program sets before hvd.init()."""

import json
import os
import subprocess
import sys

import pytest

from hvd_lars.parallel import ompi_allreduce_rules
from hvd_lars.training import threads
from hvd_lars.training.config import TrainConfig
from tests.support import REPO

RULES = os.path.join(REPO, "hvd_lars", "parallel", "ompi_allreduce_rules.conf")


@pytest.mark.unit
@pytest.mark.parametrize(
    "local_size, cores, usable, expected",
    [
        (1, [0, 1], 2, 2),  # one rank alone on its node, unbound: every core
        (2, [0, 1], 2, 1),  # two unbound ranks share 2 cores
        (2, [1], 2, 1),  # two ranks bound one core each
        (2, range(8), 16, 8),  # one rank per 8-core socket, bound (mpirun ppr:1:socket:PE=8)
        (4, range(8), 16, 4),  # two ranks per socket bound to the whole socket (--bind-to socket)
        (3, range(16), 16, 5),  # three unbound ranks on 16 cores: 16 // 3
        (1, range(64), 2, 2),  # a cgroup quota of 2 CPUs under a 64-CPU mask
        (8, [0, 1], 2, 1),  # more ranks than cores: at least 1
    ],
)
def test_threads_per_rank(local_size, cores, usable, expected):
    assert threads.threads_per_rank(local_size, cores, usable) == expected


@pytest.mark.unit
def test_the_run_log_line_names_each_ranks_cpus_and_threads():
    bound = dict(host="a", cores=[4], bound=True, local_size=2, intra_op=1, inter_op=1, input=1)
    unbound = dict(bound, host="b", cores=[0, 1, 2, 3], bound=False, intra_op=2, inter_op=2, input=0)
    alone = dict(unbound, local_size=1)
    assert "CPUs 0-3 (unbound, 1 rank on the host)" in threads.describe_placements([alone])
    assert threads.describe_placements([bound, unbound, dict(unbound, cores=[0, 2, 3])]) == (
        "cores per rank: rank 0 on a: CPUs 4 (bound), 1 intra-op / 1 inter-op / 1 input threads; "
        "rank 1 on b: CPUs 0-3 (unbound, 2 ranks on the host), 2 intra-op / 2 inter-op / 0 input threads; "
        "rank 2 on b: CPUs 0,2,3 (unbound, 2 ranks on the host), 2 intra-op / 2 inter-op / 0 input threads"
    )


# One process as a rank starts: Horovod initialised, pools sized, a training pipeline built; prints what
# TensorFlow and tf.data applied (read back, not the request).
_RANK = """
import json
from hvd_lars.parallel import collectives
from hvd_lars.training.config import TrainConfig
from hvd_lars.data import tfdata_options
from hvd_lars.training.threads import applied_threads, configure_threads
import tensorflow as tf
collectives.init()
configure_threads(TrainConfig())
ds = tf.data.Dataset.range(4).with_options(tfdata_options.options(True))
print("THREADS " + json.dumps(applied_threads(ds)))
"""
# What srun sets for 1 task on each of 2 nodes of a job allocated 2 tasks per node: the job-level count
# (SLURM_NTASKS_PER_NODE=2) is not this step's, and only Horovod's local_size() is trusted.
SRUN = {
    "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NODEID": "0",
    "SLURM_CPUS_ON_NODE": str(len(os.sched_getaffinity(0))),
}  # fmt: skip


@pytest.mark.horovod
@pytest.mark.parametrize(
    "prefix, env, expected",
    [
        (["taskset", "-c", str(min(os.sched_getaffinity(0)))], {}, 1),  # a rank bound to one core
        ([], SRUN, len(os.sched_getaffinity(0))),  # one rank per node under srun: all its cores
    ],
    ids=["bound_to_one_core", "one_rank_per_node_under_srun"],
)
def test_a_rank_runs_one_thread_per_core_it_has(prefix, env, expected):
    result = subprocess.run(
        [*prefix, sys.executable, "-c", _RANK], cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO, **env),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("THREADS ")][-1]
    applied = json.loads(line[len("THREADS ") :])
    assert (applied["intra_op"], applied["inter_op"], applied["input"]) == (expected,) * 3


@pytest.mark.unit
def test_horovod_cpu_defaults_fill_only_what_is_unset_on_a_cpu_job():
    # The user's opt-out of the rules is an allreduce chosen: the rules are left out (the other cases of
    # hvd_lars.parallel.ompi_allreduce_rules.apply: tests/test_horovod_keras.py).
    environ = {"HOROVOD_CYCLE_TIME": "0.5", "PATH": "/bin", "OMPI_MCA_coll_tuned_use_dynamic_rules": "0"}
    before = dict(environ)
    applied, _ = ompi_allreduce_rules.apply(environ, open_mpi=True, gpu=False)
    assert applied == {"OMPI_MCA_mpi_yield_when_idle": "1"} and environ == {**before, **applied}
    assert ompi_allreduce_rules.apply(environ, open_mpi=True, gpu=False)[0] == {}
    assert ompi_allreduce_rules.apply({}, open_mpi=True, gpu=False, rules=False) == (
        {"HOROVOD_CYCLE_TIME": "5", "OMPI_MCA_mpi_yield_when_idle": "1"},
        None,
    )
    # Open MPI's rules file: allreduce (collective 2), one rule for communicators of 3 ranks and more: below
    # 1 MiB algorithm 0 (Open MPI's own choice), from 1 MiB (1,048,576 B) algorithm 4, the ring.
    with open(RULES) as f:
        assert f.read().split() == "1 2 1 3 2 0 0 0 0 1048576 4 0 0".split()


@pytest.mark.unit
def test_the_main_program_sets_the_cpu_defaults_before_training(monkeypatch):
    from hvd_lars import main

    defaults = {**ompi_allreduce_rules.CPU_DEFAULTS, **ompi_allreduce_rules.RULES_SETTINGS}
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in defaults})
    names = ("HOROVOD_CYCLE_TIME", "OMPI_MCA_mpi_yield_when_idle", "OMPI_MCA_coll_tuned_use_dynamic_rules")
    seen = []
    monkeypatch.setattr(main, "run_training", lambda config: seen.append([os.environ.get(k) for k in names]))
    main._main(TrainConfig())
    assert seen == [["5", "1", "1"]] and os.environ["OMPI_MCA_coll_tuned_dynamic_rules_filename"] == RULES


@pytest.mark.unit
def test_thread_settings_are_read_back_from_tensorflow():
    import tensorflow as tf

    tf.constant(1.0) + 1.0  # this process's TensorFlow is initialised: its pools are fixed
    before = threads.applied_threads()
    requested = threads.configure_threads(TrainConfig(intra_op_threads=7, inter_op_threads=3))
    assert requested == (7, 3)
    # The request came too late: what is reported is what TensorFlow runs with, not the request.
    assert threads.applied_threads() == before and (before["intra_op"], before["inter_op"]) != (7, 3)
    assert before["intra_op"] == tf.config.threading.get_intra_op_parallelism_threads()
