"""metrics.csv, TensorBoard, summary.json across evaluations and resumes; the run's plot and progress."""

import csv
import json
import math
import os
import re
import types

import keras
import matplotlib.figure
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars.training import checkpoints, epoch_logs, plot_run
from hvd_lars.training.config import TrainConfig
from hvd_lars.training.epoch_logs import RunSummary
from hvd_lars.training.plan import make_plan

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_git(monkeypatch):
    monkeypatch.setattr(epoch_logs, "git_sha", lambda: "0" * 40)  # the unit tier starts no process


def _train(loggers, epochs, every=2, validation=True):
    """The loggers' epoch ends for `epochs` (0-based) of 8 steps, evaluated every `every` epochs and at 3."""
    counter = keras.Variable(0, dtype="int64")
    model = types.SimpleNamespace(optimizer=types.SimpleNamespace(iterations=counter))
    for logger in loggers:
        logger.set_model(model)
    for epoch in epochs:
        model.optimizer.iterations.assign((epoch + 1) * 8)
        logs = {"loss": 2.0 - 0.1 * epoch, "top1": 0.5 + 0.01 * epoch, "learning_rate": 0.1 * (epoch + 1)}
        if (epoch + 1) % every == 0 or epoch == 3:
            logs.update(test_loss=1.5, test_top1=0.6, test_top5=0.9)
            if validation:
                logs.update(val_loss=1.4, val_top1=0.61, val_top5=0.91)
        for logger in loggers:
            logger.on_epoch_end(epoch, dict(logs))


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.mark.parametrize(
    "text, problem",
    [
        (b"epoch,loss,top1\n0,2.0,0.5\n", "KeyError: 'step'"),  # not a metrics.csv of this package
        (b"epoch,step,loss\n0,8,2.0\n\xff\xfe\n", "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
        (b"epoch,step,loss\n0,8,2.0\n1,16,1.", "ValueError: empty or cut short"),  # a copy interrupted
    ],
)
def test_an_unreadable_csv_is_renamed_with_one_warning_and_begun_anew(tmp_path, caplog, text, problem):
    path = tmp_path / "metrics.csv"
    path.write_bytes(text)
    logger = epoch_logs.MetricsCSV(str(path), start_step=8)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"{path} cannot be read ({problem}"), warnings
    assert warnings[0].endswith(f"; renamed {path}.unreadable")
    assert (tmp_path / "metrics.csv.unreadable").read_bytes() == text and not path.exists()
    _train([logger], [1], validation=False)
    header, *rows = _rows(path)
    assert header[:2] == ["epoch", "step"] and [r[:2] for r in rows] == [["1", "16"]]


def _events(log_dir):
    """{(tag, step): [values]} of every scalar in the event files of log_dir (not its sub-folders)."""
    found = {}
    for name in sorted(os.listdir(log_dir)):
        if name.startswith("events.out.tfevents"):
            for record in tf.data.TFRecordDataset(os.path.join(log_dir, name)):
                event = tf.compat.v1.Event.FromString(record.numpy())
                for v in event.summary.value:
                    found.setdefault((v.tag, event.step), []).append(float(tf.make_ndarray(v.tensor)))
    return found


def test_csv_and_tensorboard_log_each_epoch_at_its_step_and_a_resume_drops_later_epochs(tmp_path):
    path, log_dir = str(tmp_path / "metrics.csv"), str(tmp_path / "tb")
    _train([epoch_logs.MetricsCSV(path), epoch_logs.TensorBoardScalars(log_dir)], range(3), validation=False)
    header, *rows = _rows(path)
    # Test columns although the first epoch had none; no invented val_ copies.
    assert header == ["epoch", "step", "learning_rate", "loss", "test_loss", "test_top1", "test_top5", "top1"]
    assert rows == [
        ["0", "8", "0.1", "2.0", "", "", "", "0.5"],
        ["1", "16", "0.2", "1.9", "1.5", "0.6", "0.9", "0.51"],
        ["2", "24", "0.30000000000000004", "1.8", "", "", "", "0.52"],
    ]
    events = _events(log_dir)
    assert {len(v) for v in events.values()} == {1}  # no step written twice
    assert {tag for tag, _ in events} == {"epoch", *header[2:]}  # each under its own tag
    assert sorted(step for tag, step in events if tag == "test_top1") == [16]
    assert events[("learning_rate", 24)] == [pytest.approx(0.3)] and events[("epoch", 24)] == [3]
    # Resumed from the checkpoint of step 20 (inside epoch 2), now with a validation split: metrics.csv
    # drops epoch 2's row and gains val_ columns; TensorBoard shows both points of epoch 2.
    _train([epoch_logs.MetricsCSV(path, start_step=20), epoch_logs.TensorBoardScalars(log_dir)], [2, 3])
    header, *rows = _rows(path)
    assert "val_top1" in header and "test_top1" in header and len(header) == 11
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and {len(r) for r in rows} == {11}
    by_name = [dict(zip(header, r)) for r in rows]
    assert by_name[1]["test_top1"] == "0.6" and by_name[1]["val_top1"] == ""
    assert by_name[3]["val_top1"] == "0.61" and by_name[3]["top1"] == "0.53"
    events = _events(log_dir)
    assert sorted(step for tag, step in events if tag == "loss") == [8, 16, 24, 32]
    assert len(events[("loss", 24)]) == 2
    assert sorted(step for tag, step in events if tag == "val_top1") == [32]


