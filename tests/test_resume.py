"""A run SIGKILLed after its checkpoint at step k and restarted ends bit for bit where an uninterrupted run
ends, in one process; and on 2 Horovod ranks, one run stopped five times (SIGKILL of one rank, of all
ranks, SIGTERM, SIGUSR1) and restarted each time with the same command ends tensor for tensor where the
uninterrupted run ends, with every epoch's row once.

Why 2 ranks are exact too: every rank averages its batch-norm moving statistics over the ranks before each
checkpoint (`PeriodicCheckpoint`), so at the checkpoint the resumed run starts from (rank 0's, broadcast
to all) the uninterrupted run's ranks hold those same averaged values; the data order is a function of the
seed and the step; and an average of 2 float32 values is one rounded sum, the same in either order.
Before statistics were averaged at checkpoints, rank 1 resumed with rank 0's statistics where the
uninterrupted rank 1 kept its own, and the runs differed after the resume.
"""

import dataclasses
import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.support import REPO, small_runs
from tests.support.main_server import run_main
from tests.test_main import _scalars

KILLER = os.path.join(REPO, "tests", "support", "kill_at_step.py")
FLAGS = [
    "--flagfile=flags/fashion_mnist_lars.flags", "--max_train_examples=2048",
    "--max_eval_examples=500", "--global_batch_size=256", "--epochs=3", "--warmup_epochs=1",
    "--peak_learning_rate=4", "--checkpoint_every_steps=5", "--run_name=r", "--verbose=0",
]  # fmt: skip


def _train(workdir, launcher=(), kill_at=None):
    program = [KILLER, f"--kill_at_step={kill_at}"] if kill_at else ["-m", "hvd_lars.main"]
    cmd = list(launcher) + [sys.executable] + program + FLAGS + [f"--workdir={workdir}"]
    return run_main(cmd, cwd=REPO, timeout=400)


def _final_variables(workdir):
    reader = tf.train.load_checkpoint(os.path.join(workdir, "r", "checkpoints"))
    names = [n for n in reader.get_variable_to_shape_map() if "model" in n or "optimizer" in n]
    assert len(names) > 20
    # Weights, optimizer slots and step, and the batch-norm moving statistics are all compared.
    assert sum("moving_mean" in n or "moving_variance" in n for n in names) == 10
    return {n: reader.get_tensor(n) for n in names}


def _check_resume(tmp_path, launcher):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _train(straight, launcher).returncode == 0
    # 8 steps per epoch; killed after step 12, between the checkpoints of steps 10 and 15.
    result = _train(killed, launcher, kill_at=12)
    assert result.returncode != 0
    steps = sorted(
        int(f.split("-")[1].split(".")[0])
        for f in os.listdir(killed / "r" / "checkpoints")
        if f.endswith(".index")
    )
    assert steps == [5, 8, 10]  # every 5 steps and at the end of epoch 1
    result = _train(killed, launcher)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout and "(step 10)" in result.stdout
    a, b = _final_variables(straight), _final_variables(killed)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.horovod
