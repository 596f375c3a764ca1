"""Every state a run directory can be found in at a start, and what the start does with it:

- every file a run reads back, found cut short, empty or foreign (another run's or another format's): the
  run falls back or rebuilds with a one-line warning naming the file (`test_a_damaged_file_...`); never a
  traceback, and the damaged file is kept under <run>/damaged/;
- checkpoints of two lineages, a plan in the checkpoint against another in the flags, records (summary.json,
  metrics.csv, TensorBoard) of another lineage or missing, checkpoints that cannot be read or that belong to
  another model (`test_a_run_directory_...`):
  the start resumes from the right checkpoint, refuses in one line (exit 2, the checkpoints untouched), or
  starts afresh when told to, and never deletes or moves a sound checkpoint.

The run: flags/smoke.flags (3 updates per epoch, 2 epochs), a checkpoint every update, killed after
update 4 (tests/support/kill_at_step.py), its directory put in a state, then the main program again."""

import csv
import dataclasses
import functools
import glob
import hashlib
import json
import os
import shutil
import sys

import numpy as np
import pytest

from tests.support import REPO
from tests.support.main_server import run_main
from tests.support.small_runs import final_tensors

pytestmark = pytest.mark.horovod

FLAGS = ["--flagfile=flags/smoke.flags", "--precision=float32", "--resume=true", "--checkpoint_every_steps=1",
         "--noasync_checkpoints"]  # fmt: skip
ENV = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")


def _main(workdir, *extra, program=("-m", "hvd_lars.main")):
    cmd = [sys.executable, *program, *FLAGS, f"--workdir={workdir}", *extra]
    return run_main(cmd, cwd=REPO, env=ENV, timeout=300)


KILLER = ("tests/support/kill_at_step.py",)


class Runs:
    """The run directories the tests start from, each made once per module when first asked for."""

    def __init__(self, tmp_path_factory):
        self.factory = tmp_path_factory

    def _made(self, name, *extra, program=("-m", "hvd_lars.main"), returncode=0):
        workdir = self.factory.mktemp(name)
        cmd = [sys.executable, *program, *FLAGS, f"--workdir={workdir}", *extra]
        result = run_main(cmd, cwd=REPO, env=ENV, timeout=300)
        assert result.returncode == returncode, result.stderr[-3000:]
        return workdir / "smoke"

    @functools.cached_property
    def killed(self):
        """Killed after update 4: checkpoints 2, 3, 4; epoch 0 in metrics.csv, summary.json and the
        TensorBoard events."""
        return self._made("killed", "--kill_at_step=4", program=KILLER, returncode=-9)

    @functools.cached_property
    def uninterrupted(self):
        return self._made("uninterrupted")

    @functools.cached_property
    def uninterrupted_half_rate(self):
        return self._made("uninterrupted_half_rate", "--peak_learning_rate=0.5")

    @functools.cached_property
    def other_model(self):
        return self._made("other_model", "--model=resnet20", "--steps_per_epoch=1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


@pytest.fixture(scope="module")
def killed(runs):
    return runs.killed


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


def _damage(path, kind, run, other_model=None):
    with open(path, "rb") as f:
        data = f.read()
    if kind == "cut short":
        data = data[: len(data) // 2]
    elif kind == "empty":
        data = b""
    elif os.path.basename(path) == "checkpoint":  # another run's list: its checkpoints live elsewhere
        data = b'model_checkpoint_path: "/elsewhere/run/checkpoints/ckpt-9"\n'
    elif path.endswith(".index") or "ckpt-4.data" in path:  # another checkpoint's (of another model)
        suffix = ".index" if path.endswith(".index") else ".data-00000-of-00001"
        with open(other_model / "checkpoints" / f"ckpt-2{suffix}", "rb") as f:
            data = f.read()
    else:  # another format's: the other text file of the run
        with open(run / ("summary.json" if path.endswith(".csv") else "metrics.csv"), "rb") as f:
            data = f.read()
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.horovod
@pytest.mark.parametrize("kind", ["cut short", "empty", "foreign"])
@pytest.mark.parametrize("name", list(FILES))
def test_a_damaged_file_is_named_kept_and_fallen_back_from(runs, tmp_path, name, kind):
    run = tmp_path / "smoke"
    shutil.copytree(runs.killed, run)
    path = FILES[name](run)
    other_model = runs.other_model if kind == "foreign" and name.startswith("checkpoint") else None
    _damage(path, kind, run, other_model)
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
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["epoch"], r["step"]) for r in rows] == [("0", "3"), ("1", "6")]
    assert all(r["test_top1"] != "" for r in rows)
    assert len({r["run_id"] for r in rows}) == 1  # one lineage


