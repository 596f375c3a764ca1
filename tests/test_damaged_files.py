"""Damaged checkpoints at a start, in one process: the newest unreadable one is named in a warning and the
one before it resumed, none readable is one refusal line, a garbled index is no obstacle."""

import hashlib
import logging
import os
import shutil

import keras
import pytest
import tensorflow as tf

from hvd_lars.training import checkpoints, epoch_logs, plot_run
from hvd_lars.training.train import run
from tests.test_train import smoke

pytestmark = pytest.mark.unit


def _config(workdir, **overrides):
    # A checkpoint at every update: the run of 2 epochs x 2 updates keeps ckpt-2, ckpt-3 and ckpt-4.
    return smoke(workdir, checkpoint_every_steps=1, async_checkpoints=False, precision="float32", **overrides)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(epoch_logs, "git_sha", lambda: "0" * 40)  # git is a process; the unit tier starts none
        patch.setattr(plot_run, "plot_run", lambda run_dir: None)  # the plot: tests/test_epoch_logs.py
        run(_config(workdir := tmp_path_factory.mktemp("finished")))
    return workdir


@pytest.fixture
def workdir(finished, tmp_path, monkeypatch):
    monkeypatch.setattr(epoch_logs, "git_sha", lambda: "0" * 40)
    monkeypatch.setattr(plot_run, "plot_run", lambda run_dir: None)
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _digests(folder):
    # The job's claim on the directory (running.*) is the only file a refused start may write.
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("running."))
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class _Digests(keras.callbacks.Callback):
    """The checkpoint files as the start left them, before the first update writes any."""

    def __init__(self, folder):
        super().__init__()
        self.folder, self.found = folder, None

    def on_train_begin(self, logs=None):  # each fit's: the epoch resumed mid-way's first
        self.found = self.found or _digests(self.folder)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "checkpoint" in r.name]


def test_the_newest_checkpoint_damaged_is_named_and_the_one_before_it_resumed(workdir, caplog):
    folder = workdir / "loop" / "checkpoints"
    _flip(folder / "ckpt-4.data-00000-of-00001")
    damaged, seen = _digests(folder), _Digests(folder)
    summary = run(_config(workdir), extra_callbacks=[seen])  # update 4 again, the run's last
    assert summary["resumed_from_step"] == 3 and summary["epochs"][-1]["epoch"] == 2
    assert seen.found == damaged  # the damaged files where they were, as they were
    [warning] = _warnings(caplog)
    assert warning.startswith(f"the checkpoint {folder}/ckpt-4 (") and "Checksum does not match" in warning
    assert warning.endswith(") cannot be read: an older one is tried, its files are left")


def test_no_checkpoint_readable_is_one_refusal_line_and_nothing_changes(workdir, caplog):
    folder = workdir / "loop" / "checkpoints"
    for step in (2, 3, 4):
        _flip(folder / f"ckpt-{step}.data-00000-of-00001")
    before = _digests(workdir)
    with pytest.raises(checkpoints.ResumeRefused) as refused:
        run(_config(workdir))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        f"no checkpoint in {folder} can be read: {folder}/ckpt-4 ("
    )
    assert message.index("ckpt-4 (") < message.index("ckpt-3 (") < message.index("ckpt-2 (")
    assert message.endswith(f"; to train afresh, give another --run_name or remove {workdir / 'loop'}.")
    assert _digests(workdir) == before and _warnings(caplog) == []


@pytest.mark.parametrize(
    "garbled", [b'model_checkpoint_path: "ckpt-', bytes(range(256))], ids=["cut", "binary"]
)
def test_a_garbled_index_resumes_the_newest_checkpoint_on_disk(workdir, garbled, caplog):
    folder = workdir / "loop" / "checkpoints"
    (folder / "checkpoint").write_bytes(garbled)
    config = _config(workdir, epochs=3, allow_plan_change=("epochs",))
    assert run(config)["resumed_from_step"] == 4
    # One the manager cannot open (not text) is removed in one warning; one it reads as none is left to it.
    removed = f"the checkpoint index {folder}/checkpoint cannot be read ("
    assert [w.startswith(removed) for w in _warnings(caplog)] == [True] * (b"\xff" in garbled)
    state = tf.train.get_checkpoint_state(str(folder))  # written anew by the manager
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == ["ckpt-5", "ckpt-6"]