def test_summary_json_is_strict_json_and_reads_back_non_finite_values(tmp_path):
    config = TrainConfig(max_train_examples=64, epochs=1, global_batch_size=8, peak_learning_rate=0.1)
    plan = make_plan(config, 1, 64)
    summary = RunSummary(str(tmp_path), config, plan, 0)
    summary.on_epoch_end(0, {"loss": float("nan"), "top1": 0.1, "grad": float("inf"), "low": -math.inf})
    text = (tmp_path / "summary.json").read_text()
    written = json.loads(text, parse_constant=lambda token: pytest.fail(f"bare {token} in strict JSON"))
    want = {"epoch": 1, "loss": "NaN", "top1": 0.1, "grad": "Infinity", "low": "-Infinity"}
    assert written["epochs"][0] == want
    back = RunSummary.load(str(tmp_path))["epochs"][0]
    assert math.isnan(back["loss"]) and back["grad"] == math.inf and back["low"] == -math.inf
    assert checkpoints.strict({"a": [1.5, float("nan")], "b": "NaN"}) == {"a": [1.5, "NaN"], "b": "NaN"}
    # Cut short: renamed, one warning; a resumed run writes it anew from its own epochs.
    (tmp_path / "summary.json").write_text(text[: len(text) // 2])
    assert RunSummary.load(str(tmp_path)) is None and (tmp_path / "summary.json.unreadable").exists()
    RunSummary(str(tmp_path), config, plan, 8)
    assert json.loads((tmp_path / "summary.json").read_text())["epochs"] == []


def test_end_of_a_run_prints_its_summary_and_draws_its_plot(tmp_path, caplog, monkeypatch):
    config = TrainConfig(
        max_train_examples=64, epochs=4, global_batch_size=8, warmup_epochs=1, peak_learning_rate=0.4
    )
    plan = make_plan(config, 1, 64)
    summary = RunSummary(str(tmp_path), config, plan, 0)
    _train([epoch_logs.MetricsCSV(str(tmp_path / "metrics.csv")), summary], range(4))
    caplog.set_level("INFO", logger="hvd_lars")
    summary.finish(str(tmp_path / "checkpoints" / "ckpt-32"))
    said = [re.sub(r" in \d+ s,", " in T s,", r.getMessage()) for r in caplog.records]
    assert said == [
        f"finished {tmp_path.name}: 4 of 4 epochs (32 steps) in T s, images/s not measured",
        "final test top-1 0.6000 (best 0.6000, epoch 2), top-5 0.9000 (best 0.9000)",
        "final validation top-1 0.6100 (best 0.6100, epoch 2), top-5 0.9100 (best 0.9100)",
        f"checkpoint {tmp_path}/checkpoints/ckpt-32",
        f"logs {tmp_path}/{{summary.json, metrics.csv, tensorboard/}}",
        f"plot {tmp_path}/run.png",
    ]
    s = dict(run_name="r", epochs=[], images_per_second=0, plan=dict(epochs=1, total_steps=1), wall_time_s=2)
    line = epoch_logs._end_lines(s, "d", None, None)[0]
    assert line == "finished r: 0 of 1 epoch (1 step) in 2 s, images/s not measured"
    s = {**s, "images_per_second": 12.3}  # measured over the one epoch of this start (its tracing in it)
    line = epoch_logs._end_lines(s, "d", None, None, steady=False)[0]
    assert line.endswith(" in 2 s, 12 images/s (this start's one epoch, tracing included)")
    assert os.path.getsize(tmp_path / "run.png") > 10_000
    loss, top1, rate = plot_run.make_figure(str(tmp_path)).axes[:3]
    assert [ax.get_title() for ax in (loss, top1, rate)] == ["loss", "top-1", "learning rate"]
    lines = {line.get_label(): line for line in top1.lines}
    np.testing.assert_array_equal(lines["training"].get_xdata(), [8, 16, 24, 32])
    np.testing.assert_array_equal(lines["test"].get_xdata(), [16, 32])  # evaluated epochs only
    np.testing.assert_allclose(lines["validation"].get_ydata(), [0.61, 0.61])
    schedule = rate.lines[0]
    assert len(schedule.get_xdata()) == plan.total_steps == 32
    # Warmup from 0 to 0.4 over 8 updates: update k (drawn at step k + 1) has rate 0.4 k / 8.
    np.testing.assert_allclose(schedule.get_ydata()[:8], [0.05 * k for k in range(8)], rtol=1e-6)
    # A plot that cannot be written (a small figure: the write is what fails) is one warning; the finished
    # run stays finished.
    monkeypatch.setattr(plot_run, "make_figure", lambda run_dir: matplotlib.figure.Figure((1, 1)))
    os.remove(tmp_path / "run.png")
    (tmp_path / "run.png").mkdir()
    caplog.clear()
    summary.finish(None)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"no plot of this run (IsADirectoryError: [Errno 21] Is a directory: '{tmp_path}/run.png.tmp' -> "
        f"'{tmp_path}/run.png'); try `hvd-lars-plot {tmp_path}`"
    ]
    assert caplog.records[-1].getMessage() == "plot not written" and not (tmp_path / "run.png.tmp").exists()


@pytest.mark.parametrize("metrics", [None, "epoch,step,loss\n"])
def test_plot_run_in_the_first_epoch_says_no_epoch_has_finished(tmp_path, capsys, metrics):
    # summary.json is written before the first update; metrics.csv (or its first row) after epoch 0.
    (tmp_path / "summary.json").write_text('{"plan": {"steps_per_epoch": 3}, "epochs": []}')
    if metrics is not None:
        (tmp_path / "metrics.csv").write_text(metrics)
    assert plot_run.main([str(tmp_path)]) == 0
    out = capsys.readouterr()
    said = "no epoch has finished yet (summary.json, no metrics.csv row); nothing to plot"
    assert out.out == f"[hvd_lars] {tmp_path}: {said}\n"
    assert out.err == "" and not (tmp_path / "run.png").exists()
    # Not a run directory: one error line, exit status 2.
    assert plot_run.main([str(tmp_path / "nothing")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("hvd_lars: error: ") and len(out.err.splitlines()) == 1


END = re.compile(r"\d/5 - \d+s - \d+[mu]?s/step - loss: \d+\.\d{4}(e-\d\d)?")  # Keras's own epoch line


@pytest.mark.parametrize(
    "progress, fit, expected",
    [
        # A line once 25 s have passed since the previous (or the epoch's start): after micro-batch 3 of 5
        # (30 s at 10 s each), not after 4 nor 5, the epoch's last. 192 images in 30 s; 2 left: 20 s.
        (
            (2, 5, 64, 25), (2, 5),
            ["Epoch 1/2", "3/5 - 30s - 6 images/s - loss: {2} - 20s left", END,
             "Epoch 2/2", "3/5 - 30s - 6 images/s - loss: {7} - 20s left", END],
        ),
        # Every micro-batch, from where a resumed epoch resumed: 3 micro-batches finish an epoch of 5.
        (
            (4, 5, 8, 0), (1, 3),
            ["Epoch 1/4", "3/5 - 10s - 1 images/s - loss: {0} - 20s left",
             "4/5 - 20s - 1 images/s - loss: {1} - 10s left", END],
        ),
        ((2, 5, 8, None), (2, 5), ["Epoch 1/2", END, "Epoch 2/2", END]),  # no interval: epoch lines only
    ],
    ids=["every_25s", "resumed_every_batch", "epoch_lines_only"],
)  # fmt: skip
def test_progress_lines(capsys, progress, fit, expected):
    ticks = iter(range(0, 10_000, 10))  # read as an epoch begins and after each micro-batch: 10 s each
    progress = epoch_logs.EpochProgress(*progress, clock=lambda: next(ticks))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.arange(40, dtype="float32").reshape(20, 2) / 40
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(2).repeat()
    losses = []  # the running mean loss after each micro-batch
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(logs["loss"]))
    model.fit(
        data, epochs=fit[0], steps_per_epoch=fit[1], callbacks=[record, progress], verbose=0, shuffle=False
    )
    losses = [f"{v:.4f}" if v > 1e-3 else f"{v:.4e}" for v in losses]  # as Keras's epoch line writes them
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(expected), lines
    for line, want in zip(lines, expected):
        assert END.fullmatch(line) if want is END else line == want.format(*losses), (line, want)


def test_time_left_is_written_as_keras_writes_its_eta():
    assert [epoch_logs._duration(s) for s in (0.4, 42, 90, 3725)] == ["0s", "42s", "1:30", "1:02:05"]
