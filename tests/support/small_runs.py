"""Short runs of the main program: a small CNN on a test data set (the data tests), and one run stopped
three times and restarted each time with the same command (the resume tests)."""

import csv
import json
import os
import re
import sys

from tests.support import REPO, TWO_RANKS
from tests.support.main_server import run_main

KILLER = os.path.join(REPO, "tests", "support", "kill_at_step.py")


def train_small_cnn(dataset, data_dir, workdir, run_name, global_batch, epochs, **settings):
    """Trains small_cnn briefly in this process (32x32 images, no warmup, LR 0.1) on a test data set, as
    `python -m hvd_lars.main` would with the same settings; returns its summary.json as a dict."""
    import pytest

    from hvd_lars.training import epoch_logs, plot_run, train
    from hvd_lars.training.config import TrainConfig

    config = TrainConfig(
        dataset=dataset, data_dir=str(data_dir), model="small_cnn", image_size=32,
        global_batch_size=global_batch, epochs=epochs, warmup_epochs=0, peak_learning_rate=0.1,
        run_name=run_name, workdir=str(workdir), verbose=0, **settings,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(epoch_logs, "git_sha", lambda: "0" * 40)  # git is a process; the unit tier starts none
        patch.setattr(plot_run, "plot_run", lambda run_dir: None)  # the plot: tests/test_epoch_logs.py
        train.run(config)
    with open(os.path.join(workdir, run_name, "summary.json")) as f:
        return json.load(f)


# flags/smoke.flags on 2 ranks at 8x8 pixels, 4 epochs of 4 updates (epoch ends at 4, 8, 12, 16), a
# synchronous checkpoint every 2 updates: every stop below lands on a checkpoint the uninterrupted run
# writes too, so both runs average the ranks' batch-norm statistics at the same updates and end tensor for
# tensor equal.
RESTART_FLAGS = [
    "--flagfile=flags/smoke.flags", "--precision=float32", "--steps_per_epoch=4", "--epochs=4",
    "--image_size=8", "--checkpoint_every_steps=2", "--noasync_checkpoints", "--max_eval_examples=32",
    "--keep_checkpoints=9", "--verbose=2",
]  # fmt: skip
# (after update, signal, rank: -1 every rank) and the update the next start resumes from: each kind of stop.
STOPS = [
    ((3, "KILL", 1), 2),  # one rank dies mid-epoch: back to its checkpoint of update 2
    ((8, "KILL", -1), 6),  # every rank dies after epoch 1's last update, before its logs: back to 6
    ((11, "USR1", 1), 12),  # a signal to one rank: every rank stops after the next update (epoch 2's last,
    # logged first), which is saved (TERM: tests/test_faults.py)
]
SCHEDULE = "--stop_schedule=" + ",".join(f"{s}:{n}:{r}" for (s, n, r), _ in STOPS)


def restart_command(workdir):
    """The one command of the restart sequence: 2 ranks, tests/support/kill_at_step.py with `SCHEDULE`
    (the stops taken are recorded beside `workdir`)."""
    record = f"--stop_record={os.path.join(workdir, 'stops')}"
    return [*TWO_RANKS, sys.executable, KILLER, *RESTART_FLAGS, SCHEDULE, record, f"--workdir={workdir}"]


def uninterrupted_command(workdir):
    return [*TWO_RANKS, sys.executable, "-m", "hvd_lars.main", *RESTART_FLAGS, f"--workdir={workdir}"]


def run_restart_sequence(workdir):
    """Runs `restart_command` (its ranks forked from tests/support/main_server.py's server) until it succeeds,
    at most len(STOPS) + 1 times; returns one dict per start: returncode, resumed (the update it resumed
    from, or None), stopped (the update a stop signal ended it at, or None), output (stdout + stderr)."""
    starts = []
    for _ in range(len(STOPS) + 1):
        result = run_main(restart_command(workdir), cwd=REPO, timeout=400)
        output = result.stdout + result.stderr
        resumed = re.search(r"resumed from \S+/ckpt-(\d+) \(step (\d+)\)", output)
        stopped = re.search(r"stopped at step (\d+), checkpoint", output)
        starts.append({"returncode": result.returncode, "resumed": int(resumed.group(2)) if resumed else None,
                       "stopped": int(stopped.group(1)) if stopped else None, "output": output})  # fmt: skip
        if result.returncode == 0:
            break
    return starts


def metrics_rows(run_dir):
    """The rows of `run_dir`/metrics.csv (dicts of strings)."""
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def final_tensors(run_dir, step=None):
    """{name: value} of the model and optimizer tensors of `run_dir`'s latest checkpoint, or of update
    `step`'s: every weight, slot, counter and batch-norm statistic, not the run record (whose run id
    differs between runs)."""
    import tensorflow as tf

    folder = os.path.join(run_dir, "checkpoints")
    reader = tf.train.load_checkpoint(os.path.join(folder, f"ckpt-{step}") if step else folder)
    names = [n for n in reader.get_variable_to_shape_map() if n.startswith(("model/", "optimizer/"))]
    return {n: reader.get_tensor(n) for n in names}
