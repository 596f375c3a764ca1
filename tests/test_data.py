"""Fashion-MNIST from the Debian files; per-rank shards."""

import numpy as np
import pytest

from hvd_lars.data import fashion_mnist, get_input
from hvd_lars.data.sharding import eval_shard_range, train_shard_indices


def test_fashion_mnist_splits():
    x, y = fashion_mnist.load("train")
    assert x.shape == (60000, 28, 28, 1) and x.dtype == np.uint8
    assert y.shape == (60000,) and sorted(np.unique(y)) == list(range(10))
    assert np.bincount(y).tolist() == [6000] * 10  # balanced classes (Xiao et al. 2017)
    x, y = fashion_mnist.load("test")
    assert x.shape == (10000, 28, 28, 1) and np.bincount(y).tolist() == [1000] * 10


def test_fashion_mnist_statistics():
    x, _ = fashion_mnist.load("train")
    x = x.astype(np.float64) / 255.0
    assert x.mean() == pytest.approx(fashion_mnist.MEAN, abs=5e-5)
    assert x.std() == pytest.approx(fashion_mnist.STD, abs=5e-5)


def test_missing_data_names_the_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist.load("train", str(tmp_path))


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ValueError, match="'imagenet9'.*fashion_mnist"):
        get_input("imagenet9")


@pytest.mark.parametrize("n, world", [(60000, 2), (10, 3), (7, 7), (10000, 6)])
def test_train_shards_disjoint_and_equal(n, world):
    shards = [train_shard_indices(n, r, world) for r in range(world)]
    assert {len(s) for s in shards} == {n // world}
    together = np.concatenate(shards)
    assert len(np.unique(together)) == len(together) == (n // world) * world


@pytest.mark.parametrize("n, world", [(10000, 2), (10000, 3), (5, 4), (1, 2)])
def test_eval_shards_cover_every_example_once(n, world):
    covered = np.concatenate([np.arange(*eval_shard_range(n, r, world)) for r in range(world)])
    np.testing.assert_array_equal(covered, np.arange(n))


def test_pipeline_batches_and_normalisation():
    data = get_input(
        "fashion_mnist",
        per_rank_batch=64,
        rank=1,
        world_size=2,
        seed=0,
        max_train_examples=256,
        max_eval_examples=100,
        eval_batch=30,
    )
    images, labels = next(iter(data.train))
    assert images.shape == (64, 28, 28, 1) and labels.shape == (64,)
    assert images.dtype == "float32"
    eval_sizes = [int(b[1].shape[0]) for b in data.eval]
    assert eval_sizes == [30, 20]  # rank 1 of 2 evaluates images 50..99
    x, _ = fashion_mnist.load("test")
    first = next(iter(data.eval))[0].numpy()
    want = (x[50:80].astype(np.float32) / 255.0 - fashion_mnist.MEAN) / fashion_mnist.STD
    np.testing.assert_allclose(first, want, rtol=1e-6)
