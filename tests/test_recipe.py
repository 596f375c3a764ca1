"""`--optimizer=nesterov` and `momentum`: Keras's SGD rules on the L2-decayed gradient, on the schedule."""

import keras
import numpy as np
import pytest

from hvd_lars.training.config import TrainConfig
from hvd_lars.training.plan import build_optimizer, build_schedule, make_plan

pytestmark = pytest.mark.unit

MOMENTUM, DECAY = 0.9, 5e-4


def _reference(w, gradients, rates, nesterov):
    """Keras's sgd.py on d = g + decay w, in float64: v = m v - lr d; w += v (Nesterov: w += m v - lr d)."""
    w, v = w.astype(np.float64), np.zeros_like(w, np.float64)
    for g, lr in zip(gradients, rates):
        d = g + DECAY * w
        v = MOMENTUM * v - lr * d
        w = w + (MOMENTUM * v - lr * d if nesterov else v)
    return w


def _train(optimizer, w0, gradients, decayed=False):
    w = keras.Variable(w0, name="kernel")
    for g in gradients:
        g = g + DECAY * w.numpy() if decayed else g
        optimizer.apply_gradients([(keras.ops.convert_to_tensor(g), w)])
    return np.asarray(w.numpy(), np.float64)


@pytest.mark.parametrize("name", ["nesterov", "momentum"])
def test_nesterov_and_momentum_follow_keras_rules_on_the_schedule(name):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 2)).astype(np.float32)
    gradients = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(3)]
    config = TrainConfig(
        optimizer=name, peak_learning_rate=2.0, global_batch_size=64, epochs=3, warmup_epochs=1,
        schedule="mlperf_poly", momentum=MOMENTUM, weight_decay=DECAY,
    )  # fmt: skip
    plan = make_plan(config, 1, 6400)  # 100 steps per epoch, warmup 100 steps from 0 to 2.0
    schedule = build_schedule(config, plan)
    rates = [float(schedule(step)) for step in range(3)]
    assert rates == [0, pytest.approx(0.02), pytest.approx(0.04)]
    got = _train(build_optimizer(config, plan), w0, gradients)
    expected = _reference(w0, gradients, rates, nesterov=name == "nesterov")
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    # The rules differ after the first step with a non-zero rate (by m lr d): the test tells them apart.
    assert np.abs(_reference(w0, gradients, rates, nesterov=name != "nesterov") - expected).max() > 1e-3
    # Keras's own SGD given the decayed gradient (coupled L2: Keras's weight_decay would be decoupled).
    sgd = keras.optimizers.SGD(schedule, momentum=MOMENTUM, nesterov=name == "nesterov")
    np.testing.assert_allclose(got, _train(sgd, w0, gradients, decayed=True), rtol=1e-6, atol=1e-7)
    assert build_optimizer(config, plan).inner_optimizer.name == f"{name}_sgd"
