"""Data-parallel glue between Keras 3 and Horovod's TensorFlow collectives: every Horovod call lives here.

Horovod's own Keras layer (`horovod.tensorflow.keras`) does not support Keras 3 (Horovod issue 4290): its
DistributedOptimizer hooks methods Keras 3 never calls, so gradients would silently not be averaged.
This module therefore builds on `horovod.tensorflow` collectives directly. Without Horovod installed, or
run outside a launcher, everything works as a single process (rank 0 of world size 1).
"""

import os

import numpy as np

_hvd = None  # horovod.tensorflow once `init()` has run with Horovod available.

# Environment variables that launchers set for every rank; used to refuse a silent single-process run
# when a multi-rank job was asked for but Horovod is missing.
_LAUNCHER_SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def init():
    """Initialises Horovod (once) and returns (rank, world size).

    Raises:
        RuntimeError: a launcher started several ranks but Horovod cannot be imported.
    """
    global _hvd
    if _hvd is None:
        try:
            import horovod.tensorflow as hvd
        except ImportError as e:
            launched = [v for v in _LAUNCHER_SIZE_VARIABLES if int(os.environ.get(v, "1") or 1) > 1]
            if launched:
                raise RuntimeError(
                    f"This process was launched as one of several ranks ({launched[0]}="
                    f"{os.environ[launched[0]]}) but Horovod is not importable: {e}. "
                    "Run `make setup` (install/setup.sh) to build it."
                ) from e
            return 0, 1
        hvd.init()
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


def is_chief():
    """True on rank 0, the only rank that prints, writes files and checkpoints."""
    return rank() == 0


def average_gradients(grads):
    """Averages a list of gradient tensors over ranks in one fused allreduce (identity when size 1).

    `None` entries (variables without a gradient) are passed through untouched on every rank.
    """
    if size() == 1:
        return list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    # One grouped allreduce: Horovod fuses the tensors into few ring-allreduce messages.
    reduced = _hvd.grouped_allreduce([grads[i] for i in present], op=_hvd.Average)
    out = list(grads)
    for i, g in zip(present, reduced):
        out[i] = g
    return out


def broadcast_variables(variables, root_rank=0):
    """Overwrites `variables` (Keras or tf variables) on every rank with rank `root_rank`'s values."""
    if size() == 1:
        return
    import keras

    tf_vars = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    # Same starting point on every rank: model weights, optimizer slots, step counter.
    _hvd.broadcast_variables(tf_vars, root_rank=root_rank)


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


def distributed_optimizer(optimizer):
    """Returns a copy of a Keras 3 optimizer that averages gradients over all ranks before each update.

    The copy is an instance of a subclass of `type(optimizer)` made from `optimizer.get_config()`, so any
    Keras 3 optimizer (LARS, SGD, ...) works and its update rule is unchanged. The allreduce sits where
    Keras hands the gradients of one update to clipping, weight decay and `update_step`: after Keras's own
    gradient accumulation (`gradient_accumulation_steps`) has averaged the micro-batches, so ranks talk
    once per update, not once per micro-batch, and before clipping, so clipping sees the global gradient.
    With world size 1 the optimizer is returned as it is. Call it before the optimizer is built.

    Raises:
        ValueError: the optimizer is already built (its slots would be lost).
    """
    if size() == 1:
        return optimizer
    return _averaging_copy(optimizer)


def _averaging_copy(optimizer):
    if optimizer.built:
        raise ValueError(f"distributed_optimizer needs an unbuilt optimizer; {optimizer.name} is built.")
    import keras

    from hvd_lars.lars import LARS

    base = type(optimizer)

    class _DistributedOptimizer(base):
        # Keras 3.15 calls _clip_gradients exactly once per applied update, in both the plain and the
        # accumulating path (tests/test_distributed.py fails if a Keras release moves it).
        def _clip_gradients(self, grads):
            return super()._clip_gradients(average_gradients(list(grads)))

    _DistributedOptimizer.__name__ = f"Distributed{base.__name__}"
    config = optimizer.get_config()
    if isinstance(optimizer, LARS) and isinstance(optimizer._learning_rate, keras.Variable):
        # LARS uses a caller's rate variable itself; the config holds only its value.
        config["learning_rate"] = optimizer._learning_rate
    return _DistributedOptimizer.from_config(config)
