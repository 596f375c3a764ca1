"""Synthetic data of any shape, for throughput: one fixed random batch repeated, no decoding.

Measures the training step alone (as tf_cnn_benchmarks' synthetic mode does); `train_from(k)` is the same
stream for every k. By default the epoch has
ImageNet-1k's sizes, so steps per epoch match a real ImageNet run with the same batch.
"""

import numpy as np
import tensorflow as tf

from hvd_lars.data import pipeline, preprocessing
from hvd_lars.data.input_pipeline import InputPipeline, InputShapes
from hvd_lars.data.sharding import check_rank, eval_shard_range

IMAGENET_TRAIN_EXAMPLES = 1_281_167  # ILSVRC-2012 training images (Russakovsky et al. 2015)
IMAGENET_EVAL_EXAMPLES = 50_000  # ILSVRC-2012 validation images
IMAGENET_CLASSES = 1000


def _batch(size, image_size, channels, num_classes, rng):
    images = rng.standard_normal((size, image_size, image_size, channels), dtype=np.float32)
    labels = rng.integers(0, num_classes, size=size, dtype=np.int32)
    return images, labels


def _sizes(
    per_rank_batch,
    max_train_examples,
    max_eval_examples,
    image_size,
    channels,
    num_classes,
    num_train_examples,
    num_eval_examples,
):
    """(image size, training examples, evaluation examples) after the defaults and caps; checked."""
    image_size = image_size or preprocessing.DEFAULT_IMAGE_SIZE
    num_train = min(num_train_examples, max_train_examples or num_train_examples)
    num_eval = min(num_eval_examples, max_eval_examples or num_eval_examples)
    if min(image_size, channels, num_classes, num_train, num_eval, per_rank_batch) <= 0:
        raise ValueError(
            f"synthetic data needs positive sizes, got image_size={image_size}, channels={channels}, "
            f"num_classes={num_classes}, examples={num_train}/{num_eval}, per_rank_batch={per_rank_batch}."
        )
    return image_size, num_train, num_eval


def synthetic_shapes(
    per_rank_batch,
    max_train_examples=0,
    max_eval_examples=0,
    image_size=preprocessing.DEFAULT_IMAGE_SIZE,
    channels=3,
    num_classes=IMAGENET_CLASSES,
    num_train_examples=IMAGENET_TRAIN_EXAMPLES,
    num_eval_examples=IMAGENET_EVAL_EXAMPLES,
):
    """`InputShapes` of `synthetic_input` with these arguments, from the arguments alone: no batch is
    made (a global batch of 32,768 at 224x224 would be 19.7 GB of float32).

    Raises:
        ValueError: a non-positive size, as `synthetic_input`.
    """
    image_size, num_train, _ = _sizes(
        per_rank_batch,
        max_train_examples,
        max_eval_examples,
        image_size,
        channels,
        num_classes,
        num_train_examples,
        num_eval_examples,
    )
    return InputShapes((image_size, image_size, channels), num_classes, num_train)


def synthetic_input(
    per_rank_batch,
    rank,
    world_size,
    seed,
    data_dir=None,
    max_train_examples=0,
    max_eval_examples=0,
    image_size=preprocessing.DEFAULT_IMAGE_SIZE,
    channels=3,
    num_classes=IMAGENET_CLASSES,
    num_train_examples=IMAGENET_TRAIN_EXAMPLES,
    num_eval_examples=IMAGENET_EVAL_EXAMPLES,
    deterministic=True,
    eval_batch=0,
    input_threads=0,
):
    """Standard-normal float32 images (B, image_size, image_size, channels), uniform int32 labels.

    `max_*_examples` > 0 cap the nominal sizes. Evaluation covers exactly `num_eval_examples` images
    across ranks (contiguous ranges, as for real data), so `ExactEvaluation`'s count check holds.

    Raises:
        ValueError: bad rank/world size, or a non-positive size.
    """
    check_rank(rank, world_size)
    image_size, num_train, num_eval = _sizes(
        per_rank_batch,
        max_train_examples,
        max_eval_examples,
        image_size,
        channels,
        num_classes,
        num_train_examples,
        num_eval_examples,
    )
    rng = np.random.default_rng(seed + rank)
    # Nothing to compute per element: one thread is enough unless asked otherwise.
    opts = pipeline.options(deterministic, threads=input_threads or 1)
    train = tf.data.Dataset.from_tensors(_batch(per_rank_batch, image_size, channels, num_classes, rng))
    train = train.repeat().with_options(opts)
    start, stop = eval_shard_range(num_eval, rank, world_size)
    eval_batch = eval_batch or per_rank_batch
    one = tf.data.Dataset.from_tensors(_batch(1, image_size, channels, num_classes, rng)).unbatch()
    evaluation = one.repeat(stop - start).batch(eval_batch).with_options(opts)
    return InputPipeline(
        train=train,
        # Every batch is the same one: the stream is where a resumed run left it at any batch.
        train_from=lambda start_batch=0: train,
        eval=evaluation,
        num_train_examples=num_train,
        num_eval_examples=num_eval,
        num_classes=num_classes,
        input_shape=(image_size, image_size, channels),
    )
