"""Horovod's learning-rate callbacks for Keras 3 (`hvd.callbacks.LearningRateWarmupCallback`,
`LearningRateScheduleCallback`), with Horovod's momentum correction (Goyal et al. 2017, section 2.1).

Horovod's own set `optimizer.lr` and `optimizer.momentum` through `keras.backend.set_value`, which Keras 3
lacks (Horovod issue 4290), and Keras 3 bakes `momentum` into the compiled step as a constant. Horovod
corrects the momentum by setting it to `m * lr_new / lr_old` for the one batch in which the rate changes.
For an optimizer whose velocity carries the rate (`v = m v - lr g`, Keras's SGD and RMSprop), that equals
rescaling the velocity by `lr_new / lr_old` before that update, which is what `correct_momentum` does.
"""

import sys

import keras

from hvd_lars.optim.rate_callbacks import LearningRateWarmup
from hvd_lars.optim.wrapping import held_rate, innermost_optimizer, to_float
from hvd_lars.parallel import collectives
from hvd_lars.parallel.accumulation import accumulation_steps


def momentum_slots(optimizer):
    """The variables holding `optimizer`'s velocity in units of the rate, which Horovod's correction
    rescales; [] when it has no momentum (Adam: Horovod's `hasattr(optimizer, 'momentum')` is false; or
    momentum 0). Looks through wrappers (DistributedOptimizer, LossScaleOptimizer).

    Raises:
        ValueError: an optimizer with momentum where rescaling the velocity is not Horovod's correction:
            `hvd_lars.LARS` (it corrects its velocity itself: `momentum_correction=`), Nesterov SGD (its
            look-ahead step uses the momentum too), any other (Muon's momentum holds no rate). The message
            says to pass `momentum_correction=False`.
    """
    inner = innermost_optimizer(optimizer)
    momentum = getattr(inner, "momentum", None)
    if momentum is None or not float(momentum):
        return []
    from hvd_lars.optim.lars import LARS

    cls = type(inner).__name__
    if isinstance(inner, LARS):
        reason = "LARS rescales its own velocity: LARS(..., momentum_correction='always' or 'warmup')"
    elif type(inner) is keras.optimizers.SGD and not inner.nesterov:
        return list(getattr(inner, "momentums", []))  # none before it is built (nothing to rescale)
    elif type(inner) is keras.optimizers.RMSprop:
        # Keras 3's RMSprop keeps its momentum buffers (m = momentum m + lr g / rms) in `_momentums`
        # (a private name, checked with Keras 3.15); none before it is built.
        return list(getattr(inner, "_momentums", []))
    elif type(inner) is keras.optimizers.SGD:
        reason = "Nesterov's look-ahead step uses the momentum too, so rescaling the velocity is not exact"
    else:
        reason = f"{cls}'s velocity is not known to carry the learning rate"
    raise ValueError(
        f"momentum_correction=True with {cls}(momentum={momentum:g}): {reason}; pass "
        "momentum_correction=False to the learning-rate callback."
    )


def correct_momentum(optimizer, old_rate, new_rate):
    """Rescales `optimizer`'s velocity (`momentum_slots`) by `new_rate / old_rate`, before the update that
    uses `new_rate`; nothing when the rates are equal or `old_rate` is 0 (no velocity in its units)."""
    if old_rate == new_rate or not old_rate:
        return
    ratio = new_rate / old_rate
    for slot in momentum_slots(optimizer):
        slot.assign(slot * ratio)


def _float_rate(optimizer, who):
    """The optimizer's rate as a float; ValueError when it is a schedule or callable (it cannot be set)."""
    # A float rate is held as a variable; the public `learning_rate` would evaluate a schedule instead.
    if not isinstance(held_rate(optimizer), keras.Variable):
        raise ValueError(
            f"{who} sets a float learning rate; {optimizer.name!r} has a schedule or callable. Build the "
            "optimizer with a float rate (the callback sets it), or drop the callback."
        )
    return to_float(optimizer.learning_rate)


