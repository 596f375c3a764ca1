"""Schedule values computed by hand at the points that matter: step 0, warmup end, decay, last step."""

import copy

import keras
import numpy as np
import pytest

from hvd_lars import WarmupPolynomialDecay, epochs_to_steps, scaled_learning_rate


def _lr(schedule, step):
    return float(keras.ops.convert_to_numpy(schedule(step)))


def test_mlperf_convention_values():
    # peak 10, warmup 4 of 14 steps from 0, power 2, end 0.1.
    s = WarmupPolynomialDecay(peak_learning_rate=10.0, total_steps=14, warmup_steps=4, end_learning_rate=0.1)
    assert _lr(s, 0) == 0.0
    assert _lr(s, 1) == pytest.approx(2.5)
    assert _lr(s, 3) == pytest.approx(7.5)  # last warmup step: 10 * 3 / 4
    assert _lr(s, 4) == pytest.approx(10.0)  # first decay step: the peak
    # step 9: progress (9 - 4) / 10 = 0.5 -> 0.1 + 9.9 * 0.25
    assert _lr(s, 9) == pytest.approx(0.1 + 9.9 * 0.25)
    assert _lr(s, 13) == pytest.approx(0.1 + 9.9 * 0.01)  # last step: (1 - 0.9) ** 2
    assert _lr(s, 14) == pytest.approx(0.1)
    assert _lr(s, 1000) == pytest.approx(0.1)  # held at the end rate


def test_warmup_from_a_start_rate():
    s = WarmupPolynomialDecay(
        peak_learning_rate=33.0, total_steps=100, warmup_steps=10, warmup_start_learning_rate=1.0
    )
    assert _lr(s, 0) == pytest.approx(1.0)
    assert _lr(s, 5) == pytest.approx(1.0 + 32.0 * 0.5)


def test_no_warmup_starts_at_peak():
    s = WarmupPolynomialDecay(peak_learning_rate=2.0, total_steps=10, warmup_steps=0, power=1.0)
    assert _lr(s, 0) == pytest.approx(2.0)
    assert _lr(s, 5) == pytest.approx(1.0)


def test_vectorised_steps_match_scalar_calls():
    s = WarmupPolynomialDecay(peak_learning_rate=5.0, total_steps=20, warmup_steps=5)
    many = keras.ops.convert_to_numpy(s(np.arange(25)))
    np.testing.assert_allclose(many, [_lr(s, t) for t in range(25)], rtol=1e-6)


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


def test_linear_scaling_rule():
    assert scaled_learning_rate(0.1, 8192) == pytest.approx(3.2)  # Goyal et al.: 0.1 per 256
    assert scaled_learning_rate(2.0, 32768, reference_batch=1024) == pytest.approx(64.0)
    with pytest.raises(ValueError, match="global_batch"):
        scaled_learning_rate(0.1, 0)


def test_epochs_to_steps():
    assert epochs_to_steps(1, 60000, 4096) == 14
    assert epochs_to_steps(90, 1281167, 32768) == 90 * 39
    assert epochs_to_steps(0.5, 60000, 4096) == 7
    with pytest.raises(ValueError, match="larger than the data set"):
        epochs_to_steps(1, 1000, 4096)
