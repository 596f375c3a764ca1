"""The core's callbacks, with Horovod's names and arguments: the model and optimizer broadcast
(`BroadcastGlobalVariablesCallback`) and the metric averaging (`MetricAverageCallback`, `average_metrics`);
Horovod's warmup is `learning_rate_callbacks.LearningRateWarmupCallback`, here by name too.
"""

import zlib

import keras

from hvd_lars import keras_internals
from hvd_lars.arguments import is_number
from hvd_lars.parallel import collectives
from hvd_lars.parallel.learning_rate_callbacks import LearningRateWarmupCallback  # noqa: F401


def broadcast_model_and_optimizer(model, root_rank=0, local_variables=()):
    """Overwrites the model's and its optimizer's variables (the optimizer built first if it is not) on
    every rank with rank `root_rank`'s, but for dropout seed states and `local_variables` (model variables
    that keep each rank's values). No-op with world size 1.

    Raises:
        ValueError: the model is not built yet (build it, or use `BroadcastGlobalVariablesCallback`).
        RuntimeError: the ranks' variables differ in number, shapes or dtypes.
    """
    if not is_built(model):
        raise ValueError(
            f"model {model.name!r} is not built yet, so it has no variables to broadcast: build it first "
            "(keras.Input, model.build(input_shape) or a call on a batch), or broadcast with "
            "BroadcastGlobalVariablesCallback, which builds it from fit's data."
        )
    optimizer = getattr(model, "optimizer", None)
    local = {id(v) for v in local_variables}
    variables = [v for v in model.variables if id(v) not in local]
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables += optimizer.variables
    collectives.broadcast_variables(
        [v for v in variables if "seed_generator" not in v.path], root_rank=root_rank
    )


def is_built(model):
    """True when every layer of `model` has created its variables (what `fit` would otherwise do in its
    first step)."""
    return model.built and all(layer.built for layer in keras_internals.flatten_layers(model))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Gives every rank rank `root_rank`'s model and optimizer state (`broadcast_model_and_optimizer`) at
    the first batch of every `fit`, after every callback's `on_train_begin` (so after any restore); a model
    Keras would build in its first step is built first from the shapes of `fit`'s data. (Horovod's
    broadcasts after the first update.) `device`: "" or a TensorFlow device; `local_variables`: a
    `keras.Variable` or a list of them (else ValueError) that keep each rank's values.
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        if isinstance(local_variables, keras.Variable):
            local_variables = [local_variables]
        self.local_variables = list(local_variables or [])
        bad = [v for v in self.local_variables if not isinstance(v, keras.Variable)]
        if bad:
            raise ValueError(f"local_variables must be keras.Variable objects, got {bad[0]!r}.")
        self._done = False

    def on_train_begin(self, logs=None):
        self._done = False

    def on_train_batch_begin(self, batch, logs=None):
        if self._done:
            return
        self._done = True
        if is_built(self.model):
            self._broadcast()
            return
        model, train_function = self.model, self.model.train_function

        def first_step(iterator):
            # Called by fit in place of its step once: build from the data's shapes, broadcast, step.
            model.train_function = train_function
            keras_internals.symbolic_build(model, iterator.element_spec)
            self._broadcast()
            return train_function(iterator)

        model.train_function = first_step

    def _broadcast(self):
        with collectives.device_scope(self.device):
            broadcast_model_and_optimizer(self.model, self.root_rank, local_variables=self.local_variables)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces every number in the epoch logs (`val_*` included) by its mean over ranks (`average_metrics`)
    at each epoch end, so that the callbacks after it and Keras's History see the same values on every rank.
    Put it before those that read the logs (EarlyStopping, ModelCheckpoint, CSVLogger, ...). `device`: ""
    or a TensorFlow device for the allreduce.
    """

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        with collectives.device_scope(self.device):
            average_metrics(logs)


def average_metrics(logs):
    """Replaces each number in the dict `logs` by its mean over ranks, in place, and returns `logs`;
    RuntimeError when the ranks' dicts hold different numeric keys."""
    if not logs or collectives.size() == 1:
        return logs
    keys = sorted(k for k, v in logs.items() if is_number(v))
    # The keys' checksum travels with the values: different keys on some rank would else pair one
    # rank's loss with another's accuracy.
    checksum = zlib.crc32(",".join(keys).encode())
    sums = collectives.allreduce_sum(
        [float(logs[k]) for k in keys] + [checksum], name="hvd_lars.metric_average"
    )
    if sums[-1] != checksum * collectives.size():
        raise RuntimeError(
            f"MetricAverageCallback: rank {collectives.rank()} has logs {keys}; others differ."
        )
    for key, total in zip(keys, sums[:-1]):
        logs[key] = float(total / collectives.size())
    return logs
