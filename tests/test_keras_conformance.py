"""LARS and DistributedOptimizer held to what every Keras 3 optimizer promises, one process, against Keras's
own SGD: LARS with trust ratio 1 and no weight decay is momentum SGD; DistributedOptimizer(SGD) with world
size 1 is SGD itself."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars import LARS, BroadcastGlobalVariablesCallback, DistributedOptimizer, WarmupPolynomialDecay
from hvd_lars.parallel import elastic
from hvd_lars.parallel.horovod_keras import elastic as horovod_elastic
from tests.support import REPO

ENV = dict(os.environ, PYTHONPATH=REPO)

GRADS = [np.array([[0.5, -2.0], [1.0, 3.0]], "float32"), np.array([-1.0, 0.25], "float32")]
START = [np.array([[1.0, 2.0], [-1.0, 0.5]], "float32"), np.array([0.1, -0.2], "float32")]


def _sgd_like(kind, **kwargs):
    if kind == "lars":
        return LARS(momentum=0.9, exclude_from_layer_adaptation=".*", **kwargs)
    return DistributedOptimizer(keras.optimizers.SGD(momentum=0.9, **kwargs))


def _run(optimizer, steps=4, grads=GRADS):
    """Weights after `steps` updates of the gradients GRADS * (k + 1), and the optimizer."""
    variables = [keras.Variable(v) for v in START]
    for k in range(steps):
        optimizer.apply([g * (k + 1) for g in grads], variables)
    return [v.numpy() for v in variables], optimizer


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
    got, optimizer = _run(_sgd_like(kind, **kwargs))
    want, reference = _run(keras.optimizers.SGD(momentum=0.9, **kwargs))
    if feature == "ema":
        variables = [keras.Variable(v) for v in got]
        optimizer.finalize_variable_values(variables)  # the EMA replaces the weights, as Keras's fit ends
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The update counter counts applied updates (4 micro-batches / 2 with accumulation).
    assert int(optimizer.iterations) == int(reference.iterations) == (2 if "gradient" in feature else 4)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["lars", "distributed"])
def test_variable_constraints_are_applied_after_each_update(kind):
    # NonNeg on the kernel: the negative entries the update would produce are clipped to 0.
    got = _constrained(_sgd_like(kind, learning_rate=1.0))
    want = _constrained(keras.optimizers.SGD(learning_rate=1.0, momentum=0.9))
    np.testing.assert_allclose(got, want)
    assert (got >= 0).all() and (got == 0).any()


def _constrained(optimizer):
    w = keras.Variable(START[0])
    w.constraint = keras.constraints.NonNeg()
    optimizer.apply([tf.constant(GRADS[0])], [w])
    return w.numpy()


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["lars", "distributed"])
def test_sparse_gradients_give_the_dense_result(kind):
    # IndexedSlices for rows 0 and 2 of a 3 x 2 table (an embedding's gradient).
    def run(optimizer, sparse):
        table = keras.Variable(np.ones((3, 2), "float32"))
        values, indices = tf.constant([[1.0, 2.0], [3.0, -4.0]]), tf.constant([0, 2])
        grad = (
            tf.IndexedSlices(values, indices, tf.constant([3, 2]))
            if sparse
            else tf.scatter_nd(indices[:, None], values, [3, 2])
        )
        for _ in range(2):
            optimizer.apply([grad], [table])
        return table.numpy()

    got = run(_sgd_like(kind, learning_rate=0.1), sparse=True)
    np.testing.assert_allclose(got, run(keras.optimizers.SGD(0.1, momentum=0.9), sparse=False), rtol=1e-6)
    np.testing.assert_allclose(got[1], [1.0, 1.0])  # the row without a gradient did not move


FACTORIES = [
    lambda: LARS(WarmupPolynomialDecay(0.5, 100, 10), weight_decay=5e-4, clipnorm=2.0),
    lambda: DistributedOptimizer(
        keras.optimizers.Adam(0.01, global_clipnorm=1.0), backward_passes_per_step=2
    ),
]


@pytest.mark.unit
def test_get_serialize_and_deserialize_round_trip():
    for optimizer in (make() for make in FACTORIES):
        config = keras.optimizers.serialize(optimizer)
        again = keras.optimizers.deserialize(config)
        assert type(again) is type(optimizer) and again.get_config() == optimizer.get_config()
        got = keras.optimizers.get(config)
        assert type(got) is type(optimizer)
        assert keras.optimizers.get(optimizer) is optimizer


@pytest.mark.unit
@pytest.mark.parametrize("how", ["var_names", "var_list"])
def test_lars_honours_keras_exclude_from_weight_decay(how):
    # One step with a zero gradient: only weight decay could move w (by lr * beta * w = 0.008).
    for make in (
        lambda: LARS(learning_rate=1.0, weight_decay=0.004),
        lambda: keras.optimizers.SGD(learning_rate=1.0, weight_decay=0.004),
    ):
        w = keras.Variable(2.0, name="exclude")
        optimizer = make()
        if how == "var_names":
            optimizer.exclude_from_weight_decay(var_names=["exclude"])
        else:
            optimizer.exclude_from_weight_decay(var_list=[w])
        optimizer.apply([tf.constant(0.0)], [w])
        assert float(w.numpy()) == 2.0, type(optimizer).__name__
    kept = keras.Variable(2.0, name="kept")
    optimizer = LARS(learning_rate=1.0, weight_decay=0.004)
    optimizer.exclude_from_weight_decay(var_names=["exclude"])
    optimizer.apply([tf.constant(0.0)], [kept])
    assert float(kept.numpy()) == pytest.approx(1.992, abs=1e-6)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_broadcast_callback_trains_models_keras_builds_in_their_first_step(kind):
    x = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)
    y = x.sum(axis=1, keepdims=True)

    def fit(callbacks):
        keras.utils.set_random_seed(3)
        if kind == "sequential":
            model = keras.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
        else:
            model = Subclassed()
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        return model

    got, want = fit([BroadcastGlobalVariablesCallback(0)]), fit([])
    assert int(got.optimizer.iterations) == 4
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.unit
def test_h5_keeps_distributed_optimizers_update_counter_and_slots(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=DistributedOptimizer(keras.optimizers.Adam(0.1)),
        loss=keras.losses.MeanSquaredError(),
        jit_compile=False,
    )
    model.fit(np.ones((6, 3)), np.ones((6, 2)), batch_size=2, verbose=0)
    model.save(tmp_path / "m.h5")
    loaded = keras.models.load_model(tmp_path / "m.h5")
    assert type(loaded.optimizer) is DistributedOptimizer
    assert int(loaded.optimizer.iterations) == 3  # Keras's own Adam keeps 3 as well
    assert int(loaded.optimizer._iterations) == 3  # the wrapper's micro-batch counter
    # Keras's .h5 loader builds optimizers with no variables (Adam alike): the slots cannot be set.
    with pytest.raises(ValueError, match=r"has shape \(\), set_weights got \(2,\)"):
        loaded.optimizer.set_weights([np.zeros(2)])


@pytest.mark.unit
def test_average_aggregated_gradients_false_sums_the_micro_batches():
    # x = 1, loss -y * w: gradients -1 and -2; summed -3 (Horovod's default), averaged -1.5.
    for average, want in ((False, 3.0), (True, 1.5)):
        w = keras.Variable(0.0)
        optimizer = DistributedOptimizer(
            keras.optimizers.SGD(1.0), backward_passes_per_step=2, average_aggregated_gradients=average
        )
        optimizer.apply([tf.constant(-1.0)], [w])
        optimizer.apply([tf.constant(-2.0)], [w])
        assert float(w.numpy()) == want


@pytest.mark.unit
def test_sparse_as_dense_and_the_global_process_set_are_accepted_others_refused():
    import horovod.tensorflow as hvd

    DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=True, process_set=hvd.global_process_set)
    with pytest.raises(
        ValueError, match=r"process_set must be the global process set \(launch a subset of ranks as a job\)"
    ):
        DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="sparse_as_dense must be a bool, got 'yes'"):
        DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense="yes")


def _accumulating_model():
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )

    def loss(y, p):
        return -keras.ops.mean(y * p)

    model.compile(
        optimizer=DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2),
        loss=loss,
        jit_compile=False,
    )
    model.optimizer.build(model.trainable_variables)
    return model


X, Y = np.ones((4, 1), "float32"), np.array([[1.0], [2.0], [3.0], [4.0]], "float32")


@pytest.mark.unit
@pytest.mark.parametrize("callback", ["CommitState", "CommitStateCallback"])
def test_no_commit_in_the_middle_of_an_accumulation_cycle(callback):
    # One micro-batch, restore, then y = 1..4 from the start: (1 + 2) / 2 + (3 + 4) / 2 = 5.0 (not 3.5).
    model = _accumulating_model()
    state = elastic.KerasState(model, step=0, batch=0, epoch=0)
    commit = elastic.CommitState(state, every_steps=1) if callback == "CommitState" else None
    commit = commit or horovod_elastic.CommitStateCallback(state, batches_per_commit=1)
    model.fit(X[:1], Y[:1], batch_size=1, verbose=0, callbacks=[commit])
    state.restore()
    assert int(model.optimizer._iterations) == 0
    model.fit(X, Y, batch_size=1, shuffle=False, verbose=0, callbacks=[commit])
    assert float(model.get_weights()[0].ravel()[0]) == pytest.approx(5.0)
    assert int(model.optimizer.iterations) == 2


@pytest.mark.unit
def test_batch_and_epoch_state_callbacks_resume_inside_an_epoch():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse", jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    state = elastic.KerasState(model, batch=0, epoch=0)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((state.epoch, state.batch))

    callbacks = [
        horovod_elastic.UpdateEpochStateCallback(state),
        horovod_elastic.UpdateBatchStateCallback(state),
        horovod_elastic.CommitStateCallback(state, batches_per_commit=2),
        Record(),
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


@pytest.mark.unit
def test_reset_callbacks_run_and_the_step_is_traced_anew():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(np.ones((2, 1)), np.ones((2, 1)), verbose=0)
    state = elastic.KerasState(model, epoch=0)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(model.train_function)])
    state.on_reset()
    assert calls == [None]
    with pytest.raises(ValueError, match="is not built"):
        elastic.KerasState(keras.Sequential([keras.layers.Dense(1)]))


SAVE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import keras
    import hvd_lars
    from hvd_lars.metrics import TopKAccuracy
    from hvd_lars.models.alexnet import LocalResponseNormalization
    from hvd_lars.models.batch_norm import FusedBatchNormalization
    from hvd_lars.models.cifar_resnet import ZeroPadShortcut

    schedules = [hvd_lars.WarmupPolynomialDecay, hvd_lars.PaperPolynomialDecay, hvd_lars.WarmupCosineDecay,
                 hvd_lars.WarmupStepDecay]
    optimizers = [hvd_lars.LARS(s(0.5, 100, 10), weight_decay=5e-4) for s in schedules]
    optimizers.append(hvd_lars.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    optimizers.append(hvd_lars.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))))
    x, y = np.random.default_rng(0).normal(size=(8, 4, 4, 2)).astype("float32"), np.arange(8) % 3
    for i, optimizer in enumerate(optimizers):
        inputs = keras.Input((4, 4, 2))
        h = ZeroPadShortcut(4, 1)(FusedBatchNormalization()(LocalResponseNormalization()(inputs)))
        model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
        model.compile(optimizer=optimizer, jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[TopKAccuracy(k=2)])
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        model.save(f"{sys.argv[1]}/m{i}.keras")
        print(i, type(model.optimizer).__name__, model.optimizer.name, int(model.optimizer.iterations),
              float(model.predict(x, verbose=0).sum()))
    """
)
LOAD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import keras, hvd_lars
    x = np.random.default_rng(0).normal(size=(8, 4, 4, 2)).astype("float32")
    for i in range(6):
        model = keras.models.load_model(f"{sys.argv[1]}/m{i}.keras")
        print(i, type(model.optimizer).__name__, model.optimizer.name, int(model.optimizer.iterations),
              float(model.predict(x, verbose=0).sum()))
    """
)


@pytest.mark.horovod  # fresh processes
def test_import_hvd_lars_is_enough_to_load_every_class_in_a_new_process(tmp_path):
    def run(script):
        command = [sys.executable, "-c", script, str(tmp_path)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=ENV)
        assert result.returncode == 0, result.stderr[-4000:]
        return [line.split() for line in result.stdout.splitlines() if line[:1].isdigit()]

    saved, loaded = run(SAVE), run(LOAD)
    assert len(saved) == 6
    for before, after in zip(saved, loaded):
        assert before[:4] == after[:4]  # class, name (distributed_adam ...), update count 2
        assert float(before[4]) == pytest.approx(float(after[4]), rel=1e-5)
    assert [s[1] for s in saved] == ["LARS"] * 4 + ["DistributedOptimizer", "DistributedLossScaleOptimizer"]
    assert saved[4][2] == "distributed_adam" and saved[4][3] == "2"


MIRRORED = textwrap.dedent(
    """
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
    for name, make in (
        ("lars", lambda: LARS(0.1, momentum=0.9, exclude_from_layer_adaptation=".*")),
        ("distributed", lambda: DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))),
        ("sgd", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
    ):
        got, steps = fit(make, mirrored)
        want, _ = fit(lambda: keras.optimizers.SGD(0.1, momentum=0.9), tf.distribute.get_strategy())
        print(name, steps, float(np.abs(got - want).max()))
    """
)


@pytest.mark.horovod  # a fresh process: logical devices are set before TensorFlow starts
def test_mirrored_strategy_over_two_logical_cpus_matches_one_device():
    result = subprocess.run(
        [sys.executable, "-c", MIRRORED], capture_output=True, text=True, timeout=240, env=ENV
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    lines = [line for line in lines if line[:1] in (["lars"], ["distributed"], ["sgd"])]
    assert [line[0] for line in lines] == ["lars", "distributed", "sgd"]
    for name, steps, difference in lines:
        # 2 updates per epoch (global batch 8 over 2 replicas), 3 epochs; SGD on one device to float32.
        assert int(steps) == 6, name
        assert float(difference) < 1e-6, name
