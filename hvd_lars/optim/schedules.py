"""Learning-rate schedules for large-batch training: warmup plus polynomial, cosine or step decay.

Each schedule is a `keras.optimizers.schedules.LearningRateSchedule` of the optimizer step (applied
updates, counted from 0), built from the pure functions of `hvd_lars.optim.rate_curves`; its config is
exactly its constructor arguments, so it survives `keras.saving` and `keras.optimizers.schedules.serialize`.
Units are steps (`hvd_lars.epochs_to_steps` converts). `make_schedule` selects one by name; each class's
docstring gives its rule and source.

A schedule counts optimizer updates, never micro-batches (Keras's own optimizers with
`gradient_accumulation_steps` count micro-batches: give those a float rate and `LearningRateWarmup`).
The two polynomial conventions: docs/design.md, "Learning-rate schedules".

Example:

    schedule = WarmupPolynomialDecay(peak_learning_rate=2.0, total_steps=4000, warmup_steps=400)
    optimizer = hvd_lars.LARS(learning_rate=schedule, momentum=0.9)
"""

import dataclasses
import inspect

import keras

from hvd_lars.arguments import Range, above, at_least, check, refuse
from hvd_lars.optim import rate_curves

# Goyal et al. (2017), section 5.1: the rate falls by 10x at epochs 30, 60 and 80 of 90.
GOYAL_STEP_DECAY_FRACTIONS = (30 / 90, 60 / 90, 80 / 90)


def _schedule(cls):
    """A schedule class as a dataclass (its fields are its arguments and config), registered with Keras."""
    return keras.saving.register_keras_serializable(package="hvd_lars")(dataclasses.dataclass(eq=False)(cls))