def _is_number(value):
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, (str, bytes, bool))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's `LearningRateScheduleCallback`: between epochs `start_epoch` (included) and `end_epoch`
    (excluded; None: to the end), the rate is `initial_lr * multiplier(epoch)`.

    `epoch` is `fit`'s epoch index (from `initial_epoch`). `staircase=True`: set at the first batch of
    each epoch, with the whole epoch; `staircase=False`: before every batch, with `epoch + batch /
    steps_per_epoch`. A constant `multiplier` means staircase. At each epoch end `logs["lr"]` is the rate.

    Args:
        initial_lr: float > 0, the rate the multiplier scales.
        multiplier: number, or callable of the epoch (float) returning one.
        start_epoch, end_epoch: ints (0, None).
        staircase: bool (True).
        momentum_correction: True (Horovod's default): where the rate changes, the velocity of an
            optimizer with momentum is rescaled by new / old rate (`correct_momentum`); no-op without
            momentum; ValueError at train begin for LARS and Nesterov SGD (`momentum_slots`).
        steps_per_epoch: batches per epoch for `staircase=False`; None: `fit`'s.

    Raises:
        ValueError: `initial_lr` not a number > 0; at train begin, an optimizer whose rate is a schedule
            or callable, unknown steps per epoch, or a refused momentum correction.
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
        if not _is_number(initial_lr) or not float(initial_lr) > 0:
            raise ValueError(f"initial_lr must be a number > 0, got {initial_lr!r}.")
        self.initial_lr = float(initial_lr)
        self.staircase = staircase if callable(multiplier) else True
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.momentum_correction = bool(momentum_correction)
        self.steps_per_epoch = steps_per_epoch
        self._epoch = None

    def on_train_begin(self, logs=None):
        _float_rate(self.model.optimizer, type(self).__name__)
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
        if self.staircase:
            if batch == 0:
                self._set(self.initial_lr * self.multiplier(epoch))
        else:
            self._set(self.initial_lr * self.multiplier(epoch + batch / self.steps_per_epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = to_float(self.model.optimizer.learning_rate)

    def _set(self, rate):
        optimizer = self.model.optimizer
        old = to_float(optimizer.learning_rate)
        optimizer.learning_rate = float(rate)
        if self.momentum_correction:
            correct_momentum(optimizer, old, float(rate))


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
    optimizer needs a float learning rate. At each epoch end `logs["lr"]` is the rate, as Horovod's.

    Args:
        initial_lr: float > 0, the rate after warmup (already scaled for the global batch).
        warmup_epochs: float > 0 (5, Goyal et al.).
        momentum_correction: True (Horovod's default): at each update where the rate changes, the
            velocity of an optimizer with momentum (Keras's SGD, RMSprop) is rescaled by the new rate
            over the old (`correct_momentum`), Horovod's temporary `momentum * new / old`; no-op for
            optimizers without momentum (Adam); refused at train begin (ValueError) for `hvd_lars.LARS`
            (use its own `momentum_correction`) and Nesterov SGD, where the rescale is not exact.
        steps_per_epoch: batches per epoch; None: from `fit` (its `steps`). Updates per epoch are batches
            divided by the optimizer's gradient accumulation.
        verbose: 1 prints on rank 0 when the warmup ends.

    Raises:
        ValueError: `initial_lr` or `warmup_epochs` not > 0; at train begin, unknown steps per epoch, an
            optimizer whose rate is a schedule or callable, or a refused momentum correction.
    """

    def __init__(
        self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0
    ):
        if not _is_number(initial_lr) or not float(initial_lr) > 0:
            raise ValueError(f"initial_lr must be a number > 0, got {initial_lr!r}.")
        if not _is_number(warmup_epochs) or not float(warmup_epochs) > 0:
            raise ValueError(f"warmup_epochs must be a number > 0, got {warmup_epochs!r}.")
        super().__init__(self._warmup_rate)
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = float(warmup_epochs)
        self.momentum_correction = bool(momentum_correction)
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._updates_per_epoch = None
        self._finished = False

    def on_train_begin(self, logs=None):
        batches = self.steps_per_epoch or (self.params or {}).get("steps")
        if not batches:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch (fit could not tell it).")
        if self.momentum_correction:
            momentum_slots(self.model.optimizer)  # refuses LARS and Nesterov before the first update
        self._updates_per_epoch = max(1, batches // accumulation_steps(self.model.optimizer))
        self._finished = self._epoch() >= self.warmup_epochs
        super().on_train_begin(logs)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = to_float(self.model.optimizer.learning_rate)

    def _epoch(self):
        return to_float(self.model.optimizer.iterations) / self._updates_per_epoch

    def _warmup_rate(self, step):
        size = collectives.size()
        epoch = min((step + 1) / self._updates_per_epoch, self.warmup_epochs)
        return self.initial_lr / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def _set_rate(self):
        if self._finished:
            return
        optimizer = self.model.optimizer
        old = _float_rate(optimizer, type(self).__name__)
        super()._set_rate()
        if self.momentum_correction:
            correct_momentum(optimizer, old, to_float(optimizer.learning_rate))
        # This update's rate was the last of the warmup (epoch + 1 / U reached W).
        if (to_float(optimizer.iterations) + 1) / self._updates_per_epoch >= self.warmup_epochs:
            self._finished = True
            if self.verbose and collectives.is_chief():
                # As Horovod's callback says it, on standard output.
                sys.stdout.write(
                    f"LearningRateWarmupCallback: warmup finished at rate {self.initial_lr:g}.\n"
                )
