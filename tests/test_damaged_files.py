"""Damaged checkpoints at a start, in one process: the newest unreadable one and an index that is not text are
named in warnings and the checkpoint before resumed, ending as the uninterrupted run; none readable (damaged,
or without a plan record) is one refusal line (an index cut short: tests/test_train.py)."""

import hashlib
import logging
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars.training import checkpoints, epoch_logs, plot_run
from hvd_lars.training.train import run
from tests.support import small_runs
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
        summary = run(_config(workdir := tmp_path_factory.mktemp("finished")))
    assert summary["resumed_from_step"] == 0 and [e["epoch"] for e in summary["epochs"]] == [1, 2]
    return workdir


def _digests(folder):
    # The job's claim on the directory (running.*) is the only file a refused start may write.
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("running."))
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "checkpoint" in r.name]


def test_the_newest_checkpoint_and_the_index_damaged_are_named_and_the_one_before_resumed(
    finished, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(epoch_logs, "git_sha", lambda: "0" * 40)
    monkeypatch.setattr(plot_run, "plot_run", lambda run_dir: None)
    folder = shutil.copytree(finished, tmp_path, dirs_exist_ok=True) / "loop" / "checkpoints"
    _flip(folder / "ckpt-4.data-00000-of-00001")
    (folder / "checkpoint").write_bytes(bytes(range(256)))  # not text: the manager cannot open it
    damaged, found = _digests(folder), []  # and the files as the start left them, before update 4 writes any
    seen = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: found.append(_digests(folder)))
    summary = run(_config(tmp_path), extra_callbacks=[seen])  # update 4 again, the run's last
    assert summary["resumed_from_step"] == 3 and summary["epochs"][-1]["epoch"] == 2
    del damaged["checkpoint"]  # the index alone is removed
    assert found == [damaged]  # the damaged files where they were, as they were
    newest, index = _warnings(caplog)
    assert newest.startswith(f"the checkpoint {folder}/ckpt-4 (") and "Checksum does not match" in newest
    assert newest.endswith(") cannot be read: an older one is tried, its files are left")
    assert index.startswith(f"the checkpoint index {folder}/checkpoint cannot be read (")
    state = tf.train.get_checkpoint_state(str(folder))  # written anew by the manager
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == ["ckpt-4"]
    # The start from update 3 ends as the uninterrupted run, tensor for tensor.
    ours, theirs = small_runs.final_tensors(tmp_path / "loop"), small_runs.final_tensors(finished / "loop")
    assert len(ours) > 20 and int(ours["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 4
    np.testing.assert_equal(ours, theirs)


def test_no_checkpoint_readable_is_one_refusal_line_and_nothing_changes(finished, tmp_path, caplog):
    folder = shutil.copytree(finished, tmp_path, dirs_exist_ok=True) / "loop" / "checkpoints"
    for step in (3, 4):
        _flip(folder / f"ckpt-{step}.data-00000-of-00001")
    tf.train.Checkpoint(step=tf.Variable(2)).write(str(folder / "ckpt-2"))  # no plan: not written by a run
    before = _digests(tmp_path)
    with pytest.raises(checkpoints.ResumeRefused) as refused:  # with every change of the plan allowed
        run(_config(tmp_path, allow_plan_change=("any",)))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        f"no checkpoint in {folder} can be read: {folder}/ckpt-4 ("
    )
    assert message.index("ckpt-4 (") < message.index("ckpt-3 (") < message.index("ckpt-2 (")
    assert message.endswith(
        f"{folder}/ckpt-2 (it holds no plan record); to train afresh, give another --run_name or remove "
        f"{tmp_path / 'loop'}."
    )
    assert _digests(tmp_path) == before and _warnings(caplog) == []
