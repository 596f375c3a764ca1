"""ImageNet-1k (ILSVRC-2012) through tensorflow-datasets' `imagenet2012`, prepared from the user's tars.

ImageNet cannot be downloaded automatically: the user puts `ILSVRC2012_img_train.tar` and
`ILSVRC2012_img_val.tar` (from image-net.org) in a manual folder; the first run converts them to TFRecord
shards under `data_dir/imagenet2012/<version>/` (hours on the full set, once) and later runs reuse them.
Nothing is ever downloaded: the builder only reads `manual_dir`, and GCS lookups stay off. The
preparation converts ImageNet's CMYK JPEGs and its PNG-as-JPEG to plain RGB JPEGs. Training reads the
prepared record files in `records.record_stream`'s order, so a resumed run starts at its step without
reading (let alone decoding) the records before it.
"""

import os
import tarfile

import tensorflow as tf

from hvd_lars.data import pipeline, records
from hvd_lars.data.input_pipeline import InputPipeline, InputShapes
from hvd_lars.data.preprocessing import DEFAULT_IMAGE_SIZE
from hvd_lars.data.sharding import check_rank, eval_shard_range, train_shard_range
from hvd_lars.parallel import collectives

NAME = "imagenet2012"
MANUAL_FILES = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")
# Encoded images shuffled together on each rank (~110 KB each; `records.record_stream`'s window); the
# record files are also read in a fresh order every epoch. 10,000 as the shuffle buffer of the TensorFlow
# ResNet reference.
SHUFFLE_BUFFER = 10_000
# ILSVRC-2012 validation file names: ILSVRC2012_val_00000001.JPEG ... ILSVRC2012_val_00050000.JPEG.
VALIDATION_NAME = "ILSVRC2012_val_{:08d}.JPEG"


def _tfds():
    """The `tensorflow_datasets` module, or an ImportError saying how to install it."""
    try:
        import tensorflow_datasets as tfds  # optional extra: hvd_lars.data must import without it
    except ImportError as e:
        raise ImportError(
            f"--dataset=imagenet2012 needs tensorflow-datasets ({e}); install the extra: "
            "pip install 'hvd_lars[imagenet]' (or pip install -r requirements.txt)."
        ) from e
    return tfds


def validation_labels_path():
    """The validation label file tensorflow-datasets' builder reads (one synset per line, line i labelling
    `ILSVRC2012_val_<i>.JPEG`; 50,000 lines)."""
    tfds = _tfds()
    from tensorflow_datasets.datasets.imagenet2012 import imagenet_common  # optional extra, as in _tfds

    return os.fspath(tfds.core.tfds_path(imagenet_common._VALIDATION_LABELS_FNAME))


def check_validation_tar(val_tar, labels_path=None):
    """Refuses a validation tar that does not hold exactly the images the label file covers.

    tensorflow-datasets' `imagenet2012` builder labels the validation images by position: it zips the
    *sorted names in the tar* with the lines of its label file (`imagenet_common.get_validation_labels`),
    so a tar missing `ILSVRC2012_val_00000001.JPEG` would give every later image its predecessor's label
    (and a stray extra entry would shift the rest). This check runs before any preparation.

    Args:
        val_tar: path of `ILSVRC2012_img_val.tar`.
        labels_path: the label file (default `validation_labels_path()`); N lines cover the names
            `VALIDATION_NAME.format(i)` for i in 1..N.

    Raises:
        ValueError: names missing from the tar or extra in it, with their counts and the first few.
    """
    labels_path = labels_path or validation_labels_path()
    with open(labels_path) as f:
        count = len(f.read().strip().splitlines())
    expected = {VALIDATION_NAME.format(i) for i in range(1, count + 1)}
    with tarfile.open(val_tar, "r:") as tar:
        names = set(tar.getnames())  # every entry, folders included, as the builder sorts them
    missing, extra = sorted(expected - names), sorted(names - expected)
    if missing or extra:

        def some(items):
            shown = ", ".join(items[:5])
            return f"{len(items):,} ({shown}{', ...' if len(items) > 5 else ''})" if items else "none"

        raise ValueError(
            f"{val_tar} does not hold exactly the {count:,} validation images the label file {labels_path} "
            f"covers ({VALIDATION_NAME.format(1)} to {VALIDATION_NAME.format(count)}): missing "
            f"{some(missing)}; extra {some(extra)}. tensorflow-datasets labels them by position in the "
            "sorted list, so any other set would be labelled wrongly. Use the complete "
            "ILSVRC2012_img_val.tar (50,000 JPEGs) from https://image-net.org."
        )


