# Horovod's examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py (Apache 2.0, Uber Technologies),
# ported to Keras 3 and hvd_lars as a user would: the Horovod import becomes hvd_lars.parallel.horovod_keras,
# `tf.keras.*` becomes `keras.*`, `backend.set_value(optimizer.lr, x)` becomes `optimizer.learning_rate = x`,
# MNIST becomes the local Fashion-MNIST files, checkpoints are `.keras` files. Two flags (--epochs,
# --steps-per-epoch, defaulting to Horovod's 24 and 500) let the test run it short.
#
#   horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script ./discover.sh \
#       python examples/tensorflow2_keras_mnist_elastic.py

import argparse

import keras
import tensorflow as tf

import hvd_lars.parallel.horovod_keras as hvd
from hvd_lars.data import fashion_mnist

parser = argparse.ArgumentParser(description="Tensorflow 2.0 Keras MNIST Example")

parser.add_argument(
    "--use-mixed-precision", action="store_true", default=False, help="use mixed precision for training"
)
parser.add_argument("--epochs", type=int, default=24)
parser.add_argument("--steps-per-epoch", type=int, default=500)

args = parser.parse_args()

if args.use_mixed_precision:
    keras.mixed_precision.set_global_policy("mixed_float16")

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

model = keras.Sequential(
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
model.compile(
    loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"], jit_compile=False
)

# Horovod: initialize optimizer state so we can synchronize across workers
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def on_state_reset():
    state.model.optimizer.learning_rate = 0.001 * hvd.size()
    # Re-initialize, to join with possible new ranks
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None)


state.register_reset_callbacks([on_state_reset])

callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint("./checkpoint-{epoch}.keras"))


# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
@hvd.elastic.run
def train(state):
    state.model.fit(
        dataset,
        steps_per_epoch=args.steps_per_epoch // hvd.size(),
        epochs=args.epochs - state.epoch,
        callbacks=callbacks,
        verbose=1,
    )


train(state)
