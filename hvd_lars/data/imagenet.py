"""ImageNet-1k (ILSVRC-2012) through tensorflow-datasets' `imagenet2012`, read from prepared records.

The records are made once, before training (`hvd-lars-prepare imagenet2012`,
`hvd_lars.data.imagenet_preparation`); every rank refuses a `data_dir` without a finished preparation,
naming that command. Training reads the record files in `records.record_stream`'s order (a resumed run
reads nothing before its step), evaluation in `records.record_sequence`'s. A record file that cannot be
read to its end gives an image named by that file, handed over as an unreadable image is.
"""

import dataclasses

import tensorflow as tf

from hvd_lars.data import encoded_images, records
from hvd_lars.data.imagenet_preparation import COMMAND, NAME, prepared_builder, tfds_module
from hvd_lars.data.interface import InputShapes
from hvd_lars.data.preprocessing import DEFAULT_IMAGE_SIZE
from hvd_lars.data.sharding import check_rank, eval_shard_range, train_shard_range

# Records shuffled together in memory on each rank (~110 KB each): the shuffle buffer of the TensorFlow
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
    """serialized record -> (file name, JPEG bytes, label int32); a `records.unreadable` element -> (its
    record file's path, b"", 0): an image no decoder accepts, which the input pipeline then names."""
    features = ds_builder.info.features
    decoders = {"image": tfds_module().decode.SkipDecoding()}  # preprocessing decodes the crop only

    def parse(serialized):
        e = features.deserialize_example(serialized, decoders=decoders)
        return e["file_name"], e["image"], tf.cast(e["label"], tf.int32)

    def parse_or_name(serialized):
        is_unreadable, filename = records.unreadable_file(serialized)
        return tf.cond(
            is_unreadable, lambda: (filename, tf.constant(b""), tf.constant(0)), lambda: parse(serialized)
        )

    return parse_or_name


def _source(ds_builder, split):
    """Finite dataset of (file name, JPEG bytes, label) of `split`, each record once."""
    instructions = ds_builder.info.splits[split].file_instructions
    return records.record_sequence(instructions).map(_parser(ds_builder), num_parallel_calls=tf.data.AUTOTUNE)


def _split_sizes(splits, max_train_examples, max_eval_examples):
    """(training, validation) records used: each split's size, capped by its `max_*_examples` when > 0."""
    num_train, num_eval = splits["train"].num_examples, splits["validation"].num_examples
    return min(num_train, max_train_examples or num_train), min(num_eval, max_eval_examples or num_eval)


def imagenet_shapes(request, options):
    """`InputShapes` of `imagenet_input(request, options)`, from the prepared data's dataset info; raises
    as `imagenet_preparation.prepared_builder`."""
    ds_builder = prepared_builder(request.data_dir)
    num_train, _ = _split_sizes(ds_builder.info.splits, request.max_train_examples, 0)
    image_size = options.image_size or DEFAULT_IMAGE_SIZE
    return InputShapes(
        input_shape=(image_size, image_size, 3),
        num_classes=ds_builder.info.features["label"].num_classes,
        num_train_examples=num_train,
    )


def imagenet_input(request, options):
    """`InputPipeline` of ILSVRC-2012 prepared in `request.data_dir` (`options`: `ImagenetOptions`):
    1,281,167 training and 50,000 validation images, 1,000 classes.

    Rank r trains on the contiguous slice `train[r * m : (r + 1) * m]`, m = n // world_size (the prepared
    records are in a shuffled order already), read in `records.record_stream`'s order, and evaluates
    `validation[a_r : b_r]`, the ranges tiling the set. `request.max_*_examples` > 0 keep the first that
    many records.

    Raises:
        imagenet_preparation.NotPrepared: (a FileNotFoundError) `data_dir` holds no finished preparation;
            the message names the command that makes one.
        ValueError: bad rank/world size; data prepared in another file format than TFRecord.
    """
    rank, world_size = request.rank, request.world_size
    check_rank(rank, world_size)
    ds_builder = prepared_builder(request.data_dir)
    file_format = str(getattr(ds_builder.info.file_format, "value", ds_builder.info.file_format))
    if file_format != "tfrecord":
        raise ValueError(
            f"{ds_builder.data_dir} holds {NAME} as {file_format!r} files; this pipeline reads the TFRecord "
            f"files tensorflow-datasets prepares by default, as {COMMAND} does: prepare it with that into "
            "another --data_dir."
        )
    splits = ds_builder.info.splits
    num_train, num_eval = _split_sizes(splits, request.max_train_examples, request.max_eval_examples)
    t_start, t_stop = train_shard_range(num_train, rank, world_size)
    e_start, e_stop = eval_shard_range(num_eval, rank, world_size)
    instructions = splits[f"train[{t_start}:{t_stop}]"].file_instructions
    parse = _parser(ds_builder)

    def stream_from(start):
        ds = records.record_stream(
            instructions,
            request.seed + rank,
            start,
            window_records=options.shuffle_buffer,
            block_records=options.block_records,
            deterministic=request.deterministic,
        )
        return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=request.deterministic)

    return encoded_images.pipeline(
        request,
        options,
        stream_from,
        _source(ds_builder, f"validation[{e_start}:{e_stop}]"),
        num_train_examples=num_train,
        num_eval_examples=num_eval,
        num_classes=ds_builder.info.features["label"].num_classes,
    )
