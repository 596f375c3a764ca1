"""The image-folder pipeline on a real folder of JPEGs (with CMYK, greyscale, PNG-as-JPEG, corrupt files)."""

import itertools
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from hvd_lars.data import (
    InputRequest,
    InputShapes,
    describe_input,
    encoded_images,
    get_input,
    image_folder,
    listing,
    order,
)
from hvd_lars.data import preprocessing as pp
from tests.support import REPO, TWO_RANKS
from tests.support.data_fixtures import PNG, encode, make_image_folder
from tests.support.main_server import run_main
from tests.support.small_runs import train_small_cnn


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    return str(root), make_image_folder(str(root), [3, 3, 3, 3], [2, 2, 2, 1])


def _request(root, batch=2, **fields):
    fields = {"rank": 0, "world_size": 1, "seed": 0, "deterministic": True, **fields}
    return InputRequest(per_rank_batch=batch, data_dir=root, **fields)


def _build(root, batch=2, **fields):
    """The image-folder input of `root` at 28x28 (`fields`: of the `InputRequest`)."""
    return get_input("image_folder", _request(root, batch, **fields), image_size=28)


def _shapes(data):
    return InputShapes(data.input_shape, data.num_classes, data.num_train_examples)


def _eval_errors(batches, written, preprocessing=None, size=28):
    """Each evaluation image's mean distance from the view of its lossless source, and the labels."""
    images = np.concatenate([x.numpy() for x, _ in batches])
    views = pp.get_preprocessing(preprocessing)
    sources = [views.eval(tf.constant(encode(source, PNG)), size).numpy() for _, _, _, source in written]
    return np.abs(images - sources).mean(axis=(1, 2, 3)), np.concatenate([y.numpy() for _, y in batches])


@pytest.mark.unit
def test_eval_covers_each_file_once_with_odd_files_decoded_right(folder):
    root, written = folder
    data = _build(root, batch=3, max_train_examples=50)  # more than the 12 there: all
    described = describe_input("image_folder", _request(root, max_train_examples=50), image_size=28)
    assert _shapes(data) == described == InputShapes((28, 28, 3), 4, 12)
    assert data.num_eval_examples == 7 and data.skipped_corrupt is None
    batches = list(data.eval)
    assert [int(y.shape[0]) for _, y in batches] == [3, 3, 1]
    errors, labels = _eval_errors(batches, written["validation"])
    assert labels.tolist() == [c for _, c, _, _ in written["validation"]] == [0, 0, 1, 1, 2, 2, 3]
    # Exact for the PNG; the CMYK and greyscale JPEGs in the right colours.
    kinds = [kind for _, _, kind, _ in written["validation"]]
    assert kinds == ["cmyk", "rgb", "grey", "rgb", "png", "rgb", "rgb"]
    assert errors[4] == pytest.approx(0, abs=1e-6) and errors.max() < 0.06, errors
    train_images, _ = next(iter(data.train))
    assert train_images.shape == (3, 28, 28, 3)
    assert np.abs(train_images.numpy()).max() > 1.0  # not caffe_scaled's (pixel - mean) / 256


@pytest.mark.unit
def test_max_examples_keep_every_class_described_as_built_listing_the_training_split_once(
    folder, tmp_path, monkeypatch
):
    # describe_input lists train/ and saves the index; the built input lists validation/ alone.
    listed = []
    list_split = listing.list_split
    monkeypatch.setattr(listing, "list_split", lambda root, *a: listed.append(root) or list_split(root, *a))
    root, written = folder
    request = _request(root, 4, seed=1, max_train_examples=4, max_eval_examples=4, run_dir=str(tmp_path))
    options = dict(image_size=0, preprocessing="caffe_scaled")  # image_size 0: the default, 224
    described = describe_input("image_folder", request, **options)
    assert os.listdir(tmp_path / image_folder.INDEX_FOLDER) == ["train.index.npz"]
    data = get_input("image_folder", request, **options)
    assert _shapes(data) == described == describe_input("image_folder", request, **options)
    assert listed == [f"{root}/train", f"{root}/validation"]  # the second description read the index
    assert described == InputShapes((224, 224, 3), 4, 4) and data.num_eval_examples == 4
    train_images, train_labels = next(iter(data.train))
    # One image of each class, in seed 1's order of epoch 0 (seed 0's is another).
    want = order.epoch_permutation(4, 1, 0).numpy().tolist()
    assert train_labels.numpy().tolist() == want != order.epoch_permutation(4, 0, 0).numpy().tolist()
    assert np.abs(train_images.numpy()).max() < 1.0  # caffe_scaled: (pixel - mean) / 256
    kept = [written["validation"][i] for i in (0, 1, 3, 5)]  # files 0, 1, 3, 5 of 7
    errors, labels = _eval_errors(list(data.eval), kept, "caffe_scaled", 224)
    assert labels.tolist() == [0, 0, 1, 2] and errors.max() < 0.06, errors


@pytest.mark.unit
def test_a_corrupt_file_raises_naming_it(tmp_path):
    make_image_folder(str(tmp_path), [2, 2, 2], [1, 1, 1], odd={}, corrupt=("validation", 2))
    (tmp_path / "train" / "n00000001" / "broken.JPEG").write_bytes(b"not an image")
    data = _build(str(tmp_path), batch=1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"n00000001/broken\.JPEG"):
        list(itertools.islice(data.train, 8))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"n00000002/broken\.JPEG"):
        list(data.eval)


