"""`horovod.tensorflow.keras.callbacks` for Keras 3: Horovod's five callbacks, with Horovod's arguments."""

import keras

from hvd_lars.arguments import above, check
from hvd_lars.optim.lars import correct_momentum
from hvd_lars.optim.wrapping import held_rate, to_float
from hvd_lars.parallel.callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback  # noqa: F401
from hvd_lars.parallel.learning_rate_callbacks import (  # noqa: F401
    LearningRateWarmupCallback,
    momentum_slots,
)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's `LearningRateScheduleCallback`: from epoch `start_epoch` to `end_epoch` (excluded; None:
    to the end) of `fit`, the rate is `initial_lr` (a float > 0) times `multiplier(epoch)`, set at each
    epoch's first batch (`staircase`, and for a constant `multiplier`) or before every batch with
    `epoch + batch / steps_per_epoch` (None: `fit`'s). At each epoch end `logs["lr"]` is the rate.
    `momentum_correction` and the errors at train begin as `LearningRateWarmupCallback`'s.
    """

    def __init__(
        self,
        initial_lr,
        multiplier,
        start_epoch=0,
        end_epoch=None,
        staircase=True,
        momentum_correction=True,
        steps_per_epoch=None,
    ):
        super().__init__()
        self.initial_lr = float(check("initial_lr", initial_lr, above(0)))
        self.staircase = staircase if callable(multiplier) else True
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.momentum_correction = bool(momentum_correction)
        self.steps_per_epoch = steps_per_epoch
        self._epoch = None

    def on_train_begin(self, logs=None):
        if not isinstance(held_rate(self.model.optimizer), keras.Variable):
            raise ValueError(
                f"{type(self).__name__} sets a float learning rate; {self.model.optimizer.name!r} has a "
                "schedule or callable. Build the optimizer with a float rate, or drop the callback."
            )
        if self.momentum_correction:
            momentum_slots(self.model.optimizer)  # refuses LARS and Nesterov before the first update
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__} needs steps_per_epoch (fit could not tell it).")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self._epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if not self.staircase:
            epoch += batch / self.steps_per_epoch
        elif batch:
            return
        optimizer = self.model.optimizer
        old, new = to_float(optimizer.learning_rate), self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = float(new)
        if self.momentum_correction and new != old:
            correct_momentum(momentum_slots(optimizer), old, float(new))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = to_float(self.model.optimizer.learning_rate)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's `BestModelCheckpoint`: Keras's `ModelCheckpoint` with `save_best_only=True` and `filepath`
    a required keyword (ValueError without: Keras 3 checks it when the callback is made, where Horovod's
    Spark estimators set it later). On rank 0 only, after `MetricAverageCallback`.
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
