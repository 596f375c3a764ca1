"""Fashion-MNIST from its IDX files; per-rank shards; the registry; synthetic data; descriptions."""

import dataclasses
import gzip
import itertools
import os
import struct

import numpy as np
import pytest
import tensorflow as tf

from hvd_lars.data import (
    DATASETS,
    InputRequest,
    InputShapes,
    describe_input,
    fashion_mnist_files,
    get_input,
    order,
    synthetic,
)
from hvd_lars.data.sharding import eval_shard_range, train_shard_indices, train_shard_range

REQUEST = InputRequest(per_rank_batch=4, rank=0, world_size=1, seed=0)
IMAGES, LABELS = fashion_mnist_files.FILES["test"]


def _write_idx(path, magic, array):
    """An IDX file: magic, big-endian uint32 dimensions, then the bytes; gzipped if `path` ends in .gz."""
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def train_split():
    return fashion_mnist_files.load("train")


@pytest.mark.unit
def test_fashion_mnist_splits_and_statistics(train_split):
    x, y = train_split
    assert x.shape == (60000, 28, 28, 1) and x.dtype == np.uint8 and y.shape == (60000,)
    assert np.bincount(y).tolist() == [6000] * 10  # balanced classes (Xiao et al. 2017)
    mean = x.mean() / 255  # of the pixels scaled to [0, 1]; std from the mean square
    std = np.sqrt(np.square(x, dtype=np.uint16).mean() / 255**2 - mean**2)
    assert (mean, std) == pytest.approx((fashion_mnist_files.MEAN, fashion_mnist_files.STD), abs=5e-5)
    x, y = fashion_mnist_files.load("test")
    assert x.shape == (10000, 28, 28, 1) and np.bincount(y).tolist() == [1000] * 10


@pytest.mark.unit
@pytest.mark.parametrize("compress_images,compress_labels", [(True, True), (False, False), (False, True)])
def test_tiny_split_read_in_either_form(tmp_path, compress_images, compress_labels):
    # Two 28x28 images of known pixels and labels 7, 3, under the test split's names.
    want_images = np.arange(2 * 28 * 28).reshape(2, 28, 28) % 251
    _write_idx(tmp_path / (IMAGES if compress_images else IMAGES[:-3]), 2051, want_images)
    _write_idx(tmp_path / (LABELS if compress_labels else LABELS[:-3]), 2049, np.array([7, 3]))
    images, labels = fashion_mnist_files.load("test", str(tmp_path))
    assert images.shape == (2, 28, 28, 1) and images.dtype == np.uint8
    np.testing.assert_array_equal(images[..., 0], want_images)
    assert labels.dtype == np.int32 and labels.tolist() == [7, 3]
    # An uncompressed file of other contents beside the .gz: the .gz wins.
    _write_idx(tmp_path / IMAGES[:-3], 2051, np.zeros((2, 28, 28)))
    images, _ = fashion_mnist_files.load("test", str(tmp_path))
    assert images[1, 0, 0, 0] == (784 % 251 if compress_images else 0)


@pytest.mark.unit
@pytest.mark.parametrize("n, world", [(60000, 2), (10, 3), (7, 7), (10000, 6), (18, 2), (13, 2), (5, 4)])
def test_train_shards_are_equal_and_disjoint_and_eval_shards_cover_every_example_once(n, world):
    k = n // world  # per rank; the last n % world examples are left out
    for r in range(world):
        np.testing.assert_array_equal(train_shard_indices(n, r, world), np.arange(r, k * world, world))
        assert train_shard_range(n, r, world) == (r * k, (r + 1) * k)
    with pytest.raises(ValueError, match=f"^{world - 1} training examples cannot be shared by {world} ranks"):
        train_shard_range(world - 1, 0, world)
    for m in (n, world - 1):  # evaluation: fewer examples than ranks leave some shards empty
        covered = np.concatenate([np.arange(*eval_shard_range(m, r, world)) for r in range(world)])
        np.testing.assert_array_equal(covered, np.arange(m))


