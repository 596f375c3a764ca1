"""The main program end to end on a subset of Fashion-MNIST: one process killed and resumed, two Horovod
ranks, bad input (in one process where the subject is not a start)."""

import csv
import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags as absl_flags

from hvd_lars import main
from hvd_lars.parallel import ompi_allreduce_rules
from hvd_lars.training import epoch_logs
from hvd_lars.training.config import TrainConfig
from tests.support import REPO, TWO_RANKS
from tests.support.main_server import run_main

MAIN = [sys.executable, "-m", "hvd_lars.main", "--flagfile=flags/fashion_mnist_lars.flags"]
SUBSET = [
    "--max_train_examples=4096", "--max_eval_examples=1000", "--global_batch_size=512", "--epochs=2",
    "--warmup_epochs=0.5", "--peak_learning_rate=4", "--run_name=subset",
    "--validation_examples=5000",  # the last 5,000 training images; the first 1,000 of them evaluated
]  # fmt: skip


def _scalars(folder):
    """[(tag, step)] of every scalar in the event files under `folder`."""
    import tensorflow as tf

    files = Path(folder).rglob("events.out.tfevents*")
    events = [e for f in files for e in tf.compat.v1.train.summary_iterator(str(f))]
    return [(v.tag, e.step) for e in events for v in e.summary.value]


def _run(cmd, timeout=420):
    return run_main(cmd, cwd=REPO, timeout=timeout)


@pytest.mark.horovod
def test_single_process_subset_killed_resumed_completed(tmp_path):
    # Evaluated after epoch 2 only, checkpoints every 5 updates and at epoch ends.
    command = MAIN + SUBSET + ["--eval_every_epochs=2", "--checkpoint_every_steps=5", f"--workdir={tmp_path}"]
    # SIGKILLed after update 12 of 16: the logs of epoch 1 (step 8) are written.
    killer = [sys.executable, os.path.join(REPO, "tests", "support", "kill_at_step.py"), "--kill_at_step=12"]
    result = _run(killer + command[3:])
    assert result.returncode != 0 and "global batch 512 = 1 rank x per-rank batch 512" in result.stdout
    run_dir = tmp_path / "subset"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["epoch"] for e in summary["epochs"]] == [1]  # written after each epoch, atomically
    # The index lagging at step 5, as if the later checkpoints were incomplete: epoch 1 is trained again.
    (run_dir / "checkpoints" / "checkpoint").write_text('model_checkpoint_path: "ckpt-5"\n')

    result = _run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "(step 5)" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["global_batch_size"] == 512
    assert summary["plan"]["steps_per_epoch"] == 8 and summary["plan"]["total_steps"] == 16
    # This attempt trained epochs 1 (from step 5) and 2, each listed once.
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2] and summary["resumed_from_step"] == 5
    # 16 LARS steps on 4,096 images already beat chance (0.1) by far.
    assert 0.5 < summary["final_test_top1"] <= 1.0
    assert summary["final_test_top1"] == summary["epochs"][-1]["test_top1"]
    assert summary["final_test_top5"] >= summary["final_test_top1"]
    # The validation split is evaluated as the test set is (ExactEvaluation checks its 1,000 images).
    assert 0.5 < summary["final_val_top1"] <= summary["final_val_top5"] <= 1.0
    assert summary["final_val_top1"] == summary["epochs"][-1]["val_top1"]
    assert "val_loss" in summary["epochs"][1] and "val_loss" not in summary["epochs"][0]  # not evaluated
    assert summary["images_per_second"] > 0 and summary["wall_time_s"] > 0
    assert len(summary["git_sha"]) >= 7
    # metrics.csv: one row per epoch, each with the header's fields; test_* and val_* columns although the
    # first epoch was not evaluated, and no invented ones.
    header, *lines = list(csv.reader(open(run_dir / "metrics.csv")))
    assert {len(line) for line in lines} == {len(header)} and header[:2] == ["epoch", "step"]
    evaluated = {f"{s}_{m}" for s in ("test", "val") for m in ("loss", "top1", "top5")}
    trained = {"epoch", "step", "loss", "top1", "top5", "learning_rate", "images_per_second", "epoch_time_s"}
    assert set(header) == trained | evaluated
    rows = [dict(zip(header, line)) for line in lines]
    assert [(r["epoch"], r["step"]) for r in rows] == [("0", "8"), ("1", "16")] and rows[0]["test_top1"] == ""
    assert float(rows[1]["test_top1"]) == pytest.approx(summary["final_test_top1"])
    assert float(rows[1]["val_top1"]) == pytest.approx(summary["final_val_top1"])
    # TensorBoard: each scalar under its own tag, at the epoch's last step (epoch 1 logged by the killed
    # attempt and again by this one).
    scalars = _scalars(run_dir / "tensorboard")
    tags = {tag for tag, _ in scalars}
    assert tags == set(header) - {"step"}
    assert sorted(step for tag, step in scalars if tag == "loss") == [8, 8, 16]
    assert [step for tag, step in scalars if tag in ("test_top1", "val_top1")] == [16, 16]
    assert os.path.getsize(run_dir / "run.png") > 10_000  # the plot drawn at the run's end

    # Complete: another start trains nothing and keeps the summary.
    result = _run(command)
    assert result.returncode == 0 and "complete (16 of 16 steps)" in result.stdout
    assert "resumed from" not in result.stdout  # a finished run is not resumed
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    # The same run directory with another schedule (3 epochs) is refused, naming what changed.
    result = _run(command + ["--epochs=3"])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "holds a run with another plan (epochs 2 -> 3), the plan of its checkpoint" in result.stderr


