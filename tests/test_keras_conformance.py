"""LARS (trust ratio 1, no decay) and DistributedOptimizer (world size 1) against Keras's own SGD."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS, BroadcastGlobalVariablesCallback, DistributedOptimizer
from hvd_lars.parallel import elastic
from hvd_lars.parallel.horovod_keras import elastic as horovod_elastic
from tests.support import REPO

ENV = dict(os.environ, PYTHONPATH=REPO)


def _python(script, *args):
    """The non-empty output lines, split into words, of `script` run with `args` in a new interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=240, env=ENV
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [line.split() for line in result.stdout.splitlines() if line.strip()]


GRADS = [np.array([[0.5, -2.0], [1.0, 3.0]], "float32"), np.array([-1.0, 0.25], "float32")]
START = [np.array([[1.0, 2.0], [-1.0, 0.5]], "float32"), np.array([0.1, -0.2], "float32")]


def _sgd_like(kind, **kwargs):
    if kind == "lars":
        return LARS(momentum=0.9, exclude_from_layer_adaptation=".*", **kwargs)
    return DistributedOptimizer(keras.optimizers.SGD(momentum=0.9, **kwargs))


FEATURES = {
    "plain": {},
    "clipnorm": {"clipnorm": 1.0},
    "clipvalue": {"clipvalue": 0.7},
    "global_clipnorm": {"global_clipnorm": 1.5},
    "ema": {"use_ema": True, "ema_momentum": 0.5},
    "loss_scale_factor": {"loss_scale_factor": 8.0},
    "gradient_accumulation": {"gradient_accumulation_steps": 2},
    "callable_rate": {"learning_rate": lambda: 0.05},
    "schedule": {"learning_rate": keras.optimizers.schedules.ExponentialDecay(0.1, 1, decay_rate=0.5)},
}


