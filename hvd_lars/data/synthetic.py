"""Synthetic data of any shape, for throughput: one fixed random batch repeated, no decoding.

Measures the training step alone (as tf_cnn_benchmarks' synthetic mode does). By default the epoch has
ImageNet-1k's sizes, so steps per epoch match a real ImageNet run with the same batch.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from hvd_lars.data import preprocessing, tfdata_options
from hvd_lars.data.interface import InputPipeline, InputShapes
from hvd_lars.data.sharding import check_rank, eval_shard_range

IMAGENET_TRAIN_EXAMPLES = 1_281_167  # ILSVRC-2012 training images (Russakovsky et al. 2015)
IMAGENET_EVAL_EXAMPLES = 50_000  # ILSVRC-2012 validation images
IMAGENET_CLASSES = 1000


def _batch(size, image_size, channels, num_classes, rng):
    images = rng.standard_normal((size, image_size, image_size, channels), dtype=np.float32)
    labels = rng.integers(0, num_classes, size=size, dtype=np.int32)
    return images, labels


@dataclasses.dataclass(frozen=True)
class SyntheticOptions:
    """The options of `synthetic`: the image side (0: `preprocessing.DEFAULT_IMAGE_SIZE`), channels,
    classes and the nominal training / evaluation sizes of an epoch (ImageNet-1k's by default)."""

    image_size: int = preprocessing.DEFAULT_IMAGE_SIZE
    channels: int = 3
    num_classes: int = IMAGENET_CLASSES
    num_train_examples: int = IMAGENET_TRAIN_EXAMPLES
    num_eval_examples: int = IMAGENET_EVAL_EXAMPLES


def _sizes(request, options):
    """(image size, training examples, evaluation examples) after the defaults and caps; checked."""
    image_size = options.image_size or preprocessing.DEFAULT_IMAGE_SIZE
    num_train = min(options.num_train_examples, request.max_train_examples or options.num_train_examples)
    num_eval = min(options.num_eval_examples, request.max_eval_examples or options.num_eval_examples)
    sizes = (image_size, options.channels, options.num_classes, num_train, num_eval, request.per_rank_batch)
    if min(sizes) <= 0:
        raise ValueError(
            f"synthetic data needs positive sizes, got image_size={image_size}, channels={options.channels}, "
            f"num_classes={options.num_classes}, examples={num_train}/{num_eval}, "
            f"per_rank_batch={request.per_rank_batch}."
        )
    return image_size, num_train, num_eval


def synthetic_shapes(request, options):
    """`InputShapes` of `synthetic_input(request, options)`, from the arguments alone (no batch is made).
    Raises ValueError for a non-positive size, as `synthetic_input`."""
    image_size, num_train, _ = _sizes(request, options)
    return InputShapes((image_size, image_size, options.channels), options.num_classes, num_train)


def synthetic_input(request, options):
    """Standard-normal float32 images (B, image_size, image_size, channels), uniform int32 labels.

    `request.max_*_examples` > 0 cap the nominal sizes; `data_dir` is not read. Evaluation covers exactly
    `num_eval_examples` images across ranks, in batches of `request.eval_batch` (0: `per_rank_batch`);
    every training batch is the same, so `train_from(k)` is the same stream for every k.

    Raises:
        ValueError: bad rank/world size, or a non-positive size.
    """
    rank, world_size = request.rank, request.world_size
    channels, classes = options.channels, options.num_classes
    check_rank(rank, world_size)
    image_size, num_train, num_eval = _sizes(request, options)
    rng = np.random.default_rng(request.seed + rank)
    # Nothing to compute per element: one thread is enough unless asked otherwise.
    opts = tfdata_options.options(request.deterministic, threads=request.input_threads or 1)
    train = tf.data.Dataset.from_tensors(_batch(request.per_rank_batch, image_size, channels, classes, rng))
    train = train.repeat().with_options(opts)
    start, stop = eval_shard_range(num_eval, rank, world_size)
    one = tf.data.Dataset.from_tensors(_batch(1, image_size, channels, classes, rng)).unbatch()
    evaluation = (
        one.repeat(stop - start).batch(request.eval_batch or request.per_rank_batch).with_options(opts)
    )
    return InputPipeline(
        train=train,
        train_from=lambda start_batch=0: train,
        eval=evaluation,
        num_train_examples=num_train,
        num_eval_examples=num_eval,
        num_classes=classes,
        input_shape=(image_size, image_size, channels),
    )
