"""A picture of one run from its logs: loss, top-1 and learning rate against the optimizer step.

    hvd-lars-plot RUN_DIR [--out PNG]      (or: python -m hvd_lars.training.plot_run ...)

Reads `RUN_DIR/metrics.csv` and `RUN_DIR/summary.json` and writes `RUN_DIR/run.png` (or `--out`), also
while the run trains: three panels (loss and top-1 of training, validation and test; the learning rate of
the run's schedule, rebuilt from its config and plan, with the logged rate of each epoch's last update as
points) against the step, epochs along the top. A non-finite value leaves a gap.
"""

import argparse
import csv
import logging
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
from hvd_lars.training.plan import Plan, build_schedule  # noqa: E402

SPLITS = (("", "training"), ("val_", "validation"), ("test_", "test"))


class NoEpochYet(Exception):
    """The run directory is still in its first epoch: nothing to plot yet."""


def read_metrics(run_dir):
    """metrics.csv of `run_dir` as {column: list of float} (nan where empty or "NA"), in epoch order; without
    a `step` column (Keras's CSVLogger) the steps come from the epochs and summary.json's plan.

    Raises:
        NoEpochYet: summary.json exists but no epoch has finished (no metrics.csv, or no row in it).
        FileNotFoundError: no metrics.csv or summary.json in `run_dir`.
    """
    path = os.path.join(run_dir, "metrics.csv")
    rows = []
    if os.path.exists(path):
        with open(path, newline="") as f:
            rows = sorted(csv.DictReader(f), key=lambda r: int(r["epoch"]))
    elif not os.path.exists(os.path.join(run_dir, "summary.json")):
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a run directory of hvd_lars.main.")
    if not rows:
        what = "no epoch has finished yet (summary.json, no metrics.csv row); nothing to plot"
        raise NoEpochYet(f"{run_dir}: {what}")
    columns = {k: [_number(r.get(k)) for r in rows] for k in rows[0]}
    if "step" not in columns:
        per_epoch = read_json(os.path.join(run_dir, "summary.json"))["plan"]["steps_per_epoch"]
        columns["step"] = [(e + 1) * per_epoch for e in columns["epoch"]]
    return columns


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):  # empty: not measured that epoch ("NA" in Keras's CSVLogger)
        return math.nan


def make_figure(run_dir):
    """The Figure of `run_dir` (axes "loss", "top-1", "learning rate"); raises as `read_metrics` does."""
    summary = read_json(os.path.join(run_dir, "summary.json"))
    metrics = read_metrics(run_dir)
    steps = metrics["step"]
    plan, config = summary["plan"], summary.get("config", {})
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.4), constrained_layout=True)
    for ax, (metric, title) in zip(axes[:2], (("loss", "loss"), ("top1", "top-1"))):
        for prefix, label in SPLITS:
            shown = [(s, v) for s, v in zip(steps, metrics.get(prefix + metric, [])) if not math.isnan(v)]
            if shown:
                ax.plot(*zip(*shown), marker="o", markersize=3, label=label)
        ax.set_title(title)
    try:  # the schedule, rebuilt from the run's config and plan; update k drawn at step k + 1
        schedule = build_schedule(TrainConfig(**config), Plan(**plan))
        updates = np.arange(plan["total_steps"])
        label = f"schedule ({config.get('schedule', '?')})"
        axes[2].plot(updates + 1, np.asarray(schedule(updates), dtype=np.float64), label=label)
    except (KeyError, TypeError, ValueError):
        pass
    if "learning_rate" in metrics:
        axes[2].plot(steps, metrics["learning_rate"], "o", markersize=4, label="logged (epoch's last update)")
    axes[2].set_title("learning rate")
    per_epoch = plan["steps_per_epoch"]
    for ax in axes:
        ax.legend()
        ax.set_xlim(0, plan["total_steps"])
        ax.set_xlabel("step (optimizer updates)")
        ax.grid(alpha=0.3)
        top = ax.secondary_xaxis("top", functions=(lambda s: s / per_epoch, lambda e: e * per_epoch))
        top.set_xlabel("epoch")
    final = summary.get("final_test_top1")
    final = f", final test top-1 {final:.4f}" if isinstance(final, float) and math.isfinite(final) else ""
    figure.suptitle(
        f"{summary.get('run_name', os.path.basename(run_dir))}: {config.get('optimizer', '?')} on "
        f"{config.get('model', '?')}, global batch {summary.get('global_batch_size')} over "
        f"{summary.get('world_size')} ranks{final}"
    )
    return figure


def plot_run(run_dir, out=None):
    """Writes the figure of `run_dir` to `out` (default `RUN_DIR/run.png`, by `save`); returns that path."""
    out = out or os.path.join(run_dir, "run.png")
    save(make_figure(run_dir), out)
    return out


def save(figure, out):
    """Writes `figure` as the PNG `out` whole or not at all (an OSError leaves it as it was); closes it."""
    try:
        figure.savefig(f"{out}.tmp", dpi=100, format="png")
        os.replace(f"{out}.tmp", out)
    except OSError:
        faults.remove_quietly(f"{out}.tmp")
        raise
    finally:
        plt.close(figure)


def main(argv=None):
    """`hvd-lars-plot`: logs the path written (or that no epoch has finished yet); exit 2 for bad input."""
    from hvd_lars.main import EXIT_BAD_INPUT, configure_logging

    log = logging.getLogger("hvd_lars")

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dir", help="a run directory of hvd_lars.main (holding metrics.csv, summary.json)"
    )
    parser.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/run.png)")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        log.info(plot_run(args.run_dir, args.out))
    except NoEpochYet as e:  # a run in its first epoch: not an error
        log.info(e)
    except OSError as e:  # not a run directory, or run.png cannot be written
        log.error(e)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
