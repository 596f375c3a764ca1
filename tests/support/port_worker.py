"""One rank of tests/test_horovod_port.py (run by horovodrun -np 2): the Horovod pieces a user's script
calls, on 2 real ranks, each case with hand-computed right values (see the test).

Every case: x = 1 on both ranks, a Dense(1, use_bias=False) kernel w, loss mse, so the gradient on rank r
is 2 (w - y_r), with y_0 = 1 and y_1 = 3. Rank 0 starts from w = 1, rank 1 from w = 0 (different
initialisers), so whose weights an update started from shows in the result.

Usage: port_worker.py OUT_DIR
"""

import os
import sys

import numpy as np


def _keras():
    import keras

    return keras


def _data(rank):
    return np.ones((1, 1), np.float32), np.full((1, 1), 1.0 + 2.0 * rank, np.float32)


def _values(model):
    return {
        "w": float(model.trainable_variables[0].numpy().ravel()[0]),
        "iterations": int(model.optimizer.iterations),
        "optimizer": [float(x) for v in model.optimizer.variables for x in np.asarray(v.numpy()).ravel()],
    }


def deferred_build(rank):
    """Models Keras builds in their first step: a Sequential without Input and a subclassed model."""
    keras = _keras()
    from hvd_lars import BroadcastGlobalVariablesCallback, DistributedOptimizer

    init = "ones" if rank == 0 else "zeros"

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1, use_bias=False, kernel_initializer=init)

        def call(self, x):
            return self.dense(x)

    out = {}
    for name, model in (
        ("sequential", keras.Sequential([keras.layers.Dense(1, use_bias=False, kernel_initializer=init)])),
        ("subclassed", Subclassed()),
    ):
        model.compile(
            optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
            loss="mse",
            jit_compile=False,
        )
        x, y = _data(rank)
        model.fit(x, y, batch_size=1, epochs=1, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])
        out[name] = _values(model)
    return out


def rank0_loads(rank, out_dir):
    """Rank 0 resumes from a .keras file (w = 1, momentum slot 0.5, 7 updates done); rank 1 builds the
    same model in code (w = 0, fresh optimizer)."""
    keras = _keras()
    from hvd_lars import BroadcastGlobalVariablesCallback, DistributedOptimizer
    from hvd_lars.parallel import collectives

    path = os.path.join(out_dir, "resume.keras")
    if rank == 0:
        # Written with extra models built first, so that the file's paths differ from rank 1's.
        keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        saved = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")]
        )
        saved.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
        saved.optimizer.build(saved.trainable_variables)
        saved.optimizer.inner_optimizer.momentums[0].assign([[0.5]])
        saved.optimizer.inner_optimizer.iterations.assign(7)
        saved.save(path)
    collectives.barrier()
    if rank == 0:
        model = keras.models.load_model(path)
    else:
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
        )
        model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    paths = [v.path for v in model.trainable_variables]
    x, y = _data(rank)
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])
    return {**_values(model), "paths": paths}


def warmup(rank):
    """Horovod's LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=5), 5 batches per epoch."""
    keras = _keras()
    from hvd_lars import DistributedOptimizer, LearningRateWarmupCallback

    rates = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse", jit_compile=False)
    model.fit(
        np.zeros((5, 1), np.float32), np.zeros((5, 1), np.float32), batch_size=1, epochs=6, verbose=0,
        callbacks=[LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=5), Record()],
    )  # fmt: skip
    return rates


def local_variables(rank):
    """register_local_var, PartialDistributedOptimizer, BroadcastGlobalVariablesCallback(local_variables)."""
    keras = _keras()
    from hvd_lars import BroadcastGlobalVariablesCallback, DistributedOptimizer
    from hvd_lars.parallel.horovod_keras import PartialDistributedOptimizer

    out = {}
    for case in ("register_local_var", "partial"):
        layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones" if rank == 0 else "zeros")
        model = keras.Sequential([keras.Input((1,)), layer])
        if case == "partial":
            optimizer = PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[layer])
        else:
            optimizer = DistributedOptimizer(keras.optimizers.SGD(0.1))
            optimizer.register_local_var(layer.kernel)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        x, y = _data(rank)
        callback = BroadcastGlobalVariablesCallback(0, local_variables=[layer.kernel])
        model.fit(x, y, batch_size=1, epochs=1, verbose=0, callbacks=[callback])
        out[case] = _values(model)["w"]
    return out


def main(out_dir):
    import json

    from hvd_lars.parallel import collectives

    rank, size = collectives.init()
    assert size == 2, size
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks on 2 cores
    results = {
        "deferred_build": deferred_build(rank),
        "rank0_loads": rank0_loads(rank, out_dir),
        "warmup": warmup(rank),
        "local_variables": local_variables(rank),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
