"""Gradient accumulation: the gradients of k micro-batches summed on the rank, handed on once per update.

`hvd_lars.DistributedOptimizer(backward_passes_per_step=k)` uses it, so that ranks communicate once per
update rather than once per micro-batch (Horovod's `backward_passes_per_step`). The accumulators are
variables of the optimizer that uses this piece, made by it (`add_variable_from_reference`) and held as
its attribute `_accumulated_gradients`, so its checkpoints hold them, a pending micro-batch included.
"""

import keras

from hvd_lars import keras_internals


class GradientAccumulation:
    """k micro-batches per update: accumulate, or (at the update's last micro-batch) update.

    Args:
        steps: int >= 1, micro-batches per update.
        average: True: the update gets the micro-batches' mean gradient (Keras's own
            `gradient_accumulation_steps`); False: their sum (Horovod's `average_aggregated_gradients=False`).
    """

    def __init__(self, steps, average):
        self.steps = steps
        self.average = average

    def create(self, optimizer, var_list):
        """One zero accumulator per variable of `var_list`, made by `optimizer` (its variables)."""
        return [optimizer.add_variable_from_reference(v, name="gradient_accumulator") for v in var_list]

    def apply(self, grads, accumulators, micro_batch, update):
        """Adds this micro-batch's `grads` to `accumulators`, or on the update's last micro-batch calls
        `update(gradients)` with the update's mean (or sum) and zeroes the accumulators.

        Traceable: both branches are one `keras.ops.cond` on `micro_batch` (the 0-based count of
        micro-batches before this one, a tensor or variable); only the update branch runs `update`, so
        whatever `update` communicates is communicated once per update.

        Args:
            grads: list of gradients (None for a variable without one).
            accumulators: the accumulators of `grads`' variables, in the same order.
            micro_batch: int scalar tensor or variable.
            update: callable(list of gradients or None), the update with the accumulated gradients.
        """
        divisor = self.steps if self.average else 1

        def finish():
            totals = [None if g is None else (g + a) / divisor for g, a in zip(grads, accumulators)]
            update(totals)
            for g, a in zip(grads, accumulators):
                if g is not None:
                    a.assign(keras.ops.zeros_like(a))

        def accumulate():
            for g, a in zip(grads, accumulators):
                if g is not None:
                    a.assign_add(keras.ops.cast(g, a.dtype))

        keras.ops.cond((micro_batch + 1) % self.steps == 0, finish, accumulate)


def accumulation_steps(optimizer):
    """Micro-batches per update of `optimizer` (int >= 1), through any chain of wrappers: a
    `DistributedOptimizer`'s `backward_passes_per_step`, or Keras's own `gradient_accumulation_steps`."""
    while True:
        steps = getattr(optimizer, "backward_passes_per_step", None)
        if steps is not None:
            return steps
        if not hasattr(optimizer, "inner_optimizer"):
            return optimizer.gradient_accumulation_steps or 1
        optimizer = optimizer.inner_optimizer


def at_update_boundary(optimizer):
    """True when `optimizer` holds no partly accumulated gradients: every micro-batch seen so far belongs
    to an applied update (always true without gradient accumulation). Through any chain of wrappers
    (`DistributedOptimizer(backward_passes_per_step=k)`, Keras's `gradient_accumulation_steps=k`)."""
    while True:
        steps = getattr(optimizer, "backward_passes_per_step", None) or getattr(
            optimizer, "gradient_accumulation_steps", None
        )
        if steps:
            # The micro-batch count is the accumulating optimizer's own counter.
            return steps == 1 or int(keras_internals.own_iterations(optimizer)) % steps == 0
        if not hasattr(optimizer, "inner_optimizer"):
            return True
        optimizer = optimizer.inner_optimizer
