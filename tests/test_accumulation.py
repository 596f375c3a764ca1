"""Gradient accumulation: the sums and means it hands on, checkpoints between micro-batches, batch norm."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS, DistributedOptimizer
from hvd_lars.models import get_model
from hvd_lars.parallel.accumulation import accumulate, accumulation_steps, at_update_boundary
from hvd_lars.training.plan import Plan, batch_norm_note


@pytest.mark.unit
@pytest.mark.parametrize(
    "steps, average, grads, updates, after",
    [
        (2, True, [1.0, 3.0, 5.0, 7.0], [2.0, 6.0], [1.0, 0.0, 5.0, 0.0]),
        (2, False, [1.0, 3.0, 5.0, 7.0], [4.0, 12.0], [1.0, 0.0, 5.0, 0.0]),
        (3, True, [3.0, 3.0, 6.0], [4.0], [3.0, 6.0, 0.0]),
    ],
)
def test_the_update_gets_the_mean_or_the_sum_once_per_update(steps, average, grads, updates, after):
    acc, got, accumulated = keras.Variable(0.0), [], []
    for k, g in enumerate(grads):
        accumulate(
            [tf.constant(g)], [acc], tf.constant(k), steps, average, lambda gs: got.append(float(gs[0]))
        )
        accumulated.append(float(acc.numpy()))
    assert (got, accumulated) == (updates, after)  # the accumulator is zero after each update


@pytest.mark.unit
def test_steps_and_boundaries_through_wrappers():
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)
    assert accumulation_steps(keras.optimizers.LossScaleOptimizer(inner)) == 3
    # Summed micro-batches, as Horovod's average_aggregated_gradients=False: rate 1 moves w by -2, not -1.
    wrapper = DistributedOptimizer(
        keras.optimizers.SGD(1.0), backward_passes_per_step=2, average_aggregated_gradients=False
    )
    assert accumulation_steps(keras.optimizers.SGD(0.1)) == 1 and accumulation_steps(wrapper) == 2
    w = keras.Variable(np.ones(2, np.float32))
    states = []
    for _ in range(3):
        wrapper.apply([tf.ones(2)], [w])
        states.append(at_update_boundary(wrapper))
    assert states == [False, True, False] and w.numpy().tolist() == [-1.0, -1.0]


def _model_and_optimizer():
    dense = keras.layers.Dense(2, kernel_initializer="ones", bias_initializer="zeros")
    model = keras.Sequential([keras.Input((3,)), dense])
    optimizer = DistributedOptimizer(LARS(0.1, momentum=0.9), backward_passes_per_step=2)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model, optimizer


@pytest.mark.unit
def test_a_checkpoint_between_micro_batches_restores_and_trains_on_as_the_uninterrupted_run(tmp_path):
    x, y = np.arange(12, dtype=np.float32).reshape(4, 3) / 10, np.ones((4, 2), np.float32)
    # 3 micro-batches (one update applied, one micro-batch pending), saved.
    saved_model, saved_optimizer = _model_and_optimizer()
    saved_model.fit(x[:3], y[:3], batch_size=1, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=saved_model, optimizer=saved_optimizer).write(str(tmp_path / "ckpt"))
    model, optimizer = _model_and_optimizer()
    optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(path)
    status.assert_existing_objects_matched().assert_consumed()
    assert all(np.abs(a.numpy()).max() > 0 for a in optimizer._accumulated_gradients)  # the pending one
    assert (int(optimizer.iterations), int(keras.ops.convert_to_tensor(optimizer._iterations))) == (1, 3)
    # The 4th micro-batch completes the update: as the run of all 4 in one go, bit for bit.
    model.fit(x[3:], y[3:], batch_size=1, shuffle=False, verbose=0)
    whole, whole_optimizer = _model_and_optimizer()
    whole.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    assert int(optimizer.iterations) == int(whole_optimizer.iterations) == 2
    for a, b in zip(model.get_weights() + [v.numpy() for v in optimizer.variables],
                    whole.get_weights() + [v.numpy() for v in whole_optimizer.variables]):  # fmt: skip
        np.testing.assert_array_equal(a, b)


MOMENTUM = 0.9
# One update of 8 images, 1 feature: micro-batch k (2 images) is mu_k -/+ 1, mu = 0, 4, 8, 12. Each
# micro-batch's variance is 1; the 8 images' variance is 1 + var(mu) = 1 + 20 = 21.
MEANS = np.array([0.0, 4.0, 8.0, 12.0])


def _batch_norm_update(accumulation):
    """(moving mean, moving variance, logits kernel step) after one update of 8 images in `accumulation`."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.BatchNormalization(momentum=MOMENTUM, name="bn"),
         keras.layers.Dense(2, name="logits")], name=f"accumulation_{accumulation}",
    )  # fmt: skip
    steps = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
    optimizer = LARS(1.0, momentum=0.0, exclude_from_layer_adaptation=[""], **steps)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = model.get_layer("logits").kernel.numpy()
    images = np.stack([MEANS - 1, MEANS + 1], axis=1).reshape(8, 1).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((images, np.array([0, 1] * 4, np.int32)))
    model.fit(data.batch(8 // accumulation), epochs=1, verbose=0, shuffle=False)
    assert int(optimizer.iterations) == 1
    bn = model.get_layer("bn")
    step = model.get_layer("logits").kernel.numpy() - start
    return float(bn.moving_mean.numpy()[0]), float(bn.moving_variance.numpy()[0]), step


@pytest.mark.unit
def test_batch_norm_statistics_and_gradients_follow_micro_batches():
    whole_mean, whole_var, step_whole = _batch_norm_update(1)
    # Without accumulation: one moving-average step with the 8 images' mean 6 and variance 21.
    assert whole_mean == pytest.approx(0.1 * 6.0, rel=1e-6)
    assert whole_var == pytest.approx(0.9 * 1.0 + 0.1 * 21.0, rel=1e-6)
    # With 4 micro-batches: 4 moving-average steps, each with its micro-batch's mean and variance 1 (the
    # spread between micro-batches never enters); micro-batch k weighs 0.1 * 0.9 ** (3 - k).
    mean, var, step_accumulated = _batch_norm_update(4)
    weights = (1 - MOMENTUM) * MOMENTUM ** np.arange(3, -1, -1)
    assert mean == pytest.approx(float(weights @ MEANS), rel=1e-6)  # 2.244 against 0.6
    assert var == pytest.approx(MOMENTUM**4 * 1.0 + weights.sum() * 1.0, rel=1e-6)  # exactly 1 against 3
    assert whole_var / var == pytest.approx(3.0, rel=1e-6)
    # Each micro-batch is normalised by its own statistics: the update differs by more than its own size.
    assert np.abs(step_whole).max() > 1e-3
    assert np.linalg.norm(step_accumulated - step_whole) / np.linalg.norm(step_whole) > 1.0  # 1.58


@pytest.mark.unit
def test_the_run_log_says_what_accumulation_does_to_batch_norm():
    plan = Plan(4, 32768, 16, 512, 39, 100, 3900, 390, 32.0)
    cnn = get_model("small_cnn")
    assert batch_norm_note(cnn, plan) == (
        "batch norm with accumulation: 5 layers normalise each micro-batch of 16 images per rank with its "
        "own statistics and update their moving averages 512 times per update (momentum per update "
        "0.9^512 = 3.73e-24)"
    )
    without = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="no_batch_norm")
    assert batch_norm_note(without, plan) is None
    unaccumulated = Plan(2048, 32768, 16, 1, 39, 100, 3900, 390, 32.0)
    assert batch_norm_note(cnn, unaccumulated) is None
