"""A folder of images, one sub-folder per class: `train/<class>/*.JPEG`, `validation/<class>/*.JPEG`.

The other common ImageNet layout (what `ILSVRC2012_img_train.tar` unpacks to, with the validation images
sorted into class folders). Labels are the class folders' indices in sorted order, the same for both
splits, so `n01440764` is label 0 as in tensorflow-datasets' `imagenet2012`.
"""

import os

import numpy as np
import tensorflow as tf

from hvd_lars.data import pipeline, preprocessing
from hvd_lars.data.sharding import check_rank, eval_shard_range, train_shard_indices

SPLITS = {"train": "train", "eval": "validation"}
# Extensions read as images, compared case-insensitively (ImageNet's are upper-case ".JPEG").
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".gif", ".bmp")


def list_images(root, classes=None):
    """Files of one split folder, sorted by (class, file name).

    Args:
        root: folder with one sub-folder per class.
        classes: class names fixing the label order; default: the sorted sub-folder names of `root`.

    Returns:
        (paths, labels, classes): list of str, int32 array of the same length, list of class names.

    Raises:
        FileNotFoundError: `root` is missing or holds no images.
        ValueError: a sub-folder of `root` is not one of `classes`.
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"Image folder {root} not found; expected {root}/<class>/<image>.JPEG "
            "(pass --data_dir=<folder holding train/ and validation/>)."
        )
    found = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    classes = list(classes) if classes is not None else found
    index = {c: i for i, c in enumerate(classes)}
    unknown = [c for c in found if c not in index]
    if unknown:
        raise ValueError(f"{root} has class folders {unknown[:5]} that the training split lacks.")
    paths, labels = [], []
    for name in found:
        folder = os.path.join(root, name)
        files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTENSIONS))
        paths += [os.path.join(folder, f) for f in files]
        labels += [index[name]] * len(files)
    if not paths:
        raise FileNotFoundError(f"No images ({', '.join(IMAGE_EXTENSIONS)}) under {root}/<class>/.")
    return paths, np.asarray(labels, np.int32), classes


def _source(paths, labels):
    paths = tf.constant(paths)
    return tf.data.Dataset.from_tensor_slices((paths, paths, tf.constant(labels, tf.int32)))


def image_folder_input(
    per_rank_batch,
    rank,
    world_size,
    seed,
    data_dir=None,
    max_train_examples=0,
    max_eval_examples=0,
    image_size=preprocessing.DEFAULT_IMAGE_SIZE,
    deterministic=True,
    skip_corrupt=False,
    eval_batch=0,
    input_threads=0,
    preprocessing=None,
):
    """Images from `data_dir/train/<class>/` and `data_dir/validation/<class>/`, ImageNet-preprocessed.

    Training: rank r reads the files `r::world_size` of the sorted list (first `world_size *
    (n // world_size)` only; disjoint, equal sizes) and shuffles its own shard. Evaluation: rank r
    reads a contiguous range; together the ranks read every file once. `max_*_examples` > 0 keep
    that many files spread evenly over the sorted list (so every class stays represented).

    `preprocessing` names the training and evaluation views (`preprocessing.PREPROCESSINGS`: "inception"
    when None, "caffe" or "caffe_scaled" for the AlexNets as the paper's Caffe data layer fed them).

    Returns:
        `InputPipeline` with images float32 (B, image_size, image_size, 3).

    Raises:
        ValueError: `data_dir` not given, or bad rank/world size.
        FileNotFoundError: missing folders or no images.
    """
    from hvd_lars.data import InputPipeline

    check_rank(rank, world_size)
    if not data_dir:
        raise ValueError("--dataset=image_folder needs --data_dir=<folder holding train/ and validation/>.")
    image_size = image_size or preprocessing.DEFAULT_IMAGE_SIZE
    train_paths, train_labels, classes = list_images(os.path.join(data_dir, SPLITS["train"]))
    eval_paths, eval_labels, _ = list_images(os.path.join(data_dir, SPLITS["eval"]), classes)
    train_paths, train_labels = _spread(train_paths, train_labels, max_train_examples)
    eval_paths, eval_labels = _spread(eval_paths, eval_labels, max_eval_examples)

    shard = train_shard_indices(len(train_paths), rank, world_size)
    start, stop = eval_shard_range(len(eval_paths), rank, world_size)
    train, skipped = pipeline.train_dataset(
        _source([train_paths[i] for i in shard], train_labels[shard]),
        num_examples=len(shard),
        per_rank_batch=per_rank_batch,
        seed=seed + rank,
        image_size=image_size,
        read=tf.io.read_file,
        deterministic=deterministic,
        threads=input_threads,
        skip_corrupt=skip_corrupt,
        preprocessing=preprocessing,
    )
    evaluation = pipeline.eval_dataset(
        _source(eval_paths[start:stop], eval_labels[start:stop]),
        batch=eval_batch or per_rank_batch,
        image_size=image_size,
        read=tf.io.read_file,
        deterministic=deterministic,
        threads=input_threads,
        preprocessing=preprocessing,
    )
    return InputPipeline(
        train=train,
        eval=evaluation,
        num_train_examples=len(train_paths),
        num_eval_examples=len(eval_paths),
        num_classes=len(classes),
        input_shape=(image_size, image_size, 3),
        skipped_corrupt=skipped,
    )


def _spread(paths, labels, limit):
    if not limit or limit >= len(paths):
        return paths, labels
    keep = np.linspace(0, len(paths), limit, endpoint=False).astype(np.int64)
    return [paths[i] for i in keep], labels[keep]
