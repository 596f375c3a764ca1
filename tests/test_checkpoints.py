"""PeriodicCheckpoint: which updates are saved, exactly; a kill mid background write keeps the last one."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS
from hvd_lars.training.checkpoints import PeriodicCheckpoint


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3)]
    )
    model.compile(optimizer=LARS(1.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.unit
def test_saved_updates_hold_exactly_their_weights(tmp_path):
    model = _model()
    # Two checkpointers of one fit (3 updates per epoch, a checkpoint every 2): (asynchronous, at epoch
    # ends) and the updates each saves.
    cases = {"both": (True, True, [2, 3, 4, 6]), "neither": (False, False, [2, 4, 6])}
    track = lambda: tf.train.Checkpoint(model=model, optimizer=model.optimizer)  # one for each
    managers = {k: tf.train.CheckpointManager(track(), str(tmp_path / k), max_to_keep=10) for k in cases}
    saving = [
        PeriodicCheckpoint(managers[k], 2, at_epoch_end=e, asynchronous=a) for k, (a, e, _) in cases.items()
    ]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 6)).astype("float32"), rng.integers(0, 3, 12)
    at = {}  # the weights after each update
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: at.update({int(model.optimizer.iterations): model.get_weights()})
    )
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[record, *saving])
    restored = _model()
    for name, (_, _, expected) in cases.items():
        # After fit: the last write is complete and indexed.
        assert [int(path.rsplit("-", 1)[1]) for path in managers[name].checkpoints] == expected, name
        assert tf.train.latest_checkpoint(str(tmp_path / name)).endswith("ckpt-6")
        for step in expected:
            tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
                str(tmp_path / name / f"ckpt-{step}")
            ).assert_existing_objects_matched()
            assert int(restored.optimizer.iterations) == step
            np.testing.assert_equal(restored.get_weights(), at[step])


# A 64 MiB variable: its background write takes far longer than the process needs to die after save().
KILLED_MID_WRITE = """
import os, sys
import tensorflow as tf
big = tf.Variable(tf.zeros([16 * 1024 * 1024]))
step = tf.Variable(1)
manager = tf.train.CheckpointManager(tf.train.Checkpoint(big=big, step=step), sys.argv[1], max_to_keep=3)
manager.save(checkpoint_number=1)
step.assign(2)
big.assign(tf.ones([16 * 1024 * 1024]))
options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
manager.save(checkpoint_number=2, options=options)
os._exit(9)  # killed while the background thread writes checkpoint 2 (no atexit join)
"""


@pytest.mark.horovod
def test_killed_during_a_background_write_keeps_the_previous_checkpoint(tmp_path):
    command = [sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 9, result.stderr[-2000:]
    latest = tf.train.latest_checkpoint(str(tmp_path))
    assert latest.endswith("ckpt-1")
    big, step = tf.Variable(tf.ones([16 * 1024 * 1024])), tf.Variable(-1)
    tf.train.Checkpoint(big=big, step=step).restore(latest).assert_consumed()
    assert int(step.numpy()) == 1 and float(tf.reduce_max(tf.abs(big))) == 0.0
