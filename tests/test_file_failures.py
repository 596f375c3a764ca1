"""A write of the run or a read of its data that fails ends every rank with one line, exit status 2, the
last complete checkpoint kept and no partial file left; the same command resumes once the cause is gone.
Writes fail for real: a temporary file linked to /dev/full (ENOSPC) in-process, a full tmpfs under 2 ranks;
reads: a damaged image file, a garbled or cut record file of prepared imagenet2012 data."""

import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import types

import keras
import pytest
from tensorflow_datasets.datasets.imagenet2012 import imagenet_common

from hvd_lars.data import InputRequest, get_input, imagenet_preparation
from hvd_lars.training import faults
from hvd_lars.training.epoch_logs import MetricsCSV
from tests import test_imagenet as imagenet
from tests.support import REPO
from tests.support.data_fixtures import make_ilsvrc_tars, make_image_folder
from tests.support.main_server import run_main
from tests.support.small_runs import KILLER, TWO_RANKS, final_tensors

ADVICE = "then start the same command again: it resumes from the last complete checkpoint."
RESTORE = "Restore it from a copy or prepare the data set again with hvd-lars-prepare"
SKIP = "(or pass --skip_corrupt to leave out the records it cannot give)"
TRAIN_FILE = "imagenet2012-train.tfrecord-00000-of-00001"
EVAL_FILE = "imagenet2012-validation.tfrecord-00000-of-00001"


@pytest.mark.unit
def test_a_failed_write_keeps_the_file_whole_and_leaves_no_temporary(tmp_path):
    model = types.SimpleNamespace(optimizer=types.SimpleNamespace(iterations=keras.Variable(0)))
    path = tmp_path / "metrics.csv"
    logger = MetricsCSV(str(path))
    logger.set_model(model)
    model.optimizer.iterations.assign(3)
    logger.on_epoch_end(0, {"loss": 0.5})
    assert path.read_text() == "epoch,step,loss\n0,3,0.5\n" and faults.note() is None
    os.symlink("/dev/full", f"{path}.tmp")  # the next write: ENOSPC, as on a full disk
    model.optimizer.iterations.assign(6)
    logger.on_epoch_end(1, {"loss": 0.25})  # noted, not raised: the ranks stop together at their next vote
    assert path.read_text() == "epoch,step,loss\n0,3,0.5\n" and os.listdir(tmp_path) == ["metrics.csv"]
    message = (
        f"could not write {path}: [Errno 28] No space left on device. Free space or make it writable there "
        f"(or choose another --workdir), {ADVICE}"
    )
    assert faults.note() == message
    faults.note("a later failure")  # follows from the first: not the one reported
    with pytest.raises(faults.FileFailure) as raised:
        faults.agree()  # one process: no rank in the message
    assert str(raised.value) == message and faults.note() is None
    faults.agree()  # nothing noted: nothing raised


def _handed_over(dataset, data_dir, batch, **options):
    """(the input of `dataset`, its first training batch's images, [(path, split)] handed over)."""
    noted = []
    request = InputRequest(
        per_rank_batch=batch, rank=0, world_size=1, seed=0, data_dir=str(data_dir),
        on_unreadable=lambda path, split: noted.append((path, split)),
    )  # fmt: skip
    data = get_input(dataset, request, **options)
    images, _ = next(iter(data.train))
    return data, images, noted


def _reported(noted):
    faults.note_unreadable(*noted)
    message = faults.note()
    with pytest.raises(faults.FileFailure):
        faults.agree()
    return message


