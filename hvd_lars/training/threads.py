"""How many cores one rank may really use, and the thread pools sized from that one figure.

A rank's threads (TensorFlow's intra-op and inter-op pools, the input pipeline's private pool) come from
the cores the process may run on, not from `os.cpu_count()` and not from one MPI's launcher variables:

    cores  = os.sched_getaffinity(0)             the CPUs this process may run on (the launcher's binding)
    usable = the node's CPUs open to this job     the cgroup's cpuset, capped by a cgroup CPU quota
    share  = ceil(local_size * |cores| / usable)  local ranks whose masks must overlap on these cores
    threads per rank = max(1, |cores| // share)

Bound ranks (`mpirun --map-by ppr:1:socket:PE=T --bind-to core`, srun's `--cpu-bind=cores`, `taskset`)
have disjoint masks, so share = 1 and a rank gets every core of its mask; unbound ranks all see every
usable core, so share = local_size (Horovod's count of ranks on this host) and each gets usable /
local_size; ranks bound several to one socket (`--bind-to socket`) share that socket's cores. CPUs are
logical CPUs (hyperthreads count), as in TensorFlow's own defaults.
"""

import math
import os

import tensorflow as tf

from hvd_lars.parallel import collectives, ompi_allreduce_rules

# Where cgroups keep the CPUs and CPU time a process's group may use (v2, then v1).
_CGROUP_ROOT = "/sys/fs/cgroup"


def rank_cores():
    """Sorted list of the logical CPUs this process may run on (its affinity mask), e.g. [0, 1]."""
    return sorted(os.sched_getaffinity(0))


