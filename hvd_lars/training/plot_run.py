"""A picture of one run from its logs: loss, top-1 and learning rate against the optimizer step.

    python -m hvd_lars.training.plot_run RUN_DIR [--out PNG]      (or: hvd-lars-plot RUN_DIR)

Reads `RUN_DIR/metrics.csv` (one row per epoch: `hvd_lars.training.epoch_logs.MetricsCSV`) and
`RUN_DIR/summary.json` (the run's config and plan) and writes `RUN_DIR/run.png` (or `--out`): three
panels sharing the step axis (optimizer updates; epochs along the top):
- loss: training (mean over the epoch's batches), and validation and test where evaluated;
- top-1: the same three;
- learning rate: the run's schedule rebuilt from its config and plan
  (`hvd_lars.training.plan.build_schedule`)
  as a line, the rate of update k drawn at step k (the counter after it), and the logged rate of each
  epoch's last update as points, which lie on the line when the optimizer followed its schedule.
Epochs that logged a non-finite value (a diverged run) leave a gap. Works on any run directory of the
main program, also while it is still training.
"""

import argparse
import csv
import dataclasses
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display; before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hvd_lars.training import faults  # noqa: E402
from hvd_lars.training.checkpoints import read_json  # noqa: E402
from hvd_lars.training.config import TrainConfig  # noqa: E402
from hvd_lars.training.plan import (
    Plan,  # noqa: E402
    build_schedule,  # noqa: E402
)

SPLITS = (("", "training"), ("val_", "validation"), ("test_", "test"))


class NoEpochYet(Exception):
    """`run_dir` is a run directory (summary.json exists) still in its first epoch: no row to plot yet."""


def read_metrics(run_dir):
    """metrics.csv of `run_dir` as {column: list of float} (empty or "NA" fields as nan), rows in epoch
    order; a missing `step` column (runs logged by Keras's CSVLogger) is derived from the epoch and
    summary.json's steps per epoch.

    Raises:
        NoEpochYet: summary.json exists but no epoch has finished (no metrics.csv, or no row in it).
        FileNotFoundError: no metrics.csv or summary.json in `run_dir`.
    """
    path = os.path.join(run_dir, "metrics.csv")
    first_epoch = NoEpochYet(
        f"{run_dir}: no epoch has finished yet (summary.json, no metrics.csv row); nothing to plot"
    )
    if not os.path.exists(path) and os.path.exists(os.path.join(run_dir, "summary.json")):
        raise first_epoch
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a run directory of hvd_lars.main.")
    with open(path, newline="") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["epoch"]))
    if not rows:
        raise first_epoch
    columns = {k: [_number(r.get(k)) for r in rows] for k in rows[0]} if rows else {}
    if rows and "step" not in columns:
        per_epoch = read_json(os.path.join(run_dir, "summary.json"))["plan"]["steps_per_epoch"]
        columns["step"] = [(e + 1) * per_epoch for e in columns["epoch"]]
    return columns


def _number(text):
    # Empty: not measured that epoch; "NA": the same, in files Keras's CSVLogger wrote.
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def _schedule_curve(summary):
    """(steps 1..total, rate of update k - 1 at step k), or None when the config cannot be rebuilt."""

    try:
        # Keys this version does not know (a run of another version) are left out, not fatal.
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        config = TrainConfig(**{k: v for k, v in summary["config"].items() if k in known})
        plan = Plan(**summary["plan"])
        schedule = build_schedule(config, plan)
        updates = np.arange(plan.total_steps)
        return updates + 1, np.asarray(schedule(updates), dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        return None


def make_figure(run_dir):
    """The matplotlib Figure of `run_dir` (module docstring); axes titled "loss", "top-1", "learning rate".

    Raises:
        FileNotFoundError: not a run directory.
    """
    summary = read_json(os.path.join(run_dir, "summary.json"))
    metrics = read_metrics(run_dir)
    steps = metrics.get("step", [])
    per_epoch = summary["plan"]["steps_per_epoch"]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.4), constrained_layout=True)
    for ax, (metric, title) in zip(axes[:2], (("loss", "loss"), ("top1", "top-1"))):
        for prefix, label in SPLITS:
            values = metrics.get(prefix + metric)
            if values is None:
                continue
            shown = [(s, v) for s, v in zip(steps, values) if not math.isnan(v)]
            if shown:
                ax.plot(*zip(*shown), marker="o", markersize=3, label=label)
        ax.set_title(title)
        ax.legend()
    ax = axes[2]
    curve = _schedule_curve(summary)
    if curve is not None:
        ax.plot(*curve, label=f"schedule ({summary['config'].get('schedule', '?')})")
    if "learning_rate" in metrics:
        ax.plot(steps, metrics["learning_rate"], "o", markersize=4, label="logged (epoch's last update)")
    ax.set_title("learning rate")
    ax.legend()
    for ax in axes:
        ax.set_xlim(0, summary["plan"]["total_steps"])
        ax.set_xlabel("step (optimizer updates)")
        ax.grid(alpha=0.3)
        top = ax.secondary_xaxis("top", functions=(lambda s: s / per_epoch, lambda e: e * per_epoch))
        top.set_xlabel("epoch")
    final = summary.get("final_test_top1")
    final = f", final test top-1 {final:.4f}" if isinstance(final, float) and math.isfinite(final) else ""
    config = summary.get("config", {})
    figure.suptitle(
        f"{summary.get('run_name', os.path.basename(run_dir))}: {config.get('optimizer', '?')} on "
        f"{config.get('model', '?')}, global batch {summary.get('global_batch_size')} over "
        f"{summary.get('world_size')} ranks{final}"
    )
    return figure


def plot_run(run_dir, out=None):
    """Writes the figure of `run_dir` to `out` (default `RUN_DIR/run.png`); returns that path.

    Raises:
        FileNotFoundError: not a run directory.
        OSError: `out` cannot be written (the file is then as it was).
    """
    out = out or os.path.join(run_dir, "run.png")
    save(make_figure(run_dir), out)
    return out


def save(figure, out):
    """Writes `figure` as the PNG `out`, whole or not at all (through `<out>.tmp`), and closes it.

    Raises:
        OSError: `out` cannot be written (the file is then as it was).
    """
    try:
        figure.savefig(f"{out}.tmp", dpi=100, format="png")
        os.replace(f"{out}.tmp", out)
    except OSError:
        faults.remove_quietly(f"{out}.tmp")
        raise
    finally:
        plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dir", help="a run directory of hvd_lars.main (holding metrics.csv, summary.json)"
    )
    parser.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/run.png)")
    args = parser.parse_args(argv)
    try:
        print(plot_run(args.run_dir, args.out))
    except NoEpochYet as e:
        print(e)  # as the docstring promises, also while it trains: not an error
        return 0
    except OSError as e:  # not a run directory, or run.png cannot be written
        print(f"hvd_lars.training.plot_run: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
