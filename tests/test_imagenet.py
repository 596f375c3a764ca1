"""imagenet2012 through tensorflow-datasets: prepared before training (hvd_lars.data.imagenet_preparation,
hvd-lars-prepare) from a tiny ILSVRC-style pair of tars, then read; unprepared data refused."""

import collections
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_datasets.datasets.imagenet2012 import imagenet_common

from hvd_lars.data import InputRequest, InputShapes, describe_input, get_input, imagenet
from hvd_lars.data import imagenet_preparation as preparation
from tests.support import REPO, TWO_RANKS
from tests.support.data_fixtures import make_ilsvrc_tars
from tests.support.main_server import run_main

SYNSETS = ["n01440764", "n01443537", "n01739381", "n02105855"]
PER_CLASS = 4
# Two of the builder's own special cases: a listed CMYK JPEG and the PNG saved as .JPEG.
CMYK_NAME, PNG_NAME = "n01739381_1309.JPEG", "n02105855_2933.JPEG"
NUM_VAL = 6
# Label indices (0-based lines of the builder's sorted labels.txt): the training synsets, and the first
# six lines of its validation_labels.txt (n01751748, n09193705, n02105855, n04263257, n03125729, n01735189).
TRAIN_LABELS = {0: PER_CLASS, 1: PER_CLASS, 59: PER_CLASS + 1, 230: PER_CLASS + 1}
EVAL_LABELS = [65, 970, 230, 809, 516, 57]
# hvd-lars-prepare as its own process, with the fixture's short validation label file (the first argument).
PREPARE = [sys.executable, "-m", "tests.support.prepare_fixture"]


def _short_label_file(folder, lines):
    """The first `lines` lines of the builder's validation label file (a fixture holds not 50,000 images)."""
    path = os.path.join(folder, "validation_labels.txt")
    with open(preparation.validation_labels_path()) as f:
        head = f.read().splitlines()[:lines]
    with open(path, "w") as f:
        f.write("\n".join(head) + "\n")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet")
    manual, data_dir = str(root / "manual"), str(root / "tfds")
    make_ilsvrc_tars(manual, SYNSETS, PER_CLASS, NUM_VAL, cmyk_name=CMYK_NAME, png_name=PNG_NAME)
    with pytest.MonkeyPatch.context() as patch:  # tfds_path(absolute): the builder and the check read it
        patch.setattr(imagenet_common, "_VALIDATION_LABELS_FNAME", _short_label_file(str(root), NUM_VAL))
        done = preparation.prepare(manual, data_dir)
    assert done.converted and done.removed == []
    return data_dir, manual


def _request(data_dir, rank=0, world_size=1, batch=2, max_train_examples=0):
    fields = dict(seed=0, data_dir=data_dir, max_train_examples=max_train_examples, deterministic=True)
    return InputRequest(per_rank_batch=batch, rank=rank, world_size=world_size, **fields)


def _build(data_dir, rank=0, world_size=1, batch=2, max_train_examples=0, **options):
    """The imagenet2012 input of `data_dir` at 32x32 (`options`: of `imagenet.ImagenetOptions`)."""
    request = _request(data_dir, rank, world_size, batch, max_train_examples)
    return get_input("imagenet2012", request, **{"image_size": 32, **options})


@pytest.mark.unit
def test_prepared_sizes_description_records_and_rank_shares(prepared):
    data_dir, _ = prepared
    ranks = [_build(data_dir, rank=r, world_size=2, batch=3) for r in range(2)]
    # Described from the dataset info as built; each rank's sizes are the data set's.
    described = describe_input("imagenet2012", _request(data_dir), image_size=32)
    assert described == InputShapes((32, 32, 3), 1000, 18) and ranks[1].num_eval_examples == 6
    assert described == InputShapes(ranks[1].input_shape, ranks[1].num_classes, ranks[1].num_train_examples)
    train = [list(itertools.islice(r.train, 3)) for r in ranks]  # 9 records per rank: one epoch each
    assert train[0][0][0].shape == (3, 32, 32, 3) and train[0][0][0].dtype == tf.float32
    labels = [int(y) for batches in train for _, ys in batches for y in ys]
    assert collections.Counter(labels) == TRAIN_LABELS
    evaluation = [[int(y) for _, ys in r.eval for y in ys] for r in ranks]
    assert [len(e) for e in evaluation] == [3, 3]
    assert sorted(evaluation[0] + evaluation[1]) == sorted(EVAL_LABELS)
    # Each validation file carries its own line's label (line i labels ILSVRC2012_val_<i>).
    builder = preparation.builder(data_dir)
    by_name = {
        name.numpy().decode(): int(label) for name, _, label in imagenet._source(builder, "validation")
    }
    assert by_name == {f"ILSVRC2012_val_{i + 1:08d}.JPEG": label for i, label in enumerate(EVAL_LABELS)}
    # The builder converted the CMYK JPEG and the PNG to RGB JPEGs.
    found = {name.numpy().decode(): data for name, data, _ in imagenet._source(builder, "train")}
    for name in (CMYK_NAME, PNG_NAME):
        assert bool(tf.io.is_jpeg(found[name])) and tf.io.decode_jpeg(found[name]).shape == (28, 28, 3)


