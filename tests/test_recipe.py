"""hvd_lars.training.plan.build_optimizer: `--optimizer=nesterov` is Keras's Nesterov momentum on the
L2-decayed gradient, on the run's schedule, against a NumPy reference and `keras.optimizers.SGD`."""

import keras
import numpy as np
import pytest

from hvd_lars.training.config import TrainConfig
from hvd_lars.training.plan import build_optimizer, build_schedule, make_plan

pytestmark = pytest.mark.unit

MOMENTUM, DECAY = 0.9, 5e-4


def _config(optimizer):
    return TrainConfig(
        optimizer=optimizer,
        peak_learning_rate=2.0,
        global_batch_size=64,
        epochs=3,
        warmup_epochs=1,
        schedule="mlperf_poly",
        momentum=MOMENTUM,
        weight_decay=DECAY,
    )


def _nesterov_reference(w, gradients, rates):
    """Keras's SGD(nesterov=True) (keras/src/optimizers/sgd.py) on d = g + beta * w, in float64:
    v = m * v - lr * d;  w = w + m * v - lr * d."""
    w, v = w.astype(np.float64), np.zeros_like(w, np.float64)
    for g, lr in zip(gradients, rates):
        d = g + DECAY * w
        v = MOMENTUM * v - lr * d
        w = w + MOMENTUM * v - lr * d
    return w


def _train(optimizer, w0, gradients):
    w = keras.Variable(w0, name="kernel")
    for g in gradients:
        optimizer.apply_gradients([(keras.ops.convert_to_tensor(g), w)])
    return np.asarray(w.numpy(), np.float64)


@pytest.mark.parametrize("optimizer_name", ["nesterov", "momentum"])
def test_nesterov_and_momentum_follow_keras_rules_on_the_schedule(optimizer_name):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 2)).astype(np.float32)
    gradients = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(3)]
    config = _config(optimizer_name)
    plan = make_plan(config, 1, 6400)  # 100 steps per epoch, warmup 100 steps from 0 to 2.0
    schedule = build_schedule(config, plan)
    rates = [float(schedule(step)) for step in range(3)]
    assert rates[0] == 0 and rates[1] == pytest.approx(0.02) and rates[2] == pytest.approx(0.04)

    got = _train(build_optimizer(config, plan), w0, gradients)

    if optimizer_name == "nesterov":
        expected = _nesterov_reference(w0, gradients, rates)
    else:
        w, v = w0.astype(np.float64), np.zeros((3, 2))
        for g, lr in zip(gradients, rates):
            v = MOMENTUM * v - lr * (g + DECAY * w)
            w = w + v
        expected = w
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    # The two rules differ after the first step with a non-zero rate (by m * lr * d at step 2): the test
    # tells them apart.
    other = _nesterov_reference(w0, gradients, rates) if optimizer_name == "momentum" else None
    if other is not None:
        assert np.abs(other - expected).max() > 1e-3


def test_nesterov_is_keras_sgd_nesterov_given_the_decayed_gradient():
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=(4,)).astype(np.float32)
    raw = [rng.normal(size=(4,)).astype(np.float32) for _ in range(3)]
    config = _config("nesterov")
    plan = make_plan(config, 1, 6400)
    ours = _train(build_optimizer(config, plan), w0, raw)

    keras_sgd = keras.optimizers.SGD(build_schedule(config, plan), momentum=MOMENTUM, nesterov=True)
    w = keras.Variable(w0, name="kernel")
    for g in raw:
        decayed = g + DECAY * w.numpy()  # coupled L2: Keras's own weight_decay would be decoupled
        keras_sgd.apply_gradients([(keras.ops.convert_to_tensor(decayed), w)])
    np.testing.assert_allclose(ours, w.numpy(), rtol=1e-6, atol=1e-7)
    inner = build_optimizer(config, plan).inner_optimizer
    assert inner.get_config()["nesterov"] is True and inner.name == "nesterov_sgd"