def test_single_process_resume_is_exact(tmp_path):
    _check_resume(tmp_path, ())


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """The 2-rank run of `small_runs.STOPS`: (its run directory, its starts), and the uninterrupted run's
    directory."""
    workdir, straight = tmp_path_factory.mktemp("restarted"), tmp_path_factory.mktemp("straight")
    result = run_main(small_runs.uninterrupted_command(straight), cwd=REPO, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir / "smoke", small_runs.run_restart_sequence(workdir, run=run_main), straight / "smoke"


@pytest.mark.horovod
def test_two_ranks_stopped_five_times_and_restarted_end_as_the_uninterrupted_run(restarted):
    run, starts, straight = restarted
    # Each start resumed where the stop before it left the run, and the last one finished.
    assert [s["resumed"] for s in starts] == [None] + [resumed for _, resumed in small_runs.STOPS]
    assert [s["returncode"] == 0 for s in starts] == [False] * 5 + [True], [
        s["output"][-2000:] for s in starts
    ]
    assert [s["stopped"] for s in starts] == [None, None, 10, 12, None, None]  # TERM and USR1 save the next
    ours, theirs = small_runs.final_tensors(run), small_runs.final_tensors(straight)
    assert ours.keys() == theirs.keys() and len(ours) > 40
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    # Every epoch's row once, of this run, each evaluated as the uninterrupted run evaluated it.
    rows, expected = small_runs.metrics_rows(run), small_runs.metrics_rows(straight)
    assert [(r["epoch"], r["step"]) for r in rows] == [("0", "4"), ("1", "8"), ("2", "12"), ("3", "16")]
    assert [(r["test_loss"], r["test_top1"]) for r in rows] == [
        (r["test_loss"], r["test_top1"]) for r in expected
    ]
    steps = sorted({step for tag, step in _scalars(run / "tensorboard") if tag == "test_loss"})
    assert steps == [4, 8, 12, 16]


# ------------------------------------------------------------------------------ in one process
def _built(config, plan):
    """The compiled model and its optimizer (not built) as `train.start` makes them, and its build."""
    import keras

    from hvd_lars.models import get_model
    from hvd_lars.training.plan import build_optimizer

    keras.utils.set_random_seed(0)
    model = get_model("small_cnn", num_classes=10, input_shape=(8, 8, 3))
    optimizer = build_optimizer(config, plan)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model, optimizer, lambda: optimizer.build(model.trainable_variables)


def _config(**changes):
    from hvd_lars.training.config import TrainConfig

    base = dict(dataset="synthetic", image_size=8, global_batch_size=8, steps_per_epoch=4, epochs=2,
                peak_learning_rate=1.0, precision="float32")  # fmt: skip
    return TrainConfig(**{**base, **changes})


def _key(variable):
    # A variable's path without the number Keras gives the second LARS made in one process ("lars_1/..."):
    # the checkpoint pairs variables by object, not by path.
    return re.sub(r"^(distributed_)?lars(_\d+)?/", r"\1lars/", variable.path)


@pytest.mark.unit
def test_an_allowed_change_restores_every_old_variable_and_starts_the_new_ones_at_zero(tmp_path):
    from hvd_lars.training import checkpoints
    from hvd_lars.training.plan import make_plan

    # A checkpoint of update 5 under the plan without accumulation or momentum correction, every variable
    # holding a value of its own.
    old = _config()
    model, optimizer, build = _built(old, make_plan(old, 1, 64, (8, 8, 3)))
    build()
    rng = np.random.default_rng(0)
    for v in model.variables + optimizer.variables:
        if "iteration" not in v.path:
            v.assign(rng.normal(size=v.shape).astype(v.dtype))
    optimizer.iterations.assign(5)
    record = checkpoints.RunRecord(make_plan(old, 1, 64, (8, 8, 3)).settings)
    record.assign("20261201T000000Z-abcdef")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, run=record.variable)
    tf.train.CheckpointManager(checkpoint, str(tmp_path / "checkpoints"), 3).save(checkpoint_number=5)
    saved = {_key(v): v.numpy() for v in model.variables + optimizer.variables}

    new = _config(accumulation_steps=2, momentum_correction="always")
    plan = make_plan(new, 1, 64, (8, 8, 3))
    model, optimizer, build = _built(new, plan)
    refused = checkpoints.resume_or_begin(model, optimizer, build, str(tmp_path), plan, new)
    assert isinstance(refused.error, checkpoints.LineageRefused) and refused.restored is None
    assert "(momentum_correction 'none' -> 'always'; accumulation_steps 1 -> 2)" in str(refused.error)

    allowed = dataclasses.replace(new, allow_plan_change=("accumulation_steps", "momentum_correction"))
    model, optimizer, build = _built(allowed, plan)
    resumed = checkpoints.resume_or_begin(model, optimizer, build, str(tmp_path), plan, allowed)
    assert resumed.error is None and resumed.restored == str(tmp_path / "checkpoints" / "ckpt-5")
    assert resumed.run_id == "20261201T000000Z-abcdef"
    new_ones = [v for v in optimizer.variables if _key(v) not in saved]
    # 18 gradient accumulators (one per trainable tensor) and the previous learning rate, at zero.
    assert sorted({v.path.rsplit("_", 1)[-1] for v in new_ones}) == ["accumulator", "rate"]
    assert len(new_ones) == 19 and all(not np.any(v.numpy()) for v in new_ones)
    restored = [v for v in model.variables + optimizer.variables if _key(v) in saved]
    assert len(restored) == len(saved) > 40
    for v in restored:
        np.testing.assert_array_equal(v.numpy(), saved[_key(v)], err_msg=v.path)


