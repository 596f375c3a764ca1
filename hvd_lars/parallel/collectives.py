"""Data-parallel glue between Keras 3 and Horovod's TensorFlow collectives: every Horovod call lives here.

Horovod's own Keras layer (`horovod.tensorflow.keras`) does not support Keras 3 (Horovod issue 4290): its
DistributedOptimizer hooks methods Keras 3 never calls, so gradients would silently not be averaged.
This module therefore builds on `horovod.tensorflow` collectives directly. Without Horovod installed, or
run outside a launcher, everything works as a single process (rank 0 of world size 1).
"""

import os
import re

import numpy as np

_hvd = None  # horovod.tensorflow once `init()` has run with Horovod available.

# The number of processes a launcher started in this process's own job step, most specific first:
# Open MPI's mpirun (also under horovodrun, and inside Slurm, where its daemons run as a step of their own),
# Horovod's Gloo launcher, a PMI launcher (MPICH/Intel MPI's hydra, srun --mpi=pmi2), PMIx, srun. Job-level
# variables such as SLURM_NTASKS are not among them: a batch step of one process has them too.
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


def init():
    """Initialises Horovod (once) and returns (rank, world size).

    Raises:
        RuntimeError: a launcher started several ranks but Horovod cannot be imported.
        WorldSizeMismatch: a launcher says it started N processes (`launcher_world_size`) and Horovod
            reports another world size, e.g. 1 because its MPI could not join the launcher's job (Horovod
            built against another MPI, a missing PMI/PMIx plug-in): every process would train alone as
            rank 0 and write the same run directory. The message names both figures.
    """
    global _hvd
    if _hvd is None:
        variable, launched = launcher_world_size()
        try:
            import horovod.tensorflow as hvd
        except ImportError as e:
            if launched and launched > 1:
                raise RuntimeError(
                    f"This process was launched as one of several ranks ({variable}={launched}) but Horovod "
                    f"is not importable: {e}. Run `make setup` (install/setup.sh) to build it."
                ) from e
            return 0, 1
        hvd.init()
        # Elastic jobs change their size by design; their launcher's variables describe the first start.
        if launched and launched != hvd.size() and os.environ.get("HOROVOD_ELASTIC") != "1":
            raise WorldSizeMismatch(
                f"the launcher started {launched} processes ({variable}={launched}) but Horovod "
                f"initialised a world of {hvd.size()} rank(s), so each process would train on its own. "
                "Horovod's MPI did not join the launcher's job: launch with the MPI Horovod was built "
                "against (`horovodrun --check-build`; `mpirun --version`), and under Slurm with "
                "`srun --mpi=pmix` (`srun --mpi=list` shows the plug-ins)."
            )
        _hvd = hvd
    return rank(), size()


def rank():
    """This process's rank in [0, size()); 0 without Horovod."""
    return _hvd.rank() if _hvd else 0


def local_rank():
    """This process's rank on its node; 0 without Horovod."""
    return _hvd.local_rank() if _hvd else 0


def size():
    """World size: number of ranks; 1 without Horovod."""
    return _hvd.size() if _hvd else 1


def local_size():
    """Number of ranks on this process's host (node); 1 without Horovod."""
    return _hvd.local_size() if _hvd else 1


def cross_size():
    """Number of hosts holding a rank with this process's local rank (the host count when every host
    runs the same number of ranks); 1 without Horovod."""
    return _hvd.cross_size() if _hvd else 1


def host_names():
    """Sorted distinct host names of all ranks (`socket.gethostname()` on each), e.g. ["node1", "node2"].

    A collective: every rank must call it. Without Horovod, this machine's name alone.
    """
    import socket

    return sorted(set(gather_objects(socket.gethostname(), name="hvd_lars.host_names")))


