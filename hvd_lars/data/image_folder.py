"""A folder of images, one sub-folder per class: `train/<class>/*.JPEG`, `validation/<class>/*.JPEG`.

The other common ImageNet layout (what `ILSVRC2012_img_train.tar` unpacks to, with the validation images
sorted into class folders). Labels are the class folders' indices in sorted order, the same for both
splits, so `n01440764` is label 0 as in tensorflow-datasets' `imagenet2012`. Which files count as images
(hidden files, links, odd names, empty folders) is `listing`'s business; the listing is made once per
run, by rank 0, and kept in the run directory for its later starts (`index_folder`).
"""

import dataclasses
import os
import warnings

import numpy as np
import tensorflow as tf

from hvd_lars.data import encoded_images, listing, order
from hvd_lars.data.interface import InputPipeline, InputShapes
from hvd_lars.data.preprocessing import DEFAULT_IMAGE_SIZE
from hvd_lars.data.sharding import check_rank, eval_shard_range, train_shard_indices
from hvd_lars.parallel import collectives

SPLITS = {"train": "train", "eval": "validation"}
# The folder of `InputRequest.run_dir` where the listings are kept for the run's later starts.
INDEX_FOLDER = "image_folder_index"


@dataclasses.dataclass(frozen=True)
class ImageFolderOptions(encoded_images.EncodedImageOptions):
    """The options of `image_folder`: those of `encoded_images.EncodedImageOptions`."""


def index_folder(run_dir):
    """Where the listings of a run with run directory `run_dir` are kept: `<run_dir>/INDEX_FOLDER`;
    None (list every time) when `run_dir` is None."""
    return os.path.join(run_dir, INDEX_FOLDER) if run_dir else None


def list_splits(data_dir, index_dir=None, rank=0, world_size=1):
    """The `Listing`s (train, validation) of `data_dir`, made by one process of the job.

    With Horovod running `world_size` > 1 ranks, rank 0 alone reads the folders (or its index files) and
    broadcasts the listings; the others never touch them. Otherwise (one process, or ranks built in one
    process) this process lists.

    Args:
        index_dir: folder for the index files `train.index.npz` and `validation.index.npz`
            (`listing.listed`); None: list every time.

    Raises:
        FileNotFoundError / ValueError: as `listing.list_split`, on every rank (rank 0's error is
            broadcast, so no rank waits for a listing that never comes).
    """
    index = lambda split: _index_path(index_dir, split)
    shared = world_size > 1 and collectives.size() == world_size
    blobs = None
    if not shared or rank == 0:
        try:
            train, _ = listing.listed(os.path.join(data_dir, SPLITS["train"]), index("train"))
            evaluation, _ = listing.listed(
                os.path.join(data_dir, SPLITS["eval"]), index("validation"), train.classes
            )
            blobs = [train.to_bytes(), evaluation.to_bytes()]
        except (FileNotFoundError, ValueError) as e:
            if not shared:
                raise
            blobs = [type(e).__name__.encode(), str(e).encode()]
    if not shared:
        return train, evaluation
    blobs = [
        collectives.broadcast_bytes(b, name=f"hvd_lars.listing{k}") for k, b in enumerate(blobs or [b"", b""])
    ]
    if blobs[0] in (b"FileNotFoundError", b"ValueError"):
        error = FileNotFoundError if blobs[0] == b"FileNotFoundError" else ValueError
        raise error(blobs[1].decode())
    return listing.Listing.from_bytes(blobs[0]), listing.Listing.from_bytes(blobs[1])


def _index_path(index_dir, split):
    return os.path.join(index_dir, f"{split}.index.npz") if index_dir else None


def _check_data_dir(data_dir):
    if not data_dir:
        raise ValueError("--dataset=image_folder needs --data_dir=<folder holding train/ and validation/>.")


def image_folder_shapes(request, options):
    """`InputShapes` of `image_folder_input(request, options)`, from the training split's listing alone:
    its index file in `index_folder(request.run_dir)` while valid (`listing.listed`: one `stat` per folder),
    else a listing of `data_dir/train`, saved there for the run's later starts (the one
    `image_folder_input` then reuses). The validation split is not read; what `image_folder_input`
    refuses in it is refused when the input is built.

    Raises:
        ValueError: `data_dir` not given, or a training folder the listing refuses.
        FileNotFoundError: no training folder or no images in it.
    """
    _check_data_dir(request.data_dir)
    train_index = _index_path(index_folder(request.run_dir), "train")
    train, _ = listing.listed(os.path.join(request.data_dir, SPLITS["train"]), train_index)
    num_train = len(train.files)
    image_size = options.image_size or DEFAULT_IMAGE_SIZE
    return InputShapes(
        input_shape=(image_size, image_size, 3),
        num_classes=len(train.classes),
        num_train_examples=min(num_train, request.max_train_examples or num_train),  # as `_spread` keeps
    )


def _source(paths, labels):
    paths = tf.constant(paths)
    return tf.data.Dataset.from_tensor_slices((paths, paths, tf.constant(labels, tf.int32)))


def _read_file(path):
    # The one place training and evaluation files are read (tests count the calls through it).
    return tf.io.read_file(path)