@pytest.mark.unit
def test_a_resume_takes_the_default_data_folder_and_that_folder_spelled_out_for_one_plan(tmp_path):
    from hvd_lars.data.fashion_mnist_files import DEFAULT_DIR
    from hvd_lars.training import checkpoints
    from hvd_lars.training.plan import make_plan

    # A checkpoint of `make train` (--data_dir empty), resumed with --data_dir=<the folder it read>.
    default = _config(dataset="fashion_mnist", image_size=0)
    model, optimizer, build = _built(default, make_plan(default, 1, 64, (8, 8, 3)))
    build()
    optimizer.iterations.assign(5)
    record = checkpoints.RunRecord(make_plan(default, 1, 64, (8, 8, 3)).settings)
    record.assign("20261201T000000Z-abcdef")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, run=record.variable)
    tf.train.CheckpointManager(checkpoint, str(tmp_path / "checkpoints"), 3).save(checkpoint_number=5)

    spelled = dataclasses.replace(default, data_dir=DEFAULT_DIR)
    plan = make_plan(spelled, 1, 64, (8, 8, 3))
    model, optimizer, build = _built(spelled, plan)
    resumed = checkpoints.resume_or_begin(model, optimizer, build, str(tmp_path), plan, spelled)
    assert resumed.error is None and resumed.restored == str(tmp_path / "checkpoints" / "ckpt-5")
    assert resumed.run_id == "20261201T000000Z-abcdef" and int(optimizer.iterations) == 5

    elsewhere = dataclasses.replace(default, data_dir=str(tmp_path))
    plan = make_plan(elsewhere, 1, 64, (8, 8, 3))
    model, optimizer, build = _built(elsewhere, plan)
    refused = checkpoints.resume_or_begin(model, optimizer, build, str(tmp_path), plan, elsewhere)
    assert f"(data_dir {os.path.realpath(DEFAULT_DIR)!r} -> {str(tmp_path)!r})" in str(refused.error)


@pytest.mark.unit
def test_a_checkpoint_without_a_run_record_is_refused_in_one_line_and_left_as_it_is(tmp_path, capsys):
    from hvd_lars.training import checkpoints
    from hvd_lars.training.plan import make_plan

    checkpoint = tf.train.Checkpoint(step=tf.Variable(5))  # no "run": not written by a run of hvd_lars
    tf.train.CheckpointManager(checkpoint, str(tmp_path / "checkpoints"), 3).save(checkpoint_number=5)
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    config = _config(allow_plan_change=("any",))
    refused = checkpoints.resume_or_begin(None, None, None, str(tmp_path), make_plan(config, 1, 64), config)
    assert isinstance(refused.error, checkpoints.LineageRefused) and refused.restored is None
    assert str(refused.error) == (
        f"the checkpoint {tmp_path}/checkpoints/ckpt-5 holds no run record (the run id and plan every "
        "checkpoint of hvd_lars holds): its plan cannot be checked. Start afresh with --noresume or another "
        "--run_name."
    )
    assert os.listdir(tmp_path) == ["checkpoints"] and sorted(os.listdir(tmp_path / "checkpoints")) == before
    assert capsys.readouterr().out == ""


@pytest.mark.unit
def test_a_start_tries_the_index_newest_first_then_in_the_order_saved_then_the_rest(tmp_path):
    from hvd_lars.training import checkpoints

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (2, 3, 4, 7, 9):
        (folder / f"ckpt-{step}.index").write_bytes(b"")
    # An index that lists ckpt-7 (of another run, copied in) before this run's 2, 3, 4.
    lines = [
        'model_checkpoint_path: "ckpt-3"',
        *(f'all_model_checkpoint_paths: "ckpt-{s}"' for s in (7, 2, 4, 3)),
    ]
    (folder / "checkpoint").write_text("\n".join(lines) + "\n")
    assert [os.path.basename(p) for p in checkpoints.candidates(str(folder))] == [
        "ckpt-3", "ckpt-4", "ckpt-2", "ckpt-7", "ckpt-9",
    ]  # fmt: skip