def builder(data_dir=None, manual_dir=None, prepare=True):
    """The `imagenet2012` builder over `data_dir`, prepared from `manual_dir` if not yet prepared.

    Raises:
        FileNotFoundError: not prepared, and `manual_dir` lacks the two ILSVRC-2012 tars.
        ValueError: the validation tar does not hold exactly the labelled images (`check_validation_tar`).
    """
    tfds = _tfds()
    ds_builder = tfds.builder(NAME, data_dir=data_dir or None)
    if ds_builder.is_prepared() or not prepare:
        return ds_builder
    missing = [f for f in MANUAL_FILES if not manual_dir or not os.path.exists(os.path.join(manual_dir, f))]
    if missing:
        raise FileNotFoundError(
            f"ImageNet is not prepared under {ds_builder.data_dir} and --manual_dir={manual_dir!r} lacks "
            f"{', '.join(missing)}. Download both ILSVRC-2012 tars from https://image-net.org (registration "
            "needed), put them in one folder and pass --manual_dir=<that folder>; the first run converts "
            "them (once) and later runs reuse --data_dir."
        )
    check_validation_tar(os.path.join(manual_dir, MANUAL_FILES[1]))
    config = tfds.download.DownloadConfig(
        manual_dir=manual_dir,
        # Statistics are only for the catalogue; computing them reads the whole set again.
        compute_stats=tfds.download.ComputeStatsMode.SKIP,
    )
    ds_builder.download_and_prepare(download_config=config)
    return ds_builder


def _source(ds_builder, split, shuffle_files, seed):
    tfds = _tfds()
    read_config = tfds.ReadConfig(shuffle_seed=seed, try_autocache=False, skip_prefetch=True)
    ds = ds_builder.as_dataset(
        split=split,
        shuffle_files=shuffle_files,
        read_config=read_config,
        # Keep the JPEG bytes: preprocessing decodes only the crop window.
        decoders={"image": tfds.decode.SkipDecoding()},
    )
    return ds.map(lambda e: (e["file_name"], e["image"], tf.cast(e["label"], tf.int32)))


def _train_from(ds_builder, split, seed, deterministic, shuffle_buffer, block_records):
    """(start_record -> endless dataset of (file name, JPEG bytes, label)) over the record files of `split`
    (`records.record_stream`); records are parsed after the start is reached, never before."""
    tfds = _tfds()
    file_format = str(getattr(ds_builder.info.file_format, "value", ds_builder.info.file_format))
    if file_format != "tfrecord":
        raise ValueError(
            f"{ds_builder.data_dir} holds {NAME} as {file_format!r} files; this pipeline reads the TFRecord "
            "files tensorflow-datasets prepares by default. Prepare it again with the default file format."
        )
    instructions = ds_builder.info.splits[split].file_instructions
    features = ds_builder.info.features
    decoders = {"image": tfds.decode.SkipDecoding()}  # JPEG bytes: preprocessing decodes the crop only

    def parse(serialized):
        e = features.deserialize_example(serialized, decoders=decoders)
        return e["file_name"], e["image"], tf.cast(e["label"], tf.int32)

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


def _prepared_builder(data_dir, manual_dir, rank, world_size):
    """`builder` on every rank: rank 0 prepares the data if needed, the others wait for it in a barrier."""
    ds_builder = builder(data_dir, manual_dir, prepare=rank == 0)
    if world_size > 1:
        collectives.barrier()  # ranks > 0 wait for rank 0's preparation
        ds_builder = builder(data_dir, manual_dir, prepare=False)
    return ds_builder


def _split_sizes(splits, max_train_examples, max_eval_examples):
    """(training, validation) records used: each split's size, capped by its `max_*_examples` when > 0."""
    num_train, num_eval = splits["train"].num_examples, splits["validation"].num_examples
    return min(num_train, max_train_examples or num_train), min(num_eval, max_eval_examples or num_eval)