def _warn_missing_classes(train_listing, eval_listing):
    """Warns naming (the first 5 of) the training classes the validation split has no images of."""
    missing = eval_listing.missing_classes()
    if missing:
        warnings.warn(
            f"{eval_listing.root} has no images of {len(missing)} of the {len(train_listing.classes)} "
            f"training classes ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); "
            "evaluation covers the classes it has.",
            stacklevel=4,  # the caller of hvd_lars.data.get_input (which calls image_folder_input)
        )


def _train_shard(paths, labels, rank, world_size, per_rank_batch, seed, skipped, views):
    """`InputPipeline.train_from` over rank `rank`'s files `rank::world_size` of `paths` (`labels` their
    int labels): a fresh permutation of the shard each epoch (`order.index_stream` from `seed`), no file
    opened before batch `start_batch`. `skipped` as in `encoded_images.train_dataset`; `views` holds its
    keywords image_size, deterministic, threads, preprocessing."""
    shard = train_shard_indices(len(paths), rank, world_size)
    shard_paths = tf.constant([paths[i] for i in shard])
    shard_labels = tf.constant(labels[shard], tf.int32)

    def train_from(start_batch=0):
        start = start_batch * per_rank_batch
        indices = order.index_stream(len(shard), seed, start)
        stream = indices.map(
            lambda i: (tf.gather(shard_paths, i), tf.gather(shard_paths, i), tf.gather(shard_labels, i))
        )
        return encoded_images.train_dataset(
            stream,
            per_rank_batch=per_rank_batch,
            seed=seed,
            start=start,
            read=_read_file,
            skipped=skipped,
            **views,
        )

    return train_from


def _eval_shard(paths, labels, rank, world_size, batch, views):
    """`InputPipeline.eval` over rank `rank`'s contiguous range of `paths` (`eval_shard_range`), batches of
    `batch`; `views` as in `_train_shard`."""
    start, stop = eval_shard_range(len(paths), rank, world_size)
    return encoded_images.eval_dataset(
        _source(paths[start:stop], labels[start:stop]), batch=batch, read=_read_file, **views
    )


def image_folder_input(request, options):
    """Images from `data_dir/train/<class>/` and `data_dir/validation/<class>/`, ImageNet-preprocessed.

    Training: rank r reads the files `r::world_size` of the sorted list (first `world_size *
    (n // world_size)` only; disjoint, equal sizes) in a fresh permutation of its shard each epoch
    (`order.index_stream`, so `train_from(k)` opens no file before its batch k). Evaluation: rank r
    reads a contiguous range; together the ranks read every file once. `request.max_*_examples` > 0
    keep that many files spread evenly over the sorted list (so every class stays represented).
    The listings are kept in `index_folder(request.run_dir)` for the run's later starts (`list_splits`);
    without a `run_dir` the folders are listed on every call. Classes missing from the validation split
    are named in a warning (rank 0).

    Args:
        request: `InputRequest` (`data_dir`: the folder holding train/ and validation/).
        options: `ImageFolderOptions`.

    Returns:
        `InputPipeline` with images float32 (B, image_size, image_size, 3).

    Raises:
        ValueError: `data_dir` not given, bad rank/world size, or a folder the listing refuses.
        FileNotFoundError: missing folders or no images.
    """
    rank, world_size, batch = request.rank, request.world_size, request.per_rank_batch
    check_rank(rank, world_size)
    _check_data_dir(request.data_dir)
    # `options.preprocessing` names the views; the default size is the module's constant.
    image_size = options.image_size or DEFAULT_IMAGE_SIZE
    train_listing, eval_listing = list_splits(
        request.data_dir, index_folder(request.run_dir), rank, world_size
    )
    if rank == 0:
        _warn_missing_classes(train_listing, eval_listing)
    train_paths, train_labels = _spread(
        train_listing.paths(), train_listing.labels, request.max_train_examples
    )
    eval_paths, eval_labels = _spread(eval_listing.paths(), eval_listing.labels, request.max_eval_examples)
    skipped = encoded_images.skipped_counter() if options.skip_corrupt else None
    # What the training and the evaluation views share.
    views = dict(
        image_size=image_size,
        deterministic=request.deterministic,
        threads=request.input_threads,
        preprocessing=options.preprocessing,
        on_unreadable=request.on_unreadable,
    )
    train_from = _train_shard(
        train_paths, train_labels, rank, world_size, batch, request.seed + rank, skipped, views
    )
    evaluation = _eval_shard(eval_paths, eval_labels, rank, world_size, request.eval_batch or batch, views)
    return InputPipeline(
        train=train_from(0),
        train_from=train_from,
        eval=evaluation,
        num_train_examples=len(train_paths),
        num_eval_examples=len(eval_paths),
        num_classes=len(train_listing.classes),
        input_shape=(image_size, image_size, 3),
        skipped_corrupt=skipped,
    )


def _spread(paths, labels, limit):
    if not limit or limit >= len(paths):
        return paths, labels
    keep = np.linspace(0, len(paths), limit, endpoint=False).astype(np.int64)
    return [paths[i] for i in keep], labels[keep]
