"""tf.data pipelines over encoded images: decode (naming or skipping corrupt files), batch.

A source is a `tf.data.Dataset` of (name: string, data: string, label: int32) for this rank's shard, where
`data` is the encoded bytes or a file path (then `read=tf.io.read_file`); a training source is the rank's
endless stream in training order, from any element on. A file that cannot be read or decoded stops the
pipeline with `tf.errors.InvalidArgumentError` naming it, or, in training with `skip_corrupt=True`, is
left out, logged and counted; evaluation never skips, so every image is counted once. Deterministic mode
keeps the element order fixed, so a stream started at element k gives the elements from k on of the one
started at 0 (exact mid-epoch resume).
"""

import dataclasses
import sys

import tensorflow as tf

from hvd_lars.data import tfdata_options
from hvd_lars.data.interface import InputPipeline
from hvd_lars.data.preprocessing import DEFAULT_IMAGE_SIZE, get_preprocessing


@dataclasses.dataclass(frozen=True)
class EncodedImageOptions:
    """The options every data set of encoded images takes (`image_folder`, `imagenet2012`).

    Attributes:
        image_size: side of the square crops in pixels (0: `DEFAULT_IMAGE_SIZE`).
        preprocessing: a name of `preprocessing.PREPROCESSINGS` ("inception" when None or "").
        skip_corrupt: leave out and count training images that cannot be decoded
            (`InputPipeline.skipped_corrupt`); False: such an image stops training, naming it.
    """

    image_size: int = DEFAULT_IMAGE_SIZE
    preprocessing: str | None = None
    skip_corrupt: bool = False


def _guarded(decode, read, image_size):
    """(name, data, label, seed) -> (image, label, name, ok): decode errors become ok=False, not failures."""

    def fn(name, data, label, seed):
        zeros = tf.zeros([image_size, image_size, 3], tf.float32)
        attempt = tf.data.Dataset.from_tensors(data).map(lambda d: (decode(read(d), seed), True))
        # ignore_errors drops the one element if reading or decoding it failed; the fallback then answers.
        attempt = attempt.ignore_errors().concatenate(tf.data.Dataset.from_tensors((zeros, False)))
        image, ok = attempt.take(1).get_single_element()
        return image, label, name, ok

    return fn


def _unreadable(on_unreadable, split):
    """(image, label, name, ok) -> (image, label): not ok raises `tf.errors.InvalidArgumentError` naming
    the file, or, with `on_unreadable`, calls `on_unreadable(path, split)` and keeps the zeros image."""

    def call(name):
        on_unreadable(name.numpy().decode(errors="replace"), split)
        return False

    def fn(image, label, name, ok):
        if on_unreadable is None:
            check = tf.debugging.Assert(ok, ["Cannot read or decode image file", name], summarize=1)
        else:
            check = tf.cond(ok, lambda: ok, lambda: tf.py_function(call, [name], tf.bool))
        with tf.control_dependencies([check]):
            return tf.identity(image), label

    return fn


def train_dataset(
    stream,
    per_rank_batch,
    seed,
    image_size,
    start=0,
    read=tf.identity,
    deterministic=True,
    threads=0,
    skipped=None,
    preprocessing=None,
    on_unreadable=None,
):
    """Endless batches (float32 (B, S, S, 3), int32 (B,)) of training views of `stream`'s elements, `stream`
    starting at element `start` of this rank's stream; an image's crop and flip derive from (seed, its
    element index). `skipped`: None (a corrupt file stops the pipeline, naming it), or a
    `skipped_counter()` that counts the corrupt files left out (each epoch they are met). `on_unreadable`:
    None, or callable(path, split: "training" or "evaluation") called with a file that cannot be read or
    decoded (and is not skipped) instead of stopping, its image then zeros.
    """
    ds = stream.enumerate(start=start).map(lambda i, e: (*e, tf.stack([tf.cast(seed, tf.int64), i])))
    views = get_preprocessing(preprocessing)
    decode = lambda data, s: views.train(data, s, image_size)
    ds = ds.map(_guarded(decode, read, image_size), num_parallel_calls=tf.data.AUTOTUNE)
    if skipped is not None:

        def count(image, label, name, ok):
            def note():
                # Inside the graph: tf.print is the one way to say it as it happens.
                tf.print("hvd_lars: skipping corrupt image file", name, output_stream=sys.stderr)
                return skipped.assign_add(1)

            tf.cond(ok, lambda: skipped.read_value(), note)
            return ok

        ds = ds.filter(count).map(lambda image, label, name, ok: (image, label))
    else:
        ds = ds.map(_unreadable(on_unreadable, "training"))
    ds = ds.batch(per_rank_batch, drop_remainder=True)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(tfdata_options.options(deterministic, threads))


def skipped_counter():
    """An int64 `tf.Variable` (0) for `train_dataset(skipped=...)`, shared by a pipeline's streams."""
    return tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_corrupt_images")


def pipeline(request, options, stream_from, eval_source, read=tf.identity, **sizes):
    """The `InputPipeline` of a data set of encoded images for `request` and `options`
    (`EncodedImageOptions`): training from `stream_from(start)` (this rank's training source from element
    `start` on), evaluation of every element of `eval_source` once, `read` turning data into encoded bytes;
    `**sizes`: num_train_examples, num_eval_examples, num_classes."""
    image_size = options.image_size or DEFAULT_IMAGE_SIZE
    skipped = skipped_counter() if options.skip_corrupt else None
    batch, seed = request.per_rank_batch, request.seed + request.rank
    views = dict(
        image_size=image_size,
        read=read,
        deterministic=request.deterministic,
        threads=request.input_threads,
        preprocessing=options.preprocessing,
        on_unreadable=request.on_unreadable,
    )

    def train_from(start_batch=0):
        start = start_batch * batch
        return train_dataset(stream_from(start), batch, seed, start=start, skipped=skipped, **views)

    # Evaluation: every source element in order, the last batch smaller, nothing skipped.
    decode = lambda data, s: get_preprocessing(options.preprocessing).eval(data, image_size)
    evaluation = eval_source.map(lambda name, data, label: (name, data, label, tf.zeros([2], tf.int64)))
    evaluation = evaluation.map(_guarded(decode, read, image_size), num_parallel_calls=tf.data.AUTOTUNE)
    evaluation = evaluation.map(_unreadable(request.on_unreadable, "evaluation"))
    evaluation = evaluation.batch(request.eval_batch or batch).prefetch(tf.data.AUTOTUNE)
    return InputPipeline(
        train=train_from(0),
        train_from=train_from,
        eval=evaluation.with_options(tfdata_options.options(request.deterministic, request.input_threads)),
        input_shape=(image_size, image_size, 3),
        skipped_corrupt=skipped,
        **sizes,
    )
