"""One rank of tests/test_horovod_keras.py (horovodrun -np 2): `hvd_lars.parallel.horovod_keras` used as a
ported Horovod script uses `horovod.tensorflow.keras`. Most cases: x = 1, a Dense(1, use_bias=False) kernel w,
mse, so rank r's gradient is 2 (w - y_r) with y_0 = 1 and y_1 = 3; where rank 0 starts from w = 1 and rank 1
from w = 0, whose weights an update started from shows.

Usage: horovod_keras_worker.py OUT_DIR
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import hvd_lars.parallel.horovod_keras as hvd
from hvd_lars import BroadcastGlobalVariablesCallback, DistributedOptimizer, LearningRateWarmupCallback
from hvd_lars.parallel import collectives
from hvd_lars.parallel.horovod_keras import PartialDistributedOptimizer


def _data(rank):
    return np.ones((1, 1), np.float32), np.full((1, 1), 1.0 + 2.0 * rank, np.float32)


def _one_update(model, rank, callbacks=()):
    x, y = _data(rank)
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, callbacks=list(callbacks))
    return float(model.trainable_variables[0].numpy().ravel()[0])


def _dense(w=1.0):
    init = keras.initializers.Constant(w)
    return keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer=init)]
    )


def load_model(hvd, rank, out_dir):
    """A plain SGD(0.1) model saved by one process, loaded by hvd.load_model on both."""
    path = os.path.join(out_dir, "plain_sgd.keras")
    if rank == 0:
        model = _dense()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.save(path)
    hvd.allreduce(0.0, name="saved")  # a barrier: rank 1 reads the file only once it is written
    model = hvd.load_model(path)
    w = _one_update(model, rank, [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return {
        "w": w,
        "optimizer": type(model.optimizer).__name__,
        "inner": type(model.optimizer.inner_optimizer).__name__,
    }


def optimizer_arguments(hvd, rank):
    """op, gradient_predivide_factor, compression and groups of hvd.DistributedOptimizer on 2 ranks."""
    out = {}
    cases = {
        "average": {},
        "sum": {"op": hvd.Sum},
        "predivide": {"gradient_predivide_factor": 2.0},
        "fp16_predivide": {"compression": hvd.Compression.fp16, "gradient_predivide_factor": 2.0},
        "groups_int": {"groups": 1},
    }
    for name, kwargs in cases.items():
        model = _dense()
        model.compile(
            optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs),
            loss="mse",
            jit_compile=False,
        )
        out[name] = _one_update(model, rank)
    model = _dense()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=[[model.trainable_variables[0]]])
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    out["groups_list"] = _one_update(model, rank)
    return out


def value_collectives(hvd, rank):
    @tf.function
    def in_graph(x):
        return hvd.allreduce(x, name="in_graph", op=hvd.Sum)

    return {
        "allreduce": hvd.allreduce([rank + 1.0]).numpy().tolist(),
        "allreduce_sum": hvd.allreduce(np.float32(rank + 1.0), op=hvd.Sum).numpy().tolist(),
        "allreduce_variable": hvd.allreduce(keras.Variable([2.0 * rank])).numpy().tolist(),
        "allreduce_graph": in_graph(tf.constant([rank + 1.0])).numpy().tolist(),
        "allgather": hvd.allgather([[rank]]).numpy().tolist(),
        "broadcast": hvd.broadcast(10 * rank + 5, root_rank=1).numpy().tolist(),
        "reducescatter": hvd.reducescatter(np.arange(1.0, 5.0) * (rank + 1), op=hvd.Sum).numpy().tolist(),
    }


def aggregation_with_local_vars(hvd, rank):
    """Horovod's test_gradient_aggregation_with_local_vars in Keras 3's API: 8 tf.Variables x_i = [0] and
    y_i = [1, 2], the first 4 of each registered local, loss x - (rank + 1) * y[0], 4 backward passes
    per update, 10 passes, an optimizer that adds the gradient."""

    class AddGradient(keras.optimizers.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign_add(gradient)

    out = {}
    for average in (True, False):
        optimizer = hvd.DistributedOptimizer(
            AddGradient(learning_rate=0.1), backward_passes_per_step=4, average_aggregated_gradients=average
        )
        xs = [tf.Variable([0.0]) for _ in range(8)]
        ys = [tf.Variable([1.0, 2.0]) for _ in range(8)]
        for v in xs[:4] + ys[:4]:
            optimizer.register_local_var(v)

        @tf.function
        def step(xs=xs, ys=ys, optimizer=optimizer):
            with tf.GradientTape() as tape:
                loss = tf.stack(xs) - float(rank + 1) * tf.gather(tf.stack(ys), [0], axis=1)
            grads = tape.gradient(loss, xs + ys)
            optimizer.apply_gradients(zip(grads, xs + ys))

        trace = []
        for _ in range(10):
            step()
            trace.append([float(v.numpy()[0]) for v in xs] + [float(v.numpy()[0]) for v in ys])
        out[str(average)] = trace
    return out


def warmup_momentum_correction(hvd, rank):
    """LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=1) over 2 updates per epoch, 2 epochs,
    with SGD(0.2, momentum=0.9): w after each update (x = 1, y = 0 on both ranks)."""
    model = _dense()
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.2, momentum=0.9)),
        loss="mse",
        jit_compile=False,
    )
    trace = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            trace.append(float(self.model.trainable_variables[0].numpy().ravel()[0]))

    callbacks = [hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=1), Record()]
    history = model.fit(np.ones((2, 1), np.float32), np.zeros((2, 1), np.float32), batch_size=1, epochs=2,
                        shuffle=False, verbose=0, callbacks=callbacks)  # fmt: skip
    return {"w": trace, "lr_logs": [float(v) for v in history.history["lr"]]}


def _values(model):
    return {
        "w": float(model.trainable_variables[0].numpy().ravel()[0]),
        "iterations": int(model.optimizer.iterations),
        "optimizer": [float(x) for v in model.optimizer.variables for x in np.asarray(v.numpy()).ravel()],
    }


def deferred_build(rank):
    """Models Keras builds in their first step: a Sequential without Input and a subclassed model."""
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
    """Rank 0 resumes from a .keras file (w = 1, momentum 0.5, 7 updates); rank 1 builds the model in code."""
    path = os.path.join(out_dir, "resume.keras")
    if rank == 0:
        # An extra model built first, so that the file's paths differ from rank 1's.
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
    rank, size = hvd.init()
    assert size == 2, size
    tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks on 2 cores
    results = {
        "init": {
            "rank": hvd.rank(), "size": hvd.size(), "cross_rank": hvd.cross_rank(),
            "initialized": hvd.is_initialized(),
            "rules": os.environ.get("OMPI_MCA_coll_tuned_dynamic_rules_filename"),
        },
        "load_model": load_model(hvd, rank, out_dir),
        "optimizer_arguments": optimizer_arguments(hvd, rank),
        "value_collectives": value_collectives(hvd, rank),
        "aggregation_with_local_vars": aggregation_with_local_vars(hvd, rank),
        "warmup_momentum_correction": warmup_momentum_correction(hvd, rank),
        "deferred_build": deferred_build(rank),
        "rank0_loads": rank0_loads(rank, out_dir),
        "warmup": warmup(rank),
        "local_variables": local_variables(rank),
    }  # fmt: skip
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
