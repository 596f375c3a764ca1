"""A folder of images, one sub-folder per class: `train/<class>/*.JPEG`, `validation/<class>/*.JPEG`.

Labels are the class folders' indices in sorted order, the same for both splits (`n01440764` is label 0,
as in tensorflow-datasets' `imagenet2012`). Which files count as images is `listing`'s business; the
listing is made once per run, by rank 0, and kept in the run directory for its later starts.
"""

import dataclasses
import os
import warnings

import numpy as np
import tensorflow as tf

from hvd_lars.arguments import IMAGE_FOLDER_NEEDS_DATA_DIR
from hvd_lars.data import encoded_images, listing, order
from hvd_lars.data.interface import InputShapes
from hvd_lars.data.preprocessing import DEFAULT_IMAGE_SIZE
from hvd_lars.data.sharding import check_rank, eval_shard_range, train_shard_indices
from hvd_lars.parallel import collectives

# The folder of `InputRequest.run_dir` where the listings are kept for the run's later starts.
INDEX_FOLDER = "image_folder_index"


@dataclasses.dataclass(frozen=True)
class ImageFolderOptions(encoded_images.EncodedImageOptions):
    """The options of `image_folder`: those of `encoded_images.EncodedImageOptions`."""


def _index_path(index_dir, split):
    return os.path.join(index_dir, f"{split}.index.npz") if index_dir else None


def list_splits(data_dir, index_dir=None, rank=0, world_size=1):
    """The `Listing`s (train, validation) of `data_dir`: with Horovod running `world_size` > 1 ranks, rank
    0 alone lists (or reads its index files in `index_dir`, `listing.listed`) and broadcasts them, and its
    FileNotFoundError or ValueError (as `listing.list_split`) is raised on every rank."""
    shared = world_size > 1 and collectives.size() == world_size
    blobs = None
    if not shared or rank == 0:
        try:
            train, _ = listing.listed(os.path.join(data_dir, "train"), _index_path(index_dir, "train"))
            evaluation, _ = listing.listed(
                os.path.join(data_dir, "validation"), _index_path(index_dir, "validation"), train.classes
            )
            blobs = [train.to_bytes(), evaluation.to_bytes()]
        except (FileNotFoundError, ValueError) as e:
            if not shared:
                raise
            blobs = [type(e).__name__.encode(), str(e).encode()]
    if not shared:
        return train, evaluation
    blobs = collectives.broadcast_object(blobs, name="hvd_lars.listing")  # rank 0's
    if blobs[0] in (b"FileNotFoundError", b"ValueError"):
        error = FileNotFoundError if blobs[0] == b"FileNotFoundError" else ValueError
        raise error(blobs[1].decode())
    return listing.Listing.from_bytes(blobs[0]), listing.Listing.from_bytes(blobs[1])


def _check_data_dir(data_dir):
    if not data_dir:
        raise ValueError(IMAGE_FOLDER_NEEDS_DATA_DIR)


def _index_folder(run_dir):
    return os.path.join(run_dir, INDEX_FOLDER) if run_dir else None


def image_folder_shapes(request, options):
    """`InputShapes` of `image_folder_input(request, options)`, from the training split's listing alone
    (its index in the run directory while valid); raises as `image_folder_input` for that split."""
    _check_data_dir(request.data_dir)
    train_index = _index_path(_index_folder(request.run_dir), "train")
    train, _ = listing.listed(os.path.join(request.data_dir, "train"), train_index)
    image_size = options.image_size or DEFAULT_IMAGE_SIZE
    return InputShapes(
        input_shape=(image_size, image_size, 3),
        num_classes=len(train.classes),
        num_train_examples=min(len(train.files), request.max_train_examples or len(train.files)),
    )


def _read_file(path):
    # The one place training and evaluation files are read (tests count the calls through it).
    return tf.io.read_file(path)


def image_folder_input(request, options):
    """`InputPipeline` of `request.data_dir`/{train,validation}/<class>/ (`options`: `ImageFolderOptions`).

    Training: rank r reads the files `r::world_size` of the sorted list (`sharding.train_shard_indices`)
    in a fresh permutation each epoch (`order.index_stream`: `train_from(k)` opens no file before batch
    k). Evaluation: rank r reads a contiguous range; together the ranks read every file once.
    `request.max_*_examples` > 0 keep that many files spread evenly over the sorted list (every class
    stays represented). Classes missing from the validation split are named in a warning (rank 0).

    Raises:
        ValueError: `data_dir` not given, bad rank/world size, or a folder the listing refuses.
        FileNotFoundError: missing folders or no images.
    """
    rank, world_size = request.rank, request.world_size
    check_rank(rank, world_size)
    _check_data_dir(request.data_dir)
    train_listing, eval_listing = list_splits(
        request.data_dir, _index_folder(request.run_dir), rank, world_size
    )
    present = set(eval_listing.labels.tolist())
    missing = [c for label, c in enumerate(eval_listing.classes) if label not in present]
    if rank == 0 and missing:
        warnings.warn(
            f"{eval_listing.root} has no images of {len(missing)} of the {len(train_listing.classes)} "
            f"training classes ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); "
            "evaluation covers the classes it has.",
            stacklevel=3,  # the caller of hvd_lars.data.get_input (which calls image_folder_input)
        )
    train_paths, train_labels = _spread(
        train_listing.paths(), train_listing.labels, request.max_train_examples
    )
    eval_paths, eval_labels = _spread(eval_listing.paths(), eval_listing.labels, request.max_eval_examples)
    shard = train_shard_indices(len(train_paths), rank, world_size)
    shard_paths = tf.constant([train_paths[i] for i in shard])
    shard_labels = tf.constant(train_labels[shard], tf.int32)

    def stream_from(start):
        return order.index_stream(len(shard), request.seed + rank, start).map(
            lambda i: (tf.gather(shard_paths, i), tf.gather(shard_paths, i), tf.gather(shard_labels, i))
        )

    start, stop = eval_shard_range(len(eval_paths), rank, world_size)
    paths = tf.constant(eval_paths[start:stop])
    eval_source = tf.data.Dataset.from_tensor_slices(
        (paths, paths, tf.constant(eval_labels[start:stop], tf.int32))
    )
    return encoded_images.pipeline(
        request,
        options,
        stream_from,
        eval_source,
        read=_read_file,
        num_train_examples=len(train_paths),
        num_eval_examples=len(eval_paths),
        num_classes=len(train_listing.classes),
    )


def _spread(paths, labels, limit):
    if not limit or limit >= len(paths):
        return paths, labels
    keep = np.linspace(0, len(paths), limit, endpoint=False).astype(np.int64)
    return [paths[i] for i in keep], labels[keep]
