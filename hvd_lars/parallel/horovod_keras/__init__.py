"""`horovod.tensorflow.keras` for Keras 3: a Horovod Keras script changes
`import horovod.tensorflow.keras as hvd` into `import hvd_lars.parallel.horovod_keras as hvd` and keeps its
calls. Every public name of Horovod 0.28.1's `horovod.tensorflow.keras`, `callbacks` and `elastic`
(tests/test_horovod_names.py): Horovod's own where they need no Keras, else Horovod's defaults and names
set on this package's core (`hvd_lars.parallel`); no rule is implemented here. Needs Horovod.
"""

import sys

import keras
import tensorflow as tf

from hvd_lars.arguments import refuse
from hvd_lars.parallel import collectives
from hvd_lars.parallel import ompi_allreduce_rules as _rules
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
from hvd_lars.parallel.horovod_keras import callbacks, elastic  # noqa: F401

# Horovod's own names that need no Keras: forwarded unchanged.
_horovod = collectives.horovod_tensorflow()
Average, Sum, Compression, global_process_set = (_horovod.Average, _horovod.Sum, _horovod.Compression,
                                                 _horovod.global_process_set)  # fmt: skip
globals().update(
    (name, getattr(_horovod, name))
    for name in (
        "shutdown is_initialized start_timeline stop_timeline mpi_threads_supported mpi_enabled mpi_built "
        "gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet "
        "add_process_set remove_process_set"
    ).split()
)


def init(comm=None, process_sets=None, *, ompi_allreduce_rules=True):
    """`hvd.init()`: (rank, world size), as `collectives.init`. First, on a CPU-only Open MPI job, the
    Horovod and Open MPI settings it leaves unset of `ompi_allreduce_rules.CPU_DEFAULTS` (a 5 ms Horovod
    cycle, MPI yielding while it waits) and, where the user and site chose no allreduce, Open MPI's ring
    from 1 MiB on 3+ ranks (rank 0 says so in one line); `ompi_allreduce_rules=False` leaves Open MPI's
    allreduce choice."""
    line = None
    if not _horovod.is_initialized():
        line = _rules.apply(rules=ompi_allreduce_rules)[1]
    result = collectives.init(comm=comm, process_sets=process_sets)
    if line and collectives.is_chief() and result[1] >= _rules.MIN_RANKS:  # smaller jobs keep Open MPI's
        sys.stdout.write(line + "\n")  # a Horovod script's output, as Horovod's own lines
    return result


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
    """Horovod's `hvd.DistributedOptimizer`: `hvd_lars.parallel.optimizer.DistributedOptimizer` (see it for
    each argument) with Horovod's defaults. Where the two differ: the micro-batch gradients of
    `backward_passes_per_step` are summed here (`average_aggregated_gradients=False`, Horovod's), averaged
    by `hvd_lars.DistributedOptimizer` (Keras's `gradient_accumulation_steps`). `num_groups` is Horovod's
    deprecated name of `groups`."""
    arguments = dict(locals())  # the core's own names, `num_groups` aside
    if arguments.pop("num_groups") and groups is None:
        arguments["groups"] = num_groups
    return _optimizer.DistributedOptimizer(**arguments)


def PartialDistributedOptimizer(optimizer, name=None, *, local_layers=None, **kwargs):
    """Horovod's `horovod.keras.PartialDistributedOptimizer`: a `DistributedOptimizer` (Horovod's other
    arguments, as keywords) whose `local_layers` (a layer or a list, else ValueError) keep their gradients
    on each rank, as `register_local_var` does."""
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else list(local_layers or [])
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            refuse("local_layers", layer, "Keras layers")
    distributed = DistributedOptimizer(optimizer, name, **kwargs)
    distributed._local_layers = layers
    return distributed


def broadcast_global_variables(root_rank, model=None):
    """`hvd.broadcast_global_variables(root_rank)`: Keras 3 keeps no global variables, so the model (and its
    optimizer) to broadcast is named; ValueError without it."""
    if model is None:
        raise ValueError(
            "broadcast_global_variables: Keras 3 keeps no global variable collection; pass the model "
            "(broadcast_global_variables(0, model)) or use hvd.callbacks.BroadcastGlobalVariablesCallback(0)."
        )
    broadcast_model_and_optimizer(model, root_rank)


# Horovod's collectives on numbers, lists, arrays, tensors or variables, returning a tf.Tensor eagerly or in
# a `tf.function` (Horovod's own evaluate through Keras 2's session).


def allreduce(
    value,
    name=None,
    average=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    op=None,
    compression=Compression.none,
):
    """`hvd.allreduce`: Horovod's, on the value as a tensor (its average when `op` is None)."""
    return _horovod.allreduce(
        tf.convert_to_tensor(value), average=average, op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, compression=compression, name=name,
    )  # fmt: skip


def allgather(value, name=None):
    """`hvd.allgather`: the ranks' values concatenated along axis 0, in rank order."""
    return _horovod.allgather(tf.convert_to_tensor(value), name=name)


def broadcast(value, root_rank, name=None):
    """`hvd.broadcast`: rank `root_rank`'s value on every rank."""
    return _horovod.broadcast(tf.convert_to_tensor(value), root_rank, name=name)


def reducescatter(value, name=None, op=Average):
    """`hvd.reducescatter`: the value reduced over ranks (`op`), this rank's part of axis 0."""
    return _horovod.reducescatter(tf.convert_to_tensor(value), op=op, name=name)


def load_model(
    filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none, legacy_opts=False
):
    """`hvd.load_model`: Keras's `load_model` of `filepath` (.keras or .h5), its optimizer, whatever it is,
    held by a `DistributedOptimizer` (Horovod's defaults, `compression`) with the state the file saved.
    `custom_optimizers`: classes added to `custom_objects` by name; `legacy_opts=True`: ValueError."""
    if legacy_opts:
        raise ValueError("load_model(legacy_opts=True): Keras 3 has no legacy optimizers; pass False.")
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    model = keras.models.load_model(filepath, custom_objects=objects)
    held = getattr(model, "optimizer", None)
    while held is not None and not isinstance(held, _optimizer.DistributedOptimizer):
        held = getattr(held, "inner_optimizer", None)  # through a LossScaleOptimizer
    if held is not None:
        held.compression = collectives.compression_name(compression)
        return model
    if model.optimizer is None:
        return model
    # Wrap, don't rebuild: the loaded optimizer keeps its slots and counters. Compiling again records the
    # wrapper in the compile config, so that the model saves and loads with it.
    config = dict(model.get_compile_config())
    config.pop("optimizer")
    with keras.saving.custom_object_scope(objects):
        config = keras.saving.deserialize_keras_object(config)
    config["optimizer"] = DistributedOptimizer(model.optimizer, compression=compression)
    model.compile(**config)
    return model