@pytest.mark.unit
def test_fashion_mnist_batches_validation_split_and_resumed_stream_at_any_step(train_split):
    x, y = train_split
    x_test, y_test = fashion_mnist_files.load("test")
    # The last 59,000 training images are the validation split: 1,000 are trained on.
    sizes = dict(max_eval_examples=100, eval_batch=30)
    request = InputRequest(per_rank_batch=100, rank=1, world_size=2, seed=3, **sizes)
    data = get_input("fashion_mnist", request, validation_examples=59000)
    assert (data.num_train_examples, data.num_validation_examples, data.num_eval_examples) == (1000, 100, 100)
    mean, std = fashion_mnist_files.MEAN, fashion_mnist_files.STD
    normalised = lambda images: (images.astype(np.float32) / 255.0 - mean) / std
    # Rank 1 of 2 evaluates images 50..99 of each split, in order: validation images 1,050..1,099.
    for split, images, labels in ((data.eval, x_test, y_test), (data.validation, x[1000:], y[1000:])):
        batches = list(split)
        assert [int(b[1].shape[0]) for b in batches] == [30, 20]
        np.testing.assert_allclose(np.concatenate([b[0] for b in batches]), normalised(images[50:100]), 1e-6)
        np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), labels[50:100])
    straight = [(b[0].numpy(), b[1].numpy()) for b in data.train.take(23)]  # 4.6 epochs of 500 images
    assert straight[0][0].shape == (100, 28, 28, 1) and straight[0][0].dtype == np.float32
    # Epoch 0: rank 1's shard of the first 1,000 images (none of the validation split's) in its permutation.
    shard = train_shard_indices(1000, 1, 2)
    first = shard[order.epoch_permutation(500, 3 + 1, 0).numpy()]
    np.testing.assert_allclose(np.concatenate([b[0] for b in straight[:5]]), normalised(x[first]), 1e-6)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in straight[:5]]), y[first])
    # Step 10^9 (epoch 2 * 10^8): computed, not iterated to; its batch is that epoch's permutation there.
    epoch, offset = divmod(10**9 * 100, 500)
    want = shard[order.epoch_permutation(500, 3 + 1, epoch).numpy()[offset : offset + 100]]
    images, labels = next(iter(data.train_from(10**9)))
    np.testing.assert_allclose(images, normalised(x[want]), 1e-6)
    np.testing.assert_array_equal(labels, y[want])
    for step in (3, 5, 17):  # mid-epoch, an epoch's start, a later epoch's middle
        for (images, labels), (want_images, want_labels) in zip(data.train_from(step), straight[step:]):
            np.testing.assert_array_equal(images, want_images)
            np.testing.assert_array_equal(labels, want_labels)


