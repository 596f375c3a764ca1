"""Schedules: hand-computed values at the points that matter, config, registry, errors."""

import inspect
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import PaperPolynomialDecay, WarmupCosineDecay, WarmupPolynomialDecay, WarmupStepDecay
from hvd_lars.optim.scaling import epochs_to_steps, scaled_learning_rate
from hvd_lars.optim.schedules import SCHEDULES, make_schedule

C = np.sqrt(0.5)
HAND_VALUES = {
    # peak 10, warmup 4 of 14 from 0, end 0.1: the decay spans D = 14 - 4 + 1 = 11 steps.
    "mlperf": (
        WarmupPolynomialDecay(10.0, 14, 4, end_learning_rate=0.1),
        {0: 0.0, 1: 2.5, 3: 7.5, 4: 10.0, 9: 0.1 + 9.9 * (6 / 11) ** 2, 13: 0.1 + 9.9 * (2 / 11) ** 2,
         14: 0.1 + 9.9 * (1 / 11) ** 2, 15: 0.1, 1000: 0.1},
    ),
    "mlperf_start_rate": (WarmupPolynomialDecay(33.0, 100, 10, warmup_start_learning_rate=1), {0: 1, 5: 17}),
    "mlperf_no_warmup": (WarmupPolynomialDecay(2.0, 10, 0, power=1.0), {0: 2.0, 5: 2.0 * 6 / 11}),
    # The paper's solver: decay counted from step 0, so the rate drops at the end of warmup.
    "paper": (
        PaperPolynomialDecay(10.0, 20, 4, warmup_start_learning_rate=1.0),
        {0: 1.0, 3: 7.75, 4: 6.4, 10: 2.5, 12: 10.0 * 0.4**2, 19: 0.025, 20: 0.0, 500: 0.0},
    ),
    "paper_end_rate": (PaperPolynomialDecay(10.0, 20, 4, end_learning_rate=1.0, power=1.0),
                       {0: 0.0, 4: 1.0 + 9.0 * 0.8, 19: 1.0 + 9.0 * 0.05, 25: 1.0}),
    # peak 2, warmup 2 of 6, end 0.2: half a cosine over steps 2..6.
    "cosine": (
        WarmupCosineDecay(2.0, 6, 2, end_learning_rate=0.2),
        {0: 0.0, 1: 1.0, 2: 2.0, 3: 0.2 + 0.9 * (1 + C), 4: 1.1, 5: 0.2 + 0.9 * (1 - C), 6: 0.2, 60: 0.2},
    ),
    "step": (
        WarmupStepDecay(1.0, 8, 2, warmup_start_learning_rate=0.5, boundaries=[4, 6]),
        {0: 0.5, 1: 0.75, 2: 1.0, 3: 1.0, 4: 0.1, 5: 0.1, 6: 0.01, 8: 0.01},
    ),
    "step_held": (WarmupStepDecay(3.0, 10, 5), {0: 0.0, 4: 2.4, 5: 3.0, 9: 3.0, 99: 3.0}),
    # The MLPerf ResNet-50 TF2 reference (mlcommons/training, image_classification/tensorflow2/lars_util.py)
    # at batch 32,768: peak 31.2, warmup 25 of 90 epochs of 39 steps, end 1e-4, power 2 over 3510 - 975 + 1.
    "mlperf_reference": (
        make_schedule("mlperf_poly", 31.2, 3510, 975, end_learning_rate=1e-4),
        {0: 0.0, 500: 31.2 * 500 / 975, 975: 31.2, 3511: 1e-4,
         **{t: 1e-4 + (31.2 - 1e-4) * (1 - (t - 975) / 2536) ** 2 for t in (976, 2000, 3000, 3509, 3510)}},
    ),
}  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("case", HAND_VALUES)
def test_hand_computed_values(case):
    schedule, values = HAND_VALUES[case]
    got = {t: float(schedule(t)) for t in values}
    assert got == pytest.approx(values, rel=1e-6, abs=1e-9)  # on a tensor of steps: test_every_backend


@pytest.mark.unit
def test_linear_scaling_rule_and_epochs_to_steps():
    assert scaled_learning_rate(0.1, 8192) == pytest.approx(3.2)  # Goyal et al.: 0.1 per 256
    assert scaled_learning_rate(2.0, 32768, reference_batch=1024) == pytest.approx(64.0)
    with pytest.raises(ValueError, match="global_batch"):
        scaled_learning_rate(0.1, 0)
    assert epochs_to_steps(1, 60000, 4096) == 14
    assert epochs_to_steps(90, 1281167, 32768) == 90 * 39
    assert epochs_to_steps(0.5, 60000, 4096) == 7
    with pytest.raises(ValueError, match="larger than the data set"):
        epochs_to_steps(1, 1000, 4096)


