"""Horovod's gradual warmup for Keras 3 (`LearningRateWarmupCallback`), with Horovod's momentum correction
(Goyal et al. 2017, section 2.1) as a rescaled velocity (docs/design.md, "Momentum correction").
"""

import sys

import keras

from hvd_lars.arguments import above, check
from hvd_lars.optim.lars import LARS, correct_momentum
from hvd_lars.optim.rate_callbacks import LearningRateWarmup
from hvd_lars.optim.wrapping import innermost_optimizer, to_float
from hvd_lars.parallel import collectives
from hvd_lars.parallel.accumulation import accumulation_steps


def momentum_slots(optimizer):
    """The variables holding `optimizer`'s velocity in units of the rate (through its wrappers); [] without
    momentum. ValueError where rescaling it is not Horovod's correction (LARS, Nesterov SGD, others)."""
    inner = innermost_optimizer(optimizer)
    momentum = getattr(inner, "momentum", None)
    if momentum is None or not float(momentum):
        return []
    if type(inner) is keras.optimizers.SGD and not inner.nesterov:
        return list(getattr(inner, "momentums", []))  # none before it is built (nothing to rescale)
    if type(inner) is keras.optimizers.RMSprop:
        # Keras 3's RMSprop keeps m = momentum m + lr g / rms in `_momentums` (private, Keras 3.15).
        return list(getattr(inner, "_momentums", []))
    if isinstance(inner, LARS):
        reason = "LARS rescales its own velocity: LARS(..., momentum_correction='always' or 'warmup')"
    elif type(inner) is keras.optimizers.SGD:
        reason = "Nesterov's look-ahead step uses the momentum too, so rescaling the velocity is not exact"
    else:
        reason = f"{type(inner).__name__}'s velocity is not known to carry the learning rate"
    raise ValueError(
        f"momentum_correction=True with {type(inner).__name__}(momentum={momentum:g}): {reason}; pass "
        "momentum_correction=False to the learning-rate callback."
    )


class LearningRateWarmupCallback(LearningRateWarmup):
    """Horovod's gradual warmup (Goyal et al. 2017, section 2.2), set before every batch: before update `t`
    (from 0, the optimizer's counter, so a resumed run continues the ramp), with `U` updates per epoch,
    `lr = initial_lr / size * (e * (size - 1) / W + 1)`, `e = min((t + 1) / U, W)` (Horovod 0.28.1's
    `horovod/_keras/callbacks.py`). Afterwards the rate stays until another callback changes it. The
    optimizer needs a float rate. At each epoch end `logs["lr"]` is the rate, as Horovod's.

    Args:
        initial_lr: float > 0, the rate after warmup (already scaled for the global batch).
        warmup_epochs: float > 0, W (5, Goyal et al.).
        momentum_correction: True (Horovod's default): the velocity rescaled where the rate changes.
        steps_per_epoch: batches per epoch (None: `fit`'s), divided by the gradient accumulation.
        verbose: 1 prints on rank 0 when the warmup ends.

    Raises:
        ValueError: `initial_lr` or `warmup_epochs` not > 0; at train begin, unknown steps per epoch, an
            optimizer whose rate is a schedule or callable, or a refused momentum correction.
    """

    def __init__(
        self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0
    ):
        super().__init__(self._warmup_rate)
        self.initial_lr = float(check("initial_lr", initial_lr, above(0)))
        self.warmup_epochs = float(check("warmup_epochs", warmup_epochs, above(0)))
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
        updates = to_float(self.model.optimizer.iterations)
        self._finished = updates / self._updates_per_epoch >= self.warmup_epochs
        super().on_train_begin(logs)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = to_float(self.model.optimizer.learning_rate)

    def _warmup_rate(self, step):
        size = collectives.size()
        epoch = min((step + 1) / self._updates_per_epoch, self.warmup_epochs)
        return self.initial_lr / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def _set_rate(self):
        if self._finished:
            return
        optimizer = self.model.optimizer
        old = to_float(optimizer.learning_rate)
        super()._set_rate()
        new = to_float(optimizer.learning_rate)
        if self.momentum_correction and new != old:
            correct_momentum(momentum_slots(optimizer), old, new)
        # This update's rate was the last of the warmup (epoch + 1 / U reached W).
        if (to_float(optimizer.iterations) + 1) / self._updates_per_epoch >= self.warmup_epochs:
            self._finished = True
            if self.verbose and collectives.is_chief():  # on standard output, as Horovod's callback says it
                sys.stdout.write(
                    f"LearningRateWarmupCallback: warmup finished at rate {self.initial_lr:g}.\n"
                )
