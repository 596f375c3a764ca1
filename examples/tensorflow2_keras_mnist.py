# Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py (Apache 2.0, Uber Technologies), ported to Keras 3
# and hvd_lars as a user would: the Horovod import becomes hvd_lars.parallel.horovod_keras, `tf.keras.*`
# becomes `keras.*`, MNIST becomes the local Fashion-MNIST files, checkpoints are `.keras` files. Two flags
# (--epochs, --steps-per-epoch, defaulting to Horovod's 24 and 500) let the test run it short. The README
# shows the diff.
#
#   horovodrun -np 2 -H localhost:2 python examples/tensorflow2_keras_mnist.py

import argparse

import keras
import tensorflow as tf

import hvd_lars.parallel.horovod_keras as hvd
from hvd_lars.data import fashion_mnist


def train(epochs=24, steps_per_epoch=500):
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    (mnist_images, mnist_labels) = fashion_mnist.load("train")

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images / 255.0, tf.float32), tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = keras.Sequential(
        [
            keras.layers.Conv2D(32, [3, 3], activation="relu"),
            keras.layers.Conv2D(64, [3, 3], activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Dropout(0.25),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = keras.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    # Keras 3 has no `experimental_run_tf_function`; Horovod's ops must stay out of XLA.
    mnist_model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(),
        optimizer=opt,
        metrics=["accuracy"],
        jit_compile=False,
    )

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        #
        # Note: This callback must be in the list before the ReduceLROnPlateau,
        # TensorBoard or other metrics-based callbacks.
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint("./checkpoint-{epoch}.keras"))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    mnist_model.fit(
        dataset,
        steps_per_epoch=steps_per_epoch // hvd.size(),
        callbacks=callbacks,
        epochs=epochs,
        verbose=verbose,
    )

    # Return the model
    return mnist_model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Tensorflow 2.0 Keras MNIST Example")
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--steps-per-epoch", type=int, default=500)
    args = parser.parse_args()
    train(args.epochs, args.steps_per_epoch)
