"""tf.data pipelines over encoded images: shuffle, decode (naming or skipping corrupt files), batch.

A source is a `tf.data.Dataset` of (name: string, data: string, label: int32) for this rank's shard, where
`data` is either the encoded bytes or a file path (then `read=tf.io.read_file`); a training source is the
rank's endless stream in training order (`order.index_stream` and the builders make it), from any
element on: nothing is read or decoded before the first element it yields. A file that cannot be
read or decoded stops the pipeline with `tf.errors.InvalidArgumentError` whose message names it, or, in
training with `skip_corrupt=True`, is left out, logged and counted in `InputPipeline.skipped_corrupt`.
Evaluation never skips: every evaluation image must be counted exactly once.

Deterministic mode (the default) keeps the element order fixed, so a pipeline started at element k gives
exactly the elements from k on of the one started at 0 (tests, exact mid-epoch resume); otherwise elements
may leave the parallel decode out of order, so one slow file does not hold up the rest. Either way the
work runs on a private pool of `threads` threads (`tfdata_options.options`).
"""

import dataclasses
import sys

import tensorflow as tf

from hvd_lars.data import tfdata_options
from hvd_lars.data.preprocessing import DEFAULT_IMAGE_SIZE, get_preprocessing


@dataclasses.dataclass(frozen=True)
class EncodedImageOptions:
    """The options every data set of encoded images takes (`image_folder`, `imagenet2012`, whose options
    add their own to these).

    Attributes:
        image_size: side of the square crops in pixels (0: `DEFAULT_IMAGE_SIZE`).
        preprocessing: the training and evaluation views (`preprocessing.PREPROCESSINGS`: "inception" when
            None or "", "caffe" or "caffe_scaled" for the AlexNets as the paper's Caffe data layer fed them).
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
    """(image, label, name, ok) -> (image, label): a file that could not be read or decoded (ok False)
    raises `tf.errors.InvalidArgumentError` naming it, or, with `on_unreadable`, is passed to
    `on_unreadable(path, split)` and its image stays zeros."""

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
    """Endless batches (float32 (B, S, S, 3), int32 (B,)) of training views of `stream`'s elements.

    Args:
        stream: endless source in training order (see module docstring), starting at element `start` of
            this rank's stream: batch j of the result holds elements start + j*B ... of that stream.
        seed: int; every image's crop and flip derive from (seed, its element index in the stream), so a
            stream started at `start` gives the views the stream started at 0 gives there.
        start: int >= 0, the stream index of `stream`'s first element.
        skipped: None (a corrupt file stops the pipeline), or a `skipped_counter()` variable: corrupt
            files are then left out and counted in it (the same file again each epoch it is met).
            Skipped files shift later elements to earlier batches, so a resumed stream matches the
            uninterrupted one only up to the corrupt files met before the resume point.
        preprocessing: a name of `preprocessing.PREPROCESSINGS` ("inception" when None or "").
        on_unreadable: None (a file that cannot be read or decoded, and is not skipped, stops the pipeline
            with `tf.errors.InvalidArgumentError` naming it), or callable(path: str, split: "training" or
            "evaluation") called with it instead, its image then zeros: for a training loop that stops
            every rank at the same update (`InputRequest.on_unreadable`).
    """
    # Element i of the endless stream gets seed (seed, i): a fresh crop every epoch, repeatable runs.
    ds = stream.enumerate(start=start).map(lambda i, e: (*e, tf.stack([tf.cast(seed, tf.int64), i])))
    views = get_preprocessing(preprocessing)
    decode = lambda data, s: views.train(data, s, image_size)
    ds = ds.map(_guarded(decode, read, image_size), num_parallel_calls=tf.data.AUTOTUNE)
    if skipped is not None:

        def count(image, label, name, ok):
            def note():
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
    """An int64 `tf.Variable` (0) for `train_dataset(skipped=...)`: one per pipeline, shared by all the
    streams it starts, so the count survives a restart of the stream."""
    return tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_corrupt_images")


def eval_dataset(
    source,
    batch,
    image_size,
    read=tf.identity,
    deterministic=True,
    threads=0,
    preprocessing=None,
    on_unreadable=None,
):
    """Finite batches (float32 (B, S, S, 3), int32 (B,)) of evaluation views of every source element,
    in order, the last batch smaller. A corrupt file raises an error naming it (or goes to
    `on_unreadable`). `preprocessing` and `on_unreadable` as in `train_dataset`."""
    ds = source.map(lambda name, data, label: (name, data, label, tf.zeros([2], tf.int64)))
    views = get_preprocessing(preprocessing)
    decode = lambda data, s: views.eval(data, image_size)
    ds = ds.map(_guarded(decode, read, image_size), num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.map(_unreadable(on_unreadable, "evaluation")).batch(batch)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(tfdata_options.options(deterministic, threads))
