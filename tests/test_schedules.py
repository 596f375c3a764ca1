"""Schedule values computed by hand at the points that matter (step 0, last warmup step, first decay step,
last step) for each convention; pure functions, config round trips, the registry, momentum correction."""

import copy
import inspect
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS, WarmupPolynomialDecay, epochs_to_steps, scaled_learning_rate
from hvd_lars.optim import rate_curves
from hvd_lars.optim.schedules import (
    SCHEDULES,
    PaperPolynomialDecay,
    WarmupCosineDecay,
    WarmupStepDecay,
    make_schedule,
)


def _lr(schedule, step):
    return float(keras.ops.convert_to_numpy(schedule(step)))


def _mlperf_reference(step, peak, total_steps, warmup_steps, end):
    """The MLPerf ResNet-50 TF2 reference's PolynomialDecayWithWarmup (mlcommons/training,
    image_classification/tensorflow2/lars_util.py): warmup peak * t / W while t <= W, else Keras's
    PolynomialDecay(peak, decay_steps=T - W + 1, end, power=2) at t - W."""
    if step <= warmup_steps:
        return peak * step / warmup_steps
    decay = keras.optimizers.schedules.PolynomialDecay(peak, total_steps - warmup_steps + 1, end, power=2.0)
    return float(keras.ops.convert_to_numpy(decay(step - warmup_steps)))


@pytest.mark.unit
def test_mlperf_convention_values():
    # peak 10, warmup 4 of 14 steps from 0, power 2, end 0.1; the decay spans D = 14 - 4 + 1 = 11 steps.
    s = WarmupPolynomialDecay(peak_learning_rate=10.0, total_steps=14, warmup_steps=4, end_learning_rate=0.1)
    assert _lr(s, 0) == 0.0
    assert _lr(s, 1) == pytest.approx(2.5)
    assert _lr(s, 3) == pytest.approx(7.5)  # last warmup step: 10 * 3 / 4
    assert _lr(s, 4) == pytest.approx(10.0)  # first decay step: the peak
    assert _lr(s, 9) == pytest.approx(0.1 + 9.9 * (6 / 11) ** 2)  # progress 5 / 11
    assert _lr(s, 13) == pytest.approx(0.1 + 9.9 * (2 / 11) ** 2)  # last update: not yet the end rate
    assert _lr(s, 14) == pytest.approx(0.1 + 9.9 * (1 / 11) ** 2)
    assert _lr(s, 15) == pytest.approx(0.1)  # T + 1
    assert _lr(s, 1000) == pytest.approx(0.1)  # held at the end rate
    for t in range(0, 18):
        assert _lr(s, t) == pytest.approx(_mlperf_reference(t, 10.0, 14, 4, 0.1), rel=1e-6), t


@pytest.mark.unit
def test_mlperf_resnet50_32k_matches_the_reference():
    # The reference's defaults at batch 32,768: peak 31.2, 25 warmup epochs, end 1e-4; 39 steps per epoch
    # (1,281,167 // 32,768) x 90 epochs = 3,510 updates, 975 of warmup.
    s = make_schedule("mlperf_poly", 31.2, 3510, 975, end_learning_rate=1e-4)
    steps = [0, 1, 500, 974, 975, 976, 2000, 3000, 3500, 3509, 3510, 3511]
    got = keras.ops.convert_to_numpy(s(np.array(steps)))
    want = [_mlperf_reference(t, 31.2, 3510, 975, 1e-4) for t in steps]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9)
    assert got[steps.index(3509)] == pytest.approx(1e-4 + (31.2 - 1e-4) * (2 / 2536) ** 2, rel=1e-4)


@pytest.mark.unit
def test_warmup_from_a_start_rate():
    s = WarmupPolynomialDecay(
        peak_learning_rate=33.0, total_steps=100, warmup_steps=10, warmup_start_learning_rate=1.0
    )
    assert _lr(s, 0) == pytest.approx(1.0)
    assert _lr(s, 5) == pytest.approx(1.0 + 32.0 * 0.5)


@pytest.mark.unit
def test_no_warmup_starts_at_peak():
    # (The reference's warmup would divide 0 by 0 at step 0 here; the decay spans 10 - 0 + 1 steps.)
    s = WarmupPolynomialDecay(peak_learning_rate=2.0, total_steps=10, warmup_steps=0, power=1.0)
    assert _lr(s, 0) == pytest.approx(2.0)
    assert _lr(s, 5) == pytest.approx(2.0 * 6 / 11)


@pytest.mark.unit
def test_vectorised_steps_match_scalar_calls():
    s = WarmupPolynomialDecay(peak_learning_rate=5.0, total_steps=20, warmup_steps=5)
    many = keras.ops.convert_to_numpy(s(np.arange(25)))
    np.testing.assert_allclose(many, [_lr(s, t) for t in range(25)], rtol=1e-6)


