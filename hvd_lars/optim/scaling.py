"""Units of a learning-rate policy: epochs to optimizer steps, and rates per 256 images to peak rates.

Flags and papers speak in epochs and in learning rates per reference batch; schedules speak in optimizer
steps and absolute rates. These two helpers are the one place that converts.
"""

# Goyal et al. (2017), section 2.1: lr = 0.1 * global_batch / 256 for ResNet-50 with momentum SGD.
REFERENCE_BATCH = 256


def scaled_learning_rate(base_lr, global_batch, reference_batch=REFERENCE_BATCH):
    """Linear scaling rule: the peak learning rate for a global batch (Goyal et al. 2017, eq. in 2.1).

    Args:
        base_lr: float > 0, learning rate per `reference_batch` images.
        global_batch: int > 0, images per optimizer update summed over all ranks (and micro-batches).
        reference_batch: int > 0, the batch at which `base_lr` was tuned (256 in the references).

    Returns:
        float: `base_lr * global_batch / reference_batch`.

    Raises:
        ValueError: a non-positive argument.
    """
    for name, value in (("base_lr", base_lr), ("global_batch", global_batch)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}.")
    if not reference_batch > 0:
        raise ValueError(f"reference_batch must be > 0, got {reference_batch!r}.")
    return float(base_lr) * global_batch / reference_batch


def epochs_to_steps(epochs, num_examples, global_batch):
    """Optimizer steps in `epochs` passes over `num_examples` images at `global_batch` images per step.

    Partial final batches are dropped (every rank runs the same number of steps), so one epoch is
    `num_examples // global_batch` steps; fractional epochs become steps by `steps_in_epochs`.

    Raises:
        ValueError: `global_batch` larger than `num_examples`, or a negative count.
    """
    if epochs < 0 or num_examples <= 0 or global_batch <= 0:
        raise ValueError(
            f"need epochs >= 0, num_examples > 0, global_batch > 0; got {epochs!r}, "
            f"{num_examples!r}, {global_batch!r}."
        )
    steps_per_epoch = num_examples // global_batch
    if steps_per_epoch == 0:
        raise ValueError(
            f"global batch {global_batch} is larger than the data set ({num_examples} examples): "
            "not one full step per epoch."
        )
    return steps_in_epochs(epochs, steps_per_epoch)


def steps_in_epochs(epochs, steps_per_epoch):
    """Optimizer steps in `epochs` (a float >= 0) of `steps_per_epoch` steps: the nearest whole number, and
    at least 1 for any `epochs` > 0, so that a requested fraction of an epoch (0.5 epoch of 1 step) is
    never silently no step at all.

    Raises:
        ValueError: a negative or non-finite `epochs`, or `steps_per_epoch` < 1.
    """
    if not 0 <= epochs < float("inf") or steps_per_epoch < 1:
        raise ValueError(
            f"need finite epochs >= 0 and steps_per_epoch >= 1; got {epochs!r}, {steps_per_epoch!r}."
        )
    steps = int(round(epochs * steps_per_epoch))
    return max(steps, 1) if epochs > 0 else 0