@dataclasses.dataclass(eq=False)
class _WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from `warmup_start_learning_rate` (step 0) to `peak_learning_rate` (step W), then the
    subclass's `_after_warmup(t)`. The fields are the constructor's arguments and the config."""

    peak_learning_rate: float
    total_steps: int
    warmup_steps: int
    warmup_start_learning_rate: float = 0.0

    def __post_init__(self):
        accepted = {
            "peak_learning_rate": above(0),
            "total_steps": above(0, whole=True),
            "warmup_steps": Range(0, self.total_steps, whole=True),
            "warmup_start_learning_rate": at_least(0),
            "end_learning_rate": at_least(0),
            "power": above(0),
            "decay_factor": Range(0, 1, low_open=True, high_open=False),
        }
        for field in dataclasses.fields(self):
            if field.name in accepted:
                value = check(field.name, getattr(self, field.name), accepted[field.name])
                setattr(self, field.name, int(value) if accepted[field.name].whole else float(value))

    def __call__(self, step):
        t = keras.ops.cast(step, "float32")
        warm = rate_curves.linear_warmup(
            t, self.warmup_steps, self.warmup_start_learning_rate, self.peak_learning_rate
        )
        return keras.ops.where(t < float(self.warmup_steps), warm, self._after_warmup(t))

    def _after_warmup(self, t):
        raise NotImplementedError

    def get_config(self):
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


@_schedule
class WarmupPolynomialDecay(_WarmupSchedule):
    """Linear warmup to a peak learning rate, then polynomial decay to an end rate (MLPerf convention).

    With step `t` (optimizer updates, counted from 0), warmup steps `W`, total steps `T`, and the decay
    length `D = T - W + 1`:

    ```
    t <  W:  lr = start + (peak - start) * t / W
    t >= W:  lr = end + (peak - end) * (1 - min(t - W, D) / D) ** power
    ```
    Source: the MLPerf ResNet-50 LARS reference, `PolynomialDecayWithWarmup` in mlcommons/training
    `image_classification/tensorflow2/lars_util.py` (commit 6b277bbe, lines 112-125 and 151-158), so the
    end rate is reached at t = T + 1, after training (docs/design.md, "Learning-rate schedules").

    Args:
        peak_learning_rate: float > 0, the rate reached at the end of warmup.
        total_steps: int > 0, the number of updates T (the decay ends at T + 1, see above).
        warmup_steps: int in [0, total_steps).
        warmup_start_learning_rate: float >= 0, rate at step 0 (0 in MLPerf; 1 in the paper's solver).
        end_learning_rate: float >= 0 (1e-4 in the MLPerf ResNet-50 LARS recipe).
        power: float > 0 (2 in the paper and MLPerf).

    Returns (when called with a step): a float32 tensor shaped like the step.

    Raises:
        ValueError: arguments outside the ranges above, quoting them.
    """

    end_learning_rate: float = 0.0
    power: float = 2.0

    def _after_warmup(self, t):
        return rate_curves.polynomial_decay(
            t,
            self.peak_learning_rate,
            self.end_learning_rate,
            self.total_steps - self.warmup_steps + 1,  # the MLPerf reference's decay_steps
            self.power,
            begin_step=self.warmup_steps,
        )


@_schedule
class PaperPolynomialDecay(WarmupPolynomialDecay):
    """Linear warmup from a start rate, then polynomial decay counted from step 0 (the paper's solver).

    ```
    t <  W:      lr = start + (peak - start) * t / W
    W <= t < T:  lr = end + (peak - end) * (1 - t / T) ** power
    t >= T:      lr = end
    ```
    (so the rate drops at step W). Source: the Intel Caffe AlexNet-BN solver of You et al. (ICPP 2018),
    Caffe's `poly` policy with a linear warmup (Intel Caffe 1.0.7 `src/caffe/solvers/sgd_solver.cpp`,
    lines 48-55, 77-80, 102-105). Arguments, returns and errors are those of `WarmupPolynomialDecay`.
    """

    def _after_warmup(self, t):
        return rate_curves.polynomial_decay(
            t, self.peak_learning_rate, self.end_learning_rate, self.total_steps, self.power, begin_step=0
        )


@_schedule
class WarmupCosineDecay(_WarmupSchedule):
    """Linear warmup, then a half cosine from the peak (step W) to `end_learning_rate` (step T).

    ```
    t <  W:  lr = start + (peak - start) * t / W
    t >= W:  lr = end + (peak - end) * (1 + cos(pi * min(1, (t - W) / (T - W)))) / 2
    ```
    (Loshchilov and Hutter, SGDR, eq. 5, one cycle.) Arguments as `WarmupPolynomialDecay`, without power.
    """

    end_learning_rate: float = 0.0

    def _after_warmup(self, t):
        return rate_curves.cosine_decay(
            t,
            self.peak_learning_rate,
            self.end_learning_rate,
            self.total_steps - self.warmup_steps,
            begin_step=self.warmup_steps,
        )


@_schedule
class WarmupStepDecay(_WarmupSchedule):
    """Linear warmup, then the peak multiplied by `decay_factor` at each of `boundaries` (Goyal et al.).

    ```
    t <  W:  lr = start + (peak - start) * t / W
    t >= W:  lr = peak * decay_factor ** (number of boundaries <= t)
    ```

    Args:
        peak_learning_rate, total_steps, warmup_steps, warmup_start_learning_rate: as in
            `WarmupPolynomialDecay`.
        boundaries: increasing ints in [warmup_steps, total_steps], the steps at which the rate falls
            (Goyal et al.: epochs 30, 60, 80 of 90; see `GOYAL_STEP_DECAY_FRACTIONS`). Empty: the peak is
            held after warmup.
        decay_factor: float in (0, 1] (0.1 in Goyal et al.).

    Raises:
        ValueError: an argument out of the ranges above.
    """

    boundaries: tuple = ()
    decay_factor: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        bounds = list(self.boundaries)
        inside = Range(self.warmup_steps, self.total_steps, high_open=False, whole=True)
        if not (all(inside.accepts(b) for b in bounds) and bounds == sorted(set(bounds))):
            accepted = f"strictly increasing whole numbers in [{inside.low}, {inside.high}]"
            refuse("boundaries", self.boundaries, accepted)
        self.boundaries = [int(b) for b in bounds]

    def _after_warmup(self, t):
        values = [self.peak_learning_rate * self.decay_factor**i for i in range(len(self.boundaries) + 1)]
        return rate_curves.piecewise_constant(t, self.boundaries, values)


# The registry behind `make_schedule` (and the main program's --schedule flag).
SCHEDULES = {
    "mlperf_poly": WarmupPolynomialDecay,
    "paper_poly": PaperPolynomialDecay,
    "cosine": WarmupCosineDecay,
    "step": WarmupStepDecay,
}


def goyal_boundaries(total_steps):
    """The step schedule's boundaries when none are given: Goyal et al.'s epochs 30, 60, 80 of 90 scaled
    to `total_steps` (ints)."""
    return [int(round(f * total_steps)) for f in GOYAL_STEP_DECAY_FRACTIONS]


def make_schedule(
    name,
    peak_learning_rate,
    total_steps,
    warmup_steps,
    warmup_start_learning_rate=0.0,
    end_learning_rate=0.0,
    power=2.0,
    boundaries=None,
    decay_factor=0.1,
):
    """The schedule `SCHEDULES[name]` built from the arguments that apply to it (all in steps).

    Arguments a schedule does not take must keep their defaults here (`power` for `"cosine"`;
    `end_learning_rate` and `power` for `"step"`; `boundaries` and `decay_factor` for all but `"step"`),
    so a setting is never silently ignored. For `"step"`, `boundaries=None` means Goyal et al.'s epochs
    30, 60, 80 of 90 scaled to `total_steps`.

    Returns:
        A `keras.optimizers.schedules.LearningRateSchedule` of the optimizer step.

    Raises:
        ValueError: an unknown name (listing the valid ones), a non-default argument the schedule does
            not take, or arguments the schedule rejects.
    """
    arguments = dict(locals())  # the schedules' own names, `name` aside
    if arguments.pop("name") not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid names: {sorted(SCHEDULES)}.")
    cls = SCHEDULES[name]
    if cls is WarmupStepDecay and boundaries is None:
        arguments["boundaries"] = goyal_boundaries(total_steps)
    accepted = inspect.signature(cls).parameters
    defaults = {k: p.default for k, p in inspect.signature(make_schedule).parameters.items()}
    for key, value in arguments.items():
        if key not in accepted and value != defaults[key]:
            raise ValueError(
                f"{key}={value!r} does not apply to schedule {name!r}, which takes {list(accepted)}."
            )
    return cls(**{k: v for k, v in arguments.items() if k in accepted})