def _cgroup_paths():
    """{controller: path} of this process from /proc/self/cgroup ("" is the v2 unified hierarchy)."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    paths[controller] = path
    except (OSError, ValueError):
        pass
    return paths


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def parse_cpu_list(text):
    """'0-3,8,10-11' (the kernel's CPU list format) -> [0, 1, 2, 3, 8, 10, 11].

    Raises:
        ValueError: text that is not a CPU list, quoted.
    """
    cpus = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"CPU list {text!r}: expected ranges such as '0-3,8'.")
        cpus.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cpus))


def usable_cpus():
    """Number of logical CPUs of this node open to this process's job (an int >= 1).

    The cgroup's effective cpuset (v2 `cpuset.cpus.effective`, v1 `cpuset.effective_cpus`) when one is
    readable, else every online CPU (`os.cpu_count()`); capped by a cgroup CPU quota (v2 `cpu.max`, v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`; containers started with `--cpus`), rounded up.
    """
    paths = _cgroup_paths()
    count = os.cpu_count() or 1
    for controller, names in (("", ("cpuset.cpus.effective",)), ("cpuset", ("cpuset.effective_cpus",))):
        if controller not in paths:
            continue
        base = _CGROUP_ROOT if controller == "" else os.path.join(_CGROUP_ROOT, controller)
        for name in names:
            text = _read(os.path.join(base, paths[controller].lstrip("/"), name))
            if text:
                count = len(parse_cpu_list(text))
                break
    quota = None
    if "" in paths:
        text = _read(os.path.join(_CGROUP_ROOT, paths[""].lstrip("/"), "cpu.max"))
        if text and not text.startswith("max"):
            limit, period = text.split()
            quota = int(limit) / int(period)
    if quota is None and "cpu" in paths:
        folder = os.path.join(_CGROUP_ROOT, "cpu", paths["cpu"].lstrip("/"))
        limit, period = (
            _read(os.path.join(folder, "cpu.cfs_quota_us")),
            _read(os.path.join(folder, "cpu.cfs_period_us")),
        )
        if limit and period and int(limit) > 0:
            quota = int(limit) / int(period)
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def threads_per_rank(local_size=None, cores=None, usable=None):
    """Threads one rank should run: the cores of its affinity mask, divided among the local ranks that
    must share them (module docstring).

    Args:
        local_size: ranks on this host (default: `hvd_lars.parallel.collectives.local_size()`, Horovod's
        count; 1
            before `collectives.init()` or without Horovod).
        cores: this rank's CPUs (default `rank_cores()`).
        usable: the node's CPUs open to the job (default `usable_cpus()`).

    Returns:
        int >= 1.

    Raises:
        ValueError: local_size < 1 or an empty core list.
    """
    if local_size is None:
        local_size = collectives.local_size()
    cores = rank_cores() if cores is None else list(cores)
    usable = usable_cpus() if usable is None else usable
    if local_size < 1 or not cores:
        raise ValueError(f"threads_per_rank: local_size={local_size}, cores={cores}; need >= 1 of each.")
    mask = min(len(cores), max(1, usable))
    share = max(1, math.ceil(local_size * mask / max(1, usable)))
    return max(1, mask // share)


def placement(local_size=None):
    """What this rank may use, for the run log and summary.json: dict with `cores` (its affinity mask),
    `bound` (True when the mask is narrower than the node's usable CPUs, i.e. a launcher or taskset bound
    it), `usable` (the node's usable CPUs), `local_size` and `threads` (`threads_per_rank`)."""
    if local_size is None:
        local_size = collectives.local_size()
    cores, usable = rank_cores(), usable_cpus()
    return {
        "cores": cores,
        "bound": len(cores) < usable,
        "usable": usable,
        "local_size": local_size,
        "threads": threads_per_rank(local_size, cores, usable),
    }


def describe_cores(cores):
    """[0, 1, 2, 5] -> '0-2,5' (the kernel's CPU list format)."""
    ranges, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            ranges.append(f"{start}" if start == c else f"{start}-{c}")
            start = None
    return ",".join(ranges)


def configure_threads(config, world_size):
    """Sizes TensorFlow's intra-op and inter-op pools to the cores this rank may use
    (`hvd_lars.training.threads.threads_per_rank`: its affinity mask when the launcher bound it, else the
    node's
    usable CPUs / Horovod's local_size()), unless `config.intra_op_threads` / `inter_op_threads` say.

    Must run after `collectives.init()` and before TensorFlow executes its first op; afterwards
    TensorFlow keeps the pools it has (then `applied_threads()` reports those, not the request).

    Returns:
        (intra, inter): the requested pool sizes.
    """
    local_ranks = max(1, min(world_size, collectives.local_size()))
    per_rank = threads_per_rank(local_ranks)
    intra = config.intra_op_threads or per_rank
    inter = config.inter_op_threads or per_rank
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    except RuntimeError:
        pass  # TensorFlow already initialised by the caller: it keeps its pools (reported by the run).
    return intra, inter


def applied_threads(dataset=None):
    """The thread settings in force, read back from TensorFlow (not from the flags).

    Args:
        dataset: optional `tf.data.Dataset` (the training input) whose private pool is reported.

    Returns:
        dict: `intra_op` and `inter_op`, the pool sizes TensorFlow's context was initialised with (0 means
        TensorFlow's own default, one thread per core), `input`, the private thread pool of `dataset`'s
        options (None without a dataset; 0: tf.data's shared pool), and `omp_num_threads`, the
        OMP_NUM_THREADS environment variable (None when unset) that OpenMP code in this process reads.
    """
    tf.constant(0.0) + 0.0  # TensorFlow fixes its pools when it first runs an op; make sure it has
    threads = {
        "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        "input": None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    if dataset is not None:
        threads["input"] = dataset.options().threading.private_threadpool_size or 0
    return threads


def describe_placements(placements):
    """One log line from every rank's `hvd_lars.training.threads.placement()` joined with its
    `applied_threads`:
    host, the CPUs the rank may use (bound by the launcher or not) and the threads TensorFlow and the
    input pipeline run with, e.g. "cores per rank: rank 0 on node1: CPUs 0 (bound), 1 intra-op / 1
    inter-op / 1 input threads; ..."."""
    parts = []
    for rank, p in enumerate(placements):
        how = "bound" if p["bound"] else f"unbound, {p['local_size']} ranks on the host"
        parts.append(
            f"rank {rank} on {p['host']}: CPUs {describe_cores(p['cores'])} ({how}), "
            f"{p['intra_op']} intra-op / {p['inter_op']} inter-op / {p['input']} input threads"
        )
    return "cores per rank: " + "; ".join(parts)


# Horovod's background thread negotiates every HOROVOD_CYCLE_TIME ms in blocking MPI calls and Open MPI
# polls while it waits: with every core busy in the compute pool, that polling takes a core from the step.
# A 5 ms cycle (Horovod's default before 0.21) and MPI yielding while it waits give the core back
# (results/scaling.md, section threads, measures both). Open MPI's allreduce rules are the library's
# (hvd_lars.parallel.ompi_allreduce_rules, which says why and when a job gets them).
OMPI_ALLREDUCE_RULES = ompi_allreduce_rules.RULES_FILE
HOROVOD_CPU_DEFAULTS = {
    "HOROVOD_CYCLE_TIME": "5",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    **ompi_allreduce_rules.RULES_SETTINGS,
}


def apply_horovod_cpu_defaults(environ=None):
    """Sets Horovod's cycle time and Open MPI's yielding of `HOROVOD_CPU_DEFAULTS` in `environ` (default
    `os.environ`) where they are not set already, and the allreduce rules where
    `hvd_lars.parallel.ompi_allreduce_rules.apply` gives them (a CPU-only Open MPI job whose user and site
    chose no allreduce); returns {name: value} of those set. Call before Horovod initialises MPI
    (`collectives.init()`): all are read there. A value the user or the launcher exported is kept."""
    environ = os.environ if environ is None else environ
    applied = {
        k: v
        for k, v in HOROVOD_CPU_DEFAULTS.items()
        if k not in environ and k not in ompi_allreduce_rules.RULES_SETTINGS
    }
    environ.update(applied)
    applied.update(ompi_allreduce_rules.apply(environ)[0])
    return applied
