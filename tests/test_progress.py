"""A run stopped mid-epoch and resumed records what the uninterrupted run records: the whole epoch's training
metrics (restored from the checkpoint's running sums), its epoch header, and its time over both starts."""

import json
import os
import sys

import pytest
import tensorflow as tf

from tests.support import REPO
from tests.support.main_server import run_main
from tests.support.small_runs import TWO_RANKS, metrics_rows

KILLER = os.path.join(REPO, "tests", "support", "kill_at_step.py")
# 2 epochs of 7 updates on 2 ranks; checkpoints at every second update, so the stop's (4) is one the
# uninterrupted run writes too.
FLAGS = [
    "--flagfile=flags/smoke.flags", "--precision=float32", "--steps_per_epoch=7", "--epochs=2",
    "--checkpoint_every_steps=2", "--noasync_checkpoints", "--keep_checkpoints=9",
    "--verbose=2",
]  # fmt: skip


def _run(workdir, *fault):
    program = [KILLER, *fault] if fault else ["-m", "hvd_lars.main"]
    return run_main(
        [*TWO_RANKS, sys.executable, *program, *FLAGS, f"--workdir={workdir}"], cwd=REPO, timeout=300
    )


@pytest.mark.horovod
def test_an_epoch_resumed_mid_way_records_the_whole_epoch(tmp_path):
    straight = _run(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    stopped = _run(tmp_path / "stopped", "--kill_at_step=3", "--kill_signal=USR1")
    assert stopped.returncode == 75 and "stopped at step 4" in stopped.stdout, stopped.stderr[-3000:]
    resumed = _run(tmp_path / "stopped")
    assert resumed.returncode == 0 and "(step 4)" in resumed.stdout, resumed.stderr[-3000:]

    want, got = metrics_rows(tmp_path / "straight" / "smoke"), metrics_rows(tmp_path / "stopped" / "smoke")
    assert [r["step"] for r in got] == [r["step"] for r in want] == ["7", "14"]
    for a, b in zip(want, got):
        for key in ("loss", "top1", "top5"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5, abs=1e-6), (a["epoch"], key)
    # The resumed epoch's printed line: under its header, with the whole epoch's loss.
    out = resumed.stdout
    assert "Epoch 1/2" in out and "Epoch 2/2" in out
    printed = out[out.index("Epoch 1/2") : out.index("Epoch 2/2")]
    assert f"loss: {float(got[0]['loss']):.4f}" in printed, printed

    # Time over the two starts: the first counted up to its checkpoint of update 4, then the second's.
    record = tf.train.load_checkpoint(str(tmp_path / "stopped" / "smoke" / "checkpoints" / "ckpt-4"))
    first = json.loads(record.get_tensor("progress/.ATTRIBUTES/VARIABLE_VALUE").decode())
    assert first["step"] == 4 and first["wall_time_s"] > 0
    with open(tmp_path / "stopped" / "smoke" / "summary.json") as f:
        summary = json.load(f)
    assert summary["wall_time_s"] > first["wall_time_s"]
    # The final line says what its images/s cover.
    end = [line for line in out.splitlines() if "[hvd_lars] finished smoke: 2 of 2 epochs" in line]
    assert len(end) == 1, out[-3000:]
    assert end[0].endswith(" images/s (this start's epochs after its first)") or end[0].endswith(
        "images/s not measured"
    ), end
