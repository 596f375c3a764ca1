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


def _save(run_dir, model, optimizer, plan, step):
    """A checkpoint of update `step` under `plan` in `<run_dir>/checkpoints`, as `train.start` makes it."""
    from hvd_lars.training import checkpoints

    optimizer.iterations.assign(step)
    record = checkpoints.plan_variable(plan.settings)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, plan=record)
    tf.train.CheckpointManager(checkpoint, str(run_dir / "checkpoints"), 3).save(checkpoint_number=step)


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
    _save(tmp_path, model, optimizer, make_plan(old, 1, 64, (8, 8, 3)), step=5)
    saved = {_key(v): v.numpy() for v in model.variables + optimizer.variables}

    new = _config(accumulation_steps=2, momentum_correction="always")
    plan = make_plan(new, 1, 64, (8, 8, 3))
    model, optimizer, build = _built(new, plan)
    with pytest.raises(checkpoints.ResumeRefused) as refused:
        checkpoints.resume(model, optimizer, build, str(tmp_path), plan, ())
    assert "(momentum_correction 'none' -> 'always'; accumulation_steps 1 -> 2)" in str(refused.value)

    model, optimizer, build = _built(new, plan)
    allowed = ("accumulation_steps", "momentum_correction")
    resumed = checkpoints.resume(model, optimizer, build, str(tmp_path), plan, allowed)
    assert resumed == str(tmp_path / "checkpoints" / "ckpt-5")
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
    _save(tmp_path, model, optimizer, make_plan(default, 1, 64, (8, 8, 3)), step=5)

    spelled = dataclasses.replace(default, data_dir=DEFAULT_DIR)
    plan = make_plan(spelled, 1, 64, (8, 8, 3))
    model, optimizer, build = _built(spelled, plan)
    resumed = checkpoints.resume(model, optimizer, build, str(tmp_path), plan, ())
    assert resumed == str(tmp_path / "checkpoints" / "ckpt-5") and int(optimizer.iterations) == 5

    elsewhere = dataclasses.replace(default, data_dir=str(tmp_path))
    plan = make_plan(elsewhere, 1, 64, (8, 8, 3))
    model, optimizer, build = _built(elsewhere, plan)
    with pytest.raises(checkpoints.ResumeRefused) as refused:
        checkpoints.resume(model, optimizer, build, str(tmp_path), plan, ())
    assert f"(data_dir {os.path.realpath(DEFAULT_DIR)!r} -> {str(tmp_path)!r})" in str(refused.value)


@pytest.mark.unit
def test_a_checkpoint_without_a_plan_record_is_refused_in_one_line_and_left_as_it_is(tmp_path, capsys):
    from hvd_lars.training import checkpoints
    from hvd_lars.training.plan import make_plan

    checkpoint = tf.train.Checkpoint(step=tf.Variable(5))  # no "plan": not written by a run of hvd_lars
    tf.train.CheckpointManager(checkpoint, str(tmp_path / "checkpoints"), 3).save(checkpoint_number=5)
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    config = _config()
    with pytest.raises(checkpoints.ResumeRefused) as refused:
        checkpoints.resume(None, None, None, str(tmp_path), make_plan(config, 1, 64), ("any",))
    assert str(refused.value) == (
        f"no checkpoint in {tmp_path}/checkpoints can be read: {tmp_path}/checkpoints/ckpt-5 (it holds no "
        f"plan record); to train afresh, give another --run_name or remove {tmp_path}."
    )
    assert os.listdir(tmp_path) == ["checkpoints"] and sorted(os.listdir(tmp_path / "checkpoints")) == before
    assert capsys.readouterr().out == ""


@pytest.mark.unit
def test_a_start_tries_the_index_newest_first_then_the_rest_from_the_highest_step(tmp_path):
    from hvd_lars.training import checkpoints

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (2, 3, 4, 7, 9):
        (folder / f"ckpt-{step}.index").write_bytes(b"")
    lines = ['model_checkpoint_path: "ckpt-3"', *(f'all_model_checkpoint_paths: "ckpt-{s}"' for s in (2, 3))]
    (folder / "checkpoint").write_text("\n".join(lines) + "\n")
    assert [os.path.basename(p) for p in checkpoints.candidates(str(folder))] == [
        "ckpt-3", "ckpt-9", "ckpt-7", "ckpt-4", "ckpt-2",
    ]  # fmt: skip
