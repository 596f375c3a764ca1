"""Units of a learning-rate policy: epochs to optimizer steps, and rates per 256 images to peak rates,
the one place that converts."""

from hvd_lars.arguments import above, at_least, check, refuse

# Goyal et al. (2017), section 2.1: lr = 0.1 * global_batch / 256 for ResNet-50 with momentum SGD.
REFERENCE_BATCH = 256


def scaled_learning_rate(base_lr, global_batch, reference_batch=REFERENCE_BATCH):
    """Linear scaling rule (Goyal et al. 2017, section 2.1): `base_lr * global_batch / reference_batch`.

    Args:
        base_lr: float > 0, learning rate per `reference_batch` images.
        global_batch: int > 0, images per optimizer update summed over all ranks (and micro-batches).
        reference_batch: int > 0, the batch at which `base_lr` was tuned (256 in the references).

    Raises:
        ValueError: a non-positive argument.
    """
    for name, value in (
        ("base_lr", base_lr),
        ("global_batch", global_batch),
        ("reference_batch", reference_batch),
    ):
        check(name, value, above(0))
    return float(base_lr) * global_batch / reference_batch


def epochs_to_steps(epochs, num_examples, global_batch):
    """Optimizer steps in `epochs` passes over `num_examples` images at `global_batch` images per step.

    Partial final batches are dropped (every rank runs the same number of steps), so one epoch is
    `num_examples // global_batch` steps; fractional epochs become steps by `steps_in_epochs`.

    Raises:
        ValueError: `global_batch` larger than `num_examples`, or a negative count.
    """
    check("epochs", epochs, at_least(0))
    check("num_examples", num_examples, above(0))
    check("global_batch", global_batch, above(0))
    if global_batch > num_examples:
        refuse("global_batch", global_batch, f"no larger than the data set ({num_examples} examples)")
    return steps_in_epochs(epochs, num_examples // global_batch)


def steps_in_epochs(epochs, steps_per_epoch):
    """Optimizer steps in `epochs` (a float >= 0) of `steps_per_epoch` steps: the nearest whole number, and
    at least 1 for any `epochs` > 0 (half an epoch of 1 step is a step, not none).

    Raises:
        ValueError: a negative or non-finite `epochs`, or `steps_per_epoch` < 1.
    """
    check("epochs", epochs, at_least(0))
    check("steps_per_epoch", steps_per_epoch, at_least(1))
    steps = int(round(epochs * steps_per_epoch))
    return max(steps, 1) if epochs > 0 else 0
