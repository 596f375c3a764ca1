"""ImageNet-1k (ILSVRC-2012) through tensorflow-datasets' `imagenet2012`, read from prepared records.

The records are made once, before training, from the user's ILSVRC-2012 tars (`hvd-lars-prepare
imagenet2012`: `hvd_lars.data.imagenet_preparation`); training converts nothing, and every rank refuses a
`data_dir` without a finished preparation at once, naming that command. Training reads the prepared record
files in `records.record_stream`'s order, so a resumed run starts at its step without reading (let alone
decoding) the records before it; evaluation reads them in `records.record_sequence`'s order. A record file
that cannot be read to its end gives an image named by that file, which the input pipeline hands over as
it does an unreadable image (`records`, `encoded_images`).
"""

import dataclasses

import tensorflow as tf

from hvd_lars.data import encoded_images, records
from hvd_lars.data.imagenet_preparation import COMMAND, NAME, prepared_builder, tfds_module
from hvd_lars.data.interface import InputPipeline, InputShapes
from hvd_lars.data.preprocessing import DEFAULT_IMAGE_SIZE
from hvd_lars.data.sharding import check_rank, eval_shard_range, train_shard_range

# Encoded images shuffled together on each rank (~110 KB each; `records.record_stream`'s window); the
# record files are also read in a fresh order every epoch. 10,000 as the shuffle buffer of the TensorFlow
# ResNet reference.
SHUFFLE_BUFFER = 10_000


@dataclasses.dataclass(frozen=True)
class ImagenetOptions(encoded_images.EncodedImageOptions):
    """The options of `imagenet2012`: those of `encoded_images.EncodedImageOptions`, and

    Attributes:
        shuffle_buffer: records permuted together in memory (`records.record_stream`'s window).
        block_records: > 0 cuts the record files into blocks of that many records for the epoch order.
    """

    shuffle_buffer: int = SHUFFLE_BUFFER
    block_records: int = 0


def _parser(ds_builder):
    """serialized record -> (file name, JPEG bytes, label int32); an `records.unreadable` element -> (its
    record file's path, b"", 0): an image no decoder accepts, which the input pipeline then names."""
    tfds = tfds_module()
    features = ds_builder.info.features
    decoders = {"image": tfds.decode.SkipDecoding()}  # JPEG bytes: preprocessing decodes the crop only

    def parse(serialized):
        e = features.deserialize_example(serialized, decoders=decoders)
        return e["file_name"], e["image"], tf.cast(e["label"], tf.int32)

    def parse_or_name(serialized):
        is_unreadable, filename = records.unreadable_file(serialized)
        return tf.cond(
            is_unreadable, lambda: (filename, tf.constant(b""), tf.constant(0)), lambda: parse(serialized)
        )

    return parse_or_name


def _check_format(ds_builder):
    file_format = str(getattr(ds_builder.info.file_format, "value", ds_builder.info.file_format))
    if file_format != "tfrecord":
        raise ValueError(
            f"{ds_builder.data_dir} holds {NAME} as {file_format!r} files; this pipeline reads the TFRecord "
            f"files tensorflow-datasets prepares by default, as {COMMAND} does: prepare it with that into "
            "another --data_dir."
        )


def _source(ds_builder, split):
    """Finite dataset of (file name, JPEG bytes, label) of `split`, each record once
    (`records.record_sequence`)."""
    instructions = ds_builder.info.splits[split].file_instructions
    parse = _parser(ds_builder)
    return records.record_sequence(instructions).map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def _train_from(ds_builder, split, seed, deterministic, shuffle_buffer, block_records):
    """(start_record -> endless dataset of (file name, JPEG bytes, label)) over the record files of `split`
    (`records.record_stream`); records are parsed after the start is reached, never before."""
    instructions = ds_builder.info.splits[split].file_instructions
    parse = _parser(ds_builder)

    def stream(start):
        ds = records.record_stream(
            instructions,
            seed,
            start,
            window_records=shuffle_buffer,
            block_records=block_records,
            deterministic=deterministic,
        )
        return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)

    return stream


def _split_sizes(splits, max_train_examples, max_eval_examples):
    """(training, validation) records used: each split's size, capped by its `max_*_examples` when > 0."""
    num_train, num_eval = splits["train"].num_examples, splits["validation"].num_examples
    return min(num_train, max_train_examples or num_train), min(num_eval, max_eval_examples or num_eval)


