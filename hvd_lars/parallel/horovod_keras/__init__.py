"""The `horovod.tensorflow.keras` namespace for Keras 3: a Horovod Keras script changes
`import horovod.tensorflow.keras as hvd` into `import hvd_lars.parallel.horovod_keras as hvd` and keeps
its calls, with Horovod's names, arguments and defaults.

Every public name of Horovod 0.28.1's `horovod.tensorflow.keras`, its `callbacks` and its `elastic` is here
(tests/test_horovod_names.py lists them against Horovod's installed sources): Horovod's own where they
need no Keras (`shutdown`, `Average`, `Compression`, the process sets, ...), this package's Keras 3
versions of the rest; `broadcast_global_variables` without a model is refused with what to use instead.
The README's table lists each. Needs Horovod (the names a Horovod script uses come from it).
"""

import sys

import keras

from hvd_lars.parallel import callbacks, collectives, elastic, ompi_allreduce_rules  # noqa: F401
from hvd_lars.parallel import optimizer as _optimizer
from hvd_lars.parallel.callbacks import broadcast_model_and_optimizer
from hvd_lars.parallel.collectives import (  # noqa: F401
    cross_rank,
    cross_size,
    is_chief,
    local_rank,
    local_size,
    rank,
    size,
)

# Horovod's own names that work on Keras 3 as they are (no Keras inside them): forwarded unchanged.
_horovod = collectives.horovod_tensorflow()
shutdown = _horovod.shutdown
is_initialized = _horovod.is_initialized
start_timeline = _horovod.start_timeline
stop_timeline = _horovod.stop_timeline
mpi_threads_supported = _horovod.mpi_threads_supported
mpi_enabled = _horovod.mpi_enabled
mpi_built = _horovod.mpi_built
gloo_enabled = _horovod.gloo_enabled
gloo_built = _horovod.gloo_built
nccl_built = _horovod.nccl_built
ddl_built = _horovod.ddl_built
ccl_built = _horovod.ccl_built
cuda_built = _horovod.cuda_built
rocm_built = _horovod.rocm_built
ProcessSet = _horovod.ProcessSet
global_process_set = _horovod.global_process_set
add_process_set = _horovod.add_process_set
remove_process_set = _horovod.remove_process_set
Average = _horovod.Average
Sum = _horovod.Sum
Compression = _horovod.Compression


def init(comm=None, process_sets=None, *, ompi_allreduce_rules=True):
    """`hvd.init()`: initialises Horovod (Horovod's `comm` and `process_sets` passed on) and returns
    (rank, world size).

    First, on a CPU-only Open MPI job whose user and site chose no allreduce, points Open MPI at the
    ring for allreduces from 1 MiB on 3 or more ranks (`hvd_lars.parallel.ompi_allreduce_rules`), and
    rank 0 of a job of 3 or more ranks says so in one line; `ompi_allreduce_rules=False` (or
    `OMPI_MCA_coll_tuned_use_dynamic_rules=0` exported) leaves Open MPI's own choice. Horovod's other
    settings (its cycle time) stay Horovod's. Only the first call of a process (before MPI starts) can set
    the rules.

    Raises:
        as `hvd_lars.parallel.collectives.init`.
    """
    line = None
    if ompi_allreduce_rules and not collectives.horovod_tensorflow().is_initialized():
        line = _rules.apply()[1]
    result = collectives.init(comm=comm, process_sets=process_sets)
    if line and collectives.is_chief() and result[1] >= _rules.MIN_RANKS:  # smaller jobs keep Open MPI's
        sys.stdout.write(line + "\n")  # a Horovod script's output, as Horovod's own lines
    return result


_rules = ompi_allreduce_rules  # `init`'s keyword has the module's name


def DistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=Average,
    backward_passes_per_step=1,
    average_aggregated_gradients=False,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    scale_local_gradients=True,
):
    """Horovod's `hvd.DistributedOptimizer`, with its arguments and defaults: an
    `hvd_lars.parallel.optimizer.DistributedOptimizer` (see it for each argument) holding `optimizer`
    (any Keras 3 optimizer). As Horovod's: the micro-batch gradients of `backward_passes_per_step` are
    summed (`average_aggregated_gradients=False`), then averaged over ranks (`op=Average`);
    `num_groups` is Horovod's deprecated name of `groups`.

    Raises:
        ValueError: an `op` other than Average or Sum, `groups` that are neither an int >= 1 nor a list
            of lists of variables, or what `hvd_lars.parallel.optimizer.DistributedOptimizer` refuses.
    """
    if num_groups and groups is None:
        groups = num_groups  # Horovod's deprecated spelling
    return _optimizer.DistributedOptimizer(
        optimizer,
        backward_passes_per_step=backward_passes_per_step,
        compression=compression,
        name=name,
        average_aggregated_gradients=average_aggregated_gradients,
        scale_local_gradients=scale_local_gradients,
        sparse_as_dense=sparse_as_dense,
        process_set=process_set,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        groups=groups,
        device_dense=device_dense,
        device_sparse=device_sparse,
    )


def PartialDistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=Average,
    groups=None,
    process_set=global_process_set,
    local_layers=None,
    scale_local_gradients=True,
):
    """Horovod's `horovod.keras.PartialDistributedOptimizer`, with its arguments and defaults: a
    `DistributedOptimizer` whose `local_layers` keep their gradients on each rank
    (`hvd_lars.parallel.optimizer.PartialDistributedOptimizer`)."""
    return _optimizer.PartialDistributedOptimizer(
        optimizer,
        local_layers=local_layers,
        scale_local_gradients=scale_local_gradients,
        compression=compression,
        name=name,
        average_aggregated_gradients=False,
        sparse_as_dense=sparse_as_dense,
        process_set=process_set,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        groups=groups,
        device_dense=device_dense,
        device_sparse=device_sparse,
    )


def broadcast_global_variables(root_rank, model=None):
    """`hvd.broadcast_global_variables(root_rank)`: Keras 3 has no global variable collection, so the
    model whose variables (and optimizer's) to broadcast is named: `broadcast_model_and_optimizer`.

    Raises:
        ValueError: `model` not given.
    """
    if model is None:
        raise ValueError(
            "broadcast_global_variables: Keras 3 keeps no global variable collection; pass the model "
            "(broadcast_global_variables(0, model)) or use hvd.callbacks.BroadcastGlobalVariablesCallback(0)."
        )
    broadcast_model_and_optimizer(model, root_rank)


def allreduce(
    value,
    name=None,
    average=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    op=None,
    compression=Compression.none,
):
    """`hvd.allreduce`: a tensor-compatible value (number, list, NumPy array, tensor, variable) reduced
    over ranks, Horovod's average when `op` is None; returns a tf.Tensor, also inside a `tf.function`."""
    return collectives.allreduce_value(
        value, name, average, prescale_factor, postscale_factor, op, compression
    )  # fmt: skip


def allgather(value, name=None):
    """`hvd.allgather`: the ranks' values (tensor-compatible) concatenated along axis 0; a tf.Tensor."""
    return collectives.allgather_value(value, name)


def broadcast(value, root_rank, name=None):
    """`hvd.broadcast`: rank `root_rank`'s tensor-compatible value on every rank; a tf.Tensor."""
    return collectives.broadcast_value(value, root_rank, name)


def reducescatter(value, name=None, op=Average):
    """`hvd.reducescatter`: the value reduced over ranks (`op`), this rank's part of axis 0."""
    return collectives.reducescatter_value(value, name, op)


def load_model(
    filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none, legacy_opts=False
):
    """`hvd.load_model`: Keras's `load_model` of `filepath` (.keras or .h5), whose optimizer, whatever it
    is, comes back held by a DistributedOptimizer (Horovod's defaults, `compression`) with the state
    the file saved, so `fit` averages gradients over ranks. A file saved with a DistributedOptimizer
    keeps it (its compression set to `compression`).

    Args:
        custom_optimizers: optimizer classes the file may hold (added to `custom_objects` by name).
        custom_objects: as Keras's.
        legacy_opts: False; Keras 3 has no legacy optimizers (True raises ValueError).

    Raises:
        ValueError: `legacy_opts=True`; what Keras's `load_model` raises.
    """
    if legacy_opts:
        raise ValueError("load_model(legacy_opts=True): Keras 3 has no legacy optimizers; pass False.")
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    model = keras.models.load_model(filepath, custom_objects=objects)
    held = getattr(model, "optimizer", None)
    if held is None:
        return model
    distributed = _distributed_in(held)
    if distributed is not None:
        distributed.compression = collectives.compression_name(compression)
        return model
    # Wrap, don't rebuild: the loaded optimizer keeps its slots and counters. Compiling again records
    # the wrapper in the compile config, so that the model saves and loads with it.
    config = dict(model.get_compile_config())
    config.pop("optimizer")
    with keras.saving.custom_object_scope(objects):
        config = keras.saving.deserialize_keras_object(config)
    config["optimizer"] = DistributedOptimizer(held, compression=compression)
    model.compile(**config)
    return model


def _distributed_in(optimizer):
    """The DistributedOptimizer in `optimizer`'s chain of wrappers (LossScaleOptimizer), or None."""
    while optimizer is not None:
        if isinstance(optimizer, _optimizer.DistributedOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None
