"""hvd_lars.training.train: the whole training loop in-process, as flax's train_test.py runs its loop: a
few updates on synthetic data at world size 1, with evaluation and checkpoints, and a run that dies and starts
again (a start ending bit for bit as the uninterrupted run: tests/test_damaged_files.py)."""

import json
import os
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars.training import epoch_logs, faults
from hvd_lars.training.config import TrainConfig
from hvd_lars.training.plan import make_plan
from hvd_lars.training.train import callbacks_in_order, fit, run

pytestmark = pytest.mark.unit


def _config(**kw):
    base = dict(peak_learning_rate=2.0, global_batch_size=64, epochs=3, warmup_epochs=1)
    return TrainConfig(**{**base, **kw})


def smoke(tmp_path, **overrides):
    """A few updates of small_cnn on synthetic data, its run directory `loop` under `tmp_path`."""
    settings = dict(
        dataset="synthetic", image_size=32, model="small_cnn", optimizer="lars", global_batch_size=16,
        steps_per_epoch=2, epochs=2, warmup_epochs=0.5, peak_learning_rate=1.0, max_eval_examples=32,
        workdir=str(tmp_path), run_name="loop",
    )  # fmt: skip
    return TrainConfig(**{**settings, **overrides})


class _DiesAfterUpdate3(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):  # as a crash would (no stop checkpoint)
        if int(self.model.optimizer.iterations) == 3:
            raise RuntimeError("died")


def test_the_loop_trains_evaluates_and_starts_again_after_a_crash(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(epoch_logs, "git_sha", lambda: "0" * 40)  # the unit tier starts no process
    # 2 epochs of 2 updates, a checkpoint every update: died after update 3 (before its checkpoint).
    config = smoke(tmp_path, checkpoint_every_steps=1, async_checkpoints=False, precision="float32")
    with pytest.raises(RuntimeError, match="died"):
        run(config, extra_callbacks=[_DiesAfterUpdate3()])
    assert [e["epoch"] for e in json.loads((tmp_path / "loop" / "summary.json").read_text())["epochs"]] == [1]
    folder = tmp_path / "loop" / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.index")) == ["ckpt-1.index", "ckpt-2.index"]
    # Its index cut short, as a crash while writing it leaves it: the newest checkpoint on disk is resumed.
    (folder / "checkpoint").write_text('model_checkpoint_path: "ckpt-')
    resumed = run(config)
    assert resumed["resumed_from_step"] == 2 and [e["epoch"] for e in resumed["epochs"]] == [1, 2]
    assert 0.0 <= resumed["final_test_top1"] <= 1.0
    assert "cannot be read" not in caplog.text  # no warning: neither the index nor a checkpoint
    state = tf.train.get_checkpoint_state(str(folder))  # written anew by the manager
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == ["ckpt-3", "ckpt-4"]
    lines = (tmp_path / "loop" / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[:2] for line in lines[1:]] == [["0", "2"], ["1", "4"]]
    assert (tmp_path / "loop" / "run.png").stat().st_size > 0


def test_the_callbacks_run_in_this_order(tmp_path):
    marker, watchdog = keras.callbacks.Callback(), faults.ProgressWatchdog(0)

    def job_of(config):
        model = types.SimpleNamespace(optimizer=types.SimpleNamespace(iterations=0))
        return types.SimpleNamespace(
            config=config, run_dir=str(tmp_path), watchdog=watchdog, signals=None, extra_callbacks=[marker],
            model=model, manager=None, progress=keras.callbacks.Callback(),
        )  # fmt: skip

    job = job_of(_config())
    data = types.SimpleNamespace(
        eval=None, num_eval_examples=10, validation="v", num_validation_examples=5, skipped_corrupt=None
    )
    plan = make_plan(_config(), 1, 6400)
    summary, commit = keras.callbacks.Callback(), keras.callbacks.Callback()
    order = callbacks_in_order(job, data, plan, summary, commit)
    assert [type(c).__name__ for c in order] == [
        "FaultGuard", "ProgressWatchdog", "Callback", "MetricAverageCallback", "LearningRateLogger",
        "ExactEvaluation", "ExactEvaluation", "Callback", "MetricsCSV", "TensorBoardScalars", "Callback",
        "PeriodicCheckpoint", "Callback", "StopAfterEpoch", "EpochProgress",
    ]  # fmt: skip
    assert order[1] is watchdog and order[2] is job.progress and order[7] is marker
    assert order[10] is summary and order[12] is commit
    # The guard checkpoints through the attempt's checkpointer (at a stop), which saves the run's progress.
    assert order[0].checkpoint is order[11] and order[11].progress is job.progress
    assert [c.prefix for c in order[5:7]] == ["test", "val"]
    assert order[-1].every_s == 30 and order[-1].images_per_batch == plan.per_rank_batch_size
    # --verbose=0: no progress lines; --verbose=2: epoch lines only.
    quiet = callbacks_in_order(job_of(_config(verbose=0)), data, plan, summary)
    assert type(quiet[-1]).__name__ == "StopAfterEpoch"
    assert callbacks_in_order(job_of(_config(verbose=2)), data, plan, summary)[-1].every_s is None


def test_a_callback_that_stops_training_is_not_undone():
    # EarlyStopping-like: stops after the first epoch; fit must not start the remaining epochs again.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    stream = tf.data.Dataset.from_tensor_slices((np.ones((4, 2), "float32"), np.ones((4, 1), "float32")))
    data = types.SimpleNamespace(train_from=lambda start: stream.batch(2).repeat(), num_classes=1)
    plan = make_plan(_config(epochs=3, steps_per_epoch=2), 1, 6400)
    stop = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: setattr(model, "stop_training", True))
    fit(model, data, plan, _config(verbose=0), [stop], 0)
    assert int(model.optimizer.iterations) == 2