@pytest.mark.unit
def test_unreadable_images_are_handed_over_instead_of_raised(tmp_path):
    make_image_folder(str(tmp_path), [2, 2], [1, 1], odd={}, corrupt=("train", 1))
    damaged = tmp_path / "validation" / "n00000000" / "n00000000_0.JPEG"
    damaged.write_bytes(b"garbage")
    data, images, noted = _handed_over("image_folder", tmp_path, 5, image_size=28)
    assert images.shape == (5, 28, 28, 3)  # the 5 training images, the broken one among them
    broken = (str(tmp_path / "train" / "n00000001" / "broken.JPEG"), "training")
    # The input pipeline may read ahead into the next pass and decode the broken file again.
    assert noted[0] == broken and set(noted) == {broken}, noted
    assert sum(float(abs(image).max()) == 0 for image in images.numpy()) == 1  # its image: zeros
    assert [int(y.shape[0]) for _, y in data.eval] == [2]
    assert [n for n in noted if n[1] == "evaluation"] == [(str(damaged), "evaluation")]
    assert _reported(noted[0]) == (
        f"cannot read or decode the training image file {broken[0]}. Repair or remove it (or pass "
        f"--skip_corrupt to leave such training files out), {ADVICE}"
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """tests/test_imagenet.py's tars prepared (18 training and 6 validation records); their data_dir."""
    root = tmp_path_factory.mktemp("imagenet")
    names = dict(cmyk_name=imagenet.CMYK_NAME, png_name=imagenet.PNG_NAME)
    make_ilsvrc_tars(str(root / "manual"), imagenet.SYNSETS, imagenet.PER_CLASS, imagenet.NUM_VAL, **names)
    with pytest.MonkeyPatch.context() as patch:
        labels = imagenet._short_label_file(str(root), imagenet.NUM_VAL)
        patch.setattr(imagenet_common, "_VALIDATION_LABELS_FNAME", labels)
        imagenet_preparation.prepare(str(root / "manual"), str(root / "tfds"))
    return root / "tfds"


def _record_offsets(path):
    """The byte offset of each record of a TFRecord file (length u64, its CRC u32, data, data CRC u32)."""
    offsets, data, at = [], open(path, "rb").read(), 0
    while at < len(data):
        offsets.append(at)
        at += 12 + struct.unpack("<Q", data[at : at + 8])[0] + 4
    return offsets


def _garbled_copy(prepared_dir, tmp_path, record):
    """A copy of the prepared data whose training record `record` has 10 bytes overwritten (its CRC then
    fails: DataLossError); returns the copy and the folder of its record files."""
    copy = tmp_path / "tfds"
    shutil.copytree(prepared_dir, copy)
    folder = copy / "imagenet2012" / "5.1.0"
    data = bytearray((folder / TRAIN_FILE).read_bytes())
    at = _record_offsets(folder / TRAIN_FILE)[record] + 12 + 100
    data[at : at + 10] = b"\xff" * 10
    (folder / TRAIN_FILE).write_bytes(bytes(data))
    return copy, folder


@pytest.mark.unit
def test_damaged_record_files_are_handed_over_naming_the_file(prepared, tmp_path):
    data_dir, folder = _garbled_copy(prepared, tmp_path, 4)
    train, evaluation = str(folder / TRAIN_FILE), str(folder / EVAL_FILE)
    # Cut at a record boundary: no error from TensorFlow's reader, only 3 records where the info counts 6.
    with open(evaluation, "r+b") as f:
        f.truncate(_record_offsets(evaluation)[3])
    data, images, noted = _handed_over("imagenet2012", data_dir, 3, image_size=32)
    assert images.shape == (3, 32, 32, 3)  # the first window holds all 18 records: the damage among them
    assert [int(y.shape[0]) for _, y in data.eval] == [3, 1]  # the 3 records read, then the record file
    assert noted[0] == (train, "training") and set(noted) == {(train, "training"), (evaluation, "evaluation")}
    said = "cannot read or decode the {} record file {}. " + RESTORE
    assert _reported(noted[0]) == f"{said.format('training', train)} {SKIP}, {ADVICE}"
    assert _reported(noted[-1]) == f"{said.format('evaluation', evaluation)}, {ADVICE}"


def _one_line_from_rank_0(result, began, fragment):
    """Asserts what every failed write or read ends with: both ranks within 90 s, exit status 2, one line
    (rank 0 says what every rank stops for), no traceback; returns the line."""
    output = result.stdout + result.stderr
    assert time.monotonic() - began < 90
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "Horovod has been shut down" not in output, output[-3000:]
    # Open MPI forwards what it reads, not whole lines: one rank's line can run on into the other's.
    lines = re.findall(r"\[1,(\d)\]<stderr>:(hvd_lars: error: .*?)(?=\[1,\d\]<|$)", output, re.M)
    assert [rank for rank, _ in lines] == ["0"] and output.count("hvd_lars: error:") == 1, output[-3000:]
    assert fragment in lines[0][1], lines
    return lines[0][1]


def _temporaries(folder):
    paths = glob.glob(f"{folder}/**", recursive=True)
    return [p for p in paths if re.search(r"tmp|_temp", os.path.basename(p))]


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs mounted at tmp_path/disk (needs root: skipped otherwise)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root only): {mount.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


SMOKE = [
    "--flagfile=flags/smoke.flags", "--precision=float32", "--epochs=2",
    "--steps_per_epoch=5", "--checkpoint_every_steps=1", "--noasync_checkpoints", "--keep_checkpoints=3",
    "--verbose=0",
]  # fmt: skip


@pytest.mark.horovod
def test_a_full_disk_ends_both_ranks_with_one_line_and_resumes_once_freed(small_disk):
    command = [*TWO_RANKS, sys.executable, KILLER, *SMOKE, f"--workdir={small_disk}"]
    began = time.monotonic()
    result = run_main([*command, "--fill_disk_at_step=7"], cwd=REPO, timeout=300)
    run_dir = small_disk / "smoke"
    line = _one_line_from_rank_0(result, began, "No space left on device")
    assert line.startswith("hvd_lars: error: rank 0 of 2: could not write ") and line.endswith(ADVICE)
    assert str(run_dir) in line
    # No partial file: no temporary, every checkpoint file of a complete checkpoint, the newest of update 7.
    assert _temporaries(small_disk) == []
    folder = run_dir / "checkpoints"
    steps = sorted(int(f.split("-")[1].split(".")[0]) for f in os.listdir(folder) if f.startswith("ckpt-"))
    assert sorted(set(steps)) == [5, 6, 7] and len(steps) == 6  # .index and .data of each
    assert int(final_tensors(run_dir)["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 7
    os.remove(small_disk / "filler")
    resumed = run_main(command, cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 7)" in resumed.stdout
    assert int(final_tensors(run_dir)["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 10


@pytest.mark.horovod
def test_a_damaged_training_record_file_ends_both_ranks_with_one_line_naming_it(prepared, tmp_path):
    data_dir, folder = _garbled_copy(prepared, tmp_path, 12)  # in rank 1's half, records 9-17
    command = [
        *TWO_RANKS, sys.executable, "-m", "hvd_lars.main", "--dataset=imagenet2012", f"--data_dir={data_dir}",
        "--model=small_cnn", "--image_size=32", "--global_batch_size=4", "--epochs=2", "--warmup_epochs=0",
        "--peak_learning_rate=0.1", "--checkpoint_every_steps=1", "--run_name=r",
        f"--workdir={tmp_path / 'w'}", "--verbose=0",
    ]  # fmt: skip
    began = time.monotonic()
    line = _one_line_from_rank_0(run_main(command, cwd=REPO, timeout=300), began, str(folder / TRAIN_FILE))
    assert _temporaries(tmp_path / "w") == []
    damaged = folder / TRAIN_FILE
    assert (
        line
        == f"hvd_lars: error: rank 1 of 2: cannot read or decode the training record file {damaged}. "
        + (f"{RESTORE} {SKIP}, {ADVICE}")
    )
