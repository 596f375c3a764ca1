"""Fashion-MNIST in memory (`fashion_mnist_files`): 60,000 training and 10,000 test images (28x28x1, 10
classes), standardised, no augmentation (as Xiao et al. 2017's benchmarks), a validation split held out
of the training images on request, each rank's shard in a fresh order every epoch."""

import dataclasses

import tensorflow as tf

from hvd_lars.data import fashion_mnist_files as files
from hvd_lars.data import order, tfdata_options
from hvd_lars.data.interface import InputPipeline, InputShapes
from hvd_lars.data.sharding import eval_shard_range, train_shard_indices

# Images per evaluation batch when the request gives none: 10 batches for the test set.
EVAL_BATCH = 1000


@dataclasses.dataclass(frozen=True)
class FashionMnistOptions:
    """The options of `fashion_mnist`.

    Attributes:
        validation_examples: N > 0 holds out the last N of the 60,000 training images as a validation
            split (never trained on, evaluated like the test set); 0: none.
    """

    validation_examples: int = 0


def _normalize(x):
    return (tf.cast(x, tf.float32) / 255.0 - files.MEAN) / files.STD


def fashion_mnist_input(request, options):
    """Fashion-MNIST from the Debian package (`request.data_dir`: the folder of the four IDX files; None:
    Debian's), this rank's shard.

    With `options.validation_examples` = N > 0 the last N of the 60,000 training images are the
    validation split (`InputPipeline.validation`). `request.max_train_examples` / `max_eval_examples` > 0
    keep only the first that many training images and images of each evaluation split. Pixels are
    scaled to [0, 1] and standardised with the training set's mean and std (`fashion_mnist_files.MEAN` /
    `STD`). Evaluation batches hold `request.eval_batch` images (0: `EVAL_BATCH`).

    Raises:
        ValueError: `validation_examples` outside [0, 60,000); bad rank/world size.
        FileNotFoundError / OSError: as `fashion_mnist_files.load`.
    """
    x_train, y_train = files.load("train", request.data_dir)
    x_test, y_test = files.load("test", request.data_dir)
    _check_validation_examples(options.validation_examples, len(x_train))
    split = len(x_train) - options.validation_examples
    keep, keep_eval = request.max_train_examples or None, request.max_eval_examples or None  # None: all
    x_val, y_val = x_train[split:][:keep_eval], y_train[split:][:keep_eval]
    x_train, y_train = x_train[:split][:keep], y_train[:split][:keep]
    x_test, y_test = x_test[:keep_eval], y_test[:keep_eval]
    rank, world_size, batch = request.rank, request.world_size, request.per_rank_batch
    opts = tfdata_options.options(request.deterministic, request.input_threads)

    def evaluation(images, labels):
        start, stop = eval_shard_range(len(images), rank, world_size)
        ds = tf.data.Dataset.from_tensor_slices((images[start:stop], labels[start:stop]))
        ds = ds.batch(request.eval_batch or EVAL_BATCH, num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.map(lambda x, y: (_normalize(x), y), num_parallel_calls=tf.data.AUTOTUNE)
        return ds.prefetch(tf.data.AUTOTUNE).with_options(opts)

    shard = train_shard_indices(len(x_train), rank, world_size)
    images, labels = tf.constant(x_train[shard]), tf.constant(y_train[shard])

    def train_from(start_batch=0):
        # A fresh permutation of the shard each epoch, gathered per batch from the arrays.
        ds = order.index_stream(len(shard), request.seed + rank, start=start_batch * batch)
        ds = ds.batch(batch, drop_remainder=True).map(
            lambda i: (_normalize(tf.gather(images, i)), tf.gather(labels, i)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        return ds.prefetch(tf.data.AUTOTUNE).with_options(opts)

    return InputPipeline(
        train=train_from(0),
        train_from=train_from,
        eval=evaluation(x_test, y_test),
        num_train_examples=len(x_train),
        num_eval_examples=len(x_test),
        num_classes=files.NUM_CLASSES,
        input_shape=files.IMAGE_SHAPE,
        validation=evaluation(x_val, y_val) if len(x_val) else None,
        num_validation_examples=len(x_val),
    )


def _check_validation_examples(validation_examples, num_train):
    if not 0 <= validation_examples < num_train:
        raise ValueError(
            f"validation_examples={validation_examples} (--validation_examples): Fashion-MNIST holds out "
            f"the last N of its {num_train} training images, so N must be in [0, {num_train - 1}] "
            "(e.g. 5000; 0: none)."
        )


def fashion_mnist_shapes(request, options):
    """`InputShapes` of `fashion_mnist_input(request, options)`, from the IDX headers of the training files
    (`fashion_mnist_files.count`): no image is decoded. Raises as `fashion_mnist_input`."""
    num_train = files.count("train", request.data_dir)
    _check_validation_examples(options.validation_examples, num_train)
    num_train -= options.validation_examples
    return InputShapes(
        input_shape=files.IMAGE_SHAPE,
        num_classes=files.NUM_CLASSES,
        num_train_examples=min(num_train, request.max_train_examples or num_train),
    )
