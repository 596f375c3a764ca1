"""A write of the run or a read of its data that fails ends every rank with one line, exit status 2, the
last complete checkpoint kept and no partial file left; the same command resumes once the cause is gone.
Writes that fail for real: a temporary file linked to /dev/full (ENOSPC) in-process, a full tmpfs under 2
real ranks."""

import glob
import os
import re
import subprocess
import sys
import time

import pytest

from tests.support import REPO
from tests.support.data_fixtures import make_image_folder
from tests.support.main_server import run_main
from tests.support.small_runs import TWO_RANKS, final_tensors

KILLER = os.path.join(REPO, "tests", "support", "kill_at_step.py")
ADVICE = "then start the same command again: it resumes from the last complete checkpoint."


def _model_with_step(step):
    import keras

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.optimizer.iterations.assign(step)
    return model


@pytest.mark.unit
def test_a_failed_write_keeps_the_file_whole_and_leaves_no_temporary(tmp_path):
    from hvd_lars.training import faults
    from hvd_lars.training.epoch_logs import MetricsCSV

    path = tmp_path / "metrics.csv"
    logger = MetricsCSV(str(path))
    logger.set_model(_model_with_step(3))
    logger.on_epoch_end(0, {"loss": 0.5})
    assert path.read_text() == "epoch,step,loss\n0,3,0.5\n" and faults.note() is None
    # The next write goes to /dev/full: ENOSPC, as on a full disk.
    os.symlink("/dev/full", f"{path}.tmp")
    logger.set_model(_model_with_step(6))
    logger.on_epoch_end(1, {"loss": 0.25})  # noted, not raised: the ranks stop together at their next vote
    assert path.read_text() == "epoch,step,loss\n0,3,0.5\n"
    assert os.listdir(tmp_path) == ["metrics.csv"]
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


@pytest.mark.unit
def test_unreadable_images_are_handed_over_instead_of_raised(tmp_path):
    from hvd_lars.data import InputRequest, get_input

    make_image_folder(str(tmp_path), [2, 2], [1, 1], odd={}, corrupt=("train", 1))
    with open(tmp_path / "validation" / "n00000000" / "n00000000_0.JPEG", "wb") as f:
        f.write(b"garbage")
    noted = []
    request = InputRequest(
        per_rank_batch=5, rank=0, world_size=1, seed=0, data_dir=str(tmp_path),
        on_unreadable=lambda path, split: noted.append((path, split)),
    )  # fmt: skip
    data = get_input("image_folder", request, image_size=28)
    images, _ = next(iter(data.train))  # the 5 training images, the broken one among them
    assert images.shape == (5, 28, 28, 3)
    broken = (str(tmp_path / "train" / "n00000001" / "broken.JPEG"), "training")
    # The input pipeline may read ahead into the next pass and decode the broken file again.
    assert noted[0] == broken and set(noted) == {broken}, noted
    assert sum(float(abs(image).max()) == 0 for image in images.numpy()) == 1  # its image: zeros
    assert [int(y.shape[0]) for _, y in data.eval] == [2]
    evaluation = [n for n in noted if n[1] == "evaluation"]
    assert evaluation == [(str(tmp_path / "validation" / "n00000000" / "n00000000_0.JPEG"), "evaluation")]

    from hvd_lars.training import faults

    faults.note_unreadable(*noted[0])
    assert faults.note() == (
        f"cannot read or decode the training image file {noted[0][0]}. Repair or remove it (or pass "
        f"--skip_corrupt to leave such training files out), {ADVICE}"
    )
    with pytest.raises(faults.FileFailure):
        faults.agree()


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
    mount = ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)]
    mount = subprocess.run(mount, capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root only): {mount.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


SMOKE = [
    "--flagfile=flags/smoke.flags", "--precision=float32", "--epochs=6",
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
    assert int(final_tensors(run_dir)["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 30


def one_damaged_read(tmp_path, dataset, data_dir, fragment):
    """Trains 2 ranks on `dataset` in `data_dir`, one of its files garbled: asserts the job ends with one line
    from rank 0 holding `fragment` and no temporary file (the resume once the cause is gone: the full disk's
    test); returns the line."""
    command = [
        *TWO_RANKS, sys.executable, "-m", "hvd_lars.main", f"--dataset={dataset}", f"--data_dir={data_dir}",
        "--model=small_cnn", "--image_size=32", "--global_batch_size=4", "--epochs=2", "--warmup_epochs=0",
        "--peak_learning_rate=0.1", "--checkpoint_every_steps=1", "--run_name=r",
        f"--workdir={tmp_path / 'w'}", "--verbose=0",
    ]  # fmt: skip
    began = time.monotonic()
    line = _one_line_from_rank_0(run_main(command, cwd=REPO, timeout=300), began, fragment)
    assert _temporaries(tmp_path / "w") == []
    return line


@pytest.mark.horovod
def test_a_damaged_training_image_ends_both_ranks_with_one_line_naming_it(tmp_path):
    data = tmp_path / "data"
    make_image_folder(str(data), [4] * 4, [1] * 4, odd={})
    damaged = data / "train" / "n00000002" / "n00000002_1.JPEG"
    damaged.write_bytes(b"garbage" * 100)
    fragment = f"cannot read or decode the training image file {damaged}."
    line = one_damaged_read(tmp_path, "image_folder", data, fragment)
    assert "--skip_corrupt" in line and line.endswith(ADVICE)