@pytest.mark.unit
def test_config_is_the_constructor_arguments():
    s = WarmupPolynomialDecay(7.0, 50, 5, warmup_start_learning_rate=0.5, end_learning_rate=1e-4, power=1.5)
    config = s.get_config()
    assert config == {
        "peak_learning_rate": 7.0,
        "total_steps": 50,
        "warmup_steps": 5,
        "warmup_start_learning_rate": 0.5,
        "end_learning_rate": 1e-4,
        "power": 1.5,
    }
    clone = keras.optimizers.schedules.deserialize(copy.deepcopy(keras.optimizers.schedules.serialize(s)))
    assert clone.get_config() == config


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(peak_learning_rate=0.0, total_steps=10, warmup_steps=1), "peak_learning_rate"),
        (dict(peak_learning_rate=1.0, total_steps=0, warmup_steps=0), "total_steps"),
        (dict(peak_learning_rate=1.0, total_steps=10, warmup_steps=10), "warmup_steps"),
        (dict(peak_learning_rate=1.0, total_steps=10, warmup_steps=1, power=0.0), "power"),
        (dict(peak_learning_rate=1.0, total_steps=10, warmup_steps=1, end_learning_rate=-1.0), "-1.0"),
    ],
)
def test_invalid_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        WarmupPolynomialDecay(**kwargs)


@pytest.mark.unit
def test_linear_scaling_rule():
    assert scaled_learning_rate(0.1, 8192) == pytest.approx(3.2)  # Goyal et al.: 0.1 per 256
    assert scaled_learning_rate(2.0, 32768, reference_batch=1024) == pytest.approx(64.0)
    with pytest.raises(ValueError, match="global_batch"):
        scaled_learning_rate(0.1, 0)


@pytest.mark.unit
def test_epochs_to_steps():
    assert epochs_to_steps(1, 60000, 4096) == 14
    assert epochs_to_steps(90, 1281167, 32768) == 90 * 39
    assert epochs_to_steps(0.5, 60000, 4096) == 7
    with pytest.raises(ValueError, match="larger than the data set"):
        epochs_to_steps(1, 1000, 4096)


# --- The paper's solver convention, cosine and step decay: hand-computed values --------------------------


@pytest.mark.unit
def test_paper_convention_values():
    # peak 10, warmup 4 of 20 steps from 1, power 2: decay counted from step 0, so the rate drops at step 4.
    s = PaperPolynomialDecay(
        peak_learning_rate=10.0, total_steps=20, warmup_steps=4, warmup_start_learning_rate=1.0
    )
    assert _lr(s, 0) == pytest.approx(1.0)
    assert _lr(s, 3) == pytest.approx(7.75)  # last warmup step: 1 + 9 * 3 / 4
    assert _lr(s, 4) == pytest.approx(6.4)  # first decay step: 10 * (1 - 4 / 20) ** 2, not the peak
    assert _lr(s, 10) == pytest.approx(2.5)  # 10 * 0.5 ** 2
    assert _lr(s, 19) == pytest.approx(0.025)  # last step: 10 * (1 / 20) ** 2
    assert _lr(s, 20) == 0.0
    assert _lr(s, 500) == 0.0


@pytest.mark.unit
def test_paper_convention_with_an_end_rate():
    s = PaperPolynomialDecay(10.0, 20, 4, end_learning_rate=1.0, power=1.0)
    assert _lr(s, 0) == 0.0
    assert _lr(s, 4) == pytest.approx(1.0 + 9.0 * 0.8)
    assert _lr(s, 19) == pytest.approx(1.0 + 9.0 * 0.05)
    assert _lr(s, 25) == pytest.approx(1.0)


@pytest.mark.unit
def test_the_two_conventions_share_the_warmup_and_differ_after_it():
    mlperf = WarmupPolynomialDecay(10.0, 20, 4, warmup_start_learning_rate=1.0)
    paper = PaperPolynomialDecay(10.0, 20, 4, warmup_start_learning_rate=1.0)
    for t in range(4):
        assert _lr(mlperf, t) == _lr(paper, t)
    assert _lr(mlperf, 4) == pytest.approx(10.0)
    assert _lr(paper, 4) == pytest.approx(6.4)
    assert _lr(mlperf, 12) == pytest.approx(10.0 * (1 - 8 / 17) ** 2)  # decay over T - W + 1 = 17
    assert _lr(paper, 12) == pytest.approx(10.0 * (1 - 12 / 20) ** 2)


