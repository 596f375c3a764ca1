"""Learning-rate curves as pure functions of the optimizer step: linear warmup, polynomial, cosine and
piecewise-constant decay.

Every function takes `step` (a Python int, a NumPy array or a backend tensor of optimizer updates, counted
from 0; any shape) and returns float32 rates of the same shape as a backend tensor. They hold no state, so
a rate depends on the step alone: that is what makes a resumed run follow the same curve. The schedule
classes in `hvd_lars.optim.schedules` combine them; anyone can compose their own.

Sources: Goyal et al., "Accurate, Large Minibatch SGD" (arXiv 1706.02677), section 2.2 (gradual warmup)
and 5.1 (step decay); You et al., "ImageNet Training in Minutes" (ICPP 2018) and the MLPerf ResNet-50
LARS reference (polynomial decay, power 2); Loshchilov and Hutter, "SGDR" (arXiv 1608.03983), eq. 5
(cosine decay).
"""

import math

from keras import ops


def _steps(step):
    return ops.cast(step, "float32")


def linear_warmup(step, warmup_steps, start_rate, peak_rate):
    """Linear ramp from `start_rate` at step 0 to `peak_rate` at step `warmup_steps`, then `peak_rate`.

    ```
    t < W:   start + (peak - start) * t / W
    t >= W:  peak
    ```

    Args:
        step: optimizer updates (int, array or tensor).
        warmup_steps: int W >= 0; 0 means no warmup (the peak from step 0).
        start_rate, peak_rate: floats.

    Returns:
        float32 tensor shaped like `step`.
    """
    t = _steps(step)
    ramp = start_rate + (peak_rate - start_rate) * t / max(float(warmup_steps), 1.0)
    return ops.where(t < float(warmup_steps), ramp, ops.full_like(t, peak_rate))


def polynomial_decay(step, initial_rate, end_rate, decay_steps, power, begin_step=0):
    """Polynomial decay from `initial_rate` at `begin_step` to `end_rate` `decay_steps` updates later.

    ```
    p = clip((t - begin_step) / decay_steps, 0, 1)
    rate = end + (initial - end) * (1 - p) ** power
    ```
    so the rate is `initial_rate` up to `begin_step` and `end_rate` from `begin_step + decay_steps` on.
    The MLPerf recipe starts the decay after warmup (`begin_step = W`); the paper's solver (Caffe's
    `poly` policy) counts from step 0 (`begin_step = 0`).

    Args:
        step: optimizer updates (int, array or tensor).
        initial_rate, end_rate: floats.
        decay_steps: int > 0.
        power: float > 0 (2 in the paper and MLPerf; 1 is linear decay).
        begin_step: int >= 0.

    Returns:
        float32 tensor shaped like `step`.
    """
    # 1 - p as (steps left) / decay_steps: exact numerator, so no cancellation near the last step.
    left = ops.clip((float(begin_step + decay_steps) - _steps(step)) / float(decay_steps), 0.0, 1.0)
    return end_rate + (initial_rate - end_rate) * ops.power(left, power)


def cosine_decay(step, initial_rate, end_rate, decay_steps, begin_step=0):
    """Half-cosine decay from `initial_rate` at `begin_step` to `end_rate` `decay_steps` updates later.

    ```
    p = clip((t - begin_step) / decay_steps, 0, 1)
    rate = end + (initial - end) * (1 + cos(pi * p)) / 2
    ```
    (SGDR, Loshchilov and Hutter, eq. 5, a single cycle without restarts.)

    Args:
        step: optimizer updates (int, array or tensor).
        initial_rate, end_rate: floats.
        decay_steps: int > 0.
        begin_step: int >= 0.

    Returns:
        float32 tensor shaped like `step`.
    """
    progress = ops.clip((_steps(step) - float(begin_step)) / float(decay_steps), 0.0, 1.0)
    return end_rate + (initial_rate - end_rate) * 0.5 * (1.0 + ops.cos(math.pi * progress))


def piecewise_constant(step, boundaries, values):
    """`values[i]` for `boundaries[i-1] <= t < boundaries[i]` (step decay when values fall geometrically).

    Args:
        step: optimizer updates (int, array or tensor).
        boundaries: increasing ints (steps at which the rate changes); may be empty.
        values: floats, one more than `boundaries`.

    Returns:
        float32 tensor shaped like `step`.

    Raises:
        ValueError: `len(values) != len(boundaries) + 1`.
    """
    if len(values) != len(boundaries) + 1:
        raise ValueError(
            f"piecewise_constant needs one more value than boundaries; got {len(boundaries)} boundaries "
            f"{list(boundaries)!r} and {len(values)} values {list(values)!r}."
        )
    t = _steps(step)
    rate = ops.full_like(t, values[0])
    # Boundaries increase, so each later crossing overrides the earlier one.
    for boundary, value in zip(boundaries, values[1:]):
        rate = ops.where(t >= float(boundary), ops.full_like(t, value), rate)
    return rate
