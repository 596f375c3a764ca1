"""One rank of the 2-rank tests (run by tests/test_distributed.py through horovodrun, or alone).

Trains a small model without batch norm for a few LARS steps through the library's Horovod glue
(`distributed_optimizer`, `broadcast_variables`) inside `model.fit`, then writes this rank's weights to
<out>/rank<r>_of_<size>.npz. Each rank starts from different random weights (seed + rank), so identical
final weights also prove the broadcast. Every update's global batch is the same 32 images whatever the
world size and the accumulation A (argv[2], default 1): micro-batch k of rank r takes rows
[(r * A + k) * B, (r * A + k + 1) * B) of it, B = 32 / (size * A).

Usage: hvd_worker.py OUT_DIR [ACCUMULATION_STEPS]
"""

import os
import sys

import numpy as np

GLOBAL_BATCH = 32
STEPS = 4


def main(out_dir, accumulation=1):
    from hvd_lars import distributed

    rank, size = distributed.init()
    import keras
    import tensorflow as tf

    from hvd_lars import LARS, WarmupPolynomialDecay

    keras.utils.set_random_seed(100 + rank)
    rng = np.random.default_rng(7)
    x = rng.normal(size=(STEPS, GLOBAL_BATCH, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 5, size=(STEPS, GLOBAL_BATCH)).astype(np.int32)
    micro = GLOBAL_BATCH // (size * accumulation)
    mine = slice(rank * accumulation * micro, (rank + 1) * accumulation * micro)
    ds = tf.data.Dataset.from_tensor_slices((x[:, mine].reshape(-1, 8, 8, 1), y[:, mine].reshape(-1)))
    ds = ds.batch(micro)

    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(5, name="logits"),
        ]
    )
    schedule = WarmupPolynomialDecay(peak_learning_rate=2.0, total_steps=STEPS, warmup_steps=2)
    accumulate = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
    optimizer = distributed.distributed_optimizer(LARS(schedule, weight_decay=1e-3, eta=0.01, **accumulate))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    optimizer.build(model.trainable_variables)
    distributed.broadcast_variables(model.variables + optimizer.variables)
    initial = [v.numpy() for v in model.trainable_variables]
    model.fit(ds, epochs=1, steps_per_epoch=STEPS * accumulation, verbose=0, shuffle=False)
    os.makedirs(out_dir, exist_ok=True)
    np.savez(
        os.path.join(out_dir, f"rank{rank}_of_{size}_acc{accumulation}.npz"),
        iterations=int(optimizer.iterations.numpy()),
        **{f"initial_{i}": w for i, w in enumerate(initial)},
        **{f"final_{i}": v.numpy() for i, v in enumerate(model.trainable_variables)},
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
