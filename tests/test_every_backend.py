"""The backend-neutral wing on the Keras backend in use (TensorFlow, and JAX via `make test-backends`)."""

import importlib
import importlib.util
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from checks import readme
from hvd_lars import (
    LARS,
    LearningRateLogger,
    LearningRateWarmup,
    PaperPolynomialDecay,
    WarmupPolynomialDecay,
    scaled_learning_rate,
)
from hvd_lars.metrics import TopKAccuracy
from hvd_lars.optim.schedules import SCHEDULES, make_schedule
from tests.support import lars_reference as numpy_lars

BACKEND = keras.backend.backend()


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["paper", "decayed_gradient", "update"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_steps_match_the_numpy_rule(mode, nesterov):
    weights, grads = numpy_lars.problem(steps=4)
    kw = dict(momentum=0.9, weight_decay=5e-3, eta=0.01, epsilon=1e-5, nesterov=nesterov)
    optimizer = LARS(0.5, trust_ratio_mode=mode, **numpy_lars.EXCLUSIONS, **kw)
    variables = numpy_lars.keras_variables(weights, numpy_lars.PATHS)
    for step in grads:
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in step], variables)
    want = numpy_lars.reference(weights, grads, [0.5] * 4, exclusions=True, mode=mode, **kw)
    for path, variable, w in zip(numpy_lars.PATHS, variables, want):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(variable), w, rtol=2e-5, atol=1e-6, err_msg=path
        )


def small_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
    )


@pytest.mark.unit
def test_fit_with_lars_and_a_warmup_trains_logs_its_rate_and_saves_with_its_slots(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(256, 6)).astype(np.float32)
    y = np.argmax(x[:, :4] + 0.1 * rng.normal(size=(256, 4)), axis=1)
    model = small_model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    schedule = WarmupPolynomialDecay(scaled_learning_rate(200.0, 32), total_steps=40, warmup_steps=8)
    model.compile(
        LARS(schedule, momentum=0.9, weight_decay=1e-4), loss, metrics=[TopKAccuracy(1), TopKAccuracy(2)]
    )
    history = model.fit(x, y, batch_size=32, epochs=5, verbose=0, callbacks=[LearningRateLogger()])
    assert history.history["loss"][-1] < 0.7 * history.history["loss"][0]
    assert history.history["top1"][-1] > 0.6 and history.history["top2"][-1] >= history.history["top1"][-1]
    # The rate of each epoch's last update (steps 7, 15, ..., 39 of 40).
    expected = [float(schedule(step)) for step in range(7, 40, 8)]
    np.testing.assert_allclose(history.history["learning_rate"], expected, rtol=1e-6)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert int(loaded.optimizer.iterations) == 40
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


@pytest.mark.unit
def test_learning_rate_warmup_sets_a_float_rate_from_the_update_counter():
    model = small_model()
    model.compile(optimizer=LARS(1.0, momentum=0.9), loss="mse")
    x, y = np.ones((64, 6), np.float32), np.zeros((64, 4), np.float32)
    schedule = PaperPolynomialDecay(0.4, total_steps=12, warmup_steps=4)
    callbacks = [LearningRateWarmup(schedule), LearningRateLogger()]
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks)
    # The rate of each epoch's last update (steps 3, 7, 11 of 12): the warmup's, then the decay.
    expected = [float(schedule(step)) for step in (3, 7, 11)]
    np.testing.assert_allclose(history.history["learning_rate"], expected, rtol=1e-6)


@pytest.mark.unit
def test_schedules_take_a_tensor_of_steps():
    # Inside a compiled train step the step is a traced tensor: no Python branch on its value, as here.
    # In a fit: WarmupPolynomialDecay above, WarmupCosineDecay in the README's example below.
    steps = keras.ops.arange(50)
    for name in SCHEDULES:
        schedule = make_schedule(name, 4.0, 40, 8, warmup_start_learning_rate=0.5)
        got = keras.ops.convert_to_numpy(schedule(steps))
        np.testing.assert_allclose(got, [float(schedule(t)) for t in range(50)], rtol=1e-6, err_msg=name)


@pytest.mark.unit
def test_top_k_breaks_ties_by_class_index():
    logits = keras.ops.convert_to_tensor(np.array([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]], np.float32))
    labels = keras.ops.convert_to_tensor(np.array([1, 1]))
    top1 = TopKAccuracy(1)
    top1.update_state(labels, logits)
    assert float(top1.result()) == 0.5  # row 0: class 0 wins the tie; row 1: class 1 does


@pytest.mark.unit
def test_the_readmes_backend_example_trains(capsys, monkeypatch):
    (block,) = [b for b in readme.blocks("README.md") if b.marker.get("backend") == "every"]
    # The block sets KERAS_BACKEND for the processes it would start: later tests keep this file's backend.
    monkeypatch.setenv("KERAS_BACKEND", BACKEND)
    exec(compile(block.text, "README.md", "exec"), {})  # on this file's backend: Keras is imported already
    backend, _, top1 = capsys.readouterr().out.split()[-3:]
    assert backend == BACKEND and float(top1) > 0.9


@pytest.mark.unit
@pytest.mark.parametrize(
    "package", ["hvd_lars.parallel", "hvd_lars.models", "hvd_lars.data", "hvd_lars.training"]
)
def test_the_library_imports_off_tensorflow_and_its_tensorflow_parts_say_what_they_need(package):
    assert ("tensorflow" in sys.modules) == (BACKEND == "tensorflow")
    if BACKEND == "tensorflow":
        assert importlib.import_module(package)
        return
    with pytest.raises(ImportError, match=rf"^{package} needs tensorflow.* pip install 'hvd_lars\[train\]'"):
        importlib.import_module(package)
    with pytest.raises(ImportError, match=r"needs tensorflow under .* pip install 'hvd_lars\[train\]'"):
        from hvd_lars import DistributedOptimizer  # noqa: F401


@pytest.mark.horovod  # a process: a fresh interpreter on Keras's default backend
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is not None, reason="TensorFlow is installed here")
def test_import_on_the_default_backend_without_tensorflow_says_what_to_install():
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    result = subprocess.run(
        [sys.executable, "-c", "import hvd_lars"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: Keras's backend is TensorFlow (KERAS_BACKEND unset), which is not installed: pip "
        "install 'hvd_lars[train]', or set KERAS_BACKEND=jax (or torch) with that package installed."
    )
