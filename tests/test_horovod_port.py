"""What a Horovod Keras script does, on 2 real ranks and in fresh processes: models Keras builds
in their first step, rank 0 resuming from a file while the others build in code, Horovod's warmup formula,
local variables; and `import hvd_lars` being enough for `keras.models.load_model` in a new process.

Right values (tests/support/port_worker.py): x = 1, kernel w, mse, y_0 = 1 and y_1 = 3, rank 0 starts
from w = 1 and rank 1 from w = 0. After rank 0's weights are broadcast before the first update, the
averaged gradient at w = 1 is (2 (1 - 1) + 2 (1 - 3)) / 2 = -2; SGD(0.1, momentum=0.9) then sets the
momentum to 0.9 m + 0.2 and w to w + that momentum.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import REPO
from tests.support.horovodrun_checked_once import HOROVODRUN
from tests.support.main_server import served

pytestmark = pytest.mark.horovod

ENV = dict(os.environ, PYTHONPATH=REPO)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("port")
    worker = os.path.join(REPO, "tests", "support", "port_worker.py")
    cmd = [*HOROVODRUN, "-np", "2", "-H", "localhost:2", sys.executable, worker, str(out)]
    cmd = served(cmd, out, ENV)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=out)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_models_built_in_their_first_step_get_rank_0s_state_before_the_first_update(ranks, kind):
    for r in ranks:
        got = r["deferred_build"][kind]
        # From rank 0's w = 1: 1 + 0.2 = 1.2 (from rank 1's w = 0 the mean gradient would be -3: 1.3).
        assert got["w"] == pytest.approx(1.2, abs=1e-6)
        assert got["iterations"] == 1
        # DistributedOptimizer's micro-batch counter, SGD's counter, rate and momentum: 1, 1, 0.1, 0.2.
        assert got["optimizer"] == pytest.approx([1, 1, 0.1, 0.2], abs=1e-6)
    assert ranks[0]["deferred_build"] == ranks[1]["deferred_build"]


def test_rank_0_loads_from_a_file_and_the_others_build_in_code(ranks):
    r0, r1 = (r["rank0_loads"] for r in ranks)
    assert r0["paths"] != r1["paths"]  # e.g. dense_3/kernel against sequential_1/dense_2/kernel
    for got in (r0, r1):
        # Rank 0's file: w = 1, momentum 0.5, 7 updates; one more: momentum 0.45 + 0.2, w 1.65, 8 updates.
        assert got["w"] == pytest.approx(1.65, abs=1e-6)
        assert got["iterations"] == 8
        assert got["optimizer"] == pytest.approx([1, 8, 0.1, 0.65], abs=1e-6)


def test_warmup_follows_horovods_code_formula(ranks):
    # initial_lr 0.2 over 5 epochs of 5 batches on 2 ranks: 0.1 * ((t + 1) / 5 / 5 + 1) before update t.
    want = [0.1 * ((t + 1) / 25 + 1) for t in range(25)] + [0.2] * 5
    for r in ranks:
        assert r["warmup"] == pytest.approx(want, abs=1e-7)
        assert r["warmup"][0] == pytest.approx(0.104, abs=1e-7)
        assert r["warmup"][24] == pytest.approx(0.200, abs=1e-7)


def test_local_variables_keep_their_own_values_and_gradients(ranks):
    # Not broadcast (local_variables), not averaged, divided by the world size (Horovod's
    # scale_local_gradients): rank 0 at w = 1 has gradient 0; rank 1 at w = 0 has -6, so -3: w = 0.3.
    for case in ("register_local_var", "partial"):
        assert ranks[0]["local_variables"][case] == pytest.approx(1.0, abs=1e-6)
        assert ranks[1]["local_variables"][case] == pytest.approx(0.3, abs=1e-6)


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

    schedules = [
        hvd_lars.WarmupPolynomialDecay(0.5, 100, 10),
        hvd_lars.PaperPolynomialDecay(0.5, 100, 10),
        hvd_lars.WarmupCosineDecay(0.5, 100, 10),
        hvd_lars.WarmupStepDecay(0.5, 100, 10),
    ]
    optimizers = [hvd_lars.LARS(s, weight_decay=5e-4) for s in schedules]
    optimizers.append(hvd_lars.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    optimizers.append(hvd_lars.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))))
    x = np.random.default_rng(0).normal(size=(8, 4, 4, 2)).astype("float32")
    y = np.arange(8) % 3
    for i, optimizer in enumerate(optimizers):
        inputs = keras.Input((4, 4, 2))
        h = LocalResponseNormalization()(inputs)
        h = FusedBatchNormalization()(h)
        h = ZeroPadShortcut(4, 1)(h)
        h = keras.layers.Flatten()(h)
        model = keras.Model(inputs, keras.layers.Dense(3)(h))
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


def test_import_hvd_lars_is_enough_to_load_every_class_in_a_new_process(tmp_path):
    def run(script):
        result = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=240,
            env=ENV,
        )
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


def test_mirrored_strategy_over_two_logical_cpus_matches_one_device():
    result = subprocess.run(
        [sys.executable, "-c", MIRRORED], capture_output=True, text=True, timeout=240, env=ENV
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [
        line.split()
        for line in result.stdout.splitlines()
        if line.split()[:1] in (["lars"], ["distributed"], ["sgd"])
    ]
    assert [line[0] for line in lines] == ["lars", "distributed", "sgd"]
    for name, steps, difference in lines:
        # 2 updates per epoch (global batch 8 over 2 replicas), 3 epochs; SGD on one device to float32.
        assert int(steps) == 6, name
        assert float(difference) < 1e-6, name
