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

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.support import REPO, small_runs
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
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)


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
    result = subprocess.run(
        small_runs.uninterrupted_command(straight), cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir / "smoke", small_runs.run_restart_sequence(workdir), straight / "smoke"


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
    assert len({r["run_id"] for r in rows}) == 1
    assert [(r["test_loss"], r["test_top1"]) for r in rows] == [
        (r["test_loss"], r["test_top1"]) for r in expected
    ]
    steps = sorted(step for tag, step in _scalars(run / "tensorboard") if tag == "test_loss")
    assert steps == [4, 8, 12, 16]
