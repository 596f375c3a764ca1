"""Every file a run reads back at a start, found cut short, empty or foreign (another run's or another
format's): the run falls back or rebuilds with a one-line warning naming the file, or refuses with one
line naming it (exit 2); never a traceback, and the damaged file is kept under <run>/damaged/.

The run: flags/smoke.flags (3 updates per epoch, 2 epochs), a checkpoint every update, killed after
update 4 (tests/support/kill_at_step.py), one file damaged, then the main program again with the same
flags."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.support import REPO

pytestmark = pytest.mark.horovod

FLAGS = ["--flagfile=flags/smoke.flags", "--precision=float32", "--resume=true", "--checkpoint_every_steps=1",
         "--noasync_checkpoints"]  # fmt: skip
ENV = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")


def _main(workdir, *extra, program=("-m", "hvd_lars.main")):
    cmd = [sys.executable, *program, *FLAGS, f"--workdir={workdir}", *extra]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run directory killed after update 4: checkpoints 2, 3, 4; epoch 0 in metrics.csv, summary.json
    and the TensorBoard events."""
    workdir = tmp_path_factory.mktemp("killed")
    result = _main(workdir, "--kill_at_step=4", program=("tests/support/kill_at_step.py",))
    assert result.returncode == -9, result.stderr[-3000:]
    return workdir / "smoke"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = _main(workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir / "smoke"


def _events(run):
    return sorted(str(p) for p in (run / "tensorboard").glob("events.out.tfevents.*"))


# The files a start reads back (relative to the run directory).
FILES = {
    "checkpoint data": lambda run: str(run / "checkpoints" / "ckpt-4.data-00000-of-00001"),
    "checkpoint's own index": lambda run: str(run / "checkpoints" / "ckpt-4.index"),
    "checkpoint list": lambda run: str(run / "checkpoints" / "checkpoint"),
    "summary.json": lambda run: str(run / "summary.json"),
    "metrics.csv": lambda run: str(run / "metrics.csv"),
    "TensorBoard events": lambda run: _events(run)[0],
}


def _damage(path, kind, run):
    with open(path, "rb") as f:
        data = f.read()
    if kind == "cut short":
        data = data[: len(data) // 2]
    elif kind == "empty":
        data = b""
    elif os.path.basename(path) == "checkpoint":  # another run's list: its checkpoints live elsewhere
        data = b'model_checkpoint_path: "/elsewhere/run/checkpoints/ckpt-9"\n'
    elif path.endswith(".index") or "ckpt-4.data" in path:  # another checkpoint's (of another model)
        other = run.parent.parent / "other"
        if not other.exists():
            assert _main(other, "--model=resnet20", "--steps_per_epoch=1").returncode == 0
        suffix = ".index" if path.endswith(".index") else ".data-00000-of-00001"
        with open(other / "smoke" / "checkpoints" / f"ckpt-2{suffix}", "rb") as f:
            data = f.read()
    else:  # another format's: the other text file of the run
        with open(run / ("summary.json" if path.endswith(".csv") else "metrics.csv"), "rb") as f:
            data = f.read()
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.horovod
@pytest.mark.parametrize("kind", ["cut short", "empty", "foreign"])
@pytest.mark.parametrize("name", list(FILES))
def test_a_damaged_file_is_named_kept_and_fallen_back_from(killed, tmp_path, name, kind):
    run = tmp_path / "smoke"
    shutil.copytree(killed, run)
    path = FILES[name](run)
    _damage(path, kind, run)
    result = _main(tmp_path)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("[hvd_lars] warning:")]
    harmless = name == "TensorBoard events" and kind == "empty"  # an empty event file holds nothing
    if harmless:
        assert warnings == []
    else:
        named = path in warnings[0] if warnings else False
        if name.startswith("checkpoint") and name != "checkpoint list":  # named by prefix and its files
            named = f"{run}/checkpoints/ckpt-4 " in warnings[0] and os.path.basename(path) in warnings[0]
        assert len(warnings) == 1 and named, result.stderr[-3000:]
        kept = run / "damaged" / os.path.relpath(path, run)
        assert kept.exists()  # nothing is deleted
    resumed = "ckpt-3 (step 3)" if name.startswith("checkpoint") and name != "checkpoint list" else "(step 4)"
    assert f"[hvd_lars] resumed from {run}/checkpoints/" in result.stdout and resumed in result.stdout
    import csv

    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["epoch"], r["step"]) for r in rows] == [("0", "3"), ("1", "6")]
    assert all(r["test_top1"] != "" for r in rows)


@pytest.mark.horovod
def test_half_a_checkpoint_resumes_from_the_one_before_and_ends_as_the_uninterrupted_run(
    killed, uninterrupted, tmp_path
):
    import tensorflow as tf

    run = tmp_path / "smoke"
    shutil.copytree(killed, run)
    data = run / "checkpoints" / "ckpt-4.data-00000-of-00001"
    os.truncate(data, data.stat().st_size // 2)
    result = _main(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"the checkpoint {run}/checkpoints/ckpt-4 cannot be restored" in result.stderr
    assert f"resumed from {run}/checkpoints/ckpt-3 (step 3)" in result.stdout
    ours = tf.train.load_checkpoint(str(run / "checkpoints" / "ckpt-6"))
    theirs = tf.train.load_checkpoint(str(uninterrupted / "checkpoints" / "ckpt-6"))
    names = ours.get_variable_to_shape_map()
    assert names.keys() == theirs.get_variable_to_shape_map().keys() and len(names) > 10
    for n in names:
        np.testing.assert_array_equal(ours.get_tensor(n), theirs.get_tensor(n), err_msg=n)


@pytest.mark.horovod
def test_no_complete_checkpoint_left_is_one_line_naming_them(killed, tmp_path):
    run = tmp_path / "smoke"
    shutil.copytree(killed, run)
    for step in (2, 3, 4):
        os.truncate(run / "checkpoints" / f"ckpt-{step}.data-00000-of-00001", 100)
    result = _main(tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("hvd_lars: error:")]
    assert len(errors) == 1 and f"no checkpoint in {run}/checkpoints can be restored" in errors[0]
    assert all(f"{run}/checkpoints/ckpt-{s} (unreadable" in errors[0] for s in (2, 3, 4))
    assert sorted(os.listdir(run / "damaged" / "checkpoints")) == sorted(
        f"ckpt-{s}.{e}" for s in (2, 3, 4) for e in ("data-00000-of-00001", "index")
    )