@pytest.mark.unit
def test_skipped_count_is_exact_once_the_stream_is_read_to_its_end():
    good = [encode(np.full((8, 8, 3), 40 * c, np.uint8), PNG) for c in range(3)]
    names = ["a.png", "broken.png", "b.png", "c.png"]
    datas = [good[0], b"not an image", good[1], good[2]]
    epochs = 4  # a finite stream: read to its end, read-ahead has nothing left to run ahead to
    stream = tf.data.Dataset.from_tensor_slices((names, datas, [0, 1, 1, 2])).repeat(epochs)
    skipped = encoded_images.skipped_counter()
    batches = encoded_images.train_dataset(stream, per_rank_batch=1, seed=0, image_size=8, skipped=skipped)
    labels = [int(y.numpy()[0]) for _, y in batches]
    assert labels == [0, 1, 2] * epochs and int(skipped.numpy()) == epochs


@pytest.mark.unit
def test_the_loop_trains_on_an_image_folder_skipping_and_reporting_corrupt_files(tmp_path):
    make_image_folder(str(tmp_path / "data"), [2, 2, 2], [1, 1, 1], odd={}, corrupt=("train", 1))
    settings = dict(skip_corrupt=True, preprocessing="caffe_scaled")
    summary = train_small_cnn("image_folder", tmp_path / "data", tmp_path, "c", 2, 2, **settings)
    assert summary["plan"]["steps_per_epoch"] == 3  # 7 files // 2
    # The 32x32 crops reached the model: small_cnn's fc1 sees (32 / 4)^2 x 32 = 2,048 features (1,568 at 28).
    reader = tf.train.load_checkpoint(str(tmp_path / "c" / "checkpoints"))
    assert [2048, 128] in reader.get_variable_to_shape_map().values()
    correct = summary["final_test_top1"] * 3  # exact counts over the 3 validation images
    assert abs(correct - round(correct)) < 1e-9
    # The one broken training file is met once per pass over the shard (read-ahead may meet it early).
    assert [e["skipped_corrupt_images"] >= e["epoch"] for e in summary["epochs"]] == [True, True]


@pytest.mark.horovod
def test_a_work_directory_that_is_a_file_is_one_line_from_rank_0(folder, tmp_path):
    (tmp_path / "file").write_text("")
    cmd = [*TWO_RANKS, sys.executable, "-m", "hvd_lars.main",
           "--dataset=image_folder", f"--data_dir={folder[0]}", "--global_batch_size=4",
           "--peak_learning_rate=0.1", f"--workdir={tmp_path / 'file'}", "--run_name=r"]  # fmt: skip
    result = run_main(cmd, cwd=REPO, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    run_dir = tmp_path / "file" / "r"
    line = f"hvd_lars: error: cannot write the run directory {run_dir}: [Errno 20] Not a directory"
    output = result.stdout + result.stderr
    # Every rank meets it; rank 0 says it (one process: tests/test_faults.py).
    assert output.count("hvd_lars: error:") == output.count(line) == 1, output[-3000:]
    assert f"[1,0]<stderr>:{line}" in output, output[-3000:]


@pytest.mark.unit
def test_train_epochs_are_shard_permutations_and_a_resume_at_step_40_reads_no_more_than_at_0(
    tmp_path, monkeypatch
):
    from tests.support.read_counter import ReadCounter

    # 13 classes of one training image each: a label names its image, so shards can be compared.
    make_image_folder(str(tmp_path), [1] * 13, [1] * 5, odd={})
    counter = ReadCounter(monkeypatch)
    data = _build(str(tmp_path), rank=1, world_size=2)
    counts, resumed = {}, {}
    for step, stream in ((0, data.train), (40, data.train_from(40))):
        counter.reset()
        resumed[step] = [(x.numpy(), y.numpy()) for x, y in itertools.islice(stream, 3)]
        counts[step] = counter.settled()
        # Decoded: the 6 elements of the 3 batches, and what the pipeline read ahead (the read-ahead still
        # in flight when the iterator is dropped is cancelled, so it may leave gaps); none before them.
        decoded = sorted(counter.decoded)
        assert decoded[:6] == list(range(2 * step, 2 * step + 6)) and decoded[-1] < 2 * step + 6 + 16
        # Each file opened is decoded (a read in flight when the iterator is dropped may not be).
        assert len(counter.decoded) <= len(counter.files) <= len(counter.decoded) + 4
    # How far the pipeline reads ahead in the background varies by a few elements either way.
    assert counts[40][0] <= counts[0][0] + 8 and counts[40][2] <= counts[0][2] + 8
    # What an uninterrupted run reads: 14 epochs of rank 1's 6 images (13 // 2; image 12 left out).
    straight = [(x.numpy(), y.numpy()) for x, y in itertools.islice(data.train, 43)]
    labels = np.concatenate([y for _, y in straight]).tolist()
    assert sorted(labels[:6]) == sorted(labels[6:12]) == [1, 3, 5, 7, 9, 11]
    assert labels[:6] != labels[6:12]  # reshuffled each epoch
    # The same batches as the uninterrupted run at those steps, pixel for pixel (same crops).
    for step in (0, 40):
        for got, want in zip(resumed[step], straight[step : step + 3], strict=True):
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), step


@pytest.mark.unit
@pytest.mark.parametrize("build", [get_input, describe_input])
def test_without_a_data_dir_or_folder_says_what_to_pass(tmp_path, build):
    with pytest.raises(ValueError, match="needs --data_dir"):
        build("image_folder", _request(None), image_size=28)
    with pytest.raises(FileNotFoundError, match="train/<class>" if build is get_input else "train not found"):
        build("image_folder", _request(str(tmp_path)), image_size=28)
