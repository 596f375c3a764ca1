"""One rank of tests/test_horovod_keras.py (run by horovodrun -np 2): `hvd_lars.parallel.horovod_keras`
used as a ported Horovod script uses `horovod.tensorflow.keras`, each case with the values the test
computes by hand or with NumPy.

Cases with a Dense(1, use_bias=False) kernel w and x = 1: the squared-error gradient on rank r is
2 (w - y_r), with y_0 = 1 and y_1 = 3.

Usage: horovod_keras_worker.py OUT_DIR
"""

import json
import os
import sys

import numpy as np


def _one_update(model, rank, callbacks=()):
    x, y = np.ones((1, 1), np.float32), np.full((1, 1), 1.0 + 2.0 * rank, np.float32)
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, callbacks=list(callbacks))
    return float(model.trainable_variables[0].numpy().ravel()[0])


def _dense(w=1.0):
    import keras

    init = keras.initializers.Constant(w)
    return keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer=init)]
    )


def load_model(hvd, rank, out_dir):
    """A plain SGD(0.1) model saved by one process, loaded by hvd.load_model on both."""
    import keras

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
    import keras

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
    import keras
    import tensorflow as tf

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
    import keras
    import tensorflow as tf

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
    import keras

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


def main(out_dir):
    import hvd_lars.parallel.horovod_keras as hvd

    rank, size = hvd.init()
    assert size == 2, size
    import tensorflow as tf

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
    }  # fmt: skip
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
