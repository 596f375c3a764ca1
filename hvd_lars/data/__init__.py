"""Input pipelines, sharded per rank. `DATASETS` maps a `--dataset` name to its builder.

Every builder takes the common keywords `per_rank_batch, rank, world_size, seed, data_dir,
max_train_examples, max_eval_examples, deterministic` plus its own (`image_size`, `preprocessing`,
`skip_corrupt`, `validation_examples`, `index_dir`, ...), and returns an `InputPipeline`
whose training stream can start at any batch (`InputPipeline.train_from`) without reading the ones before.
`describe_input` takes the same arguments and says what the model and the plan need (`InputShapes`: the
image shape, the classes, the training examples) without building the input.
"""

import inspect

import numpy as np
import tensorflow as tf

from hvd_lars.data import fashion_mnist, order, pipeline
from hvd_lars.data.image_folder import image_folder_input, image_folder_shapes
from hvd_lars.data.imagenet import imagenet_input, imagenet_shapes
from hvd_lars.data.input_pipeline import InputPipeline, InputShapes
from hvd_lars.data.sharding import eval_shard_range, train_shard_indices
from hvd_lars.data.synthetic import synthetic_input, synthetic_shapes


def _in_memory(images, labels, normalize, shard, batch, deterministic=True, threads=0):
    """Finite batches of `images[shard]` in order, the last smaller (evaluation)."""
    ds = tf.data.Dataset.from_tensor_slices((images[shard], labels[shard]))
    ds = ds.batch(batch, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.map(lambda x, y: (normalize(x), y), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(pipeline.options(deterministic, threads))


def _in_memory_train(images, labels, normalize, batch, seed, deterministic=True, threads=0):
    """`train_from` of this rank's shard (`images`, `labels`): endless batches, a fresh permutation each
    epoch (`order.index_stream`), gathered per batch from the arrays."""
    images, labels = tf.constant(images), tf.constant(labels)

    def train_from(start_batch=0):
        ds = order.index_stream(len(labels), seed, start=start_batch * batch)
        ds = ds.batch(batch, drop_remainder=True)
        ds = ds.map(
            lambda i: (normalize(tf.gather(images, i)), tf.gather(labels, i)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        return ds.prefetch(tf.data.AUTOTUNE).with_options(pipeline.options(deterministic, threads))

    return train_from


def fashion_mnist_input(
    per_rank_batch,
    rank,
    world_size,
    seed,
    data_dir=None,
    max_train_examples=0,
    max_eval_examples=0,
    eval_batch=1000,
    deterministic=True,
    input_threads=0,
    validation_examples=0,
):
    """Fashion-MNIST from the Debian package: 60,000 training, 10,000 test images (28x28x1, 10 classes).

    `validation_examples` = N > 0 holds out the last N of the 60,000 training images as a validation
    split: never trained on, evaluated like the test set (`InputPipeline.validation`); training uses the
    first 60,000 - N. `max_train_examples` / `max_eval_examples` > 0 then keep only the first that many
    training images and the first that many images of each evaluation split (smoke tests).
    Pixels are scaled to [0, 1] and standardised with the mean and std of all 60,000 training images
    (fixed constants, `fashion_mnist.MEAN` / `STD`; no label information).

    Raises:
        ValueError: `validation_examples` outside [0, 60,000).
    """
    x_train, y_train = fashion_mnist.load("train", data_dir)
    x_test, y_test = fashion_mnist.load("test", data_dir)
    _check_validation_examples(validation_examples, len(x_train))
    split = len(x_train) - validation_examples
    x_val, y_val = x_train[split:], y_train[split:]
    x_train, y_train = x_train[:split], y_train[:split]
    if max_train_examples:
        x_train, y_train = x_train[:max_train_examples], y_train[:max_train_examples]
    if max_eval_examples:
        x_test, y_test = x_test[:max_eval_examples], y_test[:max_eval_examples]
        x_val, y_val = x_val[:max_eval_examples], y_val[:max_eval_examples]

    def normalize(x):
        return (tf.cast(x, tf.float32) / 255.0 - fashion_mnist.MEAN) / fashion_mnist.STD

    def evaluation(images, labels):
        start, stop = eval_shard_range(len(images), rank, world_size)
        shard = np.arange(start, stop)
        return _in_memory(images, labels, normalize, shard, eval_batch, deterministic, input_threads)

    shard = train_shard_indices(len(x_train), rank, world_size)
    train_from = _in_memory_train(
        x_train[shard], y_train[shard], normalize, per_rank_batch, seed + rank, deterministic, input_threads
    )
    return InputPipeline(
        train=train_from(0),
        train_from=train_from,
        eval=evaluation(x_test, y_test),
        num_train_examples=len(x_train),
        num_eval_examples=len(x_test),
        num_classes=fashion_mnist.NUM_CLASSES,
        input_shape=fashion_mnist.IMAGE_SHAPE,
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


def fashion_mnist_shapes(data_dir=None, max_train_examples=0, validation_examples=0):
    """`InputShapes` of `fashion_mnist_input` with these arguments, from the IDX headers of the training
    files (`fashion_mnist.count`): no image is decoded.

    Raises:
        As `fashion_mnist_input`.
    """
    num_train = fashion_mnist.count("train", data_dir)
    _check_validation_examples(validation_examples, num_train)
    num_train -= validation_examples
    return InputShapes(
        input_shape=fashion_mnist.IMAGE_SHAPE,
        num_classes=fashion_mnist.NUM_CLASSES,
        num_train_examples=min(num_train, max_train_examples or num_train),
    )


DATASETS = {
    "fashion_mnist": fashion_mnist_input,
    "imagenet2012": imagenet_input,
    "image_folder": image_folder_input,
    "synthetic": synthetic_input,
}

# What describes each input without building it (describe_input); each takes a subset of its builder's
# keywords.
SHAPES = {
    "fashion_mnist": fashion_mnist_shapes,
    "imagenet2012": imagenet_shapes,
    "image_folder": image_folder_shapes,
    "synthetic": synthetic_shapes,
}

# Keywords that only save work (see get_input).
HINTS = ("index_dir",)


def get_input(name, **kwargs):
    """Builds the input pipeline `name` (a key of `DATASETS`) with the builder's keyword arguments.

    Keywords the builder does not take are dropped when unset (None, 0, "", False), so one call can
    pass every dataset flag; a set value the builder cannot use is an error, not silently ignored.
    `HINTS` (where a builder may keep files that only save work, such as `index_dir`) are dropped
    whatever their value when the builder does not take them: they never change the data.

    Raises:
        ValueError: unknown name (listing the valid ones), or a set keyword the dataset does not take.
    """
    arguments = _arguments(name, kwargs)  # first: an unknown name is refused by name
    return DATASETS[name](**arguments)


def describe_input(name, **kwargs):
    """`InputShapes` (image shape, classes, training examples) of the input `get_input(name, **kwargs)`
    would build, without building it: nothing is allocated at the batch size, no image is decoded.

    - synthetic: from the arguments alone;
    - fashion_mnist: from the IDX headers of the training files;
    - image_folder: from the training split's listing index in `index_dir` while it is valid
      (`listing.listed`: a `stat` per folder), else from a listing of `data_dir/train`, saved there
      for the run's later starts (the validation split, which the shapes do not need, is left unread);
    - imagenet2012: from the prepared data's dataset info (data that are not prepared are refused, as
      `get_input` refuses them: `imagenet_preparation.NotPrepared`, naming the command that prepares).
    In a job, one process describes and shares the result (`hvd_lars.training.elastic`), so a listing
    is made once.

    Raises:
        ValueError: as `get_input` for the arguments; otherwise what the builder raises for the files
            the description reads (missing data, an unreadable header or listing).
    """
    arguments = _arguments(name, kwargs)
    accepted = inspect.signature(SHAPES[name]).parameters
    return SHAPES[name](**{k: v for k, v in arguments.items() if k in accepted})


def _arguments(name, kwargs):
    """The keywords of `kwargs` that builder `name` takes (get_input's rules).

    Raises:
        ValueError: unknown name, or a set keyword the dataset does not take.
    """
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; valid names: {', '.join(sorted(DATASETS))}.")
    accepted = set(inspect.signature(DATASETS[name]).parameters)
    unused = {k: v for k, v in kwargs.items() if k not in accepted and k not in HINTS}
    wrong = {k: v for k, v in unused.items() if v not in (None, 0, "", False)}
    if wrong:
        raise ValueError(
            f"Dataset {name!r} does not take {', '.join(f'{k}={v!r}' for k, v in sorted(wrong.items()))}; "
            f"it takes {', '.join(sorted(accepted))}."
        )
    return {k: v for k, v in kwargs.items() if k in accepted}
