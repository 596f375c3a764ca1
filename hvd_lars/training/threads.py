"""How many cores one rank may use, and the thread pools sized from that one figure:

    cores  = os.sched_getaffinity(0)             the CPUs this process may run on (the launcher's binding)
    usable = the node's CPUs open to this job     the cgroup's cpuset, capped by a cgroup CPU quota
    share  = ceil(local_size * |cores| / usable)  local ranks whose masks overlap on these cores
    threads per rank = max(1, |cores| // share)

Bound ranks have disjoint masks (share 1); unbound ranks share the usable CPUs among Horovod's local_size.
CPUs are logical CPUs, as in TensorFlow's own defaults.
"""

import math
import os

import tensorflow as tf

from hvd_lars.parallel import collectives, ompi_allreduce_rules


def parse_cpu_list(text):
    """'0-3,8,10-11' (the kernel's CPU list format) -> [0, 1, 2, 3, 8, 10, 11]; `ValueError` otherwise."""
    cpus = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"CPU list {text!r}: expected ranges such as '0-3,8'.")
        cpus.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cpus))


def usable_cpus():
    """Logical CPUs of this node open to this job: the cgroup's effective cpuset (else `os.cpu_count()`),
    capped by a cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us`; containers started with `--cpus`)."""
    groups = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    groups[controller] = os.path.join("/sys/fs/cgroup", controller, path.lstrip("/"))
    except (OSError, ValueError):
        pass

    def read(controller, name):
        try:
            with open(os.path.join(groups[controller], name)) as f:
                return f.read().split()
        except (KeyError, OSError):
            return []

    cpus = read("", "cpuset.cpus.effective") or read("cpuset", "cpuset.effective_cpus")
    count = len(parse_cpu_list(cpus[0])) if cpus else os.cpu_count() or 1
    quota = read("", "cpu.max")
    if not quota or quota[0] == "max":
        quota = read("cpu", "cpu.cfs_quota_us") + read("cpu", "cpu.cfs_period_us")
    if len(quota) == 2 and int(quota[0]) > 0:
        count = min(count, math.ceil(int(quota[0]) / int(quota[1])))
    return max(1, count)


def threads_per_rank(local_size=None, cores=None, usable=None):
    """Threads one rank should run, an int >= 1 (the module's formula; `ValueError` for local_size < 1 or
    no cores). Defaults: `collectives.local_size()` (1 before `init`), the affinity mask, `usable_cpus()`."""
    local_size = collectives.local_size() if local_size is None else local_size
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    usable = usable_cpus() if usable is None else usable
    if local_size < 1 or not cores:
        raise ValueError(f"threads_per_rank: local_size={local_size}, cores={cores}; need >= 1 of each.")
    mask = min(len(cores), usable)
    return max(1, mask // math.ceil(local_size * mask / usable))


def placement(local_size=None):
    """This rank's `cores` (affinity mask), `bound` (narrower than the `usable` CPUs), `local_size` and
    `threads` (`threads_per_rank`), as a dict for the run log and summary.json."""
    local_size = collectives.local_size() if local_size is None else local_size
    cores, usable = sorted(os.sched_getaffinity(0)), usable_cpus()
    return {
        "cores": cores,
        "bound": len(cores) < usable,
        "usable": usable,
        "local_size": local_size,
        "threads": threads_per_rank(local_size, cores, usable),
    }


def describe_cores(cores):
    """[0, 1, 2, 5] -> '0-2,5' (the kernel's CPU list format)."""
    ranges = []
    for c in cores:
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def configure_threads(config, world_size):
    """Sizes TensorFlow's intra-op and inter-op pools to `threads_per_rank` unless `config.intra_op_threads`
    / `inter_op_threads` say; returns the requested (intra, inter). Call after `collectives.init()` and
    before TensorFlow runs its first op: afterwards TensorFlow keeps its pools (`applied_threads` tells)."""
    per_rank = threads_per_rank(max(1, min(world_size, collectives.local_size())))
    intra = config.intra_op_threads or per_rank
    inter = config.inter_op_threads or per_rank
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    except RuntimeError:
        pass  # TensorFlow already initialised: it keeps its pools
    return intra, inter


def applied_threads(dataset=None):
    """The thread settings in force, read back from TensorFlow: dict of `intra_op`, `inter_op` (0:
    TensorFlow's default), `input` (`dataset`'s private pool; None without one, 0: tf.data's shared pool)
    and `omp_num_threads` (the environment's OMP_NUM_THREADS or None)."""
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
        how = "bound" if p["bound"] else f"unbound, {p['local_size']} ranks on the host"
        parts.append(
            f"rank {rank} on {p['host']}: CPUs {describe_cores(p['cores'])} ({how}), "
            f"{p['intra_op']} intra-op / {p['inter_op']} inter-op / {p['input']} input threads"
        )
    return "cores per rank: " + "; ".join(parts)


# Horovod's background thread negotiates every HOROVOD_CYCLE_TIME ms and Open MPI polls while it waits,
# taking a core from the step: a 5 ms cycle and MPI yielding give it back (results/scaling.md, threads).
HOROVOD_CPU_DEFAULTS = {
    "HOROVOD_CYCLE_TIME": "5",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    **ompi_allreduce_rules.RULES_SETTINGS,
}


def apply_horovod_cpu_defaults(environ=None):
    """Sets `HOROVOD_CPU_DEFAULTS` that are not set already in `environ` (default `os.environ`), the
    allreduce rules where `ompi_allreduce_rules.apply` gives them; returns {name: value} of those set.
    Call before `collectives.init()`, where MPI reads them."""
    environ = os.environ if environ is None else environ
    rules = ompi_allreduce_rules.RULES_SETTINGS
    applied = {k: v for k, v in HOROVOD_CPU_DEFAULTS.items() if k not in environ and k not in rules}
    environ.update(applied)
    applied.update(ompi_allreduce_rules.apply(environ)[0])
    return applied
