"""Fashion-MNIST read offline from its four IDX files, gzipped or not (Debian's `dataset-fashion-mnist`).

Xiao, Rasul, Vollgraf, arXiv 1708.07747: 60,000 training and 10,000 test images, 28x28 grey, 10 classes.
The files are the ones the authors publish (https://github.com/zalandoresearch/fashion-mnist, folder
data/fashion); Debian's package installs them in `DEFAULT_DIR`. The Debian files differ byte-for-byte from
the archives tensorflow-datasets registers checksums for, so they are read here directly (the IDX format
is a magic number, the dimensions and raw bytes).
"""

import gzip
import os
import struct

import numpy as np

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
# The names the authors publish; each may also be present uncompressed, without ".gz" (the .gz is read
# when both are there).
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
NUM_CLASSES = 10
IMAGE_SHAPE = (28, 28, 1)
# Per-pixel mean and standard deviation of the 60,000 training images scaled to [0, 1]
# (checked by tests/test_data.py::test_fashion_mnist_splits_and_statistics against the Debian files).
MEAN = 0.2860
STD = 0.3530

_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049


def load(split, data_dir=None):
    """(images uint8 (N, 28, 28, 1), labels int32 (N,)) of `split` ("train": N = 60,000, "test": 10,000)
    from its two IDX files in `data_dir` (default `DEFAULT_DIR`), each gzipped (`FILES`) or not.

    Raises:
        ValueError: unknown split.
        FileNotFoundError: a file is missing in both forms (says where to get the files).
        OSError: a file is not a valid IDX file, or the two disagree on the count.
    """
    images, labels = _read_split(split, data_dir, header_only=False)
    return images[..., None], labels.astype(np.int32)


def count(split, data_dir=None):
    """The number of images of one split, from its two IDX files' headers alone (a gzipped file is
    decompressed only that far). Raises as `load`, except that data cut short are only found by `load`."""
    return _read_split(split, data_dir, header_only=True)[0][0]


def _read_split(split, data_dir, header_only):
    if split not in FILES:
        raise ValueError(f"Fashion-MNIST split must be one of {sorted(FILES)}, got {split!r}.")
    image_file, label_file = (_find(data_dir or DEFAULT_DIR, name) for name in FILES[split])
    images = _read_idx(image_file, _IDX_IMAGES_MAGIC, header_only)
    labels = _read_idx(label_file, _IDX_LABELS_MAGIC, header_only)
    counts = (images[0], labels[0]) if header_only else (len(images), len(labels))
    if counts[0] != counts[1]:
        raise OSError(f"{image_file} has {counts[0]} images but {label_file} {counts[1]} labels.")
    return images, labels


def _find(data_dir, name):
    """The path of `name` (a `.gz` file) in `data_dir`, else of its uncompressed form."""
    raw = name[: -len(".gz")]
    for path in (os.path.join(data_dir, name), os.path.join(data_dir, raw)):
        if os.path.exists(path):
            return path
    all_files = ", ".join(n for files in FILES.values() for n in files)
    raise FileNotFoundError(
        f"Fashion-MNIST file {name} (or {raw}, uncompressed) not found in {data_dir}. Install the four files "
        f"with `apt-get install dataset-fashion-mnist` (Debian: into {DEFAULT_DIR}), or download them "
        f"({all_files}) from https://github.com/zalandoresearch/fashion-mnist (folder data/fashion) into a "
        "folder and pass --data_dir=<that folder>."
    )


def _read_idx(path, magic, header_only):
    """The IDX file's array (uint8, shape its dimensions), or with `header_only` its dimensions."""
    size = 16 if magic == _IDX_IMAGES_MAGIC else 8  # magic, then 3 dimensions (images) or 1 (labels)
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        data = f.read(size) if header_only else f.read()
    if len(data) < size:
        raise OSError(f"{path}: {len(data)} bytes, shorter than an IDX header ({size}).")
    found, *dims = struct.unpack(f">{size // 4}I", data[:size])
    if found != magic:
        raise OSError(f"{path}: IDX magic number {found}, expected {magic}.")
    if header_only:
        return dims
    array = np.frombuffer(data, dtype=np.uint8, offset=size)
    if array.size != int(np.prod(dims)):
        raise OSError(f"{path}: {array.size} bytes of data for shape {dims}.")
    return array.reshape(dims)
