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

TRAIN_COUNTS, EVAL_COUNTS = [3, 3, 3, 3], [2, 2, 2, 1]
SEED = 0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    return str(root), make_image_folder(str(root), TRAIN_COUNTS, EVAL_COUNTS)


@pytest.fixture(scope="module")
def one_per_class(tmp_path_factory):
    # 13 classes of one training image each: a label names its image, so shards can be compared.
    root = tmp_path_factory.mktemp("unique")
    return str(root), make_image_folder(str(root), [1] * 13, [1] * 5, odd={})


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt")
    make_image_folder(str(root), [2, 2, 2], [1, 1, 1], odd={}, corrupt=("train", 1))
    make_image_folder(str(root / "evalbad"), [2, 2, 2], [1, 1, 1], odd={}, corrupt=("validation", 2))
    return str(root)


def _request(root, rank=0, world_size=1, batch=2, **fields):
    fields = {"seed": SEED, "deterministic": True, **fields}
    return InputRequest(per_rank_batch=batch, rank=rank, world_size=world_size, data_dir=root, **fields)


def _build(root, rank=0, world_size=1, batch=2, preprocessing=None, skip_corrupt=False, **fields):
    """The image-folder input of `root` at 28x28 with these options (`fields`: of the `InputRequest`)."""
    request = _request(root, rank, world_size, batch, **fields)
    options = dict(image_size=28, preprocessing=preprocessing, skip_corrupt=skip_corrupt)
    return get_input("image_folder", request, **options)


def _labels(dataset, batches=None):
    return np.concatenate([y.numpy() for _, y in itertools.islice(dataset, batches)]).tolist()


@pytest.mark.unit
@pytest.mark.parametrize("preprocessing", [None, "caffe_scaled"])
def test_eval_covers_each_file_once_with_odd_files_decoded_right(folder, preprocessing):
    root, written = folder
    data = _build(root, batch=3, preprocessing=preprocessing)
    assert (data.num_train_examples, data.num_eval_examples, data.num_classes) == (12, 7, 4)
    assert data.input_shape == (28, 28, 3) and data.skipped_corrupt is None
    batches = list(data.eval)
    assert [int(y.shape[0]) for _, y in batches] == [3, 3, 1]
    images = np.concatenate([x.numpy() for x, _ in batches])
    labels = np.concatenate([y.numpy() for _, y in batches])
    assert labels.tolist() == [c for _, c, _, _ in written["validation"]] == [0, 0, 1, 1, 2, 2, 3]
    assert {"cmyk", "grey", "png"} <= {kind for _, _, kind, _ in written["validation"]}
    views = pp.get_preprocessing(preprocessing or "inception")
    for image, (_, _, kind, source) in zip(images, written["validation"]):
        # The view of the lossless source: exact for the PNG, CMYK and greyscale JPEGs in the right colours.
        error = np.abs(image - views.eval(tf.constant(encode(source, PNG)), 28).numpy()).mean()
        assert error == pytest.approx(0, abs=1e-6) if kind == PNG else error < 0.06, (kind, error)
    train_images, _ = next(iter(data.train))
    assert train_images.shape == (3, 28, 28, 3)
    # caffe_scaled: (pixel - mean) / 256, not the Inception normalisation.
    assert (np.abs(train_images.numpy()).max() < 1.0) == (preprocessing == "caffe_scaled")


@pytest.mark.unit
def test_train_epochs_are_permutations_of_the_shard_and_repeat_for_a_seed(one_per_class):
    root, _ = one_per_class
    data = _build(root, rank=0, world_size=2)
    labels = _labels(data.train, 6)  # two epochs of 6 images (13 // 2; image 12 left out)
    assert sorted(labels[:6]) == sorted(labels[6:]) == [0, 2, 4, 6, 8, 10]
    assert labels[:6] != labels[6:]  # reshuffled each epoch
    first = [x.numpy() for x, _ in itertools.islice(data.train, 3)]
    again = [x.numpy() for x, _ in itertools.islice(_build(root, rank=0, world_size=2).train, 3)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)  # a fresh pipeline, same seed: the same stream (resume)
    other = next(iter(_build(root, rank=0, world_size=2, seed=1).train))[0].numpy()
    assert np.abs(other - first[0]).max() > 0.1
    assert sorted(_labels(_build(root, rank=1, world_size=2).train, 3)) == [1, 3, 5, 7, 9, 11]


@pytest.mark.unit
def test_max_examples_keep_every_class(folder):
    data = _build(folder[0], batch=4, max_train_examples=4, max_eval_examples=4)
    assert (data.num_train_examples, data.num_eval_examples) == (4, 4)
    assert sorted(_labels(data.train, 1)) == [0, 1, 2, 3]
    assert _labels(data.eval) == [0, 0, 1, 2]  # files 0, 1, 3, 5 of 7


