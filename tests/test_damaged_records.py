"""A damaged record file of prepared imagenet2012 data (a garbled record, a file cut at a record boundary)
is handed over by the input pipeline as an unreadable image is, named by the record file, in training and
in evaluation; under 2 real ranks it ends both with one line naming it, exit status 2, and the same command
resumes once the file is restored."""

import os
import shutil
import struct

import pytest

from tests.test_file_failures import ADVICE, one_damaged_read
from tests.test_imagenet import prepared  # noqa: F401 (the fixture: 18 training and 6 validation records)

VERSION = os.path.join("imagenet2012", "5.1.0")
TRAIN_FILE = "imagenet2012-train.tfrecord-00000-of-00001"
EVAL_FILE = "imagenet2012-validation.tfrecord-00000-of-00001"


def _record_offsets(path):
    """The byte offset of each record of a TFRecord file (length u64, its CRC u32, data, data CRC u32)."""
    offsets, data = [], open(path, "rb").read()
    at = 0
    while at < len(data):
        offsets.append(at)
        (length,) = struct.unpack("<Q", data[at : at + 8])
        at += 12 + length + 4
    return offsets


def _garble_record(path, index):
    """Overwrites 10 bytes inside record `index`'s data (its CRC then fails: DataLossError)."""
    data = bytearray(open(path, "rb").read())
    at = _record_offsets(path)[index] + 12 + 100
    data[at : at + 10] = b"\xff" * 10
    open(path, "wb").write(bytes(data))


def _copy(data_dir, tmp_path):
    copy = tmp_path / "tfds"
    shutil.copytree(data_dir, copy)
    return copy, copy / VERSION


@pytest.mark.unit
def test_damaged_record_files_are_handed_over_naming_the_file(prepared, tmp_path):  # noqa: F811
    from hvd_lars.data import InputRequest, get_input
    from hvd_lars.training import faults

    data_dir, folder = _copy(prepared[0], tmp_path)
    train, evaluation = str(folder / TRAIN_FILE), str(folder / EVAL_FILE)
    _garble_record(train, 4)
    # Cut at a record boundary: no error from TensorFlow's reader, only 3 records where the info counts 6.
    with open(evaluation, "r+b") as f:
        f.truncate(_record_offsets(evaluation)[3])
    noted = []
    request = InputRequest(
        per_rank_batch=3, rank=0, world_size=1, seed=0, data_dir=str(data_dir),
        on_unreadable=lambda path, split: noted.append((path, split)),
    )  # fmt: skip
    data = get_input("imagenet2012", request, image_size=32)
    images, _ = next(iter(data.train))  # the first window holds all 18 records: the damage among them
    assert images.shape == (3, 32, 32, 3)
    assert [int(y.shape[0]) for _, y in data.eval] == [3, 1]  # the 3 records read, then the record file
    # The pipeline may read ahead into the next pass and meet the damaged file again.
    assert set(noted) == {(train, "training"), (evaluation, "evaluation")}, noted
    assert noted[0] == (train, "training")

    faults.note_unreadable(*noted[0])
    assert faults.note() == (
        f"cannot read or decode the training record file {train}. Restore it from a copy or prepare the "
        "data set again with hvd-lars-prepare (or pass --skip_corrupt to leave out the records it cannot "
        f"give), {ADVICE}"
    )
    with pytest.raises(faults.FileFailure):
        faults.agree()
    faults.note_unreadable(*noted[-1])
    assert faults.note() == (
        f"cannot read or decode the evaluation record file {evaluation}. Restore it from a copy or prepare "
        f"the data set again with hvd-lars-prepare, {ADVICE}"
    )
    with pytest.raises(faults.FileFailure):
        faults.agree()


@pytest.mark.horovod
def test_a_damaged_training_record_file_ends_both_ranks_with_one_line_naming_it(prepared, tmp_path):  # noqa: F811
    data_dir, folder = _copy(prepared[0], tmp_path)
    damaged = folder / TRAIN_FILE
    _garble_record(str(damaged), 12)  # in rank 1's half, records 9-17
    line = one_damaged_read(tmp_path, "imagenet2012", data_dir, str(damaged))
    assert line == (
        f"hvd_lars: error: rank 1 of 2: cannot read or decode the training record file {damaged}. Restore it "
        "from a copy or prepare the data set again with hvd-lars-prepare (or pass --skip_corrupt to leave "
        f"out the records it cannot give), {ADVICE}"
    )
