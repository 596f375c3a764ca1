"""What a restarted job meets, end to end: flags that change the plan of its checkpoints, bad flags, and a
kill between an epoch's last update and its logs."""

import csv
import os
import re
import sys

import pytest

from tests.support import REPO
from tests.support.horovodrun_checked_once import HOROVODRUN
from tests.support.main_server import run_main
from tests.test_main import _scalars

pytestmark = pytest.mark.horovod

KILLER = os.path.join(REPO, "tests", "support", "kill_at_step.py")
SMOKE = ["--flagfile=flags/smoke.flags", "--precision=float32", "--verbose=0"]


def _run(args, workdir, program=("-m", "hvd_lars.main"), launcher=()):
    cmd = [*launcher, sys.executable, *program, *SMOKE, *args, f"--workdir={workdir}"]
    return run_main(cmd, cwd=REPO, timeout=400)


@pytest.mark.parametrize(
    "flag, line",
    [
        ("--epochs=inf", "hvd_lars: error: --epochs must be a whole number > 0, got inf."),
        (
            "--peak_learning_rate=inf",
            "hvd_lars: error: --peak_learning_rate must be a finite number >= 0, got inf.",
        ),
        ("--intra_op_threads=-1", "hvd_lars: error: --intra_op_threads must be a whole number >= 0, got -1."),
        ("--seed=-1", "hvd_lars: error: --seed must be a whole number >= 0, got -1."),
    ],
)
def test_a_bad_flag_is_exit_2_with_one_line_and_nothing_written(flag, line, tmp_path):
    workdir = tmp_path / "w"
    result = _run([flag], workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == line
    assert not workdir.exists()


def test_a_flagfile_with_a_latin1_byte_is_one_line_naming_the_file_and_the_line(tmp_path):
    flagfile = tmp_path / "mine.flags"
    flagfile.write_bytes(b"--flagfile=flags/smoke.flags\n# caf\xe9 au lait (Latin-1)\n--epochs=1\n")
    result = _run([f"--flagfile={flagfile}"], tmp_path / "w")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"hvd_lars: error: --flagfile={flagfile}: line 2 is not utf-8 text (byte 0xe9 at column 6); save the "
        "file as utf-8."
    )
    assert not (tmp_path / "w").exists()


PLAN = [
    "--steps_per_epoch=2",
    "--epochs=3",
    "--checkpoint_every_steps=1",
    "--noasync_checkpoints",
]


def test_a_resume_under_another_schedule_and_weight_decay_is_refused_on_every_rank(tmp_path):
    killed = _run([*PLAN, "--schedule=mlperf_poly", "--kill_at_step=3"], tmp_path, program=(KILLER,))
    assert killed.returncode != 0
    changed = [*PLAN, "--schedule=cosine", "--weight_decay=0"]
    two_ranks = (*HOROVODRUN, "-np", "2", "-H", "localhost:2")
    result = _run(changed, tmp_path, launcher=two_ranks)
    assert result.returncode != 0
    refusal = "holds a run with another plan (schedule 'mlperf_poly' -> 'cosine'; weight_decay 0.0005 -> 0.0)"
    output = result.stdout + result.stderr
    # Refused on both ranks, said once, by rank 0 (horovodrun prefixes its lines with [1,0]<stderr>:).
    assert re.search(rf"\[1,0\]<stderr>:hvd_lars: error: \S+ {re.escape(refusal)}", output), output[-3000:]
    assert output.count("hvd_lars: error:") == 1, output[-3000:]
    # Named, the changes are taken: the run continues on the cosine curve from its checkpoint of step 3.
    allowed = _run([*changed, "--allow_plan_change=schedule,weight_decay"], tmp_path)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "resumed from" in allowed.stdout and "(step 3)" in allowed.stdout


def _rows(workdir):
    with open(os.path.join(workdir, "smoke", "metrics.csv")) as f:
        return list(csv.DictReader(f))


def test_a_kill_before_an_epochs_logs_loses_none_of_them(tmp_path):
    # 3 epochs of 3 steps; killed after update 3, the last of epoch 0, before its evaluation, logs and
    # checkpoint (the checkpoint comes after the loggers, so no checkpoint is ever ahead of its epoch's logs).
    flags = ["--steps_per_epoch=3", "--epochs=3"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _run(flags, straight).returncode == 0
    assert _run([*flags, "--kill_at_step=3"], killed, program=(KILLER,)).returncode != 0
    assert not os.path.exists(killed / "smoke" / "metrics.csv")
    result = _run(flags, killed)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(step 2)" in result.stdout  # the checkpoint of update 2 (--checkpoint_every_steps=2)
    expected, got = _rows(straight), _rows(killed)
    assert [(r["epoch"], r["step"]) for r in got] == [("0", "3"), ("1", "6"), ("2", "9")]
    # Epoch 0's row holds what the uninterrupted run measured, value for value.
    for a, b in zip(expected, got):
        assert a["test_loss"] == b["test_loss"] and a["test_top1"] == b["test_top1"], (a, b)
    steps = sorted(step for tag, step in _scalars(killed / "smoke" / "tensorboard") if tag == "test_top1")
    assert steps == [3, 6, 9]
