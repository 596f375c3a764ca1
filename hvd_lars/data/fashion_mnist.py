"""Fashion-MNIST read offline from Debian's `dataset-fashion-mnist` package (IDX files, gzip).

Xiao, Rasul, Vollgraf, arXiv 1708.07747: 60,000 training and 10,000 test images, 28x28 grey, 10 classes.
The Debian files differ byte-for-byte from the archives tensorflow-datasets registers checksums for, so
they are read here directly (the IDX format is four header fields and raw bytes).
"""

import gzip
import os
import struct

import numpy as np

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
NUM_CLASSES = 10
IMAGE_SHAPE = (28, 28, 1)
# Per-pixel mean and standard deviation of the 60,000 training images scaled to [0, 1]
# (computed by tests/test_data.py::test_fashion_mnist_statistics from the Debian files).
MEAN = 0.2860
STD = 0.3530

_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049


def load(split, data_dir=None):
    """Reads one split into memory.

    Args:
        split: "train" or "test".
        data_dir: folder holding the four `.gz` files; default `DEFAULT_DIR` (Debian's package).

    Returns:
        (images, labels): uint8 array of shape (N, 28, 28, 1) and int32 array of shape (N,), N = 60,000
        for "train" and 10,000 for "test".

    Raises:
        ValueError: unknown split.
        FileNotFoundError: the files are missing (names the Debian package to install).
        IOError: a file is not a valid IDX file.
    """
    if split not in FILES:
        raise ValueError(f"Fashion-MNIST split must be one of {sorted(FILES)}, got {split!r}.")
    data_dir = data_dir or DEFAULT_DIR
    image_file, label_file = (os.path.join(data_dir, f) for f in FILES[split])
    for path in (image_file, label_file):
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"Fashion-MNIST file {path} not found. Install it with "
                "`apt-get install dataset-fashion-mnist` (Debian), or pass --data_dir=<folder with "
                f"{FILES[split][0]} and {FILES[split][1]}>."
            )
    images = _read_idx(image_file, _IDX_IMAGES_MAGIC)
    labels = _read_idx(label_file, _IDX_LABELS_MAGIC)
    if images.shape[0] != labels.shape[0]:
        raise OSError(f"{image_file} has {images.shape[0]} images but {label_file} {labels.shape[0]} labels.")
    return images[..., None], labels.astype(np.int32)


def _read_idx(path, magic):
    with gzip.open(path, "rb") as f:
        data = f.read()
    found, count = struct.unpack(">II", data[:8])
    if found != magic:
        raise OSError(f"{path}: IDX magic number {found}, expected {magic}.")
    dims = [count]
    if magic == _IDX_IMAGES_MAGIC:
        dims += list(struct.unpack(">II", data[8:16]))
    offset = 8 + 4 * (len(dims) - 1)
    array = np.frombuffer(data, dtype=np.uint8, offset=offset)
    if array.size != int(np.prod(dims)):
        raise OSError(f"{path}: {array.size} bytes of data for shape {dims}.")
    return array.reshape(dims)
