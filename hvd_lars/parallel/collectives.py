"""Every Horovod call of the core, on `horovod.tensorflow`'s collectives (Horovod's own Keras layer does
not work with Keras 3). Without Horovod, or outside a launcher, a single process: rank 0 of world size 1.
"""

import os
import re

import numpy as np

from hvd_lars.arguments import refuse

_hvd = None  # horovod.tensorflow once `init()` has run with Horovod available.

# A launcher's process count for this job step, most specific first (Open MPI, Horovod's Gloo, PMI, PMIx,
# srun); not job-level variables such as SLURM_NTASKS, which a batch step of one process has too.
LAUNCHER_SIZE_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE",
    "HOROVOD_SIZE",
    "PMI_SIZE",
    "PMIX_SIZE",
    "SLURM_STEP_NUM_TASKS",
)


class WorldSizeMismatch(RuntimeError):
    """The launcher started a job of N processes but Horovod initialised another world size."""


def launcher_world_size(environ=None):
    """(variable, N): the first of `LAUNCHER_SIZE_VARIABLES` set to a whole number in `environ` (default
    `os.environ`), or (None, None) when no launcher describes this process."""
    environ = os.environ if environ is None else environ
    for name in LAUNCHER_SIZE_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return name, int(value)
    return None, None


def init(comm=None, process_sets=None, launched_only=False):
    """Initialises Horovod once (again after `horovod.tensorflow.shutdown()`) with `hvd.init`'s `comm` and
    `process_sets`; returns (rank, world size). `launched_only`: a process no launcher started stays rank 0
    of world size 1 without Horovod (spared seconds of MPI's start-up). RuntimeError: several ranks
    launched but no Horovod; `WorldSizeMismatch`: Horovod's world size is not the launcher's
    (`launcher_world_size`).
    """
    global _hvd
    if _hvd is None or not _hvd.is_initialized():
        variable, launched = launcher_world_size()
        if launched is None and launched_only:
            return 0, 1
        try:
            import horovod.tensorflow as hvd
        except ImportError as e:
            if launched and launched > 1:
                raise RuntimeError(
                    f"This process was launched as one of several ranks ({variable}={launched}) but Horovod "
                    f"is not importable: {e}. Run `make setup` (install/setup.sh) to build it."
                ) from e
            return 0, 1
        hvd.init(comm=comm, process_sets=process_sets)
        # Elastic jobs change size by design, and a `comm` of some ranks makes a smaller world on purpose.
        elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        if launched and launched != hvd.size() and not elastic and comm is None:
            raise WorldSizeMismatch(
                f"the launcher started {launched} processes ({variable}={launched}) but Horovod "
                f"initialised a world of {hvd.size()} rank(s), so each process would train on its own. "
                "Horovod's MPI did not join the launcher's job: launch with the MPI Horovod was built "
                "against (`horovodrun --check-build`; `mpirun --version`), and under Slurm with "
                "`srun --mpi=pmix` (`srun --mpi=list` shows the plug-ins)."
            )
        _hvd = hvd
    return rank(), size()


