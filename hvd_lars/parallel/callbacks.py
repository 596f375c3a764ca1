"""The callbacks of `horovod.tensorflow.keras`, for Keras 3 (Horovod's own use `var.ref()`, `optimizer.lr`
and `keras.backend.get_value`, which Keras 3 lacks; Horovod issue 4290). The learning-rate ones are in
`hvd_lars.parallel.learning_rate_callbacks`, and here by name too.

Same names and arguments as Horovod's, so a Horovod Keras script changes its imports only:

```python
from hvd_lars.parallel import collectives as hvd                      # hvd.init(), hvd.rank(), hvd.size()
from hvd_lars import DistributedOptimizer
from hvd_lars.parallel.callbacks import (
    BroadcastGlobalVariablesCallback, LearningRateWarmupCallback, MetricAverageCallback)
```

Put `MetricAverageCallback` before callbacks that read the epoch logs (EarlyStopping, ReduceLROnPlateau,
ModelCheckpoint, CSVLogger, TensorBoard); Keras adds its History and progress bar after the user's list.
"""

import zlib

import keras

from hvd_lars import keras_internals
from hvd_lars.parallel import collectives
from hvd_lars.parallel.learning_rate_callbacks import (  # noqa: F401  (hvd.callbacks.*)
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
)


def broadcast_model_and_optimizer(model, root_rank=0, local_variables=()):
    """Overwrites the model's and its optimizer's variables on every rank with rank `root_rank`'s.

    Model: weights and non-trainable state (batch-norm statistics); optimizer (built first, from the
    model's trainable variables, if it is not yet): step counters, slots, accumulators, learning-rate and
    loss-scale variables. Dropout seed states stay per rank, so ranks draw different masks as separate
    processes do. The ranks' lists must agree in number, shapes and dtypes, position by position; the
    paths may differ (a model loaded with `keras.models.load_model` on rank 0 against the same model
    built in code elsewhere). `local_variables`: model variables that keep each rank's own values.
    No-op with world size 1.

    Raises:
        ValueError: the model is not built yet (a `Sequential` without `keras.Input`, a subclassed model
            never called): build it first, or use `BroadcastGlobalVariablesCallback`, which builds it
            from the shapes of `fit`'s data.
        RuntimeError: the ranks' variables differ (`collectives.check_same_variables`).
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
    """Gives every rank rank `root_rank`'s model and optimizer state before the first update of each `fit`.

    Broadcasts at the first batch of every `fit` call, after every callback's `on_train_begin` (so after a
    `keras.callbacks.BackupAndRestore` restore or a checkpoint restored on rank 0 only, wherever this
    callback stands in the list) and after the optimizer is built: a fresh start and every resume begin
    from the same state on all ranks. A model that Keras would build in its first step (a `Sequential`
    without `keras.Input`, a subclassed model) is built first, as Keras builds models under a
    distribution strategy: from the shapes and dtypes of `fit`'s data (`iterator.element_spec`, no batch
    is consumed), together with its optimizer, then broadcast, then the first step runs. See
    `broadcast_model_and_optimizer` for what is sent. (Horovod's broadcasts after the first batch
    instead, when Keras 2 had just created the slots, so its first update mixes ranks' weights.)

    Args:
        root_rank: int, the rank whose state wins (0).
        device: "" or a TensorFlow device for the broadcasts (Horovod's argument).
        local_variables: a `keras.Variable` or a list of them, model variables left out of the
            broadcast (Horovod's argument): each rank keeps its own values. The optimizer's variables
            are all broadcast, as Horovod's callback does.

    Raises:
        ValueError: an entry of `local_variables` that is not a `keras.Variable`.
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
    """Replaces every number in the epoch logs, Keras's `val_*` included, by its mean over ranks.

    At each epoch end of `fit`, so that EarlyStopping, ReduceLROnPlateau, ModelCheckpoint and the loggers
    placed after this callback (and Keras's History) see the same values on every rank. The plain mean
    over ranks is the mean over all examples when every rank runs the same number of steps on batches of
    the same size, as sharded data-parallel input does. For `model.evaluate(..., return_dict=True)`
    (whose result callbacks cannot change), use `average_metrics`.

    Args:
        device: "" or a TensorFlow device for the allreduce (Horovod's argument).

    Raises:
        RuntimeError: the ranks' logs hold different keys (named in the message).
    """

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        with collectives.device_scope(self.device):
            average_metrics(logs)


def average_metrics(logs):
    """Replaces each number in the dict `logs` by its mean over ranks, in place, and returns `logs`.

    Raises:
        RuntimeError: the ranks' dicts hold different numeric keys.
    """
    if not logs or collectives.size() == 1:
        return logs
    keys = sorted(k for k, v in logs.items() if _is_number(v))
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


def _is_number(value):
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, (str, bytes))


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's `BestModelCheckpoint`: Keras's `ModelCheckpoint` with `save_best_only=True`.

    Horovod's takes no file path (its Spark estimators set one afterwards); Keras 3's ModelCheckpoint
    checks the path when it is made, so here `filepath` is a keyword argument and required. Use it on
    rank 0 only, after `MetricAverageCallback`, so that the best epoch is judged on the ranks' mean.

    Args:
        monitor, verbose, save_weights_only, mode, save_freq: Horovod's and Keras's.
        filepath: str, ending in ".keras" (or ".weights.h5" with `save_weights_only`).

    Raises:
        ValueError: no `filepath`; Keras's own for a path it refuses.
    """

    def __init__(
        self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch", *,
        filepath=None,
    ):  # fmt: skip
        if filepath is None:
            raise ValueError(
                "BestModelCheckpoint needs filepath=... (e.g. 'best.keras'): Keras 3's ModelCheckpoint "
                "checks its path when it is made, where Horovod's Spark estimator set it afterwards."
            )
        super().__init__(
            filepath, monitor=monitor, verbose=verbose, save_best_only=True,
            save_weights_only=save_weights_only, mode=mode, save_freq=save_freq,
        )  # fmt: skip
