"""A Keras 3 training script of your own, data-parallel over Horovod ranks with hvd_lars's pieces.

    horovodrun -np 2 -H localhost:2 python examples/keras_horovod_lars.py [--out=DIR] [--epochs=3]

Not the main program: its own model (a small MLP), its own data (4 Gaussian classes in 16 dimensions,
generated from a fixed seed, each rank training on its shard), its own `model.fit`. What it takes from
hvd_lars is what a `horovod.tensorflow.keras` script took from Horovod, for Keras 3:
- `hvd_lars.LARS` on a `WarmupPolynomialDecay` schedule (linear warmup over the first epoch to the peak
  rate given by the linear scaling rule, then polynomial decay to 0), wrapped by
  `hvd_lars.DistributedOptimizer`, which averages each update's gradients over the ranks;
- `BroadcastGlobalVariablesCallback(0)`: every rank starts from rank 0's weights (each rank initialises
  its model with its own seed here, so without it the ranks would train different models);
- `MetricAverageCallback()`: the epoch logs (loss, accuracy, val_loss, val_accuracy) are the means over
  ranks on every rank, so History, EarlyStopping and the printed line agree everywhere.
Runs in seconds on a CPU. With `--out=DIR` each rank writes `DIR/rank<r>.npz` (its final weights, the
learning rate before each update, its History and its own validation loss and accuracy without
averaging), which `tests/test_keras_horovod_lars_example.py` checks. Rank 0 prints lines starting with
"example:".
"""

import argparse
import os

import keras
import numpy as np

from hvd_lars import (
    LARS,
    BroadcastGlobalVariablesCallback,
    DistributedOptimizer,
    MetricAverageCallback,
    WarmupPolynomialDecay,
    scaled_learning_rate,
)
from hvd_lars.parallel import collectives as hvd

CLASSES, FEATURES = 4, 16
TRAIN_EXAMPLES, VALIDATION_EXAMPLES = 2048, 512
PER_RANK_BATCH = 64
BASE_LEARNING_RATE = 0.5  # per 256 images (linear scaling rule, Goyal et al. 2017)


def make_data(count, seed):
    """`count` examples of 4 Gaussian classes: float32 (count, 16), int32 (count,); the same on all ranks."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(0).normal(0.0, 1.0, (CLASSES, FEATURES))
    labels = rng.integers(0, CLASSES, count).astype(np.int32)
    features = centres[labels] + rng.normal(0.0, 1.5, (count, FEATURES))
    return features.astype(np.float32), labels


def make_model():
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(64, activation="relu", name="hidden"),
            keras.layers.Dense(CLASSES, name="logits"),
        ]
    )


class RateBeforeEachUpdate(keras.callbacks.Callback):
    """Records the learning rate the optimizer will use for the coming update."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="", help="folder for each rank's results (none: not written)")
    args = parser.parse_args()

    rank, size = hvd.init()
    keras.utils.set_random_seed(
        1000 + rank
    )  # different initial weights per rank: the broadcast must fix them
    x, y = make_data(TRAIN_EXAMPLES, seed=1)
    x_val, y_val = make_data(VALIDATION_EXAMPLES, seed=2)
    # Each rank trains and validates on its own shard (equal sizes, so every rank runs the same steps).
    x, y = x[rank::size], y[rank::size]
    x_val, y_val = x_val[rank::size], y_val[rank::size]

    global_batch = PER_RANK_BATCH * size
    steps_per_epoch = len(x) // PER_RANK_BATCH
    schedule = WarmupPolynomialDecay(
        peak_learning_rate=scaled_learning_rate(BASE_LEARNING_RATE, global_batch),
        total_steps=args.epochs * steps_per_epoch,
        warmup_steps=steps_per_epoch,  # one epoch
    )
    optimizer = DistributedOptimizer(LARS(schedule, momentum=0.9, weight_decay=5e-4, eta=0.01))
    model = make_model()
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,  # Horovod's collectives stay out of XLA
    )
    rates = RateBeforeEachUpdate()
    history = model.fit(
        x,
        y,
        batch_size=PER_RANK_BATCH,
        epochs=args.epochs,
        validation_data=(x_val, y_val),
        callbacks=[BroadcastGlobalVariablesCallback(0), MetricAverageCallback(), rates],
        shuffle=True,
        verbose=2 if rank == 0 else 0,
    )
    own_val_loss, own_val_accuracy = model.evaluate(x_val, y_val, batch_size=PER_RANK_BATCH, verbose=0)
    if rank == 0:
        last = {k: round(v[-1], 4) for k, v in history.history.items()}
        print(
            f"example: {size} ranks, global batch {global_batch}, {steps_per_epoch} updates per epoch",
            flush=True,
        )
        print(f"example: last epoch (means over ranks) {last}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        np.savez(
            os.path.join(args.out, f"rank{rank}.npz"),
            weights=np.concatenate([w.ravel() for w in model.get_weights()]),
            rates=np.array(rates.rates),
            steps_per_epoch=steps_per_epoch,
            peak_learning_rate=schedule.peak_learning_rate,
            own_val_loss=own_val_loss,
            own_val_accuracy=own_val_accuracy,
            **{f"history_{k}": np.array(v) for k, v in history.history.items()},
        )


if __name__ == "__main__":
    main()