def horovod_tensorflow():
    """The `horovod.tensorflow` module, imported (not initialised); ImportError saying how to build it."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise ImportError(
            f"hvd_lars.parallel.horovod_keras needs Horovod (horovod.tensorflow): {e}. Run `make setup` "
            "(install/setup.sh) to build it."
        ) from e
    return hvd


def _horovods(name, alone):
    def get():
        return getattr(_hvd, name)() if _hvd else alone

    get.__name__ = get.__qualname__ = name
    return get


# Horovod's rank and sizes (`cross_*`: among the hosts with this local rank); without Horovod, 0 and 1.
rank, local_rank, cross_rank = (_horovods(name, 0) for name in ("rank", "local_rank", "cross_rank"))
size, local_size, cross_size = (_horovods(name, 1) for name in ("size", "local_size", "cross_size"))


def gather_objects(obj, name):
    """List of the picklable `obj` from every rank, in rank order (a collective, the same `name` on every
    rank; TensorFlow's thread pools are fixed afterwards); [obj] with world size 1."""
    if size() == 1:
        return [obj]
    return list(_hvd.allgather_object(obj, name=name))


def is_chief():
    """True on rank 0, the only rank that prints, writes files and checkpoints."""
    return rank() == 0


GRADIENT_REDUCTIONS = ("overlap", "grouped")
GRADIENT_COMPRESSIONS = ("none", "fp16")
GRADIENT_OPS = ("average", "sum")
# Horovod's two compressors, known by class name so that recognising one needs no import of Horovod.
_HOROVOD_COMPRESSORS = {"NoneCompressor": "none", "FP16Compressor": "fp16"}


def compression_name(compression):
    """ "none" or "fp16" for one of those strings or Horovod's `Compression.none` / `Compression.fp16`
    (classes or instances); ValueError for anything else."""
    if isinstance(compression, str) and compression in GRADIENT_COMPRESSIONS:
        return compression
    cls = compression if isinstance(compression, type) else type(compression)
    if cls.__module__ == "horovod.tensorflow.compression" and cls.__name__ in _HOROVOD_COMPRESSORS:
        return _HOROVOD_COMPRESSORS[cls.__name__]
    refuse("compression", compression, f"one of {GRADIENT_COMPRESSIONS}, hvd.Compression.none or .fp16")


def op_name(op):
    """ "average" or "sum" for one of those strings or Horovod's `hvd.Average` / `hvd.Sum`; ValueError for
    anything else (Adasum, Min, Max, Product included)."""
    if isinstance(op, str) and op in GRADIENT_OPS:
        return op
    if not isinstance(op, str) and op is not None:
        hvd = horovod_tensorflow()  # a Horovod constant can only come from an imported Horovod
        if op == hvd.Average:
            return "average"
        if op == hvd.Sum:
            return "sum"
    refuse("op", op, f"one of {GRADIENT_OPS}, hvd.Average or hvd.Sum (as Horovod's Keras optimizer)")


def allreduce_gradients(
    grads, reduction="overlap", compression="none", op="average", predivide=1.0, groups=None, device=""
):
    """Averages (or sums) over ranks a list of gradients (tensors, `tf.IndexedSlices` made dense, or None,
    passed through); returns a list of the same length, each in its own dtype. Identity with world size 1.
    The arguments are `DistributedOptimizer`'s (its docstring), checked there; `groups` are positions here.

    "overlap" enqueues one allreduce per tensor as backprop produces it (Horovod fuses those ready),
    "grouped" one grouped allreduce after the last. "fp16" divides by N in the tensor's own precision and
    sums in float16 (docs/design.md, "Gradient compression"); `predivide` f multiplies by 1 / f before the
    sum and f / N after. bfloat16 travels as float32 (Horovod has no bfloat16 sum).
    """
    if size() == 1:
        return list(grads)
    import tensorflow as tf

    present = [i for i, g in enumerate(grads) if g is not None]
    dense = {i: tf.convert_to_tensor(grads[i]) for i in present}
    grouped = groups is not None or reduction == "grouped"
    if groups is None:
        groups = [present] if grouped else [[i] for i in present]
    else:
        listed = {i for group in groups for i in group}
        groups = [[i for i in group if i in dense] for group in groups] + [
            [i] for i in present if i not in listed
        ]
    out = list(grads)
    with device_scope(device):
        for k, group in enumerate(g for g in groups if g):
            tensors = [dense[i] for i in group]
            reduced = _reduce_group(tensors, group, grouped, op, compression, float(predivide), k)
            for i, r in zip(group, reduced):
                out[i] = r
    return out


def device_scope(device):
    """`tf.device(device)` for Horovod's `device` arguments; no scope for "" (TensorFlow's placement)."""
    import contextlib

    import tensorflow as tf

    return tf.device(device) if device else contextlib.nullcontext()


def _reduce_group(tensors, positions, grouped, op, compression, predivide, k):
    """One allreduce of `tensors` (grouped when `grouped`, else of the one tensor), in their dtypes, named
    by position: Keras's automatic layer names may differ between ranks (see `broadcast_variables`)."""
    import tensorflow as tf

    n = size()
    pre, post = 1.0, 1.0
    if compression == "fp16":
        # Divided before the rounding to float16 (by N, or by f and the rest after), then summed.
        if op == "average":
            pre, post = (predivide, predivide / n) if predivide != 1.0 else (n, 1.0)
        wire = [tf.cast(g / tf.cast(pre, g.dtype), tf.float16) for g in tensors]
        scale = {"op": _hvd.Sum}
    else:
        wire = [tf.cast(g, tf.float32) if g.dtype == tf.bfloat16 else g for g in tensors]
        scale = {"op": _hvd.Average if op == "average" else _hvd.Sum}
        if op == "average" and predivide != 1.0:
            # Horovod's split of the mean: 1 / f before the sum, f after it (its C++ adds the 1 / N).
            scale.update(prescale_factor=1.0 / predivide, postscale_factor=predivide)
    if not grouped:
        # One op per tensor: enqueued with Horovod as soon as its gradient exists.
        name = f"hvd_lars.gradient.{positions[0]}"
        reduced = [_hvd.allreduce(wire[0], name=name, ignore_name_scope=True, **scale)]
    else:
        # One op: waits for every gradient of the group, then Horovod fuses them into few messages.
        name = "hvd_lars.gradients" if k == 0 else f"hvd_lars.gradients.{k}"
        reduced = _hvd.grouped_allreduce(wire, name=name, ignore_name_scope=True, **scale)
    reduced = [tf.cast(r, g.dtype) for g, r in zip(tensors, reduced)]  # no op where the dtypes agree
    return reduced if post == 1.0 else [r * tf.cast(post, r.dtype) for r in reduced]


def broadcast_variables(variables, root_rank=0, what="variables"):
    """Overwrites `variables` (Keras or tf) on every rank with rank `root_rank`'s, each named by its position
    (Keras's automatic names may differ between ranks, and Horovod pairs collectives by name). First the
    ranks compare the number, shapes and dtypes of their `variables` (a collective), so that a mismatch is
    the same RuntimeError on every rank, naming the first difference, not a hang."""
    if size() == 1:
        return
    import keras
    import tensorflow as tf

    def described(v):  # what ranks compare: the path without the numbers of Keras's automatic names
        path = re.sub(r"_\d+(?=[_/]|$)", "", getattr(v, "path", None) or v.name.split(":")[0])
        return path, tuple(int(d) for d in v.shape), str(getattr(v.dtype, "name", v.dtype))

    lists = _hvd.allgather_object([described(v) for v in variables], name="hvd_lars.variable_lists")
    reference = lists[0]
    for r, other in enumerate(lists[1:], start=1):
        mine, theirs = [d[1:] for d in reference], [d[1:] for d in other]
        if mine == theirs:
            continue
        i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))

        def entry(items, i=i):
            return f"{items[i][0]} {list(items[i][1])} {items[i][2]}" if i < len(items) else "nothing"

        raise RuntimeError(
            f"ranks disagree about the {what} they exchange: rank 0 has {len(reference)}, rank {r} has "
            f"{len(other)}; first difference at position {i}: rank 0 {entry(reference)}, rank {r} "
            f"{entry(other)}. Every rank must build the same model and optimizer (same layers, shapes and "
            "dtypes, created in the same order)."
        )
    tf_vars = [v.value if isinstance(v, keras.Variable) else v for v in variables]

    @tf.function(autograph=False)
    def broadcast_all():
        # One graph: the broadcasts run concurrently, and Horovod's background thread batches them.
        for i, var in enumerate(tf_vars):
            name = f"hvd_lars.broadcast.{i}"
            var.assign(_hvd.broadcast(var.read_value(), root_rank, name=name, ignore_name_scope=True))

    broadcast_all()


