"""Horovod and Open MPI settings for CPU ranks, set by `apply` before MPI starts (`horovod_keras.init()`,
the training application's `main`): `CPU_DEFAULTS`, and the coll/tuned rules file beside this module (from
1 MiB on 3+ ranks the ring, algorithm 4; below it Open MPI's choice); why the ring, and what it costs (sums
that depend on the order gradients arrive): results/allreduce_hosts.md.
"""

import os
import shutil

RULES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ompi_allreduce_rules.conf")
# The communicator size from which the file's rules apply.
MIN_RANKS = 3
RULES_SETTINGS = {
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_dynamic_rules_filename": RULES_FILE,
}
# Horovod's and Open MPI's polling take a core from the ranks' own work: a 5 ms cycle, MPI yielding while
# it waits (results/archive/scaling_threads.md; results/peer.md, 2 ranks on one 2-core machine).
CPU_DEFAULTS = {"HOROVOD_CYCLE_TIME": "5", "OMPI_MCA_mpi_yield_when_idle": "1"}
# Open MPI's names for choosing collectives: the tuned component's parameters, and the component list.
_CHOICE_PREFIX, _COMPONENT_CHOICE = "coll_tuned_", "coll"


def parameter_files(environ=None):
    """The Open MPI parameter files that exist, in Open MPI's order: `OMPI_MCA_mca_base_param_files`'s
    list, else `$HOME/.openmpi/mca-params.conf` and `openmpi-mca-params.conf` of `$OPAL_SYSCONFDIR`,
    `$OPAL_PREFIX/etc`, the `mpirun` on PATH's `<prefix>/etc`, `/etc/openmpi`."""
    environ = os.environ if environ is None else environ
    listed = environ.get("OMPI_MCA_mca_base_param_files")
    if listed is not None:
        candidates = listed.split(os.pathsep)
    else:
        home = environ.get("HOME") or os.path.expanduser("~")
        folders = [environ.get("OPAL_SYSCONFDIR", "")]
        if environ.get("OPAL_PREFIX"):
            folders.append(os.path.join(environ["OPAL_PREFIX"], "etc"))
        mpirun = shutil.which("mpirun", path=environ.get("PATH"))
        if mpirun:
            folders.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(mpirun))), "etc"))
        folders.append("/etc/openmpi")
        candidates = [os.path.join(home, ".openmpi", "mca-params.conf")]
        candidates += [os.path.join(f, "openmpi-mca-params.conf") for f in folders if f]
    paths = [os.path.expanduser(p.strip()) for p in candidates]
    return [p for i, p in enumerate(paths) if p and p not in paths[:i] and os.path.isfile(p)]


def chosen_allreduce(environ=None, files=None):
    """Where the user or the site chose Open MPI's collectives, or None: the first `OMPI_MCA_coll_tuned_*`
    (or `OMPI_MCA_coll`) variable of `environ` ("OMPI_MCA_coll_tuned_use_dynamic_rules=0"), else the first
    `coll_tuned_*` (or `coll`) line of a parameter file (`files`, default `parameter_files(environ)`)."""
    environ = os.environ if environ is None else environ
    for name in sorted(environ):
        if name.startswith("OMPI_MCA_" + _CHOICE_PREFIX) or name == "OMPI_MCA_" + _COMPONENT_CHOICE:
            return f"{name}={environ[name]}"
    for path in parameter_files(environ) if files is None else files:
        try:
            with open(path) as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            name = line.split("#", 1)[0].split("=", 1)[0].strip()
            if name.startswith(_CHOICE_PREFIX) or name == _COMPONENT_CHOICE:
                return f"{name} in {path}"
    return None


def open_mpi_job(environ=None):
    """True when Horovod would reduce through Open MPI: its MPI is Open MPI (libopen-pal loaded with
    `horovod.tensorflow`, or `OMPI_COMM_WORLD_SIZE` set) and its controller is not Gloo."""
    environ = os.environ if environ is None else environ
    if environ.get("HOROVOD_CONTROLLER", "").lower() == "gloo" or "HOROVOD_GLOO_RENDEZVOUS_ADDR" in environ:
        return False
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return True
    try:
        import horovod.tensorflow  # noqa: F401  (loads Horovod's MPI library, without starting MPI)
    except ImportError:
        return False
    try:
        with open("/proc/self/maps") as f:
            return any("libopen-pal" in line for line in f)
    except OSError:  # no /proc (not Linux): only the launcher's variable tells
        return False


def apply(environ=None, open_mpi=None, gpu=None, files=None, rules=True):
    """For a CPU-only Open MPI job, sets in `environ` (default `os.environ`) the `CPU_DEFAULTS` it does not
    set, and `RULES_SETTINGS` where `rules` and the user and site chose no allreduce (`chosen_allreduce`,
    with `files`); `open_mpi`, `gpu`: None asks `open_mpi_job` and TensorFlow. Returns ({name: value} set;
    the log line saying what was done with the rules or why not, or None: not a CPU-only Open MPI job, or
    not `rules`)."""
    environ = os.environ if environ is None else environ
    if not (open_mpi_job(environ) if open_mpi is None else open_mpi):
        return {}, None
    if gpu is None:  # Horovod then reduces GPU tensors with NCCL, not Open MPI
        import tensorflow as tf

        gpu = bool(tf.config.list_physical_devices("GPU"))
    if gpu:
        return {}, None
    applied = {k: v for k, v in CPU_DEFAULTS.items() if k not in environ}
    environ.update(applied)
    if not rules:
        return applied, None
    chosen = chosen_allreduce(environ, files)
    if chosen:
        return applied, f"hvd_lars: Open MPI's allreduce as chosen ({chosen}); {RULES_FILE} not applied."
    environ.update(RULES_SETTINGS)
    return {**applied, **RULES_SETTINGS}, (
        f"hvd_lars: Open MPI allreduce from 1 MiB on 3+ ranks: the ring ({RULES_FILE}); "
        "OMPI_MCA_coll_tuned_use_dynamic_rules=0 keeps Open MPI's own choice."
    )