@pytest.mark.horovod
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("kind", ["lars", "distributed"])
def test_follows_keras_sgd_with_each_base_class_feature(kind, feature):
    kwargs = {"learning_rate": 0.1, **FEATURES[feature]}
    weights = []
    for optimizer in (_sgd_like(kind, **kwargs), keras.optimizers.SGD(momentum=0.9, **kwargs)):
        variables = [keras.Variable(v) for v in START]
        for k in range(4):
            optimizer.apply([g * (k + 1) for g in GRADS], variables)
        optimizer.finalize_variable_values(variables)  # as fit ends: with use_ema, the EMA replaces w
        weights.append([v.numpy() for v in variables])
        # The update counter counts applied updates (4 micro-batches / 2 with accumulation).
        assert int(optimizer.iterations) == (2 if "gradient" in feature else 4)
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["lars", "distributed"])
def test_constraints_and_sparse_gradients_as_keras_sgd(kind):
    # NonNeg on a kernel clips what the updates make negative; IndexedSlices for rows 0 and 2 of a 3 x 2
    # table (an embedding's gradient) give the dense result.
    def run(optimizer, sparse):
        kernel, table = keras.Variable(START[0]), keras.Variable(np.ones((3, 2), "float32"))
        kernel.constraint = keras.constraints.NonNeg()
        values, indices = tf.constant([[1.0, 2.0], [3.0, -4.0]]), tf.constant([0, 2])
        rows = tf.IndexedSlices(values, indices, tf.constant([3, 2]))
        for _ in range(2):
            optimizer.apply(
                [tf.constant(GRADS[0]), rows if sparse else tf.convert_to_tensor(rows)], [kernel, table]
            )
        return kernel.numpy(), table.numpy()

    got = run(_sgd_like(kind, learning_rate=1.0), sparse=True)
    for a, b in zip(got, run(keras.optimizers.SGD(1.0, momentum=0.9), sparse=False)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert (got[0] >= 0).all() and (got[0] == 0).any()
    np.testing.assert_array_equal(got[1][1], [1.0, 1.0])  # the row without a gradient did not move


@pytest.mark.unit
@pytest.mark.parametrize("how", ["var_names", "var_list"])
def test_lars_honours_keras_exclude_from_weight_decay(how):
    # Zero gradients: only weight decay could move w; LARS, then SGD, each move the kept one by 0.4%.
    excluded, kept = keras.Variable(2.0, name="exclude"), keras.Variable(2.0, name="kept")
    for optimizer in (LARS(1.0, weight_decay=0.004), keras.optimizers.SGD(1.0, weight_decay=0.004)):
        optimizer.exclude_from_weight_decay(**{how: ["exclude"] if how == "var_names" else [excluded]})
        optimizer.apply([tf.constant(0.0), tf.constant(0.0)], [excluded, kept])
    assert (float(excluded.numpy()), float(kept.numpy())) == pytest.approx((2.0, 2.0 * 0.996**2), abs=1e-6)


class Subclassed(keras.Model):
    def __init__(self, layers):
        super().__init__()
        self.hidden, self.out = layers

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.unit
def test_broadcast_callback_trains_models_keras_builds_in_their_first_step():
    x = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)

    def fit(kind, callbacks):
        keras.utils.set_random_seed(3)
        layers = [keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
        model = keras.Sequential(layers) if kind == "sequential" else Subclassed(layers)
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
        model.fit(x, x.sum(axis=1), batch_size=4, shuffle=False, verbose=0, callbacks=callbacks)
        return model

    want = fit("sequential", [])  # the same layers trained alike in either kind of model
    for kind in ("sequential", "subclassed"):
        got = fit(kind, [BroadcastGlobalVariablesCallback(0)])
        assert int(got.optimizer.iterations) == 2
        for a, b in zip(got.get_weights(), want.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.unit
def test_h5_keeps_distributed_optimizers_update_counter_and_slots(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    loss = keras.losses.MeanSquaredError()  # the .h5 loader refuses "mse"
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.Adam(0.1)), loss=loss, jit_compile=False)
    for _ in range(3):  # as fit's updates, without tracing a step
        model.optimizer.apply([np.ones(w.shape, "float32") for w in model.weights], model.weights)
    model.save(tmp_path / "m.h5")
    loaded = keras.models.load_model(tmp_path / "m.h5")
    assert type(loaded.optimizer) is DistributedOptimizer
    # The update counter (Keras's own Adam keeps 3 as well) and the wrapper's micro-batch counter.
    assert int(loaded.optimizer.iterations) == int(loaded.optimizer._iterations) == 3
    # Keras's .h5 loader builds optimizers with no variables (Adam alike): the slots cannot be set.
    with pytest.raises(ValueError, match=r"has shape \(\), set_weights got \(2,\)"):
        loaded.optimizer.set_weights([np.zeros(2)])


@pytest.mark.unit
@pytest.mark.parametrize("callback", ["CommitState", "CommitStateCallback"])
def test_no_commit_in_the_middle_of_an_accumulation_cycle(callback):
    # One micro-batch, restore, then y = 1..4 from the start: (1 + 2) / 2 + (3 + 4) / 2 = 5.0 (not 3.5).
    x, y = np.ones((4, 1), "float32"), np.array([[1.0], [2.0], [3.0], [4.0]], "float32")
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    model = keras.Sequential([keras.Input((1,)), dense])
    optimizer = DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    model.compile(optimizer=optimizer, loss=lambda y, p: -keras.ops.mean(y * p), jit_compile=False)
    optimizer.build(model.trainable_variables)
    state = elastic.KerasState(model, step=0, batch=0, epoch=0)
    if callback == "CommitState":
        commit = elastic.CommitState(state, every_steps=1)
    else:
        commit = horovod_elastic.CommitStateCallback(state, batches_per_commit=1)
    model.fit(x[:1], y[:1], batch_size=1, verbose=0, callbacks=[commit])
    state.restore()
    assert int(optimizer._iterations) == 0
    model.fit(x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[commit])
    assert float(model.get_weights()[0].ravel()[0]) == pytest.approx(5.0)
    assert int(optimizer.iterations) == 2


@pytest.mark.unit
def test_batch_and_epoch_state_callbacks_resume_inside_an_epoch_and_a_reset_retraces():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse", jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    state = elastic.KerasState(model, batch=0, epoch=0)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda *_, **__: seen.append((state.epoch, state.batch))
    )
    callbacks = [
        horovod_elastic.UpdateEpochStateCallback(state),
        horovod_elastic.UpdateBatchStateCallback(state),
        horovod_elastic.CommitStateCallback(state, batches_per_commit=2),
        record,
    ]
    x = np.zeros((4, 1), "float32")
    model.fit(x, x, batch_size=1, epochs=1, verbose=0, callbacks=callbacks)
    assert (state.epoch, state.batch) == (1, 0)
    state.batch = 3  # as if restored from a commit after 3 batches of epoch 1
    state.commit()
    seen.clear()
    model.fit(x, x, batch_size=1, epochs=3 - state.epoch, verbose=0, callbacks=callbacks)
    # Epoch 1 finishes with its 4th batch only, then epoch 2 has all 4.
    assert seen == [(1, 4), (2, 1), (2, 2), (2, 3), (2, 4)]
    assert (state.epoch, state.batch) == (3, 0)
    assert int(model.optimizer.iterations) == 4 + 1 + 4
    # A reset runs the registered callbacks with the step to be traced anew.
    calls = []
    state.register_reset_callbacks([lambda: calls.append(model.train_function)])
    state.on_reset()
    assert calls == [None]
    with pytest.raises(ValueError, match="is not built"):
        elastic.KerasState(keras.Sequential([keras.layers.Dense(1)]))


