"""One rank of the 2-rank tests of ranks that disagree about their variables (tests/test_faults.py runs it
through horovodrun). Each case trains a small Keras model with `DistributedOptimizer` after
`broadcast_model_and_optimizer`, as `hvd_lars.training.train.run` does, and writes this rank's final weights
to
<out>/rank<r>.npz, with the error the second case raised.

Cases, in this order: "extra_model": rank 1 builds (and drops) one more Keras model before training,
so Keras's automatic names differ between the ranks (sequential_1/dense_2 against sequential/dense);
"extra_layer": rank 1's model has one more Dense layer than rank 0's.

Usage: mismatch_worker.py OUT_DIR
"""

import os
import sys

import numpy as np


def train(case, rank):
    """Trains case `case`'s model for one epoch of 4 updates; returns its weights' paths and values."""
    import keras

    from hvd_lars import DistributedOptimizer
    from hvd_lars.parallel.callbacks import broadcast_model_and_optimizer

    keras.utils.set_random_seed(rank)  # different initial weights: the broadcast must align them
    if case == "extra_model" and rank == 1:
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    layers = [keras.Input((4,)), keras.layers.Dense(3, activation="tanh")]
    if case == "extra_layer" and rank == 1:
        layers.append(keras.layers.Dense(3, activation="tanh"))
    model = keras.Sequential(layers + [keras.layers.Dense(2)])
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=False)
    broadcast_model_and_optimizer(model)
    rng = np.random.default_rng(rank)
    x, y = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return [v.path for v in model.weights], model.get_weights()


def main(out_dir):
    from hvd_lars.parallel import collectives

    rank, _ = collectives.init()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks on 2 cores
    names, weights = train("extra_model", rank)
    try:
        train("extra_layer", rank)
        error = ""
    except RuntimeError as e:
        error = str(e)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), *weights, names=np.array(names), error=error)


if __name__ == "__main__":
    main(*sys.argv[1:])
