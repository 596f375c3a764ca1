"""hvd_lars.training.train: the whole training loop in-process, as flax's train_test.py runs its loop: a
few updates on synthetic data at world size 1, with evaluation, a checkpoint, and a resume from it."""

import json

import pytest

from hvd_lars.training import epoch_logs
from hvd_lars.training.config import TrainConfig
from hvd_lars.training.train import run


def smoke(tmp_path, **overrides):
    settings = dict(
        dataset="synthetic",
        image_size=32,
        model="small_cnn",
        optimizer="lars",
        global_batch_size=16,
        steps_per_epoch=2,
        epochs=2,
        warmup_epochs=0.5,
        peak_learning_rate=1.0,
        max_eval_examples=32,
        workdir=str(tmp_path),
        run_name="loop",
    )
    return TrainConfig(**{**settings, **overrides})


@pytest.mark.unit
def test_the_loop_trains_evaluates_checkpoints_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(
        epoch_logs, "git_sha", lambda: "0" * 40
    )  # git is a process; the unit tier starts none
    first = run(smoke(tmp_path, epochs=1))
    assert [e["epoch"] for e in first["epochs"]] == [1] and 0.0 <= first["final_test_top1"] <= 1.0
    assert json.loads((tmp_path / "loop" / "summary.json").read_text())["resumed_from_step"] == 0
    # The same run extended to 2 epochs resumes from the checkpoint of update 2 and trains 2 more.
    second = run(smoke(tmp_path, epochs=2, allow_plan_change=("epochs",)))
    assert second["resumed_from_step"] == 2 and [e["epoch"] for e in second["epochs"]] == [1, 2]
    lines = (tmp_path / "loop" / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[:2] for line in lines[1:]] == [["0", "2"], ["1", "4"]]
    assert (tmp_path / "loop" / "run.png").stat().st_size > 0
