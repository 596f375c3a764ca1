"""Learning-rate curves as pure functions of the optimizer step (an int, array or tensor of updates from
0, any shape), returning float32 rates of its shape: a resumed run follows the same curve. The schedules
of `hvd_lars.optim.schedules` combine them.

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

    `start + (peak - start) * t / W` for t < W; W = `warmup_steps` (int >= 0; 0: no warmup).
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
    (MLPerf starts after warmup, `begin_step = W`; the paper's solver at 0). `decay_steps` an int > 0,
    `power` a float > 0 (2 in the paper and MLPerf).
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
    """
    progress = ops.clip((_steps(step) - float(begin_step)) / float(decay_steps), 0.0, 1.0)
    return end_rate + (initial_rate - end_rate) * 0.5 * (1.0 + ops.cos(math.pi * progress))


def piecewise_constant(step, boundaries, values):
    """`values[i]` for `boundaries[i-1] <= t < boundaries[i]` (increasing ints, maybe none; one value more).

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