# ------------------------------------------------------------------------------ earlier runs kept
# Run ids in the order they started; "unrecorded" (files without a run id) counts as the oldest.
B, C, D = "20260101T000000Z-00000b", "20260201T000000Z-00000c", "20260301T000000Z-00000d"


@pytest.mark.unit
@pytest.mark.parametrize("keep, kept", [(3, [B, C, D]), (1, [D]), (0, None)])
def test_a_fresh_start_keeps_the_newest_earlier_runs_and_names_each_it_removes(tmp_path, caplog, keep, kept):
    caplog.set_level("INFO", logger="hvd_lars")
    import json

    from hvd_lars.training import checkpoints

    run, earlier = tmp_path / "r", tmp_path / "r" / "earlier_runs"
    for name in (C, "unrecorded", B):
        (earlier / name / "checkpoints").mkdir(parents=True)
        (earlier / name / "metrics.csv").write_text("epoch\n")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "ckpt-4.index").write_bytes(b"")
    (run / "summary.json").write_text(json.dumps({"run_id": D}))  # the run a fresh start replaces

    config = _config(resume=False, keep_earlier_runs=keep)
    started = checkpoints.resume_or_begin(None, None, None, str(run), None, config)
    assert started.error is None and started.run_id not in (B, C, D)
    assert (sorted(os.listdir(earlier)) if earlier.exists() else None) == kept
    assert sorted(os.listdir(run)) == (["earlier_runs"] if kept else [])
    keeps = {
        3: f"{earlier} keeps the newest 3 earlier runs (--keep_earlier_runs=3; rm -r {earlier} clears them)",
        1: f"{earlier} keeps the newest earlier run (--keep_earlier_runs=1; rm -r {earlier} clears them)",
        0: "--keep_earlier_runs=0 keeps no earlier run",
    }[keep]
    moved = "kept in" if keep else "moved to"
    removed = ["unrecorded", B, C, D][: 4 - keep]
    assert [r.getMessage() for r in caplog.records if r.levelname == "INFO"] == [
        f"--noresume: a new run begins in {run}; the earlier run's checkpoints/, summary.json are "
        f"{moved} {earlier / D}; {keeps}",
        *(f"removed {earlier / name}, an earlier run: {keeps}" for name in removed),
    ]


@pytest.mark.unit
def test_a_start_keeps_what_is_not_a_run_and_a_refused_start_removes_nothing(tmp_path, capsys):
    from hvd_lars.training import checkpoints
    from hvd_lars.training.plan import make_plan

    earlier = tmp_path / "earlier_runs"
    for name in (B, C, "notes"):
        (earlier / name).mkdir(parents=True)
    old, new = _config(), _config(seed=1, keep_earlier_runs=0)
    record = checkpoints.RunRecord(make_plan(old, 1, 64, (8, 8, 3)).settings)
    record.assign(D)
    checkpoint = tf.train.Checkpoint(run=record.variable)
    tf.train.CheckpointManager(checkpoint, str(tmp_path / "checkpoints"), 3).save(checkpoint_number=5)
    new_plan = make_plan(new, 1, 64, (8, 8, 3))
    refused = checkpoints.resume_or_begin(None, None, None, str(tmp_path), new_plan, new)
    assert "(seed 0 -> 1)" in str(refused.error) and sorted(os.listdir(earlier)) == [B, C, "notes"]
    assert capsys.readouterr().out == ""

    assert checkpoints.keep_newest(str(tmp_path), 1) == [str(earlier / B)]
    assert sorted(os.listdir(earlier)) == [C, "notes"]
    assert checkpoints.keep_newest(str(tmp_path), 0) == [str(earlier / C)]
    assert os.listdir(earlier) == ["notes"]  # not a run's folder: left, and the folder with it