@pytest.mark.horovod
def test_two_ranks_subset(tmp_path):
    # The non-default gradient paths (the default, overlapped and uncompressed, runs in the launcher and
    # resume tests): one grouped allreduce per update, gradients as float16 on the wire.
    flags = [f"--workdir={tmp_path}", "--gradient_reduction=grouped", "--gradient_compression=fp16"]
    result = _run([*TWO_RANKS, *MAIN, *SUBSET, *flags])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "global batch 512 = 2 ranks x per-rank batch 256" in result.stdout
    # Only rank 0 prints progress.
    assert "[1,0]<stdout>:Epoch 1/2" in result.stdout and "[1,1]<stdout>:Epoch" not in result.stdout
    summary = json.loads((tmp_path / "subset" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["per_rank_batch_size"] == 256
    # Two unbound ranks (plain horovodrun) on this node share its cores: TensorFlow's pools and the input
    # pipeline's were sized to cores / 2 threads each.
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    threads = summary["threads"]
    assert (threads["intra_op"], threads["inter_op"], threads["input"]) == (share, share, share)
    assert threads["cores_per_rank"] == [sorted(os.sched_getaffinity(0))] * 2
    # ExactEvaluation would have raised unless the ranks evaluated 1,000 images of each split together.
    assert 0.5 < summary["final_test_top1"] <= 1.0 and 0.5 < summary["final_val_top1"] <= 1.0


BAD_FLAGS = [  # (flags, the one line), {tmp} the test's folder
    ("--flagfile={tmp}/typo.flags", "--epoch (line 2 of --flagfile={tmp}/typo.flags): no such flag; "
     "did you mean --epochs? (--help lists them)"),
    ("--noasync_checkpoint",
     "--noasync_checkpoint: no such flag; did you mean --async_checkpoints? (--help lists them)"),
    ("--model=vgg99", "--model='vgg99'; valid: alexnet, alexnet_bn, resnet18, resnet20, resnet34, resnet50, "
     "small_cnn, small_cnn_nobn."),
    ("--momentum=1.5", "--momentum must be a finite number >= 0 and < 1, got 1.5."),
    ("--epochs=abc", "--epochs must be a whole number > 0, got 'abc'."),
    ("--deterministic=maybe", "--deterministic must be true or false, got 'maybe'."),
    ("--run_name=../x",
     "--run_name='../x': a folder name inside --workdir (no '/', not '.' or '..'); --workdir says where."),
    ("--warmup_epochs=20", "--warmup_epochs=20.0 must be < --epochs=12."),
    ("--flagfile=flags/nope.flags", "Unable to open flagfile: [Errno 2] No such file or directory: "
     "'flags/nope.flags' (the experiments' flagfiles are in flags/)"),
    ("extra", "unexpected arguments extra: give settings as --name=value."),
    ("--flagfile={tmp}/mine.flags", "--flagfile={tmp}/mine.flags: line 2 is not utf-8 text (byte 0xe9 at "
     "column 6); save the file as utf-8."),
]  # fmt: skip


@pytest.mark.horovod
@pytest.mark.parametrize("flag, line", BAD_FLAGS)
def test_bad_flags_are_one_line_before_tensorflow_is_imported(flag, line, tmp_path):
    (tmp_path / "mine.flags").write_bytes(b"--flagfile=flags/smoke.flags\n# caf\xe9 au lait (Latin-1)\n")
    (tmp_path / "typo.flags").write_text("--flagfile=flags/smoke.flags\n--epoch=3\n")
    flag = flag.format(tmp=tmp_path)
    result = subprocess.run(
        [*MAIN[:1], "-X", "importtime", *MAIN[1:], flag], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stdout == ""
    errors = [e for e in result.stderr.splitlines() if not e.startswith("import time:")]
    assert errors == [f"hvd_lars: error: {line.format(tmp=tmp_path)}"]
    imported = {e.split("|")[-1].strip().split(".")[0] for e in result.stderr.splitlines() if "|" in e}
    assert "hvd_lars" in imported and not imported & {"tensorflow", "keras", "horovod", "numpy"}


def _exit_of(flags, monkeypatch, caplog):
    """The exit status and error lines of the main program given `flags`, run in this process."""
    values = absl_flags.FlagValues()
    main.define_flags(values)
    values(["main", "--flagfile=flags/fashion_mnist_lars.flags", *flags])
    monkeypatch.setattr(epoch_logs, "git_sha", lambda: "0" * 40)
    monkeypatch.setattr(ompi_allreduce_rules, "apply", lambda: ({}, None))
    with pytest.raises(SystemExit) as ended:
        main._main(main.config_from_flags(values))
    return ended.value.code, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.unit
@pytest.mark.parametrize(
    "flag, fragments",
    [
        ("--data_dir=/nonexistent", ["apt-get install dataset-fashion-mnist", "/nonexistent"]),
        ("--accumulation_steps=3", ["--global_batch_size=4096", "1 rank x 3 accumulation steps = 3"]),
        ("--per_rank_batch_size=100", ["--per_rank_batch_size=100 contradicts --global_batch_size=4096"]),
    ],
)
def test_bad_input_found_at_start_is_one_clear_error(flag, fragments, tmp_path, monkeypatch, caplog):
    status, [line] = _exit_of([flag, f"--workdir={tmp_path}"], monkeypatch, caplog)
    assert status == 2 and all(fragment in line for fragment in fragments), line
    assert os.listdir(tmp_path) == []  # no run directory left behind


@pytest.mark.unit
def test_help_lists_every_setting_once_by_group_and_exits_0(capsys):
    with pytest.raises(SystemExit) as ended:
        main.parse(["main", "--help"])
    out = capsys.readouterr()
    assert ended.value.code == 0 and out.err == "" and out.out == main.help_text() + "\n"
    help_text = out.out
    assert help_text.startswith("usage: python -m hvd_lars.main --flagfile=flags/<experiment>.flags")
    groups = [line for line in help_text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert groups == [
        "Data:", "Model:", "Optimizer and schedule:", "Batch and scale:", "Checkpoints and resume:",
        "Evaluation and logs:", "Performance:", "Faults:",
    ]  # fmt: skip
    for name in (f.name for f in dataclasses.fields(TrainConfig)):
        assert help_text.count(f"--{name}  (default: ") + help_text.count(f"--[no]{name}  (") == 1
    assert "  --global_batch_size  (default: 0)\n      Images per update" in help_text
    assert "  --[no]exclude_bn_and_bias  (default: false)" in help_text
    assert "  --[no]checkpoint_at_epoch_end  (default: true)" in help_text
    assert (
        "(default: lars) LARS, or SGD with coupled L2 decay. One of: lars, momentum, nesterov."
        in " ".join(help_text.split())
    )


@pytest.mark.unit
def test_no_settings_point_at_the_flagfiles_and_absls_other_errors_pass_on(capsys):
    for message in ("--flagfile with no argument", "flag --verbosity=x: invalid literal for int()"):
        assert main._unparsed_value(message) == message  # its other forms, its own flags: as they are
    with pytest.raises(SystemExit) as ended:
        main.parse(["main"])
    want = "no settings: give an experiment, e.g. --flagfile=flags/smoke.flags (flags/ holds the paper's)."
    assert ended.value.code == 2 and capsys.readouterr().err == f"hvd_lars: error: {want}\n"


@pytest.mark.horovod
def test_batch_not_divisible_by_ranks_is_refused_on_every_rank(tmp_path):
    result = _run([*TWO_RANKS, *MAIN, "--global_batch_size=4095", f"--workdir={tmp_path}"], timeout=180)
    assert result.returncode != 0
    assert "--global_batch_size=4095 does not divide by the world size 2" in result.stdout + result.stderr
    assert not (tmp_path / "fashion_mnist_lars_b4096").exists()


@pytest.mark.unit
def test_every_field_is_a_flag_with_its_declared_default_and_help():
    for name, field in {f.name: f for f in dataclasses.fields(TrainConfig)}.items():
        flag = main.FLAGS[name]
        default = list(field.default) if isinstance(field.default, tuple) else field.default
        assert flag.default == default, name
        assert flag.help.startswith(field.metadata["help"]), name


@pytest.mark.unit
def test_only_errors_raised_by_the_package_count_as_bad_input():
    with pytest.raises(ValueError) as ours:
        TrainConfig(seed=-1).validate()
    assert main._raised_here(ours.value)
    import keras

    with pytest.raises(ValueError) as keras_own:
        keras.layers.Dense(1, activation="no_such_activation")
    assert not main._raised_here(keras_own.value)


@pytest.mark.horovod  # fresh interpreters where Horovod cannot be found, as before its build
def test_without_horovod_the_package_imports_whole_and_trains_as_one_process(tmp_path):
    hidden = "import sys; sys.modules['horovod'] = None"  # importlib.util.find_spec('horovod') is None
    program = "import hvd_lars.main; hvd_lars.main.main()"
    result = subprocess.run(
        [sys.executable, "-c", f"{hidden}; sys.argv[0] = 'hvd-lars-train'; {program}", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    assert result.stdout.startswith("usage: python -m hvd_lars.main --flagfile=")
    # A library user's import first (every export, Horovod's pieces too, as one process), then a start.
    library = "from hvd_lars import DistributedOptimizer, LARS, fuse_batch_norm"
    smoke = [
        f"--flagfile={REPO}/flags/smoke.flags",
        "--epochs=1",
        "--warmup_epochs=0.5",
        "--steps_per_epoch=2",
    ]
    result = subprocess.run(
        [sys.executable, "-c", f"{hidden}; {library}; {program}", *smoke, f"--workdir={tmp_path}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["world_size"] == 1 and [e["epoch"] for e in summary["epochs"]] == [1]