@pytest.mark.unit
def test_an_option_the_dataset_does_not_take_is_refused_naming_those_it_takes():
    request = dataclasses.replace(REQUEST, per_rank_batch=8, max_train_examples=64, max_eval_examples=16)
    for build in (get_input, describe_input):
        with pytest.raises(ValueError, match="'imagenet9'.*fashion_mnist"):
            build("imagenet9", REQUEST)
        refusal = r"^Dataset 'fashion_mnist' does not take image_size=227; it takes validation_examples\.$"
        with pytest.raises(ValueError, match=refusal):
            build("fashion_mnist", request, image_size=227)
        with pytest.raises(ValueError, match=r"'fashion_mnist' does not take preprocessing='caffe'"):
            build("fashion_mnist", request, preprocessing="caffe")
        with pytest.raises(ValueError, match="does not take image_size=0, skip_corrupt=False"):
            build("fashion_mnist", request, skip_corrupt=False, image_size=0)
        with pytest.raises(ValueError, match=r"not take seed=3; .* \(seed is a field of InputRequest\)\.$"):
            build("synthetic", request, seed=3)
        with pytest.raises(ValueError, match="'synthetic' does not take validation_examples=100; it takes"):
            build("synthetic", request, validation_examples=100)
    with pytest.raises(ValueError, match="synthetic data needs positive sizes.*per_rank_batch=0"):
        describe_input("synthetic", dataclasses.replace(REQUEST, per_rank_batch=0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.rank = 1
    for entry in DATASETS.values():  # each dataset's options are a frozen dataclass too
        assert dataclasses.is_dataclass(entry.options) and entry.options.__dataclass_params__.frozen


@pytest.mark.unit
def test_synthetic_shapes_exact_eval_count_and_one_batch():
    request = dict(per_rank_batch=4, seed=0, max_eval_examples=10, eval_batch=3, world_size=3)
    options = dict(image_size=16, num_classes=7)
    ranks = [get_input("synthetic", InputRequest(rank=r, **request), **options) for r in range(3)]
    images, labels = next(iter(ranks[0].train))
    assert images.shape == (4, 16, 16, 3) and images.dtype == "float32"
    assert labels.dtype == "int32" and 0 <= int(labels.numpy().min()) and int(labels.numpy().max()) < 7
    assert ranks[0].num_train_examples == 1_281_167 and ranks[0].num_eval_examples == 10
    sizes = [[int(y.shape[0]) for _, y in r.eval] for r in ranks]
    assert sizes == [[3], [3], [3, 1]]  # ranges [0, 3), [3, 6), [6, 10)
    assert ranks[0].input_shape == (16, 16, 3) and ranks[0].num_classes == 7
    np.testing.assert_array_equal(next(iter(ranks[0].train_from(10**9)))[0], images)  # one batch at any step


def _shapes_of(data):
    return InputShapes(data.input_shape, data.num_classes, data.num_train_examples)


@pytest.fixture
def tiny_fashion_mnist(tmp_path):
    """A Fashion-MNIST folder of 12 training and 3 test images (the four files under their names)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("test", 3)):
        images, labels = fashion_mnist_files.FILES[split]
        _write_idx(tmp_path / images, 2051, rng.integers(0, 256, (count, 28, 28)))
        _write_idx(tmp_path / labels, 2049, rng.integers(0, 10, count))
    return str(tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize("limit, held_out", [(0, 4), (5, 0), (5, 4)])
def test_fashion_mnist_described_from_the_headers_as_built(tiny_fashion_mnist, monkeypatch, limit, held_out):
    request = dataclasses.replace(REQUEST, data_dir=tiny_fashion_mnist, max_train_examples=limit)
    built = get_input("fashion_mnist", request, validation_examples=held_out)
    kept = min(12 - held_out, limit or 12)
    assert _shapes_of(built) == InputShapes((28, 28, 1), 10, kept)
    # Trained on: the first `kept` images (back from standardised to the file's pixels).
    trained = np.concatenate([b[0].numpy() for b in built.train.take(kept // 4)])
    trained = np.rint((trained * fashion_mnist_files.STD + fashion_mnist_files.MEAN) * 255).astype(np.uint8)
    first = {i.tobytes() for i in fashion_mnist_files.load("train", tiny_fashion_mnist)[0][:kept]}
    assert len(trained) == kept // 4 * 4 and {i.tobytes() for i in trained} <= first
    read = fashion_mnist_files._read_idx
    headers_only = lambda path, magic, header: read(path, magic, header) if header else pytest.fail("decoded")
    monkeypatch.setattr(fashion_mnist_files, "_read_idx", headers_only)  # describe_input decodes none
    assert describe_input("fashion_mnist", request, validation_examples=held_out) == _shapes_of(built)


@pytest.mark.unit
def test_fashion_mnist_description_refuses_what_the_builder_refuses(tiny_fashion_mnist, tmp_path):
    request = dataclasses.replace(REQUEST, data_dir=tiny_fashion_mnist)
    for n, build in itertools.product((-1, 12, 70000), (get_input, describe_input)):
        with pytest.raises(ValueError, match=rf"validation_examples={n} .*must be in \[0, 11\]"):
            build("fashion_mnist", request, validation_examples=n)
    images, _ = fashion_mnist_files.FILES["train"]
    path = os.path.join(tiny_fashion_mnist, images)
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">IIII", 2049, 12, 28, 28))  # a label file's magic under the image file's name
    with pytest.raises(OSError, match="IDX magic number 2049, expected 2051"):
        describe_input("fashion_mnist", request)
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">II", 2051, 12))
    with pytest.raises(OSError, match=r"8 bytes, shorter than an IDX header \(16\)"):
        describe_input("fashion_mnist", request)
    with pytest.raises(FileNotFoundError) as raised:
        describe_input("fashion_mnist", dataclasses.replace(REQUEST, data_dir=str(tmp_path / "none")))
    message = str(raised.value)
    assert f"{images} (or {images[:-3]}, uncompressed) not found in {tmp_path / 'none'}" in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "github.com/zalandoresearch/fashion-mnist" in message and "--data_dir" in message


@pytest.mark.unit
@pytest.mark.parametrize("max_train_examples, options", [(0, {}), (9, {"image_size": 16}),
    (0, {"image_size": 32, "num_classes": 7, "num_train_examples": 40, "channels": 1})])  # fmt: skip
def test_synthetic_described_as_built(max_train_examples, options):
    request = dataclasses.replace(REQUEST, per_rank_batch=2, max_train_examples=max_train_examples)
    built = get_input("synthetic", request, **options)
    assert describe_input("synthetic", request, **options) == _shapes_of(built)


@pytest.mark.unit
def test_synthetic_description_at_a_32k_global_batch_makes_no_batch_and_no_dataset(monkeypatch):
    """32,768 images of 224x224x3 float32 would be 19.7 GB: describing them allocates none of it."""

    def refused(*args, **kwargs):
        raise AssertionError("describe_input built data")

    monkeypatch.setattr(synthetic, "_batch", refused)
    monkeypatch.setattr(tf.data.Dataset, "from_tensors", refused)
    monkeypatch.setattr(tf, "constant", refused)
    request = dataclasses.replace(REQUEST, per_rank_batch=32768, run_dir="/unused")
    assert describe_input("synthetic", request, image_size=224) == InputShapes((224, 224, 3), 1000, 1_281_167)
    with pytest.raises(AssertionError, match="built data"):  # the spies are in the builder's way
        get_input("synthetic", request, image_size=224)