@pytest.mark.unit
def test_cosine_values():
    # peak 2, warmup 2 of 6 steps from 0, end 0.2: half cosine over steps 2..6.
    s = WarmupCosineDecay(peak_learning_rate=2.0, total_steps=6, warmup_steps=2, end_learning_rate=0.2)
    assert _lr(s, 0) == 0.0
    assert _lr(s, 1) == pytest.approx(1.0)  # last warmup step
    assert _lr(s, 2) == pytest.approx(2.0)  # first decay step: the peak
    assert _lr(s, 3) == pytest.approx(0.2 + 1.8 * (1 + np.sqrt(0.5)) / 2)  # cos(pi / 4)
    assert _lr(s, 4) == pytest.approx(1.1)  # half way: the mean of peak and end
    assert _lr(s, 5) == pytest.approx(0.2 + 1.8 * (1 - np.sqrt(0.5)) / 2)  # last step
    assert _lr(s, 6) == pytest.approx(0.2)
    assert _lr(s, 60) == pytest.approx(0.2)


@pytest.mark.unit
def test_step_decay_values():
    s = WarmupStepDecay(1.0, total_steps=8, warmup_steps=2, warmup_start_learning_rate=0.5, boundaries=[4, 6])
    rates = [_lr(s, t) for t in range(9)]
    np.testing.assert_allclose(rates, [0.5, 0.75, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01, 0.01], rtol=1e-6)
    held = WarmupStepDecay(3.0, total_steps=10, warmup_steps=5)  # no boundaries: the peak is held
    assert [_lr(held, t) for t in (0, 4, 5, 9, 99)] == pytest.approx([0.0, 2.4, 3.0, 3.0, 3.0])


# --- Pure functions ------------------------------------------------------------------------------------


@pytest.mark.unit
def test_pure_functions_broadcast_over_steps():
    steps = np.array([0, 1, 2, 3, 4])
    np.testing.assert_allclose(_np(rate_curves.linear_warmup(steps, 4, 0.0, 8.0)), [0, 2, 4, 6, 8])
    np.testing.assert_allclose(_np(rate_curves.linear_warmup(steps, 0, 0.0, 8.0)), [8] * 5)  # no warmup
    np.testing.assert_allclose(
        _np(rate_curves.polynomial_decay(steps, 4.0, 0.0, 2, 1.0, begin_step=2)), [4, 4, 4, 2, 0]
    )
    np.testing.assert_allclose(
        _np(rate_curves.cosine_decay(steps, 4.0, 0.0, 4)),
        [4, 2 + 2 * np.sqrt(0.5), 2, 2 - 2 * np.sqrt(0.5), 0],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        _np(rate_curves.piecewise_constant(steps, [1, 3], [9.0, 3.0, 1.0])), [9, 3, 3, 1, 1]
    )
    np.testing.assert_allclose(_np(rate_curves.piecewise_constant(steps, [], [7.0])), [7] * 5)
    with pytest.raises(ValueError, match="one more value than boundaries"):
        rate_curves.piecewise_constant(steps, [1, 2], [1.0, 2.0])


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedules_follow_an_int64_step_variable_in_a_graph(name):
    # Optimizers call the schedule with their int64 update counter inside a tf.function.
    schedule = make_schedule(name, 4.0, 90, 5, warmup_start_learning_rate=0.5)
    counter = tf.Variable(0, dtype=tf.int64)
    rate = tf.function(lambda: schedule(counter))
    for t in (0, 4, 5, 47, 89, 90):
        counter.assign(t)
        # Graph rewrites (a division turned into a product) may change the last bit.
        assert float(rate()) == pytest.approx(_lr(schedule, t), rel=1e-6)


# --- Config round trip, registry, argument checks -----------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "schedule",
    [
        PaperPolynomialDecay(33.0, 3900, 390, warmup_start_learning_rate=1.0),
        WarmupCosineDecay(2.0, 100, 10, warmup_start_learning_rate=0.1, end_learning_rate=1e-3),
        WarmupStepDecay(3.2, 90, 5, boundaries=[30, 60, 80], decay_factor=0.5),
    ],
    ids=lambda s: type(s).__name__,
)
def test_config_round_trip(schedule):
    config = schedule.get_config()
    assert list(config) == list(inspect.signature(type(schedule)).parameters)
    clone = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule))
    assert type(clone) is type(schedule) and clone.get_config() == config
    assert json.loads(json.dumps(config)) == config
    np.testing.assert_array_equal(_np(clone(np.arange(120))), _np(schedule(np.arange(120))))


