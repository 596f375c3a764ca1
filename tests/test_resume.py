"""A run SIGKILLed after its checkpoint at step k and restarted ends where an uninterrupted run ends."""

import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
from conftest import REPO

from hvd_lars.train import KILL_AT_STEP_ENV

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
ARGS = [
    "-m", "hvd_lars.main", "--flagfile=flags/fashion_mnist_lars.flags", "--max_train_examples=2048",
    "--max_eval_examples=500", "--global_batch_size=256", "--epochs=3", "--warmup_epochs=1",
    "--peak_learning_rate=4", "--checkpoint_every_steps=5", "--run_name=r", "--verbose=0",
]  # fmt: skip


def _train(workdir, launcher=(), kill_at=None):
    env = dict(os.environ)
    env.pop(KILL_AT_STEP_ENV, None)
    if kill_at:
        env[KILL_AT_STEP_ENV] = str(kill_at)
    cmd = list(launcher) + [sys.executable] + ARGS + [f"--workdir={workdir}"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


def _final_variables(workdir):
    reader = tf.train.load_checkpoint(os.path.join(workdir, "r", "checkpoints"))
    names = [n for n in reader.get_variable_to_shape_map() if "model" in n or "optimizer" in n]
    assert len(names) > 20
    return {n: reader.get_tensor(n) for n in names}


def _check_resume(tmp_path, launcher, exact):
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
        if exact:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        else:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_single_process_resume_is_exact(tmp_path):
    _check_resume(tmp_path, (), exact=True)


def test_two_rank_resume_within_tolerance(tmp_path):
    _check_resume(tmp_path, (HOROVODRUN, "-np", "2", "-H", "localhost:2"), exact=False)
