"""Fashion-MNIST's IDX files from any folder, gzipped or uncompressed."""

import gzip
import os
import shutil
import struct

import numpy as np
import pytest

from hvd_lars.data import fashion_mnist_files

IMAGES, LABELS = fashion_mnist_files.FILES["test"]


def _write_idx(path, magic, array, compress):
    """An IDX file as the format defines it: magic, big-endian uint32 dimensions, then the bytes."""
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    opener = gzip.open if compress else open
    with opener(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _tiny_split(folder, compress_images, compress_labels):
    """Two 28x28 images of known pixels and labels 7, 3, written under the test split's names."""
    images = np.arange(2 * 28 * 28, dtype=np.int64).reshape(2, 28, 28) % 251
    labels = np.array([7, 3])
    image_name = IMAGES if compress_images else IMAGES[:-3]
    label_name = LABELS if compress_labels else LABELS[:-3]
    _write_idx(os.path.join(folder, image_name), 2051, images, compress_images)
    _write_idx(os.path.join(folder, label_name), 2049, labels, compress_labels)
    return images, labels


@pytest.mark.unit
@pytest.mark.parametrize("compress_images,compress_labels", [(True, True), (False, False), (False, True)])
def test_tiny_split_read_in_either_form(tmp_path, compress_images, compress_labels):
    want_images, want_labels = _tiny_split(tmp_path, compress_images, compress_labels)
    images, labels = fashion_mnist_files.load("test", str(tmp_path))
    assert images.shape == (2, 28, 28, 1) and images.dtype == np.uint8
    np.testing.assert_array_equal(images[..., 0], want_images)
    assert labels.dtype == np.int32 and labels.tolist() == [7, 3]
    assert images[1, 0, 0, 0] == 784 % 251 and images[1, 27, 27, 0] == (2 * 784 - 1) % 251


@pytest.mark.unit
def test_gzipped_file_is_read_when_both_forms_are_there(tmp_path):
    _tiny_split(tmp_path, True, True)
    # An uncompressed file of other contents beside the .gz: the .gz wins.
    _write_idx(tmp_path / IMAGES[:-3], 2051, np.zeros((2, 28, 28)), compress=False)
    images, _ = fashion_mnist_files.load("test", str(tmp_path))
    assert images[1, 0, 0, 0] == 784 % 251


@pytest.mark.unit
def test_uncompressed_copy_of_the_real_test_split_reads_the_same(tmp_path):
    source = fashion_mnist_files.DEFAULT_DIR
    if not os.path.exists(os.path.join(source, IMAGES)):
        pytest.skip(f"Fashion-MNIST not installed in {source}")
    for name in (IMAGES, LABELS):
        with gzip.open(os.path.join(source, name), "rb") as f, open(tmp_path / name[:-3], "wb") as out:
            shutil.copyfileobj(f, out)
    images, labels = fashion_mnist_files.load("test", str(tmp_path))
    want_images, want_labels = fashion_mnist_files.load("test")
    assert images.shape == (10_000, 28, 28, 1)
    np.testing.assert_array_equal(images, want_images)
    np.testing.assert_array_equal(labels, want_labels)
    # The published test split has 1,000 images of each class.
    assert np.bincount(labels).tolist() == [1000] * 10


@pytest.mark.unit
def test_missing_file_names_both_forms_and_where_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError) as raised:
        fashion_mnist_files.load("test", str(tmp_path))
    message = str(raised.value)
    assert f"{IMAGES} (or {IMAGES[:-3]}, uncompressed) not found in {tmp_path}" in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "github.com/zalandoresearch/fashion-mnist" in message and "--data_dir" in message


@pytest.mark.unit
def test_bad_magic_number_is_refused(tmp_path):
    _tiny_split(tmp_path, False, False)
    _write_idx(tmp_path / LABELS[:-3], 2051, np.array([7, 3]), compress=False)
    with pytest.raises(OSError, match="IDX magic number 2051, expected 2049"):
        fashion_mnist_files.load("test", str(tmp_path))