def gather_objects(obj, name):
    """List of `obj` (any picklable value) from every rank, in rank order; [obj] with world size 1.

    A collective: every rank must call it with the same `name`. Runs TensorFlow ops, so TensorFlow's
    thread pools are fixed afterwards.
    """
    if size() == 1:
        return [obj]
    # Objects travel pickled; Horovod's allgather_object gathers one per rank.
    return list(_hvd.allgather_object(obj, name=name))


def is_chief():
    """True on rank 0, the only rank that prints, writes files and checkpoints."""
    return rank() == 0


# How gradients travel (DistributedOptimizer's `gradient_reduction` and `compression` arguments).
GRADIENT_REDUCTIONS = ("overlap", "grouped")
GRADIENT_COMPRESSIONS = ("none", "fp16")


def allreduce_gradients(grads, reduction="overlap", compression="none"):
    """Averages a list of gradients over ranks; identity with world size 1.

    Args:
        grads: list of tensors (any shape; float16, bfloat16, float32 or float64) or `None` (a variable
            without a gradient: passed through untouched on every rank). `tf.IndexedSlices` are made
            dense first (Horovod's `sparse_as_dense`): the same bytes on every rank, whatever the rows.
        reduction: "overlap": one allreduce per tensor, each depending on its own gradient only, so that
            inside a `tf.function` TensorFlow's executor starts each as soon as backprop has produced that
            gradient, and Horovod's background thread fuses those that are ready together into few ring
            allreduces (as Horovod's own `DistributedGradientTape` does); "grouped": one grouped
            allreduce of all tensors, which starts only when the last gradient exists.
        compression: "none", or "fp16": each tensor is divided by the world size in its own precision,
            cast to float16, summed over ranks and cast back, halving the bytes on the wire. Dividing
            before the sum (Horovod's `prescale_factor`) keeps the sum of N ranks at the size of one
            rank's gradient, so it cannot overflow float16 (max 65,504) at 2,048 ranks as a sum of
            undivided values can. The price is at the other end: values below 6.1e-5 * N (float16's
            smallest normal number) lose relative precision and below 6e-8 * N become 0 (at N = 2,048:
            0.12 and 1.2e-4). Dynamic loss scaling lifts them: in `DistributedOptimizer(
            LossScaleOptimizer(...))` the scaled gradients travel, and an overflow on the wire reaches
            the loss scaler's check, which halves the scale.
            A bfloat16 route is not offered: Horovod 0.28.1's allreduce refuses bfloat16, bfloat16 sends
            the same 16 bits per value as float16, and its only gain (range, so no prescaling) would
            need either an allgather (N times the bytes) or new reduction kernels in Horovod.

    Returns:
        A list of the same length: the mean over ranks of each gradient, in its own dtype (bfloat16
        gradients travel as float32, since Horovod has no bfloat16 reduction).

    Raises:
        ValueError: an unknown `reduction` or `compression`, naming the accepted values.
    """
    if reduction not in GRADIENT_REDUCTIONS:
        raise ValueError(f"gradient reduction {reduction!r}; valid: {', '.join(GRADIENT_REDUCTIONS)}.")
    if compression not in GRADIENT_COMPRESSIONS:
        raise ValueError(f"gradient compression {compression!r}; valid: {', '.join(GRADIENT_COMPRESSIONS)}.")
    if size() == 1:
        return list(grads)
    import tensorflow as tf

    present = [i for i, g in enumerate(grads) if g is not None]
    dense = [tf.convert_to_tensor(grads[i]) for i in present]
    if compression == "fp16":
        # Divided by N in the gradient's precision, then one rounding to float16; summed, not averaged.
        wire = [tf.cast(g / tf.cast(size(), g.dtype), tf.float16) for g in dense]
        op = _hvd.Sum
    else:
        wire = [tf.cast(g, tf.float32) if g.dtype == tf.bfloat16 else g for g in dense]
        op = _hvd.Average
    # Named by position, not by the graph's tensor and scope names: those carry Keras's automatic layer
    # names, which differ between ranks that created different numbers of layers (broadcast_variables).
    if reduction == "grouped":
        # One op: waits for every gradient, then Horovod fuses them into few messages.
        reduced = _hvd.grouped_allreduce(wire, op=op, name="hvd_lars.gradients", ignore_name_scope=True)
    else:
        # One op per tensor: each is enqueued with Horovod as soon as its gradient exists.
        reduced = [
            _hvd.allreduce(w, op=op, name=f"hvd_lars.gradient.{i}", ignore_name_scope=True)
            for i, w in zip(present, wire)
        ]
    out = list(grads)
    for i, g, r in zip(present, dense, reduced):
        out[i] = tf.cast(r, g.dtype) if r.dtype != g.dtype else r
    return out


