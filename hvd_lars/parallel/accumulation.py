"""Gradient accumulation: the gradients of k micro-batches summed on the rank and handed on once per
update (`DistributedOptimizer(backward_passes_per_step=k)`), in accumulators that are variables of the
optimizer (so its checkpoints hold a pending micro-batch)."""

import keras

from hvd_lars import keras_internals


def accumulate(grads, accumulators, micro_batch, steps, average, update):
    """Adds this micro-batch's `grads` (None for no gradient) to `accumulators` (in the same order), or
    on the update's last of `steps` micro-batches calls `update(gradients)` with the update's mean
    (`average`, as Keras's accumulation) or sum (Horovod's) and zeroes them: one traceable
    `keras.ops.cond` on `micro_batch` (the micro-batches before this one)."""

    def finish():
        update(
            [None if g is None else (g + a) / (steps if average else 1) for g, a in zip(grads, accumulators)]
        )
        for g, a in zip(grads, accumulators):
            if g is not None:
                a.assign(keras.ops.zeros_like(a))

    def add():
        for g, a in zip(grads, accumulators):
            if g is not None:
                a.assign_add(keras.ops.cast(g, a.dtype))

    keras.ops.cond((micro_batch + 1) % steps == 0, finish, add)


def accumulation_steps(optimizer):
    """Micro-batches per update of `optimizer` (int >= 1), through any chain of wrappers: a
    `DistributedOptimizer`'s `backward_passes_per_step`, or Keras's own `gradient_accumulation_steps`."""
    return _accumulating(optimizer)[1]


def at_update_boundary(optimizer):
    """True when `optimizer` (through any chain of wrappers) holds no partly accumulated gradients."""
    accumulating, steps = _accumulating(optimizer)
    # The micro-batch count is the accumulating optimizer's own counter.
    return steps == 1 or int(keras_internals.own_iterations(accumulating)) % steps == 0


def _accumulating(optimizer):
    while True:
        steps = getattr(optimizer, "backward_passes_per_step", None) or getattr(
            optimizer, "gradient_accumulation_steps", None
        )
        if steps or not hasattr(optimizer, "inner_optimizer"):
            return optimizer, steps or 1
        optimizer = optimizer.inner_optimizer
