"""hvd-lars-prepare: what it refuses before converting anything, and what needs no preparation."""

import collections
import fcntl
import os
import subprocess
import sys
import tempfile

import pytest

from hvd_lars import prepare
from hvd_lars.data import DATASETS
from hvd_lars.data import imagenet_preparation as preparation
from tests.support import REPO

TARS = "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar"


def _prepare(capsys, *arguments):
    """(exit status, stdout lines, stderr lines) of `hvd-lars-prepare arguments...`, in this process."""
    status = prepare.main(list(arguments))
    out, err = capsys.readouterr()
    return status, out.splitlines(), err.splitlines()


def _tars(folder):
    """Stand-ins for the two tars (the refusals below come before anything reads them)."""
    folder.mkdir()
    for name in preparation.MANUAL_FILES:
        (folder / name).write_bytes(b"\0" * 1000)
    return str(folder)


@pytest.mark.unit
def test_every_data_set_either_prepares_or_says_it_needs_nothing_and_others_are_refused(capsys):
    assert set(prepare.PREPARATIONS) | set(prepare.NO_PREPARATION) == set(DATASETS)
    assert not set(prepare.PREPARATIONS) & set(prepare.NO_PREPARATION)
    for name, reason in prepare.NO_PREPARATION.items():
        said = [f"[hvd_lars] {name} needs no preparation: {reason}."]
        assert _prepare(capsys, name) == (0, said, [])
        refusal = f"hvd_lars: error: --data_dir=/nonexistent: no such folder ({name} reads its data there)."
        got = _prepare(capsys, name, "--data_dir=/nonexistent")
        assert got == ((2, [], [refusal]) if name in ("fashion_mnist", "image_folder") else (0, said, []))
    assert not os.path.exists("/nonexistent")
    refusal = f"hvd_lars: error: unknown data set 'imagenet'; valid: {', '.join(sorted(DATASETS))}."
    assert _prepare(capsys, "imagenet") == (2, [], [refusal])


@pytest.mark.unit
def test_missing_tars_are_named_with_their_folder(capsys, tmp_path, monkeypatch):
    data_dir, manual = str(tmp_path / "tfds"), _tars(tmp_path / "manual")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # Python's temporary folder too
    os.remove(tmp_path / "manual" / "ILSVRC2012_img_val.tar")
    status, out, err = _prepare(capsys, "imagenet2012", f"--manual_dir={manual}", f"--data_dir={data_dir}")
    assert status == 2 and out == []  # refused before it says it prepares
    assert err == [
        f"hvd_lars: error: ImageNet is not prepared under --data_dir={data_dir}, and --manual_dir="
        f"{manual} lacks ILSVRC2012_img_val.tar. Download {TARS} from https://image-net.org "
        "(registration needed), put both in one folder and run hvd-lars-prepare imagenet2012 --manual_dir="
        f"<folder holding {TARS}> --data_dir={data_dir}."
    ]
    status, _, err = _prepare(capsys, "imagenet2012", f"--data_dir={data_dir}")
    assert status == 2 and err[0].startswith(
        f"hvd_lars: error: ImageNet is not prepared under --data_dir={data_dir}, and no --manual_dir. "
    )
    assert os.listdir(tmp_path) == ["manual"]  # refused before writing anything, temporary files included


@pytest.mark.unit
def test_an_unwritable_folder_a_held_lock_and_too_little_space_are_refused(capsys, tmp_path, monkeypatch):
    data_dir, manual = tmp_path / "tfds", _tars(tmp_path / "manual")
    command = ("imagenet2012", f"--manual_dir={manual}", f"--data_dir={data_dir}")
    # Nobody may create a folder at the top of sysfs, root included (the tests run as root in CI).
    status, _, err = _prepare(capsys, *command[:2], "--data_dir=/sys/hvd_lars")
    assert status == 2 and len(err) == 1
    assert err[0].startswith("hvd_lars: error: cannot write --data_dir=/sys/hvd_lars (") and err[0].endswith(
        ": /sys/hvd_lars). Prepare into a folder you may write, and train with that --data_dir."
    )
    lock = data_dir / "imagenet2012" / preparation.LOCK_NAME
    lock.parent.mkdir(parents=True)
    with open(lock, "a") as held:  # as a preparation at work holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _prepare(capsys, *command)[::2] == (2, [
            f"hvd_lars: error: another preparation is writing ImageNet into --data_dir={data_dir} (it holds "
            f"{lock}): wait for it to finish, or stop it and run this command again."])  # fmt: skip
    assert os.listdir(lock.parent) == [preparation.LOCK_NAME]
    for name in preparation.MANUAL_FILES:
        os.truncate(os.path.join(manual, name), 3 * 10**9)  # sparse: 3 GB each, no block written
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(preparation.shutil, "disk_usage", lambda path: usage(10**13, 10**13, 5.5 * 10**9))
    files = ", ".join(preparation.MANUAL_FILES)
    assert _prepare(capsys, *command)[::2] == (2, [
        f"hvd_lars: error: --data_dir={data_dir} has 5.5 GB free; the records need about 6.0 GB (the size "
        f"of {files}). Free some space or prepare into another folder."])  # fmt: skip
    monkeypatch.setattr(preparation.shutil, "disk_usage", lambda path: usage(10**13, 0, 6 * 10**9))
    with pytest.raises(preparation.CannotPrepare, match="does not hold exactly the 50,000 validation images"):
        preparation.prepare(manual, str(data_dir))  # room enough: refused by the next check instead


@pytest.mark.horovod
def test_the_console_script_and_the_module_as_a_user_runs_them(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "hvd-lars-prepare")
    command = [script, "imagenet2012", f"--manual_dir={tmp_path}", f"--data_dir={tmp_path / 'tfds'}"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    [error] = refused.stderr.splitlines()  # TensorFlow's start-up notices left out
    assert refused.returncode == 2 and f"--manual_dir={tmp_path} lacks {TARS}." in error
    # A usage error of the console script: one line, before TensorFlow is imported.
    bad = subprocess.run([sys.executable, "-X", "importtime", script, "fashion_mnist", "--bogus"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    errors = [line for line in bad.stderr.splitlines() if not line.startswith("import time:")]
    want = (
        "unrecognized arguments: --bogus (data sets: fashion_mnist, image_folder, imagenet2012, synthetic; "
    )
    assert bad.returncode == 2 and errors == [f"hvd_lars: error: {want}hvd-lars-prepare --help says more)"]
    assert "tensorflow" not in [line.split("|")[-1].strip() for line in bad.stderr.splitlines()]
    command = [sys.executable, "-m", "hvd_lars.prepare", "--help"]
    helped = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: hvd-lars-prepare [-h]")
    assert "--manual_dir" in helped.stdout and "--data_dir" in helped.stdout