def all_ranks_true(flag, name="hvd_lars.all_ranks_true"):
    """True on every rank when `flag` (a boolean scalar tensor) is true on every rank; `flag` itself with
    world size 1. Used to make a decision that each rank takes from its own data (a loss scaler's
    overflow check) the same on every rank, so that no rank enters a collective that others skip."""
    if size() == 1:
        return flag
    import tensorflow as tf

    # Sum of the ranks that vote no: an int32 allreduce of 4 bytes.
    noes = _hvd.allreduce(tf.cast(tf.logical_not(flag), tf.int32), op=_hvd.Sum, name=name)
    return tf.equal(noes, 0)


def broadcast_variables(variables, root_rank=0, what="variables"):
    """Overwrites `variables` (Keras or tf variables) on every rank with rank `root_rank`'s values.

    The ranks first compare their lists (`check_same_variables`), then broadcast each variable under a
    name given by its position in the list: Horovod pairs the ranks' collectives by name, and names made
    from Keras's automatic layer names (`sequential_3/dense_7/...`) differ between ranks that created
    different numbers of layers before, which would leave every rank waiting for a tensor that the others
    never send.

    Raises:
        RuntimeError: the ranks' lists differ (see `check_same_variables`).
    """
    if size() == 1:
        return
    import keras
    import tensorflow as tf

    check_same_variables(variables, what)
    tf_vars = [v.value if isinstance(v, keras.Variable) else v for v in variables]

    @tf.function(autograph=False)
    def broadcast_all():
        # One graph: the broadcasts run concurrently, and Horovod's background thread batches them.
        for i, var in enumerate(tf_vars):
            name = f"hvd_lars.broadcast.{i}"
            var.assign(_hvd.broadcast(var.read_value(), root_rank, name=name, ignore_name_scope=True))

    # Same starting point on every rank: model weights, optimizer slots, step counter.
    broadcast_all()


def structural_path(variable):
    """`variable.path` (or `.name`) without the numbers Keras appends to automatic names, e.g.
    "sequential_3/dense_7/kernel" -> "sequential/dense/kernel", "sgd/dense_7_kernel_momentum" ->
    "sgd/dense_kernel_momentum": what ranks that built the same model in different sessions agree on."""
    path = getattr(variable, "path", None) or variable.name.split(":")[0]
    return re.sub(r"_\d+(?=[_/]|$)", "", path)


def describe_variables(variables):
    """[(structural path, shape tuple, dtype name)] of `variables`, the description ranks compare."""
    return [
        (structural_path(v), tuple(int(d) for d in v.shape), str(getattr(v.dtype, "name", v.dtype)))
        for v in variables
    ]


def first_difference(lists, what="variables"):
    """The message naming the first difference between rank 0's list (`lists[0]`) and another rank's,
    or None when they agree: the same number of variables, and the same shape and dtype at each position.
    Paths may differ (a model loaded by `keras.models.load_model` against the same one built in code);
    they are named in the message. `lists[r]` is rank r's `describe_variables`."""
    reference = lists[0]

    def layout(items):
        return [(tuple(shape), dtype) for _, shape, dtype in items]

    for r, other in enumerate(lists[1:], start=1):
        if layout(other) == layout(reference):
            continue
        i = next(
            (i for i, (a, b) in enumerate(zip(layout(reference), layout(other))) if a != b),
            min(len(reference), len(other)),
        )

        def entry(items, i=i):
            if i >= len(items):
                return "nothing (its list ends there)"
            path, shape, dtype = items[i]
            return f"{path} {list(shape)} {dtype}"

        return (
            f"ranks disagree about the {what} they exchange: rank 0 has {len(reference)}, rank {r} has "
            f"{len(other)}; first difference at position {i}: rank 0 {entry(reference)}, rank {r} "
            f"{entry(other)}. Every rank must build the same model and optimizer (same layers, shapes and "
            "dtypes, created in the same order)."
        )
    return None