# ------------------------------------------------------------------------------ run-directory states
def _digests(folder):
    """{path relative to `folder`: sha256} of every file under `folder` ({} when it is missing)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, "**"), recursive=True)):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


def _run_id(run):
    with open(run / "summary.json") as f:
        return json.load(f)["run_id"]


def _rows(run):
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _copy_checkpoint(source, step, run, as_step):
    for path in glob.glob(str(source / "checkpoints" / f"ckpt-{step}.*")):
        suffix = os.path.basename(path).split(".", 1)[1]
        shutil.copy(path, run / "checkpoints" / f"ckpt-{as_step}.{suffix}")


def _index(run, newest, listed):
    # The index tf.train.CheckpointManager reads (a CheckpointState text proto), names relative.
    lines = [
        f'model_checkpoint_path: "ckpt-{newest}"',
        *(f'all_model_checkpoint_paths: "ckpt-{s}"' for s in listed),
    ]
    (run / "checkpoints" / "checkpoint").write_text("\n".join(lines) + "\n")


def _two_lineages_in_one_index(run, runs):
    # Another run's checkpoint copied in and listed first (here the uninterrupted run's ckpt-5, of a higher
    # step), this run's ckpt-4 the index's newest.
    _copy_checkpoint(runs.uninterrupted, 5, run, 5)
    _index(run, 4, [5, 2, 3, 4])


def _check_two_lineages(run, runs, outputs):
    other = _run_id(runs.uninterrupted)
    kept = run / "earlier_runs" / other / "checkpoints"
    # Kept byte for byte (the manager would have deleted it as the oldest of its list), named in one line.
    assert _digests(kept) == {
        k: v for k, v in _digests(runs.uninterrupted / "checkpoints").items() if "ckpt-5" in k
    }
    assert (
        f"checkpoints of another run (ckpt-5, run {other}) lay beside {run}/checkpoints/ckpt-4" in outputs[0]
    )


def _check_fresh_start(run, runs, outputs):
    earlier = run / "earlier_runs" / _run_id(runs.killed)
    said = f"[hvd_lars] --noresume: a new run begins in {run}; the earlier run's checkpoints/, metrics.csv, "
    assert said + f"tensorboard/, summary.json are kept in {earlier}" in outputs[0]
    assert _digests(earlier / "checkpoints") == _digests(runs.killed / "checkpoints")
    assert [r["step"] for r in _rows(earlier)] == ["3"]
    # The new run's rows only, with the new run's learning rates.
    assert [r["learning_rate"] for r in _rows(run)] == [
        r["learning_rate"] for r in _rows(runs.uninterrupted_half_rate)
    ]


def _check_allowed_accumulation(run, runs, outputs):
    import tensorflow as tf

    from hvd_lars.training.checkpoints import read_record

    record = read_record(str(run / "checkpoints" / "ckpt-6"))
    assert record["run_id"] == _run_id(runs.killed) and record["plan"]["accumulation_steps"] == 2
    names = tf.train.load_checkpoint(str(run / "checkpoints" / "ckpt-6")).get_variable_to_shape_map()
    assert sum(n.startswith("optimizer/_variables/") for n in names) == 18  # the accumulators, saved


def _check_summary_missing(run, runs, outputs):
    with open(run / "summary.json") as f:
        assert [e["epoch"] for e in json.load(f)["epochs"]] == [2]  # written anew: the epochs since


def _check_metrics_rebuilt(run, runs, outputs):
    assert (
        f"[hvd_lars] warning: {run}/metrics.csv is missing; rebuilt with the 1 epoch(s) of summary.json"
        in outputs[0]
    )


def _foreign_logs(run, runs):
    (run / "metrics.csv").unlink()
    shutil.rmtree(run / "tensorboard")
    shutil.copy(runs.uninterrupted / "metrics.csv", run / "metrics.csv")
    shutil.copytree(runs.uninterrupted / "tensorboard", run / "tensorboard")


def _check_foreign_logs(run, runs, outputs):
    from tests.test_main import _scalars

    other = _run_id(runs.uninterrupted)
    assert _digests(run / "earlier_runs" / other) == {
        k: v
        for k, v in _digests(runs.uninterrupted).items()
        if k == "metrics.csv" or k.startswith("tensorboard")
    }
    # Epoch 0's row is this run's own again (from its summary.json), evaluated value for value.
    assert _rows(run)[0]["test_loss"] == _rows(runs.killed)[0]["test_loss"]
    steps = sorted(step for tag, step in _scalars(run / "tensorboard") if tag == "test_top1")
    assert steps == [6]  # epoch 0's scalars were the other run's: kept aside, not mixed in


def _check_foreign_summary(run, runs, outputs):
    other = _run_id(runs.uninterrupted)
    assert _digests(run / "earlier_runs" / other) == {
        "summary.json": _digests(runs.uninterrupted)["summary.json"]
    }
    assert _run_id(run) == _run_id(runs.killed)


def _cut(*steps):
    def prepare(run, runs):
        for step in steps:
            data = run / "checkpoints" / f"ckpt-{step}.data-00000-of-00001"
            os.truncate(data, data.stat().st_size // 2)

    return prepare


def _check_fell_back(run, runs, outputs):
    assert f"the checkpoint {run}/checkpoints/ckpt-4 cannot be restored" in outputs[0]
    assert sorted(os.listdir(run / "damaged" / "checkpoints")) == [
        "ckpt-4.data-00000-of-00001",
        "ckpt-4.index",
    ]


def _check_none_readable(run, runs, outputs):
    assert all(f"{run}/checkpoints/ckpt-{s} (unreadable" in outputs[0] for s in (2, 3, 4))
    assert sorted(os.listdir(run / "damaged" / "checkpoints")) == sorted(
        f"ckpt-{s}.{e}" for s in (2, 3, 4) for e in ("data-00000-of-00001", "index")
    )


def _other_model_newest(run, runs):
    _copy_checkpoint(runs.other_model, 2, run, 5)
    _index(run, 5, [2, 3, 4, 5])


def _check_not_damaged(run, runs, outputs):
    assert not (run / "damaged").exists()


def _remove(name):
    def prepare(run, runs):
        (run / name).unlink()

    return prepare


def _empty(name):
    def prepare(run, runs):
        (run / name).write_bytes(b"")

    return prepare


@dataclasses.dataclass
class State:
    """A run directory's state (`prepare` makes it in a copy of `base`) and the starts made in it, each
    (extra flags, expected): "resumed ckpt-N", "refused <fragment of the one error line>", "unreadable
    <fragment>" (refused, the unreadable files set aside) or "killed" (with kill_at_step.py); `final`: the
    run the last start ends tensor for tensor equal to; `check(run, runs, outputs)`: what else must hold."""

    starts: list
    prepare: object = None
    base: str = "killed"
    final: str = "uninterrupted"
    check: object = None


STATES = {
    "two lineages in one index": State(
        [((), "resumed ckpt-4")], _two_lineages_in_one_index, check=_check_two_lineages
    ),
    "a fresh start, then its own flags": State(
        [(("--noresume", "--peak_learning_rate=0.5", "--kill_at_step=2"), "killed"),
         (("--peak_learning_rate=0.5",), "resumed ckpt-2")],
        final="uninterrupted_half_rate", check=_check_fresh_start,
    ),
    "a plan that adds accumulators": State(
        [(("--accumulation_steps=2",), "refused accumulation_steps 1 -> 2"), ((), "resumed ckpt-4")]
    ),
    "a plan that adds accumulators, allowed": State(
        [(("--accumulation_steps=2", "--allow_plan_change=accumulation_steps"), "resumed ckpt-4")],
        final=None, check=_check_allowed_accumulation,
    ),
    "a plan that adds the previous learning rate": State(
        [(("--momentum_correction=always",), "refused momentum_correction 'none' -> 'always'"),
         (("--momentum_correction=always", "--allow_plan_change=momentum_correction"), "resumed ckpt-4")],
        final=None,
    ),
    "the same plan spelled otherwise": State(
        [(("--global_batch_size=0", "--per_rank_batch_size=32"), "resumed ckpt-4")]
    ),
    "summary.json deleted": State(
        [(("--peak_learning_rate=2",), "refused peak_learning_rate 1.0 -> 2.0"), ((), "resumed ckpt-4")],
        _remove("summary.json"), check=_check_summary_missing,
    ),
    "summary.json emptied": State(
        [(("--peak_learning_rate=2",), "refused peak_learning_rate 1.0 -> 2.0")], _empty("summary.json"),
        final=None,
    ),
    "metrics.csv deleted": State(
        [((), "resumed ckpt-4")], _remove("metrics.csv"), check=_check_metrics_rebuilt
    ),
    "metrics.csv and TensorBoard of another run": State(
        [((), "resumed ckpt-4")], _foreign_logs, check=_check_foreign_logs
    ),
    "summary.json of another run": State(
        [((), "resumed ckpt-4")], lambda run, runs: shutil.copy(runs.uninterrupted / "summary.json", run),
        check=_check_foreign_summary,
    ),
    "the newest checkpoint cut to half": State([((), "resumed ckpt-3")], _cut(4), check=_check_fell_back),
    "no checkpoint readable": State(
        [((), "unreadable no checkpoint in {run}/checkpoints can be restored")], _cut(2, 3, 4), final=None,
        check=_check_none_readable,
    ),
    "another model's checkpoint named newest": State(
        [((), "refused model 'resnet20' -> 'small_cnn'")], _other_model_newest, final=None,
        check=_check_not_damaged,
    ),
}  # fmt: skip


@pytest.mark.horovod
@pytest.mark.parametrize("state", list(STATES))
def test_a_run_directory_in_any_state_resumes_the_right_checkpoint_refuses_or_starts_afresh(
    state, runs, tmp_path
):
    spec = STATES[state]
    run = tmp_path / "smoke"
    shutil.copytree(getattr(runs, spec.base), run)
    if spec.prepare:
        spec.prepare(run, runs)
    outputs = []
    for flags, expected in spec.starts:
        kind, _, fragment = expected.partition(" ")
        fragment = fragment.format(run=run)
        before = _digests(run / "checkpoints")
        program = KILLER if kind == "killed" else ("-m", "hvd_lars.main")
        result = _main(tmp_path, *flags, program=program)
        outputs.append(result.stdout + result.stderr)
        assert "Traceback" not in result.stderr, (expected, result.stderr[-3000:])
        errors = [line for line in result.stderr.splitlines() if line.startswith("hvd_lars: error:")]
        if kind in ("refused", "unreadable"):
            assert result.returncode == 2 and len(errors) == 1 and fragment in errors[0], (expected, errors)
            if kind == "refused":  # nothing of the run directory's checkpoints is touched
                assert _digests(run / "checkpoints") == before
        elif kind == "killed":
            assert result.returncode == -9, result.stderr[-3000:]
        else:
            assert result.returncode == 0 and errors == [], (expected, result.stderr[-3000:])
            step = fragment.split("-")[1]
            assert f"[hvd_lars] resumed from {run}/checkpoints/{fragment} (step {step})" in result.stdout
    if spec.final:
        ours, theirs = final_tensors(run), final_tensors(getattr(runs, spec.final))
        assert ours.keys() == theirs.keys() and len(ours) > 40
        for name in ours:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
        # Every epoch's row once, all of this run.
        rows = _rows(run)
        assert [(r["epoch"], r["step"]) for r in rows] == [("0", "3"), ("1", "6")]
        assert {r["run_id"] for r in rows} == {_run_id(run)}
        # The checkpoint records the run and the one plan of the attempt, as summary.json does.
        from hvd_lars.training.checkpoints import read_record

        with open(run / "summary.json") as f:
            summary = json.load(f)
        record = read_record(str(run / "checkpoints" / "ckpt-6"))
        assert record == {"run_id": summary["run_id"], "plan": summary["plan"]["settings"]}
    if spec.check:
        spec.check(run, runs, outputs)
