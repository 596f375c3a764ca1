"""Threads per rank = max(1, |cores| // ceil(local_size x |cores| / usable)): mask, job's CPUs of the node."""

import contextlib
import math
import os

import tensorflow as tf

from hvd_lars.arguments import counted
from hvd_lars.parallel import collectives


def usable_cpus():
    """CPUs of this node open to this job: its cgroup's cpuset (else all), capped by its CPU quota."""

    def read(controller, name):  # controller "": cgroup v2's unified hierarchy
        try:
            with open("/proc/self/cgroup") as f:
                for _, controllers, path in (line.rstrip("\n").split(":", 2) for line in f):
                    if controller in controllers.split(","):
                        with open(os.path.join("/sys/fs/cgroup", controller, path.lstrip("/"), name)) as g:
                            return g.read().split()
        except (OSError, ValueError):
            pass
        return []

    cpus = (read("", "cpuset.cpus.effective") or read("cpuset", "cpuset.effective_cpus") or [""])[0]
    ranges = [part.partition("-") for part in cpus.split(",") if part]  # the kernel's list: "0-3,8"
    count = sum(int(last or first) - int(first) + 1 for first, _, last in ranges) or os.cpu_count() or 1
    quota = read("", "cpu.max") or read("cpu", "cpu.cfs_quota_us") + read("cpu", "cpu.cfs_period_us")
    if len(quota) == 2 and quota[0] != "max" and int(quota[0]) > 0:  # "max", -1: no quota
        count = min(count, math.ceil(int(quota[0]) / int(quota[1])))
    return max(1, count)


def threads_per_rank(local_size=None, cores=None, usable=None):
    """Threads one rank should run (>= 1, the module's formula); defaults: this process's figures."""
    local_size = collectives.local_size() if local_size is None else local_size
    usable = usable or usable_cpus()
    mask = min(len(os.sched_getaffinity(0) if cores is None else cores), usable)
    return max(1, mask // math.ceil(local_size * mask / usable))


def placement():
    """This rank's `cores` (affinity mask), `bound` (fewer than `usable_cpus()`) and `local_size`."""
    cores = sorted(os.sched_getaffinity(0))
    return dict(cores=cores, bound=len(cores) < usable_cpus(), local_size=collectives.local_size())


def configure_threads(config):
    """Sizes TensorFlow's pools (before its first op) to `threads_per_rank` or the config's; returns them."""
    per_rank = threads_per_rank(collectives.local_size())
    intra, inter = config.intra_op_threads or per_rank, config.inter_op_threads or per_rank
    with contextlib.suppress(RuntimeError):  # TensorFlow already initialised: it keeps its pools
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    return intra, inter


def applied_threads(dataset=None):
    """The thread settings in force: `intra_op`, `inter_op`, `input` (`dataset`'s pool), `omp_num_threads`."""
    tf.constant(0.0) + 0.0  # TensorFlow fixes its pools when it first runs an op
    return {
        "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        "input": None if dataset is None else dataset.options().threading.private_threadpool_size or 0,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def describe_placements(placements):
    """One log line of every rank's `placement()` joined with its host and `applied_threads`."""
    parts = []
    for rank, p in enumerate(placements):
        c = p["cores"]
        how = "bound" if p["bound"] else f"unbound, {counted(p['local_size'], 'rank')} on the host"
        cpus = f"{c[0]}-{c[-1]}" if len(c) > 1 and c[-1] - c[0] == len(c) - 1 else ",".join(map(str, c))
        parts.append(
            f"rank {rank} on {p['host']}: CPUs {cpus} ({how}), "
            f"{p['intra_op']} intra-op / {p['inter_op']} inter-op / {p['input']} input threads"
        )
    return "cores per rank: " + "; ".join(parts)