@pytest.mark.unit
def test_a_corrupt_file_raises_naming_it_or_is_skipped_and_counted(corrupt):
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"n00000001/broken\.JPEG"):
        _labels(_build(corrupt, batch=1).train, 8)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"n00000002/broken\.JPEG"):
        list(_build(corrupt + "/evalbad", batch=2).eval)
    data = _build(corrupt, batch=1, skip_corrupt=True)
    labels = _labels(data.train, 18)  # three epochs of the 6 readable images
    for epoch in range(3):
        assert sorted(labels[6 * epoch : 6 * (epoch + 1)]) == [0, 0, 1, 1, 2, 2]
    # At least the broken files the stream holds before its 18th readable image; tf.data may read ahead.
    paths = listing.list_split(os.path.join(corrupt, "train")).paths()
    broken = [i for i, path in enumerate(paths) if path.endswith(b"broken.JPEG")]
    stream = list(itertools.islice(order.index_stream(len(paths), SEED).as_numpy_iterator(), 21))
    before_18th_readable = stream[: [i for i, k in enumerate(stream) if k not in broken][17]]
    assert int(data.skipped_corrupt.numpy()) >= sum(k in broken for k in before_18th_readable) >= 2


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
def test_the_loop_trains_on_an_image_folder_skipping_and_reporting_corrupt_files(corrupt, tmp_path):
    summary = train_small_cnn(
        "image_folder", corrupt, tmp_path, "c", 2, 2, skip_corrupt=True, preprocessing="caffe_scaled"
    )
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


def _batches(dataset, count):
    return [(x.numpy(), y.numpy()) for x, y in itertools.islice(dataset, count)]


@pytest.mark.unit
def test_resume_at_step_100_reads_and_decodes_no_more_than_at_step_0(one_per_class, monkeypatch):
    from tests.support.read_counter import ReadCounter

    counter = ReadCounter(monkeypatch)
    data = _build(one_per_class[0], batch=2)
    straight = _batches(data.train, 103)  # 15 epochs of the 13 images: what an uninterrupted run reads
    counts = {}
    for step in (0, 100):
        counter.reset()
        resumed = _batches(data.train_from(step), 3)
        counts[step] = counter.settled()
        # The same batches as the uninterrupted run at those steps, pixel for pixel (same crops).
        for (x, y), (want_x, want_y) in zip(resumed, straight[step : step + 3]):
            np.testing.assert_array_equal(x, want_x)
            np.testing.assert_array_equal(y, want_y)
        # Decoded: the 6 elements of the 3 batches, and what the pipeline read ahead (the read-ahead still
        # in flight when the iterator is dropped is cancelled, so it may leave gaps); none before them.
        decoded = sorted(counter.decoded)
        assert decoded[:6] == list(range(2 * step, 2 * step + 6)) and decoded[-1] < 2 * step + 6 + 16
        # Each file opened is decoded (a read in flight when the iterator is dropped may not be).
        assert len(counter.decoded) <= len(counter.files) <= len(counter.decoded) + 4
    # How far the pipeline reads ahead in the background varies by a few elements either way.
    assert counts[100][0] <= counts[0][0] + 8 and counts[100][2] <= counts[0][2] + 8


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs", [{}, {"max_train_examples": 5}, {"max_train_examples": 50, "image_size": 0}]
)
def test_described_as_built_listing_the_training_split_once(folder, tmp_path, monkeypatch, kwargs):
    # describe_input lists train/ and saves the index; the built input lists validation/ alone.
    listed = []
    list_split = listing.list_split
    monkeypatch.setattr(listing, "list_split", lambda root, *a: listed.append(root) or list_split(root, *a))
    root = folder[0]
    request = _request(root, run_dir=str(tmp_path), max_train_examples=kwargs.get("max_train_examples", 0))
    options = {"image_size": kwargs.get("image_size", 28)}
    described = describe_input("image_folder", request, **options)
    assert listed == [f"{root}/train"]
    assert os.listdir(tmp_path / image_folder.INDEX_FOLDER) == ["train.index.npz"]
    built = get_input("image_folder", request, **options)
    assert listed == [f"{root}/train", f"{root}/validation"]
    size = kwargs.get("image_size", 28) or 224  # 0: the default
    expected = InputShapes((size, size, 3), 4, min(12, kwargs.get("max_train_examples") or 12))
    assert described == expected
    assert InputShapes(built.input_shape, built.num_classes, built.num_train_examples) == expected
    assert describe_input("image_folder", request, **options) == expected
    assert len(listed) == 2  # read from the index


@pytest.mark.unit
@pytest.mark.parametrize("build", [get_input, describe_input])
def test_without_a_data_dir_or_folder_says_what_to_pass(tmp_path, build):
    with pytest.raises(ValueError, match="needs --data_dir"):
        build("image_folder", _request(None), image_size=28)
    with pytest.raises(FileNotFoundError, match="train/<class>" if build is get_input else "train not found"):
        build("image_folder", _request(str(tmp_path)), image_size=28)
