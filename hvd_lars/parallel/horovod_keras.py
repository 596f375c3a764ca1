"""The `horovod.tensorflow.keras` namespace for Keras 3: a Horovod Keras script changes
`import horovod.tensorflow.keras as hvd` into `import hvd_lars.parallel.horovod_keras as hvd` and keeps
its calls (`hvd.init()`, `hvd.DistributedOptimizer(...)`, `hvd.callbacks.BroadcastGlobalVariablesCallback(0)`,
`hvd.elastic.KerasState(...)`, `@hvd.elastic.run`). Only names with a Keras 3 replacement are here; the
README's table lists each, and what is refused or ignored.
"""

import keras

from hvd_lars.parallel import callbacks, elastic  # noqa: F401  (hvd.callbacks.*, hvd.elastic.*)
from hvd_lars.parallel.callbacks import broadcast_model_and_optimizer
from hvd_lars.parallel.collectives import (  # noqa: F401
    cross_size,
    init,
    is_chief,
    local_rank,
    local_size,
    rank,
    size,
)
from hvd_lars.parallel.optimizer import DistributedOptimizer, PartialDistributedOptimizer  # noqa: F401

# `hvd.load_model(path)`: Keras's own; `import hvd_lars` has registered DistributedOptimizer, so the
# optimizer comes back wrapped, with its state.
load_model = keras.models.load_model


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
