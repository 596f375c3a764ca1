"""LearningRateWarmup and LearningRateLogger in `model.fit`: the schedule's rate at every update."""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS
from hvd_lars.optim.rate_callbacks import LearningRateLogger, LearningRateWarmup
from hvd_lars.optim.schedules import PaperPolynomialDecay, WarmupPolynomialDecay

BATCH = 8
STEPS_PER_EPOCH = 3
EPOCHS = 4
# 12 updates; warmup 5 from 0.02 to 0.2, then the paper's decay from step 0 (a drop at step 5).
SCHEDULE = PaperPolynomialDecay(0.2, EPOCHS * STEPS_PER_EPOCH, 5, warmup_start_learning_rate=0.02)


def _model(optimizer, seed=0, **compile_kwargs):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(size=(3, 2)).astype("float32"), np.zeros(2, "float32")])
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    return model


def _fit(model, callbacks, epochs=EPOCHS, initial_epoch=0, batch_size=BATCH):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS_PER_EPOCH, 3)).astype("float32")
    y = (x @ np.array([[1.0, -2.0], [0.5, 0.0], [-1.0, 3.0]])).astype("float32")
    kwargs = dict(batch_size=batch_size, epochs=epochs, initial_epoch=initial_epoch, shuffle=False, verbose=0)
    return model.fit(x, y, callbacks=callbacks, **kwargs)


class _RecordRates(keras.callbacks.Callback):
    """Per batch: the update counter before it and the float rate its update used (read after the batch)."""

    def __init__(self):
        super().__init__()
        self.steps, self.rates = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.steps.append(int(self.model.optimizer.iterations.numpy()))

    def on_train_batch_end(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate.numpy()))


@pytest.mark.unit
def test_callback_gives_the_schedule_rate_at_every_step_and_after_a_resume(tmp_path):
    make = lambda rate: LARS(rate, momentum=0.9, weight_decay=1e-3, eta=0.1)
    inside = _model(make(SCHEDULE), run_eagerly=True)  # one traced fit (outside) is enough
    history_inside = _fit(inside, [LearningRateLogger()])
    # One epoch (3 of the 5 warmup steps), a checkpoint, three more epochs; resumed: a fresh model (other
    # weights) and optimizer restored from the checkpoint, with a stale, changed rate the callback must not
    # build on.
    outside, record, csv_path = _model(make(0.0)), _RecordRates(), tmp_path / "metrics.csv"
    csv_logger = keras.callbacks.CSVLogger(csv_path, append=True)  # the file gets both fits' epochs
    callbacks = [LearningRateWarmup(SCHEDULE), record, LearningRateLogger(), csv_logger]
    _fit(outside, callbacks, epochs=1)
    path = tf.train.Checkpoint(model=outside, optimizer=outside.optimizer).save(str(tmp_path / "ckpt"))
    history_outside = _fit(outside, callbacks, initial_epoch=1)
    second, record_second = _model(make(0.5), seed=1, run_eagerly=True), _RecordRates()
    second.optimizer.build(second.trainable_variables)
    tf.train.Checkpoint(model=second, optimizer=second.optimizer).restore(path).assert_consumed()
    second.optimizer.learning_rate = 7.0
    _fit(second, [LearningRateWarmup(SCHEDULE), record_second], initial_epoch=1)
    assert (record_second.steps, record_second.rates) == (record.steps[3:], record.rates[3:])
    for a, b in zip(outside.get_weights(), second.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert record.steps == list(range(12))
    assert record.rates == [float(SCHEDULE(t)) for t in range(12)]
    # The same updates as with the schedule inside the optimizer (up to graph vs eager rounding).
    for a, b in zip(inside.get_weights(), outside.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # Logged: the rate of each epoch's last update (steps 2, 5, 8, 11), in history and in the CSV file.
    want = [float(SCHEDULE(t)) for t in (2, 5, 8, 11)]
    assert history_outside.history["learning_rate"] == want[1:]
    with open(csv_path) as f:
        logged = [float(row["learning_rate"]) for row in csv.DictReader(f)]
    np.testing.assert_allclose([history_inside.history["learning_rate"], logged], [want, want], rtol=1e-6)


@pytest.mark.unit
def test_gradient_accumulation_counts_updates_not_micro_batches():
    # 2 epochs of 6 micro-batches of 4 images, accumulated in pairs: 3 updates of 8 images per epoch.
    schedule = WarmupPolynomialDecay(0.2, 6, 3, warmup_start_learning_rate=0.05)
    accumulating = _model(keras.optimizers.SGD(0.0, gradient_accumulation_steps=2))
    record = _RecordRates()
    history = _fit(accumulating, [LearningRateWarmup(schedule), record, LearningRateLogger()], 2, 0, 4)
    assert record.steps == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert record.rates == [float(schedule(t // 2)) for t in range(12)]
    assert history.history["learning_rate"] == [float(schedule(2)), float(schedule(5))]
    assert int(accumulating.optimizer.iterations.numpy()) == 6


@pytest.mark.unit
def test_the_loss_scalers_inner_rate_refusals_and_the_steps_per_execution_warning():
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0))
    callback = LearningRateWarmup(SCHEDULE)
    callback.set_model(_model(optimizer))
    optimizer.inner_optimizer.iterations.assign(7)
    callback.on_train_batch_begin(0)
    assert float(optimizer.inner_optimizer.learning_rate.numpy()) == float(SCHEDULE(7))
    optimizer = keras.optimizers.SGD(SCHEDULE)  # named "sgd" by Keras 3.14+, "SGD" by 3.12-3.13
    callback.set_model(_model(optimizer))
    with pytest.raises(ValueError, match=f"float learning rate; SGD '{optimizer.name}' has a Paper"):
        callback.on_train_begin()
    with pytest.raises(ValueError, match="schedule must be a callable of the step, got 0.1"):
        LearningRateWarmup(0.1)
    callback.set_model(_model(keras.optimizers.SGD(0.0), steps_per_execution=2))
    with pytest.warns(UserWarning, match="steps_per_execution=2: the rate is set once per 2 steps"):
        callback.on_train_begin()
