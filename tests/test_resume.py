"""Resumes end where the uninterrupted run ends: on 2 Horovod ranks, one run stopped by each kind of stop
(SIGKILL of one rank, of every rank, a signal to one rank) and restarted with the same command, tensor for
tensor, with every epoch's row once and its whole-epoch metrics (in one process, a run that dies and starts
again: tests/test_train.py). In one process, what a start restores and what it refuses.

2 ranks are exact too: every rank averages its batch-norm statistics over the ranks before each checkpoint,
the data order is a function of the seed and the step, and an average of 2 float32 values is one rounded sum.
"""

import json
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars.models import get_model
from hvd_lars.training import checkpoints
from hvd_lars.training.config import TrainConfig
from hvd_lars.training.plan import build_optimizer, make_plan
from tests.support import REPO, small_runs
from tests.support.main_server import run_main
from tests.test_main import _scalars


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """The 2-rank run of `small_runs.STOPS`: (its run directory, its starts), and the uninterrupted run's
    directory."""
    workdir, straight = tmp_path_factory.mktemp("restarted"), tmp_path_factory.mktemp("straight")
    result = run_main(small_runs.uninterrupted_command(straight), cwd=REPO, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir / "smoke", small_runs.run_restart_sequence(workdir), straight / "smoke"


@pytest.mark.horovod
def test_two_ranks_stopped_and_restarted_end_as_the_uninterrupted_run(restarted):
    run_dir, starts, straight = restarted
    # Each start resumed where the stop before it left the run, and the last one finished.
    assert [s["resumed"] for s in starts] == [None] + [resumed for _, resumed in small_runs.STOPS]
    assert [s["returncode"] == 0 for s in starts] == [False] * 3 + [True], [
        s["output"][-2000:] for s in starts
    ]
    assert [s["stopped"] for s in starts] == [None, None, 12, None]  # a signal saves the next update
    assert "reached 1 of 2 rank(s) (this one: none)" in starts[2]["output"]  # rank 0's line
    ours, theirs = small_runs.final_tensors(run_dir), small_runs.final_tensors(straight)
    assert ours.keys() == theirs.keys() and len(ours) > 40
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    # Every epoch's row once, each as the uninterrupted run measured it: the epochs resumed mid-way (from
    # updates 2 and 6) with the whole epoch's training metrics, restored from the checkpoint's running sums.
    rows, expected = small_runs.metrics_rows(run_dir), small_runs.metrics_rows(straight)
    assert [(r["epoch"], r["step"]) for r in rows] == [("0", "4"), ("1", "8"), ("2", "12"), ("3", "16")]
    for a, b in zip(expected, rows):
        assert (a["test_loss"], a["test_top1"]) == (b["test_loss"], b["test_top1"])
        for key in ("loss", "top1", "top5"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5, abs=1e-6), (a["epoch"], key)
    steps = sorted({step for tag, step in _scalars(run_dir / "tensorboard") if tag == "test_loss"})
    assert steps == [4, 8, 12, 16]
    # The epoch resumed from update 2 printed under its header with the whole epoch's loss.
    out = starts[1]["output"]
    printed = out[out.index("Epoch 1/4") : out.index("Epoch 2/4")]
    assert f"loss: {float(rows[0]['loss']):.4f}" in printed, printed
    # Time adds up over the starts: the stop's checkpoint holds the earlier starts', the summary more.
    record = tf.train.load_checkpoint(str(run_dir / "checkpoints" / "ckpt-12"))
    stopped = json.loads(record.get_tensor("progress/.ATTRIBUTES/VARIABLE_VALUE").decode())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert stopped["step"] == 12 and 0 < stopped["wall_time_s"] < summary["wall_time_s"]
    end = [line for line in starts[-1]["output"].splitlines() if "] finished smoke: 4 of 4 epochs" in line]
    # The last start trained one epoch (updates 12 to 16): its rate is that epoch's, tracing in it.
    assert len(end) == 1 and end[0].endswith(" images/s (this start's one epoch, tracing included)")


# ------------------------------------------------------------------------------ in one process
def _built(config, plan):
    """The compiled model and its optimizer (not built) as `train.start` makes them, and its build."""
    keras.utils.set_random_seed(0)
    model = get_model("small_cnn", num_classes=10, input_shape=(8, 8, 3))
    optimizer = build_optimizer(config, plan)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model, optimizer, lambda: optimizer.build(model.trainable_variables)


def _config(**changes):
    base = dict(dataset="synthetic", image_size=8, global_batch_size=8, steps_per_epoch=4, epochs=2,
                peak_learning_rate=1.0, precision="float32")  # fmt: skip
    return TrainConfig(**{**base, **changes})


def _key(variable):
    # A variable's path without the number Keras gives the second LARS made in one process ("lars_1/..."):
    # the checkpoint pairs variables by object, not by path.
    return re.sub(r"^(distributed_)?lars(_\d+)?/", r"\1lars/", variable.path)


@pytest.mark.unit
def test_an_allowed_change_restores_every_old_variable_and_starts_the_new_ones_at_zero(tmp_path):
    # A checkpoint of update 5 under the plan without accumulation or momentum correction, every variable
    # holding a value of its own, as `train.start` makes it.
    old = make_plan(_config(), 1, 64, (8, 8, 3))
    model, optimizer, build = _built(_config(), old)
    build()
    rng = np.random.default_rng(0)
    for v in model.variables + optimizer.variables:
        if "iteration" not in v.path:
            v.assign(rng.normal(size=v.shape).astype(v.dtype))
    optimizer.iterations.assign(5)
    record = checkpoints.plan_variable(old.settings)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, plan=record)
    tf.train.CheckpointManager(checkpoint, str(tmp_path / "checkpoints"), 3).save(checkpoint_number=5)
    saved = {_key(v): v.numpy() for v in model.variables + optimizer.variables}

    new = _config(accumulation_steps=2, momentum_correction="always")
    plan = make_plan(new, 1, 64, (8, 8, 3))
    model, optimizer, build = _built(new, plan)
    with pytest.raises(checkpoints.ResumeRefused) as refused:
        checkpoints.resume(model, optimizer, build, str(tmp_path), plan, ())
    assert "(momentum_correction 'none' -> 'always'; accumulation_steps 1 -> 2)" in str(refused.value)
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
def test_a_start_tries_the_index_newest_first_then_the_rest_from_the_highest_step(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (2, 3, 4, 7, 9):
        (folder / f"ckpt-{step}.index").write_bytes(b"")
    lines = ['model_checkpoint_path: "ckpt-3"', *(f'all_model_checkpoint_paths: "ckpt-{s}"' for s in (2, 3))]
    (folder / "checkpoint").write_text("\n".join(lines) + "\n")
    assert [os.path.basename(p) for p in checkpoints.candidates(str(folder))] == [
        "ckpt-3", "ckpt-9", "ckpt-7", "ckpt-4", "ckpt-2",
    ]  # fmt: skip


@pytest.mark.horovod
def test_a_restart_under_another_schedule_and_weight_decay_is_refused_on_every_rank(restarted):
    # The uninterrupted run of the restart test (schedule mlperf_poly, weight decay 5e-4), started again.
    changed = small_runs.uninterrupted_command(restarted[2].parent)
    result = run_main([*changed, "--weight_decay=0", "--schedule=cosine"], cwd=REPO, timeout=400)
    output = result.stdout + result.stderr
    refusal = "holds a run with another plan (schedule 'mlperf_poly' -> 'cosine'; weight_decay 0.0005 -> 0.0)"
    # Refused on both ranks, said once, by rank 0 (horovodrun prefixes its lines with [1,0]<stderr>:).
    assert result.returncode != 0 and output.count("hvd_lars: error:") == 1, output[-3000:]
    assert re.search(rf"\[1,0\]<stderr>:hvd_lars: error: \S+ {re.escape(refusal)}", output), output[-3000:]