@pytest.mark.unit
def test_schedules_follow_an_int64_step_variable_in_a_graph():
    # Optimizers call the schedule with their int64 update counter inside a tf.function.
    schedules = [
        make_schedule(name, 4.0, 90, 5, warmup_start_learning_rate=0.5) for name in sorted(SCHEDULES)
    ]
    assert [type(s) for s in schedules] == [SCHEDULES[name] for name in sorted(SCHEDULES)]
    counter = tf.Variable(0, dtype=tf.int64)
    rates = tf.function(lambda: [schedule(counter) for schedule in schedules])
    for t in (0, 4, 5, 47, 89, 90):
        counter.assign(t)
        want = [float(schedule(t)) for schedule in schedules]
        np.testing.assert_allclose(rates(), want, rtol=1e-6, err_msg=f"step {t}")  # graph rewrites: last bit


@pytest.mark.unit
@pytest.mark.parametrize(
    "schedule",
    [
        WarmupPolynomialDecay(7.0, 50, 5, warmup_start_learning_rate=0.5, end_learning_rate=1e-4, power=1.5),
        PaperPolynomialDecay(33.0, 3900, 390, warmup_start_learning_rate=1.0),
        # NumPy integers are stored as int (JSON would refuse them).
        WarmupCosineDecay(
            2.0, np.int64(100), np.int32(10), warmup_start_learning_rate=0.1, end_learning_rate=1e-3
        ),
        WarmupStepDecay(3.2, 90, 5, boundaries=[30, 60, 80], decay_factor=0.5),
    ],
    ids=lambda s: type(s).__name__,
)
def test_config_is_the_constructor_arguments_and_round_trips(schedule):
    config = schedule.get_config()
    assert list(config) == list(inspect.signature(type(schedule)).parameters)
    assert type(schedule)(**config).get_config() == config
    clone = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule))
    assert type(clone) is type(schedule) and clone.get_config() == config
    assert json.loads(json.dumps(config)) == config
    np.testing.assert_array_equal(np.asarray(clone(np.arange(120))), np.asarray(schedule(np.arange(120))))


@pytest.mark.unit
def test_make_schedule_passes_the_arguments_on():
    mlperf = make_schedule("mlperf_poly", 29.0, 3510, 702, end_learning_rate=1e-4, power=2.0)
    want = dict(peak_learning_rate=29.0, total_steps=3510, warmup_steps=702, warmup_start_learning_rate=0.0)
    assert mlperf.get_config() == {**want, "end_learning_rate": 1e-4, "power": 2.0}
    # Goyal et al.'s epochs 30, 60, 80 of 90, in steps.
    assert make_schedule("step", 1.0, 90, 5).boundaries == [30, 60, 80]
    assert make_schedule("step", 1.0, 900, 50).boundaries == [300, 600, 800]
    assert make_schedule("step", 1.0, 90, 5, boundaries=[]).boundaries == []


G = (1.0, 90, 5)  # peak rate, total and warmup steps


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, args, kwargs, fragment",
    [
        ("mlperf_poly", (0.0, 10, 1), {}, "peak_learning_rate"),
        ("mlperf_poly", (1.0, 0, 0), {}, "total_steps"),
        ("mlperf_poly", (1.0, 10, 10), {}, "warmup_steps"),
        ("mlperf_poly", (1.0, 10, 1), dict(power=0.0), "power"),
        ("mlperf_poly", (1.0, 10, 1), dict(end_learning_rate=-1.0), "-1.0"),
        ("mlperf_poly", (1.0, 10.5, 1), {}, "whole number > 0, got 10.5"),
        ("poly", G, {}, r"schedule 'poly'; valid names: \['cosine', 'mlperf_poly', 'paper_poly', 'step'\]"),
        ("cosine", G, dict(power=3.0), "power=3.0 does not apply to schedule 'cosine'"),
        ("step", G, dict(end_learning_rate=1e-4), "end_learning_rate=0.0001 does not apply to sche"),
        ("mlperf_poly", G, dict(boundaries=[30]), r"boundaries=\[30\] does not apply"),
        ("paper_poly", G, dict(decay_factor=0.5), "decay_factor=0.5 does not apply"),
        ("step", G, dict(boundaries=[3, 50]), r"must be strictly increasing whole numbers in \[5, 90\]"),
        ("step", G, dict(boundaries=[60, 30]), r"got \[60, 30\]"),
        ("step", G, dict(decay_factor=0.0), "decay_factor must be a finite number > 0 and <= 1"),
        ("cosine", G, dict(warmup_start_learning_rate=-0.5), "warmup_start_.* >= 0, got -0.5"),
    ],
)  # fmt: skip
def test_invalid_arguments(name, args, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_schedule(name, *args, **kwargs)
