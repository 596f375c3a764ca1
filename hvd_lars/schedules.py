"""Learning-rate policy for large-batch training: linear scaling, gradual warmup, polynomial decay.

Sources: Goyal et al., "Accurate, Large Minibatch SGD" (arXiv 1706.02677) for the linear scaling rule and
gradual warmup; You et al., "ImageNet Training in Minutes" (ICPP 2018) and the MLPerf ResNet-50 LARS
reference for warmup followed by polynomial (power 2) decay. Every schedule here is a pure function of
the optimizer step (applied updates, not micro-batches).
"""

import keras
from keras import ops

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
    `num_examples // global_batch` steps; fractional epochs are rounded to the nearest step.

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
    return int(round(epochs * steps_per_epoch))


@keras.saving.register_keras_serializable(package="hvd_lars")
class WarmupPolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to a peak learning rate, then polynomial decay to an end rate (MLPerf convention).

    With step `t` (optimizer updates, counted from 0), warmup steps `W`, total steps `T`:

    ```
    t <  W:      lr = start + (peak - start) * t / W
    W <= t < T:  lr = end + (peak - end) * (1 - (t - W) / (T - W)) ** power
    t >= T:      lr = end
    ```

    Args:
        peak_learning_rate: float > 0, the rate reached at the end of warmup.
        total_steps: int > 0, the step at which the end rate is reached.
        warmup_steps: int in [0, total_steps).
        warmup_start_learning_rate: float >= 0, rate at step 0 (0 in MLPerf; 1 in the paper's solver).
        end_learning_rate: float >= 0 (1e-4 in the MLPerf ResNet-50 LARS recipe).
        power: float > 0 (2 in the paper and MLPerf).

    Returns (when called with a step): a float32 scalar tensor.

    Raises:
        ValueError: arguments outside the ranges above, quoting them.
    """

    def __init__(
        self,
        peak_learning_rate,
        total_steps,
        warmup_steps,
        warmup_start_learning_rate=0.0,
        end_learning_rate=0.0,
        power=2.0,
    ):
        if not peak_learning_rate > 0:
            raise ValueError(f"peak_learning_rate must be > 0, got {peak_learning_rate!r}.")
        if not (isinstance(total_steps, int) and total_steps > 0):
            raise ValueError(f"total_steps must be an int > 0, got {total_steps!r}.")
        if not (isinstance(warmup_steps, int) and 0 <= warmup_steps < total_steps):
            raise ValueError(
                f"warmup_steps must be an int in [0, total_steps={total_steps}), got {warmup_steps!r}."
            )
        if warmup_start_learning_rate < 0 or end_learning_rate < 0:
            raise ValueError(
                "warmup_start_learning_rate and end_learning_rate must be >= 0, got "
                f"{warmup_start_learning_rate!r} and {end_learning_rate!r}."
            )
        if not power > 0:
            raise ValueError(f"power must be > 0, got {power!r}.")
        self.peak_learning_rate = float(peak_learning_rate)
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.warmup_start_learning_rate = float(warmup_start_learning_rate)
        self.end_learning_rate = float(end_learning_rate)
        self.power = float(power)

    def __call__(self, step):
        t = ops.cast(step, "float32")
        peak, start, end = self.peak_learning_rate, self.warmup_start_learning_rate, self.end_learning_rate
        warmup_steps = float(self.warmup_steps)
        decay_steps = float(self.total_steps - self.warmup_steps)
        warm = start + (peak - start) * t / max(warmup_steps, 1.0)
        progress = ops.clip((t - warmup_steps) / decay_steps, 0.0, 1.0)
        decayed = end + (peak - end) * ops.power(1.0 - progress, self.power)
        return ops.where(t < warmup_steps, warm, decayed)

    def get_config(self):
        return {
            "peak_learning_rate": self.peak_learning_rate,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "warmup_start_learning_rate": self.warmup_start_learning_rate,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
        }