def broadcast_object(value, root_rank=0, name="hvd_lars.broadcast_object"):
    """Rank `root_rank`'s picklable `value` on every rank (itself with size 1)."""
    if size() == 1:
        return value
    return _hvd.broadcast_object(value, root_rank=root_rank, name=name)


def average_variables(variables, name="hvd_lars.average_variables"):
    """Replaces each variable (Keras or tf, float) by its mean over ranks, eagerly (batch-norm moving
    statistics, which each rank updates from its own batches); no-op with size 1."""
    if size() == 1 or not variables:
        return
    import keras

    tf_vars = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    means = _hvd.grouped_allreduce([v.read_value() for v in tf_vars], op=_hvd.Average, name=name)
    for var, mean in zip(tf_vars, means):
        var.assign(mean)


def allreduce_sum(values, name):
    """Sums a float64 NumPy array (or list of numbers) over ranks, exactly; returns a NumPy array. `name`:
    the same on every rank, one per call site."""
    array = np.asarray(values, dtype=np.float64)
    if size() == 1:
        return array
    import tensorflow as tf

    return _hvd.allreduce(tf.constant(array), op=_hvd.Sum, name=name).numpy()


def max_over_ranks(number, name):
    """The largest of the ranks' integers `number`, on every rank (`name` as for `allreduce_sum`)."""
    if size() == 1:
        return int(number)
    import tensorflow as tf

    return int(_hvd.allreduce(tf.constant(int(number), tf.int64), op=_hvd.Max, name=name).numpy())
