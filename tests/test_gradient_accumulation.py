"""Gradient accumulation as its own piece (`hvd_lars.parallel.accumulation`): the sums and means it hands
on, and a checkpoint taken between the micro-batches of an update restores, pending micro-batch included,
and trains on as an uninterrupted run."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS, DistributedOptimizer
from hvd_lars.parallel.accumulation import accumulate, accumulation_steps, at_update_boundary

X = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
Y = np.ones((4, 2), np.float32)


def run(steps, average, grads_per_micro_batch):
    """The gradients `update` receives, micro-batch by micro-batch, and the accumulator after each."""
    acc = keras.Variable(0.0)
    updates, after = [], []
    for k, g in enumerate(grads_per_micro_batch):
        accumulate(
            [tf.constant(g)], [acc], tf.constant(k), steps, average, lambda gs: updates.append(float(gs[0]))
        )
        after.append(float(acc.numpy()))
    return updates, after


@pytest.mark.unit
def test_the_update_gets_the_mean_or_the_sum_once_per_update():
    # Gradients 1, 3 | 5, 7: means 2 and 6, sums 4 and 12; the accumulator is zero after each update.
    assert run(2, True, [1.0, 3.0, 5.0, 7.0]) == (
        [2.0, 6.0],
        [1.0, 0.0, 5.0, 0.0],
    )
    assert run(2, False, [1.0, 3.0, 5.0, 7.0]) == (
        [4.0, 12.0],
        [1.0, 0.0, 5.0, 0.0],
    )
    assert run(3, True, [3.0, 3.0, 6.0]) == ([4.0], [3.0, 6.0, 0.0])


@pytest.mark.unit
def test_steps_and_boundaries_through_wrappers():
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)
    assert accumulation_steps(keras.optimizers.LossScaleOptimizer(inner)) == 3
    wrapper = DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    assert accumulation_steps(keras.optimizers.SGD(0.1)) == 1 and accumulation_steps(wrapper) == 2
    w = keras.Variable(np.ones(2, np.float32))
    wrapper.build([w])
    states = []
    for _ in range(3):
        wrapper.apply([tf.ones(2)], [w])
        states.append(at_update_boundary(wrapper))
    assert states == [False, True, False]


def model_and_optimizer():
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones", bias_initializer="zeros")]
    )
    optimizer = DistributedOptimizer(LARS(0.1, momentum=0.9), backward_passes_per_step=2)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model, optimizer


@pytest.mark.unit
def test_a_checkpoint_between_micro_batches_restores_and_trains_on_as_the_uninterrupted_run(tmp_path):
    # 3 micro-batches of X[:3] (one update applied, one micro-batch pending), saved.
    saved_model, saved_optimizer = model_and_optimizer()
    saved_model.fit(X[:3], Y[:3], batch_size=1, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=saved_model, optimizer=saved_optimizer).write(str(tmp_path / "ckpt"))
    model, optimizer = model_and_optimizer()
    optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(path)
    status.assert_existing_objects_matched().assert_consumed()
    assert all(np.abs(a.numpy()).max() > 0 for a in optimizer._accumulated_gradients)  # the pending one
    assert (int(optimizer.iterations), int(keras.ops.convert_to_tensor(optimizer._iterations))) == (1, 3)
    # The 4th micro-batch completes the update: as the run of all 4 in one go, bit for bit.
    model.fit(X[3:], Y[3:], batch_size=1, shuffle=False, verbose=0)
    whole, whole_optimizer = model_and_optimizer()
    whole.fit(X, Y, batch_size=1, shuffle=False, verbose=0)
    assert int(optimizer.iterations) == int(whole_optimizer.iterations) == 2
    for a, b in zip(model.get_weights() + [v.numpy() for v in optimizer.variables],
                    whole.get_weights() + [v.numpy() for v in whole_optimizer.variables]):  # fmt: skip
        np.testing.assert_array_equal(a, b)
