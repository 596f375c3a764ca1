"""Callbacks that set the learning rate from a schedule before each update, and log the rate used.

For optimizers built with a float rate, in the user's own `model.fit`; a schedule given to the optimizer
itself needs neither setter (`hvd_lars.optim.schedules`).
"""

import warnings

import keras

from hvd_lars.optim.wrapping import held_rate, to_float


class LearningRateWarmup(keras.callbacks.Callback):
    """Sets a float learning rate from a schedule of the optimizer's update counter before every batch.

    For any Keras 3 optimizer built with a float rate (through its wrappers): before each batch,
    `optimizer.learning_rate = schedule(optimizer.iterations)`, from the update counter alone, so a run
    restored from a checkpoint continues the curve exactly, and with gradient accumulation the rate
    changes once per update.

    Args:
        schedule: callable of the step (int, optimizer updates from 0) returning the rate as a float or
            scalar tensor: any schedule of `hvd_lars.optim.schedules` (`make_schedule(...)`), or any
            `keras.optimizers.schedules.LearningRateSchedule`.

    Raises:
        ValueError: `schedule` is not callable; at train begin, the optimizer's rate is a schedule or
            callable.

    With `steps_per_execution=k > 1` the rate is set once per k steps (a warning says so).
    """

    def __init__(self, schedule):
        super().__init__()
        if not callable(schedule):
            raise ValueError(f"schedule must be a callable of the step, got {schedule!r}.")
        self.schedule = schedule

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        rate = held_rate(optimizer)
        if not isinstance(rate, keras.Variable):
            raise ValueError(
                "LearningRateWarmup needs an optimizer with a float learning rate; "
                f"{type(optimizer).__name__} {optimizer.name!r} has a {type(rate).__name__}. Pass the "
                "schedule to the optimizer instead, or build the optimizer with a float rate (for example "
                "learning_rate=0.0)."
            )
        steps_per_execution = getattr(self.model, "steps_per_execution", 1) or 1
        if steps_per_execution > 1:
            warnings.warn(
                f"LearningRateWarmup with steps_per_execution={steps_per_execution}: the rate is set once "
                f"per {steps_per_execution} steps.",
                stacklevel=2,
            )
        self._set_rate()  # right from the start, e.g. for callbacks that read it before the first batch

    def on_train_batch_begin(self, batch, logs=None):
        self._set_rate()

    def _set_rate(self):
        optimizer = self.model.optimizer
        optimizer.learning_rate = to_float(self.schedule(int(to_float(optimizer.iterations))))


class LearningRateLogger(keras.callbacks.Callback):
    """Adds `learning_rate` to the epoch logs: the rate the optimizer used for its last update of the epoch.

    A float rate is read at epoch end; a schedule inside the optimizer through `optimizer.learning_rate`
    before each batch (what that batch's update uses, whatever counter the optimizer feeds it). Place it
    before CSVLogger and TensorBoard (whose own `learning_rate` is, for a schedule, the next update's).

    Args:
        key: str, the name in the logs (`"learning_rate"`).
    """

    def __init__(self, key="learning_rate"):
        super().__init__()
        self.key = key
        self._scheduled = False
        self._rate = None

    def on_train_begin(self, logs=None):
        self._scheduled = not isinstance(held_rate(self.model.optimizer), keras.Variable)

    def on_train_batch_begin(self, batch, logs=None):
        if self._scheduled:
            self._rate = self.model.optimizer.learning_rate

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        rate = self._rate if self._scheduled else self.model.optimizer.learning_rate
        if rate is not None:
            logs[self.key] = to_float(rate)