@pytest.mark.unit
def test_make_schedule_builds_each_registered_schedule():
    assert sorted(SCHEDULES) == ["cosine", "mlperf_poly", "paper_poly", "step"]
    for name, cls in SCHEDULES.items():
        assert type(make_schedule(name, 1.0, 90, 5)) is cls
    mlperf = make_schedule("mlperf_poly", 29.0, 3510, 702, end_learning_rate=1e-4, power=2.0)
    assert mlperf.get_config() == {
        "peak_learning_rate": 29.0,
        "total_steps": 3510,
        "warmup_steps": 702,
        "warmup_start_learning_rate": 0.0,
        "end_learning_rate": 1e-4,
        "power": 2.0,
    }
    # Goyal et al.'s epochs 30, 60, 80 of 90, in steps.
    assert make_schedule("step", 1.0, 90, 5).boundaries == [30, 60, 80]
    assert make_schedule("step", 1.0, 900, 50).boundaries == [300, 600, 800]
    assert make_schedule("step", 1.0, 90, 5, boundaries=[]).boundaries == []


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, kwargs, fragment",
    [
        (
            "poly",
            {},
            r"unknown schedule 'poly'; valid names: \['cosine', 'mlperf_poly', 'paper_poly', 'step'\]",
        ),
        ("cosine", dict(power=3.0), "power=3.0 does not apply to schedule 'cosine'"),
        ("step", dict(end_learning_rate=1e-4), "end_learning_rate=0.0001 does not apply to schedule 'step'"),
        ("mlperf_poly", dict(boundaries=[30]), r"boundaries=\[30\] does not apply"),
        ("paper_poly", dict(decay_factor=0.5), "decay_factor=0.5 does not apply"),
        (
            "step",
            dict(boundaries=[3, 50]),
            r"boundaries must be strictly increasing whole numbers in \[5, 90\]",
        ),
        ("step", dict(boundaries=[60, 30]), r"got \[60, 30\]"),
        ("step", dict(decay_factor=0.0), "decay_factor must be a finite number > 0 and <= 1"),
        (
            "cosine",
            dict(warmup_start_learning_rate=-0.5),
            "warmup_start_learning_rate must be a finite number >= 0, got -0.5",
        ),
    ],
)
def test_make_schedule_errors(name, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_schedule(name, 1.0, 90, 5, **kwargs)


@pytest.mark.unit
def test_numpy_integer_steps_are_accepted_and_stored_as_int():
    s = WarmupCosineDecay(1.0, np.int64(100), np.int32(10))
    assert type(s.get_config()["total_steps"]) is int and type(s.get_config()["warmup_steps"]) is int
    with pytest.raises(ValueError, match="total_steps must be a whole number > 0, got 10.5"):
        WarmupCosineDecay(1.0, 10.5, 1)


# --- Momentum correction: the numbers in hvd_lars.optim.schedules' docstring
# ---------------------------------


@pytest.mark.unit
def test_uncorrected_momentum_delays_a_linear_ramp_by_m_over_1_minus_m_steps():
    # Caffe-style velocity v = m v + lr_t g with a steady gradient g = 1 during a ramp lr_t = t / 200.
    m, slope = 0.9, 1.0 / 200
    v = 0.0
    for t in range(151):
        v = m * v + slope * t
    corrected = slope * t / (1 - m)  # v rescaled by lr_t / lr_{t-1} each step: lr_t * sum m^k
    delayed = slope * (t - m / (1 - m)) / (1 - m)  # the corrected velocity 9 steps earlier
    assert v == pytest.approx(delayed, rel=1e-7)  # up to the m ** t start-up term
    assert v / corrected == pytest.approx(1 - 9 / 150, rel=1e-7)


@pytest.mark.unit
@pytest.mark.parametrize("factor, extra_steps", [(0.1, 81.0), (0.81, 9 * (1 / 0.81 - 1))])
def test_a_rate_drop_without_momentum_correction_overshoots(factor, extra_steps):
    # Displacement after the rate falls by `factor`, uncorrected minus corrected, in units of steady
    # steps at the new rate (lr_new / (1 - m)).
    excess = _displacement_after_drop(factor, False) - _displacement_after_drop(factor, True)
    assert excess / (factor / (1 - 0.9)) == pytest.approx(extra_steps, rel=1e-3)


def _displacement_after_drop(factor, correction):
    """Momentum SGD in LARS (trust ratio 1), steady gradient 1: how far w moves once the rate, 1 so far,
    falls to `factor`."""
    opt = LARS(1.0, momentum=0.9, exclude_from_layer_adaptation=[""], momentum_correction=correction)
    w = keras.Variable(0.0, name="w")
    opt.build([w])

    @tf.function
    def apply():
        opt.apply([tf.constant(1.0)], [w])

    for _ in range(150):  # reach the steady velocity 1 / (1 - m) = 10
        apply()
    start = float(w.numpy())
    opt.learning_rate = factor
    for _ in range(150):
        apply()
    return start - float(w.numpy())


def _np(x):
    return keras.ops.convert_to_numpy(x)
