"""The callbacks of `horovod.tensorflow.keras`, for Keras 3 (Horovod's own use `var.ref()`, `optimizer.lr`
and `keras.backend.get_value`, which Keras 3 lacks; Horovod issue 4290).

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

from hvd_lars.optim.rate_callbacks import LearningRateWarmup
from hvd_lars.optim.wrapping import to_float
from hvd_lars.parallel import collectives
from hvd_lars.parallel.optimizer import accumulation_steps


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
    return model.built and all(layer.built for layer in model._flatten_layers())


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
        local_variables: a `keras.Variable` or a list of them, model variables left out of the
            broadcast (Horovod's argument): each rank keeps its own values. The optimizer's variables
            are all broadcast, as Horovod's callback does.

    Raises:
        ValueError: an entry of `local_variables` that is not a `keras.Variable`.
    """

    def __init__(self, root_rank=0, local_variables=None):
        super().__init__()
        self.root_rank = root_rank
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
            model._symbolic_build(data_batch=iterator.element_spec)
            self._broadcast()
            return train_function(iterator)

        model.train_function = first_step

    def _broadcast(self):
        broadcast_model_and_optimizer(self.model, self.root_rank, local_variables=self.local_variables)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces every number in the epoch logs, Keras's `val_*` included, by its mean over ranks.

    At each epoch end of `fit`, so that EarlyStopping, ReduceLROnPlateau, ModelCheckpoint and the loggers
    placed after this callback (and Keras's History) see the same values on every rank. The plain mean
    over ranks is the mean over all examples when every rank runs the same number of steps on batches of
    the same size, as sharded data-parallel input does. For `model.evaluate(..., return_dict=True)`
    (whose result callbacks cannot change), use `average_metrics`.

    Raises:
        RuntimeError: the ranks' logs hold different keys (named in the message).
    """

    def on_epoch_end(self, epoch, logs=None):
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


class LearningRateWarmupCallback(LearningRateWarmup):
    """Horovod's gradual warmup (Goyal et al. 2017, section 2.2): the rate grows linearly from about
    `initial_lr / size` to `initial_lr` over the first `warmup_epochs` epochs, set before every batch.

    Before update `t` (from 0), with `U` updates per epoch and `W = warmup_epochs`:
    `lr = initial_lr / size * (e * (size - 1) / W + 1)` with `e = min((t + 1) / U, W)`, the formula of
    Horovod 0.28.1's code (`horovod/_keras/callbacks.py`: epoch + (batch + 1) / steps, so that each epoch
    ends on a round value), whose docstring describes `e = t / U`. So the first update uses
    `initial_lr / size * (1 + (size - 1) / (U * W))` and the last warmup update `initial_lr`
    (initial_lr 0.2, W 5, U 5, 2 ranks: 0.104, then 0.200 at update 24). Here `t` is the optimizer's update
    counter, so a run resumed from a checkpoint continues the ramp exactly. After the warmup the callback
    leaves the rate to the user's other schedule callbacks (the last warmup rate, `initial_lr`, stays
    until one changes it; unlike Horovod's, it never exceeds `initial_lr` when `W` is fractional). The
    optimizer needs a float learning rate.

    Args:
        initial_lr: float > 0, the rate after warmup (already scaled for the global batch).
        warmup_epochs: float > 0 (5, Goyal et al.).
        momentum_correction: False. Horovod's default True rescales the optimizer's momentum for one
            batch when the rate changes; Keras 3 optimizers bake their momentum into the compiled step,
            so a callback cannot change it: True raises ValueError (use `hvd_lars.LARS(...,
            momentum_correction=True)`, which rescales its velocity itself).
        steps_per_epoch: batches per epoch; None: from `fit` (its `steps`). Updates per epoch are batches
            divided by the optimizer's gradient accumulation.
        verbose: 1 prints on rank 0 when the warmup ends.

    Raises:
        ValueError: `initial_lr` or `warmup_epochs` not > 0, or `momentum_correction=True`; at train begin,
            unknown steps per epoch, or an optimizer whose rate is a schedule or callable.
    """

    def __init__(
        self, initial_lr, warmup_epochs=5, momentum_correction=False, steps_per_epoch=None, verbose=0
    ):
        if not _is_number(initial_lr) or not float(initial_lr) > 0:
            raise ValueError(f"initial_lr must be a number > 0, got {initial_lr!r}.")
        if not _is_number(warmup_epochs) or not float(warmup_epochs) > 0:
            raise ValueError(f"warmup_epochs must be a number > 0, got {warmup_epochs!r}.")
        if momentum_correction:
            raise ValueError(
                "momentum_correction=True: Keras 3 optimizers compile their momentum into the training step, "
                "so a callback cannot rescale it; use hvd_lars.LARS(..., momentum_correction=True), which "
                "rescales its velocity by the rate ratio itself, and momentum_correction=False here."
            )
        super().__init__(self._warmup_rate)
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = float(warmup_epochs)
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._updates_per_epoch = None
        self._finished = False

    def on_train_begin(self, logs=None):
        batches = self.steps_per_epoch or (self.params or {}).get("steps")
        if not batches:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch (fit could not tell it).")
        self._updates_per_epoch = max(1, batches // accumulation_steps(self.model.optimizer))
        self._finished = self._epoch() >= self.warmup_epochs
        super().on_train_begin(logs)

    def _epoch(self):
        return to_float(self.model.optimizer.iterations) / self._updates_per_epoch

    def _warmup_rate(self, step):
        size = collectives.size()
        epoch = min((step + 1) / self._updates_per_epoch, self.warmup_epochs)
        return self.initial_lr / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def _set_rate(self):
        if self._finished:
            return
        super()._set_rate()
        # This update's rate was the last of the warmup (epoch + 1 / U reached W).
        if (to_float(self.model.optimizer.iterations) + 1) / self._updates_per_epoch >= self.warmup_epochs:
            self._finished = True
            if self.verbose and collectives.is_chief():
                print(f"LearningRateWarmupCallback: warmup finished at rate {self.initial_lr:g}.", flush=True)