def imagenet_shapes(request, options):
    """`InputShapes` of `imagenet_input(request, options)`, from the prepared data's dataset info (split
    sizes, label count): no record is read.

    Raises:
        As `imagenet_preparation.prepared_builder` (`NotPrepared`, a FileNotFoundError, naming the command
        that prepares the data).
    """
    ds_builder = prepared_builder(request.data_dir)
    num_train, _ = _split_sizes(ds_builder.info.splits, request.max_train_examples, 0)
    image_size = options.image_size or DEFAULT_IMAGE_SIZE
    return InputShapes(
        input_shape=(image_size, image_size, 3),
        num_classes=ds_builder.info.features["label"].num_classes,
        num_train_examples=num_train,
    )


def _batches_from(stream, per_rank_batch, seed, skipped, views):
    """`InputPipeline.train_from` over `stream` (start record -> records, as `_train_from` returns):
    batch k starts at record k * per_rank_batch, and nothing before it is read. `skipped` as in
    `encoded_images.train_dataset`; `views` holds its keywords image_size, deterministic, threads,
    preprocessing."""

    def train_from(start_batch=0):
        start = start_batch * per_rank_batch
        return encoded_images.train_dataset(
            stream(start), per_rank_batch=per_rank_batch, seed=seed, start=start, skipped=skipped, **views
        )

    return train_from


def imagenet_input(request, options):
    """ILSVRC-2012: 1,281,167 training and 50,000 validation images, 1,000 classes, preprocessed.

    Rank r trains on the contiguous slice `train[r * m : (r + 1) * m]`, m = n // world_size (the prepared
    records are already in a shuffled order), read in `records.record_stream`'s order: its shard files in
    a fresh order each epoch, `options.shuffle_buffer` records at a time permuted in memory
    (`options.block_records` > 0 cuts the files into smaller blocks). It evaluates
    `validation[a_r : b_r]`, the ranges tiling the set. `request.max_*_examples` > 0 keep the first that
    many records. The data must be prepared before (`imagenet_preparation.prepare`); each rank checks on
    its own, so none waits for another.

    Args:
        request: `InputRequest` (`data_dir`: where the data were prepared).
        options: `ImagenetOptions`.

    Returns:
        `InputPipeline` with images float32 (B, image_size, image_size, 3).

    Raises:
        imagenet_preparation.NotPrepared: (a FileNotFoundError) `data_dir` holds no finished preparation;
            the message names the command that makes one.
        ValueError: data prepared in another file format than TFRecord.
    """
    rank, world_size, seed, batch = request.rank, request.world_size, request.seed, request.per_rank_batch
    check_rank(rank, world_size)
    # `options.preprocessing` names the views; the default size is the module's constant.
    image_size = options.image_size or DEFAULT_IMAGE_SIZE
    ds_builder = prepared_builder(request.data_dir)
    _check_format(ds_builder)
    splits = ds_builder.info.splits
    num_train, num_eval = _split_sizes(splits, request.max_train_examples, request.max_eval_examples)
    t_start, t_stop = train_shard_range(num_train, rank, world_size)
    e_start, e_stop = eval_shard_range(num_eval, rank, world_size)
    stream = _train_from(
        ds_builder,
        f"train[{t_start}:{t_stop}]",
        seed + rank,
        request.deterministic,
        options.shuffle_buffer,
        options.block_records,
    )
    skipped = encoded_images.skipped_counter() if options.skip_corrupt else None
    # What the training and the evaluation views share.
    views = dict(
        image_size=image_size,
        deterministic=request.deterministic,
        threads=request.input_threads,
        preprocessing=options.preprocessing,
        on_unreadable=request.on_unreadable,
    )
    train_from = _batches_from(stream, batch, seed + rank, skipped, views)
    evaluation = encoded_images.eval_dataset(
        _source(ds_builder, f"validation[{e_start}:{e_stop}]"),
        batch=request.eval_batch or batch,
        **views,
    )
    return InputPipeline(
        train=train_from(0),
        train_from=train_from,
        eval=evaluation,
        num_train_examples=num_train,
        num_eval_examples=num_eval,
        num_classes=ds_builder.info.features["label"].num_classes,
        input_shape=(image_size, image_size, 3),
        skipped_corrupt=skipped,
    )
