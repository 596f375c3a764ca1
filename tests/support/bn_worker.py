"""One rank of the 2-rank batch-norm statistics test (tests/test_batch_norm_ranks.py).

A model with batch norm trains 2 epochs of 2 LARS steps through the library's Horovod glue; rank r's
images have mean 1 + 3 r and standard deviation 1 + r, so each rank's moving statistics follow its own
data. Callbacks record the moving mean and variance around the two places the library averages them:
    [record "before", ExactEvaluation (epoch 2 only), record "mid", PeriodicCheckpoint, record "after"]
Epoch 1: only the checkpoint averages (mid == before); epoch 2: the evaluation averages first.
Writes <out>/rank<r>.npz with arrays "<epoch>_<when>" of shape (2, FEATURES) (mean; variance).

Usage: bn_worker.py OUT_DIR
"""

import os
import sys

import numpy as np

FEATURES = 4
PER_RANK = 16  # training images per rank per epoch: 2 steps of 8


def main(out_dir):
    from hvd_lars.parallel import collectives

    rank, size = collectives.init()
    import keras
    import tensorflow as tf

    from hvd_lars import LARS, DistributedOptimizer, WarmupPolynomialDecay
    from hvd_lars.training.checkpoints import PeriodicCheckpoint, moving_statistics
    from hvd_lars.training.epoch_logs import ExactEvaluation

    keras.utils.set_random_seed(100 + rank)
    rng = np.random.default_rng(rank)
    x = (1 + 3 * rank + (1 + rank) * rng.normal(size=(PER_RANK, FEATURES))).astype(np.float32)
    y = rng.integers(0, 3, size=PER_RANK).astype(np.int32)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    evaluation = tf.data.Dataset.from_tensor_slices((x[:6], y[:6])).batch(4)

    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.BatchNormalization(momentum=0.5, name="bn"),
            keras.layers.Dense(3, name="logits"),
        ]
    )
    # A schedule, as the main program uses (at main 6dd5379 a float rate through distributed_optimizer is
    # tracked twice and cannot be checkpointed; the dist branch fixes that).
    schedule = WarmupPolynomialDecay(0.1, total_steps=4, warmup_steps=1)
    optimizer = DistributedOptimizer(LARS(schedule, weight_decay=1e-4))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    optimizer.build(model.trainable_variables)
    collectives.broadcast_variables(model.variables + optimizer.variables)
    assert len(moving_statistics(model)) == 2  # the batch norm's moving mean and variance

    records = {}

    def record(when):
        def save(epoch, logs=None):
            bn = model.get_layer("bn")
            records[f"{epoch + 1}_{when}"] = np.stack([bn.moving_mean.numpy(), bn.moving_variance.numpy()])

        return keras.callbacks.LambdaCallback(on_epoch_end=save)

    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, os.path.join(out_dir, "checkpoints"), max_to_keep=5)
    callbacks = [
        record("before"),
        ExactEvaluation(evaluation, 6 * size, every_epochs=2),
        record("mid"),
        PeriodicCheckpoint(manager, every_steps=0),
        record("after"),
    ]
    model.fit(train, epochs=2, steps_per_epoch=2, callbacks=callbacks, verbose=0, shuffle=False)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **records)


if __name__ == "__main__":
    main(sys.argv[1])