SAVE_OR_LOAD = """
import sys
import numpy as np
import keras
import hvd_lars

x, y = np.random.default_rng(0).normal(size=(8, 4, 4, 2)).astype("float32"), np.arange(8) % 3
report = lambda i, model: print(i, type(model.optimizer).__name__, model.optimizer.name,
                                int(model.optimizer.iterations), float(model.predict(x, verbose=0).sum()))
if sys.argv[2] == "load":
    for i in range(4):
        report(i, keras.models.load_model(f"{sys.argv[1]}/m{i}.keras"))
    sys.exit()

from hvd_lars.metrics import TopKAccuracy
from hvd_lars.models.alexnet import LocalResponseNormalization
from hvd_lars.models.batch_norm import FusedBatchNormalization
from hvd_lars.models.cifar_resnet import ZeroPadShortcut

# Each class hvd_lars registers, in 4 models: the 4 schedules, LARS, both wrappers, the metric, 3 layers.
from hvd_lars import DistributedOptimizer as Distributed
lars = lambda schedule: hvd_lars.LARS(schedule(0.5, 100, 10), weight_decay=5e-4)
optimizers = [lars(hvd_lars.WarmupPolynomialDecay), lars(hvd_lars.WarmupStepDecay),
              Distributed(keras.optimizers.Adam(hvd_lars.PaperPolynomialDecay(0.01, 100, 10))),
              Distributed(keras.optimizers.LossScaleOptimizer(lars(hvd_lars.WarmupCosineDecay)))]
for i, optimizer in enumerate(optimizers):
    inputs = keras.Input((4, 4, 2))
    h = ZeroPadShortcut(4, 1)(FusedBatchNormalization()(LocalResponseNormalization()(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[TopKAccuracy(k=2)])
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    model.save(f"{sys.argv[1]}/m{i}.keras")
    report(i, model)
"""


@pytest.mark.horovod  # fresh processes
def test_import_hvd_lars_is_enough_to_load_every_class_in_a_new_process(tmp_path):
    run = lambda mode: [line for line in _python(SAVE_OR_LOAD, str(tmp_path), mode) if line[0].isdigit()]
    saved, loaded = run("save"), run("load")
    assert [s[1] for s in saved] == ["LARS", "LARS", "DistributedOptimizer", "DistributedLossScaleOptimizer"]
    assert saved[2][2:4] == ["distributed_adam", "2"]
    for before, after in zip(saved, loaded, strict=True):
        assert before[:4] == after[:4]  # class, name, update count
        assert float(before[4]) == pytest.approx(float(after[4]), rel=1e-5)


MIRRORED = """
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from hvd_lars import LARS, DistributedOptimizer

x = np.linspace(-1, 1, 32, dtype="float32").reshape(16, 2)
y = x @ np.array([[1.0], [-2.0]], "float32")

def fit(make, strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")])
        model.compile(optimizer=make(), loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    return weights, int(model.optimizer.iterations.numpy())

mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
assert mirrored.num_replicas_in_sync == 2
sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)
want, _ = fit(sgd, tf.distribute.get_strategy())
for name, make in (
    ("lars", lambda: LARS(0.1, momentum=0.9, exclude_from_layer_adaptation=".*")),
    ("distributed", lambda: DistributedOptimizer(sgd())),
    ("sgd", sgd),
):
    got, steps = fit(make, mirrored)
    print(name, steps, float(np.abs(got - want).max()))
"""


@pytest.mark.horovod  # a fresh process: logical devices are set before TensorFlow starts
def test_mirrored_strategy_over_two_logical_cpus_matches_one_device():
    lines = [line for line in _python(MIRRORED) if line[:1] in (["lars"], ["distributed"], ["sgd"])]
    assert [line[0] for line in lines] == ["lars", "distributed", "sgd"]
    for name, steps, difference in lines:
        # 2 updates per epoch (global batch 8 over 2 replicas), 3 epochs; SGD on one device to float32.
        assert (int(steps), float(difference) < 1e-6) == (6, True), name