@pytest.mark.unit
def test_refused_until_prepared_a_copy_read_and_prepared_already_without_the_tars_until_damaged(
    prepared, tmp_path, capsys
):
    from hvd_lars import prepare

    data_dir, manual = prepared
    copy = tmp_path / "tfds"
    expected = (
        f"ImageNet is not prepared under --data_dir={copy} (there is no {copy}/imagenet2012/5.1.0). Prepare "
        "it once, on one node, before training: hvd-lars-prepare imagenet2012 --manual_dir=<folder holding "
        f"ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar> --data_dir={copy}; then train with the same "
        "--data_dir."
    )
    for refused in (_build, lambda d: describe_input("imagenet2012", _request(d), image_size=32)):
        with pytest.raises(preparation.NotPrepared) as info:
            refused(str(copy))
        assert str(info.value) == expected and isinstance(info.value, FileNotFoundError)
    assert not os.path.exists(copy)  # nothing written, nothing converted
    shutil.copytree(data_dir, copy)
    described = describe_input("imagenet2012", _request(str(copy), max_train_examples=5), image_size=32)
    assert described == InputShapes((32, 32, 3), 1000, 5)  # the training records limited to the first 5
    # The command on prepared data: nothing to do, and the tars are not looked for.
    assert prepare.main(["imagenet2012", f"--manual_dir={tmp_path / 'none'}", f"--data_dir={copy}"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"[hvd_lars] imagenet2012 is prepared already under {copy}/imagenet2012/5.1.0: 18 training and 6 "
        "validation images.",
        f"[hvd_lars] train on it with --dataset=imagenet2012 --data_dir={copy} (the ImageNet flagfiles set "
        f"the dataset), e.g. launch/mpirun.sh hostfile 512 flags/resnet50_bs32k_lars.flags --data_dir={copy}",
    ]
    assert not os.path.exists(tmp_path / "none")
    variant = copy / "imagenet2012" / "5.1.0"
    (variant / "imagenet2012-validation.tfrecord-00000-of-00001").unlink()
    with pytest.raises(
        preparation.NotPrepared, match=r"5\.1\.0 lacks 1 of its record files \(imagenet2012-valid"
    ):
        _build(str(copy))
    # tensorflow-datasets would reuse the folder as it is: the preparation refuses, saying what to remove.
    with pytest.raises(preparation.CannotPrepare, match=f"remove it \\(rm -r {variant}\\)"):
        preparation.prepare(manual, str(copy))
    (variant / "features.json").unlink()
    with pytest.raises(preparation.NotPrepared, match="5.1.0 lacks features.json"):
        _build(str(copy))


@pytest.mark.unit
def test_the_default_folder_is_tensorflow_datasets_own(monkeypatch):
    from tensorflow_datasets.core import constants

    monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
    for expected in (os.path.join(os.path.expanduser("~"), "tensorflow_datasets"), "/elsewhere/tfds"):
        assert preparation.default_data_dir() == constants.get_default_data_dir() == expected
        monkeypatch.setenv("TFDS_DATA_DIR", "/elsewhere/tfds")  # for the second


@pytest.mark.unit
def test_the_loop_trains_on_prepared_imagenet(prepared, tmp_path):
    from tests.support.small_runs import train_small_cnn

    data_dir, _ = prepared
    # --max_train_examples=13: the first 13 of the 18 training records, 3 updates of 4 images.
    summary = train_small_cnn("imagenet2012", data_dir, tmp_path, "inet", 4, 1, max_train_examples=13)
    assert summary["plan"]["steps_per_epoch"] == 3 and summary["plan"]["settings"]["train_examples"] == 13
    correct = summary["final_test_top1"] * NUM_VAL  # exact counts over the 6 validation images
    assert abs(correct - round(correct)) < 1e-9


def _wait_for(path, process, limit_s=300):
    """Returns once `path` exists; fails if `process` ends first (or, a safety net only, after `limit_s`)."""
    start = time.monotonic()
    while not os.path.exists(path):
        assert process.poll() is None, (
            f"ended with {process.returncode} before {path}:\n{process.stdout.read()}"
        )
        assert time.monotonic() - start < limit_s, f"no {path} after {limit_s} s"
        time.sleep(0.05)


@pytest.mark.horovod
def test_interrupted_preparation_counts_for_nothing_and_runs_again_cleanly(prepared, tmp_path):
    reference, manual = prepared
    data_dir, dataset = str(tmp_path / "tfds"), tmp_path / "tfds" / "imagenet2012"
    labels = _short_label_file(str(tmp_path), NUM_VAL)
    arguments = ["imagenet2012", f"--manual_dir={manual}", f"--data_dir={data_dir}"]
    # SIGKILLed (nothing can clean up after it) once the training split's records are written and before
    # the validation split's: tests/support/prepare_fixture.py writes the marker and waits there.
    marker = str(tmp_path / "first_records")
    command = [*PREPARE, labels, f"--stop_after_first_records={marker}", "--", *arguments]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(marker, process)
    finally:
        process.kill()  # SIGKILL
        process.communicate()
    assert process.returncode == -signal.SIGKILL
    left = (tmp_path / "first_records").read_text()
    assert os.listdir(left) == ["imagenet2012-train.tfrecord-00000-of-00001"]
    assert sorted(os.listdir(dataset)) == sorted([preparation.LOCK_NAME, os.path.basename(left)])

    # Nothing counts as prepared: each of two Horovod ranks stops at once with one line naming the command.
    expected = (
        f"hvd_lars: error: ImageNet is not prepared under --data_dir={data_dir} (there is no "
        f"{dataset}/5.1.0, only {os.path.basename(left)} of a preparation at work or interrupted). Prepare "
        "it once, on one node, before training: hvd-lars-prepare imagenet2012 --manual_dir=<folder holding "
        f"ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar> --data_dir={data_dir}; then train with the "
        "same --data_dir."
    )
    train = [*TWO_RANKS, sys.executable, "-m", "hvd_lars.main", "--dataset=imagenet2012", "--epochs=1",
             f"--data_dir={data_dir}", "--model=small_cnn", "--image_size=32", "--global_batch_size=4",
             "--warmup_epochs=0", "--peak_learning_rate=0.1", f"--workdir={tmp_path}/runs"]  # fmt: skip
    two = run_main(train, cwd=REPO, timeout=300)
    output = two.stdout + two.stderr
    assert two.returncode != 0 and "Traceback" not in output
    # A host's own data: each rank says it, rank 1 naming itself (horovodrun prefixes [1,r]<stderr>:).
    assert f"[1,0]<stderr>:{expected}" in output, output[-3000:]
    rank_1 = expected.replace("hvd_lars: error:", "hvd_lars rank 1: error:", 1)
    assert f"[1,1]<stderr>:{rank_1}" in output, output[-3000:]
    # Nothing is left of the refused start: its run directory went with the claim's lock file.
    assert os.listdir(tmp_path / "runs") == []

    # The same command again removes what the killed one left and writes the uninterrupted run's records.
    again = subprocess.run([*PREPARE, labels, "--", *arguments], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    said = [line for line in again.stdout.splitlines() if line.startswith("[hvd_lars]")]
    assert said[0] == f"[hvd_lars] removed what interrupted preparations left: {left}"
    assert said[1].startswith(
        f"[hvd_lars] preparing imagenet2012 from --manual_dir={manual} into {dataset}/5"
    )
    assert re.fullmatch(
        rf"\[hvd_lars\] imagenet2012 prepared in \d+:\d\d:\d\d \(h:mm:ss\) under {dataset}/5\.1\.0: "
        r"18 training and 6 validation images\.",
        said[2],
    ), said
    assert said[3].startswith(f"[hvd_lars] train on it with --dataset=imagenet2012 --data_dir={data_dir} ")
    assert "Generating train examples..." in again.stdout + again.stderr  # tensorflow-datasets' bars
    assert sorted(os.listdir(dataset)) == sorted([preparation.LOCK_NAME, "5.1.0"])
    preparation.prepared_builder(data_dir)
    records = sorted(n for n in os.listdir(dataset / "5.1.0") if ".tfrecord-" in n)
    assert records == [f"imagenet2012-{s}.tfrecord-00000-of-00001" for s in ("train", "validation")]
    for name, count in zip(records, (18, NUM_VAL)):
        # Compared as examples: the order of an Example's features varies from process to process.
        ours, uninterrupted = (
            [tf.train.Example.FromString(r.numpy()) for r in tf.data.TFRecordDataset(os.fspath(path))]
            for path in (dataset / "5.1.0" / name, os.path.join(reference, "imagenet2012", "5.1.0", name))
        )
        assert len(ours) == count and ours == uninterrupted


@pytest.mark.unit
def test_a_validation_tar_with_extra_or_missing_entries_is_refused_before_preparation(tmp_path):
    names = [f"ILSVRC2012_val_{i:08d}.JPEG" for i in (1, 2, 3, 5, 6, 7)] + ["val/", "notes.txt"]
    make_ilsvrc_tars(str(tmp_path), SYNSETS[:1], 1, 0, val_names=names)
    labels = _short_label_file(str(tmp_path), NUM_VAL)
    with pytest.raises(ValueError) as info:
        preparation.check_validation_tar(str(tmp_path / "ILSVRC2012_img_val.tar"), labels)
    message = str(info.value)
    assert "the 6 validation images" in message and "missing 1 (ILSVRC2012_val_00000004.JPEG)" in message
    assert "extra 3 (ILSVRC2012_val_00000007.JPEG, notes.txt, val)" in message
    make_ilsvrc_tars(str(tmp_path), SYNSETS[:1], 1, NUM_VAL)
    assert preparation.check_validation_tar(str(tmp_path / "ILSVRC2012_img_val.tar"), labels) == NUM_VAL
    # Images 2 and 3 alone, against the whole label file: prepared, they would carry lines 1 and 2's labels.
    manual, data_dir = str(tmp_path / "manual"), tmp_path / "tfds"
    make_ilsvrc_tars(manual, SYNSETS[:1], 1, 0, val_names=names[1:3])
    with pytest.raises(preparation.CannotPrepare) as info:
        preparation.prepare(manual, str(data_dir))
    message = str(info.value)
    assert "does not hold exactly the 50,000 validation images" in message and "extra none" in message
    assert "missing 49,998 (ILSVRC2012_val_00000001.JPEG, ILSVRC2012_val_00000004.JPEG" in message
    assert os.listdir(data_dir / "imagenet2012") == [preparation.LOCK_NAME]  # refused before converting


@pytest.mark.unit
def test_resume_at_step_100_reads_and_decodes_no_more_than_at_step_0(prepared, monkeypatch):
    from tests.support.read_counter import ReadCounter

    data_dir, _ = prepared
    counter = ReadCounter(monkeypatch)
    # Blocks of 3 records shuffled 2 blocks (6 records) at a time: 3 windows per epoch of 18 records.
    data = _build(data_dir, batch=2, block_records=3, shuffle_buffer=6)
    straight = [(x.numpy(), y.numpy()) for x, y in itertools.islice(data.train, 103)]
    labels = np.concatenate([y for _, y in straight])
    for epoch in range(3):  # each epoch is a permutation of the 18 records, a new one each time
        assert collections.Counter(labels[18 * epoch : 18 * (epoch + 1)].tolist()) == TRAIN_LABELS
    assert labels[:18].tolist() != labels[18:36].tolist()
    counts = {}
    for step in (0, 100):
        counter.reset()
        stream = data.train_from(step) if step else data.train  # train: train_from(0), built with data
        resumed = [(x.numpy(), y.numpy()) for x, y in itertools.islice(stream, 3)]
        counts[step] = counter.settled()
        np.testing.assert_equal(resumed, straight[step : step + 3])
        # Decoded: the 6 elements of the 3 batches, and what the pipeline read ahead (the read-ahead still
        # in flight when the iterator is dropped is cancelled, so it may leave gaps); none before them.
        decoded = sorted(counter.decoded)
        assert decoded[:6] == list(range(2 * step, 2 * step + 6)) and decoded[-1] < 2 * step + 6 + 16
    # Records read (blocks inside a file read past the records before them, undecoded): at step 100 the
    # window holding element 200 and the next, as at step 0 the first two windows; never earlier ones. The
    # read-ahead's reach depends on timing, so the bound allows two more windows; replaying the 11 epochs
    # before element 200 would read about 200 records.
    assert counts[100][1] <= counts[0][1] + 36 and counts[100][2] <= counts[0][2] + 8