def check_same_variables(variables, what="variables"):
    """Raises the same RuntimeError on every rank when the ranks' `variables` differ in number, or in shape
    or dtype at some position, naming the first difference (with each rank's path there); returns
    otherwise. Paths alone may differ.

    A collective (one allgather of the descriptions): every rank must call it, before any collective
    that exchanges the variables, so that a mismatch is an error instead of a hang. No-op with size 1.
    """
    if size() == 1:
        return
    # Python lists travel pickled; Horovod's allgather_object gathers one per rank, in rank order.
    lists = _hvd.allgather_object(describe_variables(variables), name="hvd_lars.variable_lists")
    message = first_difference(lists, what)
    if message:
        raise RuntimeError(message)


def broadcast_object(value, root_rank=0, name="hvd_lars.broadcast_object"):
    """Rank `root_rank`'s picklable `value` on every rank (itself with size 1): how a decision taken on
    rank 0 alone (a work directory it cannot write) reaches every rank."""
    if size() == 1:
        return value
    return _hvd.broadcast_object(value, root_rank=root_rank, name=name)


def average_variables(variables, name="hvd_lars.average_variables"):
    """Replaces each variable (Keras or tf, float) by its mean over ranks, eagerly; no-op with size 1.

    Used for batch-norm moving statistics: gradients keep the trainable weights identical, but each rank
    updates its moving mean and variance from its own batches, so they drift apart.
    """
    if size() == 1 or not variables:
        return
    import keras

    tf_vars = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    means = _hvd.grouped_allreduce([v.read_value() for v in tf_vars], op=_hvd.Average, name=name)
    for var, mean in zip(tf_vars, means):
        var.assign(mean)


def allreduce_sum(values, name):
    """Sums a float64 NumPy array (or list of numbers) over ranks; returns a NumPy array.

    Used for exact counts (correct predictions, examples seen) and for example-weighted metric sums.
    `name` must be the same on every rank and unique per call site.
    """
    array = np.asarray(values, dtype=np.float64)
    if size() == 1:
        return array
    import tensorflow as tf

    # Eager allreduce of host values: Sum, not Average, so weights (example counts) stay exact.
    return _hvd.allreduce(tf.constant(array), op=_hvd.Sum, name=name).numpy()


def barrier():
    """Blocks until every rank reaches it (used before rank 0 reads files other ranks wrote)."""
    allreduce_sum([0.0], name="hvd_lars.barrier")


def broadcast_bytes(data, name, root_rank=0):
    """Rank `root_rank`'s `data` (bytes) on every rank; the other ranks pass anything (e.g. None).

    Used to hand rank 0's image-folder listing to every rank, so only one process reads the folder.
    Identity with size 1. `name` must be the same on every rank and unique per call site.
    """
    if size() == 1:
        return data
    import tensorflow as tf

    # The length first (the others must allocate as much), then the bytes as one uint8 tensor.
    mine = len(data) if rank() == root_rank else 0
    length = int(_hvd.broadcast(tf.constant([mine], tf.int64), root_rank, name=f"{name}.size").numpy()[0])
    if rank() == root_rank:
        array = np.frombuffer(data, np.uint8)
    else:
        array = np.zeros(length, np.uint8)
    return _hvd.broadcast(tf.constant(array), root_rank, name=f"{name}.data").numpy().tobytes()
