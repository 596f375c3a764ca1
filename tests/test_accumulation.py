"""Batch norm under gradient accumulation, quantified: per-micro-batch statistics and A moving-average
updates per optimizer update (hvd_lars.training.train.batch_norm_note says so in the run log)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS
from hvd_lars.models import get_model
from hvd_lars.training.plan import Plan, batch_norm_note

MOMENTUM = 0.9
# One update of 8 images, 1 feature: micro-batch k (2 images) is mu_k -/+ 1, mu = 0, 4, 8, 12. Each
# micro-batch's variance is 1; the 8 images' variance is 1 + var(mu) = 1 + 20 = 21.
MEANS = np.array([0.0, 4.0, 8.0, 12.0])
IMAGES = np.stack([MEANS - 1, MEANS + 1], axis=1).reshape(8, 1).astype(np.float32)
LABELS = np.array([0, 1] * 4, np.int32)


@pytest.fixture(scope="module")
def updates():
    """{A: (moving mean, moving variance, logits kernel step)} after one update over IMAGES with A micro-
    batches; momentum SGD at rate 1 (batch norm comes first, so its statistics do not depend on it)."""
    out = {}
    for accumulation in (1, 4):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((1,)),
                keras.layers.BatchNormalization(momentum=MOMENTUM, name="bn"),
                keras.layers.Dense(2, name="logits"),
            ],
            name=f"accumulation_{accumulation}",
        )
        steps = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
        optimizer = LARS(1.0, momentum=0.0, exclude_from_layer_adaptation=[""], **steps)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        start = model.get_layer("logits").kernel.numpy()
        data = tf.data.Dataset.from_tensor_slices((IMAGES, LABELS)).batch(8 // accumulation)
        model.fit(data, epochs=1, verbose=0, shuffle=False)
        assert int(optimizer.iterations) == 1
        bn = model.get_layer("bn")
        step = model.get_layer("logits").kernel.numpy() - start
        out[accumulation] = (float(bn.moving_mean.numpy()[0]), float(bn.moving_variance.numpy()[0]), step)
    return out


@pytest.mark.unit
def test_moving_statistics_follow_micro_batches(updates):
    whole_mean, whole_var, _ = updates[1]
    # Without accumulation: one moving-average step with the 8 images' mean 6 and variance 21.
    assert whole_mean == pytest.approx(0.1 * 6.0, rel=1e-6)
    assert whole_var == pytest.approx(0.9 * 1.0 + 0.1 * 21.0, rel=1e-6)

    mean, var, _ = updates[4]
    # With 4 micro-batches: 4 moving-average steps (momentum 0.9 ** 4 = 0.656 per update), each with its
    # micro-batch's mean and with variance 1: the spread between micro-batches never enters.
    weights = (1 - MOMENTUM) * MOMENTUM ** np.arange(3, -1, -1)  # micro-batch k weighs 0.1 * 0.9 ** (3 - k)
    assert mean == pytest.approx(float(weights @ MEANS), rel=1e-6)  # 2.244 against 0.6
    assert var == pytest.approx(MOMENTUM**4 * 1.0 + weights.sum() * 1.0, rel=1e-6)  # exactly 1 against 3
    assert whole_var / var == pytest.approx(3.0, rel=1e-6)


@pytest.mark.unit
def test_gradients_follow_micro_batch_normalisation(updates):
    # Each micro-batch is normalised by its own mean and variance, so the averaged gradient is not the
    # global batch's: the one update moves the logits' kernel differently.
    step_whole, step_accumulated = updates[1][2], updates[4][2]
    assert np.abs(step_whole).max() > 1e-3
    relative = np.linalg.norm(step_accumulated - step_whole) / np.linalg.norm(step_whole)
    assert relative > 1.0  # 1.58 here: the two updates differ by more than the update itself


@pytest.mark.unit
def test_the_run_log_says_what_accumulation_does_to_batch_norm():
    plan = Plan(4, 32768, 16, 512, 39, 100, 3900, 390, 32.0)
    note = batch_norm_note(get_model("small_cnn"), plan)
    assert note == (
        "batch norm with accumulation: 5 layers normalise each micro-batch of 16 images per rank with its "
        "own statistics and update their moving averages 512 times per update (momentum per update "
        "0.9^512 = 3.73e-24)"
    )
    without = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="no_batch_norm")
    assert batch_norm_note(without, plan) is None
    unaccumulated = Plan(2048, 32768, 16, 1, 39, 100, 3900, 390, 32.0)
    assert batch_norm_note(get_model("small_cnn"), unaccumulated) is None