def imagenet_shapes(data_dir=None, max_train_examples=0, image_size=DEFAULT_IMAGE_SIZE, manual_dir=None):
    """`InputShapes` of `imagenet_input` with these arguments, from the prepared data's dataset info (split
    sizes, label count): no record is read. Unprepared data are prepared first from `manual_dir`, as
    rank 0 of `imagenet_input` does; describe in one process of a job only.

    Raises:
        As `builder`.
    """
    ds_builder = builder(data_dir, manual_dir)
    num_train, _ = _split_sizes(ds_builder.info.splits, max_train_examples, 0)
    image_size = image_size or DEFAULT_IMAGE_SIZE
    return InputShapes(
        input_shape=(image_size, image_size, 3),
        num_classes=ds_builder.info.features["label"].num_classes,
        num_train_examples=num_train,
    )


def _batches_from(stream, per_rank_batch, seed, skipped, views):
    """`InputPipeline.train_from` over `stream` (start record -> records, as `_train_from` returns):
    batch k starts at record k * per_rank_batch, and nothing before it is read. `skipped` as in
    `pipeline.train_dataset`; `views` holds its keywords image_size, deterministic, threads, preprocessing."""

    def train_from(start_batch=0):
        start = start_batch * per_rank_batch
        return pipeline.train_dataset(
            stream(start), per_rank_batch=per_rank_batch, seed=seed, start=start, skipped=skipped, **views
        )

    return train_from


def imagenet_input(
    per_rank_batch,
    rank,
    world_size,
    seed,
    data_dir=None,
    max_train_examples=0,
    max_eval_examples=0,
    image_size=DEFAULT_IMAGE_SIZE,
    manual_dir=None,
    deterministic=True,
    skip_corrupt=False,
    eval_batch=0,
    input_threads=0,
    preprocessing=None,
    shuffle_buffer=SHUFFLE_BUFFER,
    block_records=0,
):
    """ILSVRC-2012: 1,281,167 training and 50,000 validation images, 1,000 classes, preprocessed.

    Rank r trains on the contiguous slice `train[r * m : (r + 1) * m]`, m = n // world_size (the prepared
    records are already in a shuffled order), read in `records.record_stream`'s order: its shard files in
    a fresh order each epoch, `shuffle_buffer` records at a time permuted in memory (`block_records` > 0
    cuts the files into smaller blocks). It evaluates `validation[a_r : b_r]`, the ranges tiling the
    set. `max_*_examples` > 0 keep the first that many records. With several ranks, the data must be
    prepared before (one single-process run with --manual_dir), or rank 0 prepares while the others
    wait in a Horovod barrier.

    `preprocessing` names the training and evaluation views (`preprocessing.PREPROCESSINGS`: "inception"
    when None, "caffe" or "caffe_scaled" for the AlexNets as the paper's Caffe data layer fed them).

    Returns:
        `InputPipeline` with images float32 (B, image_size, image_size, 3).

    Raises:
        FileNotFoundError: not prepared and no tars in `manual_dir`.
        ValueError: a validation tar that does not hold exactly the labelled images, or data prepared in
            another file format than TFRecord.
    """
    check_rank(rank, world_size)
    # `preprocessing`, the argument, names the views; the default size is the module's constant.
    image_size = image_size or DEFAULT_IMAGE_SIZE
    ds_builder = _prepared_builder(data_dir, manual_dir, rank, world_size)
    num_train, num_eval = _split_sizes(ds_builder.info.splits, max_train_examples, max_eval_examples)
    t_start, t_stop = train_shard_range(num_train, rank, world_size)
    e_start, e_stop = eval_shard_range(num_eval, rank, world_size)
    stream = _train_from(
        ds_builder, f"train[{t_start}:{t_stop}]", seed + rank, deterministic, shuffle_buffer, block_records
    )
    skipped = pipeline.skipped_counter() if skip_corrupt else None
    # What the training and the evaluation views share.
    views = dict(
        image_size=image_size, deterministic=deterministic, threads=input_threads, preprocessing=preprocessing
    )
    train_from = _batches_from(stream, per_rank_batch, seed + rank, skipped, views)
    evaluation = pipeline.eval_dataset(
        _source(ds_builder, f"validation[{e_start}:{e_stop}]", shuffle_files=False, seed=seed),
        batch=eval_batch or per_rank_batch,
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
