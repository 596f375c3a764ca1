"""A picture of one run from its logs: loss, top-1 and learning rate against the optimizer step."""

import argparse
import csv
import math
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display; before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hvd_lars.training import faults  # noqa: E402
from hvd_lars.training.checkpoints import read_json  # noqa: E402
from hvd_lars.training.config import TrainConfig  # noqa: E402
from hvd_lars.training.plan import Plan, build_schedule  # noqa: E402


class NoEpochYet(Exception):
    """The run directory is still in its first epoch: nothing to plot yet."""


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):  # not measured that epoch (an empty cell), or not a number: a gap
        return math.nan


def make_figure(run_dir):
    """The Figure of `run_dir`: loss, top-1, learning rate. Raises OSError: no summary.json; `NoEpochYet`."""
    summary = read_json(os.path.join(run_dir, "summary.json"))
    plan, path = summary["plan"], os.path.join(run_dir, "metrics.csv")
    with open(path if os.path.exists(path) else os.devnull, newline="") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["epoch"]))
    if not rows:
        raise NoEpochYet(
            f"{run_dir}: no epoch has finished yet (summary.json, no metrics.csv row); nothing to plot"
        )
    metrics = {k: [_number(r[k]) for r in rows] for k in rows[0]}
    config, per_epoch, steps = summary["config"], plan["steps_per_epoch"], metrics["step"]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.4), constrained_layout=True)
    for ax, metric in zip(axes[:2], ("loss", "top1")):
        for prefix, label in (("", "training"), ("val_", "validation"), ("test_", "test")):
            shown = [(s, v) for s, v in zip(steps, metrics.get(prefix + metric, [])) if not math.isnan(v)]
            if shown:
                ax.plot(*zip(*shown), marker="o", markersize=3, label=label)
    updates = np.arange(plan["total_steps"])  # update k at step k + 1
    rates = np.asarray(build_schedule(TrainConfig(**config), Plan(**plan))(updates), dtype=np.float64)
    axes[2].plot(updates + 1, rates, label=f"schedule ({config['schedule']})")
    if "learning_rate" in metrics:
        axes[2].plot(steps, metrics["learning_rate"], "o", markersize=4, label="logged (epoch's last update)")
    for ax, title in zip(axes, ("loss", "top-1", "learning rate")):
        ax.legend()
        ax.set(title=title, xlim=(0, plan["total_steps"]), xlabel="step (optimizer updates)")
        ax.grid(alpha=0.3)
        top = ax.secondary_xaxis("top", functions=(lambda s: s / per_epoch, lambda e: e * per_epoch))
        top.set_xlabel("epoch")
    final = summary.get("final_test_top1")
    final = f", final test top-1 {final:.4f}" if isinstance(final, float) and math.isfinite(final) else ""
    figure.suptitle(
        f"{summary['run_name']}: {config['optimizer']} on {config['model']}, global batch "
        f"{plan['global_batch_size']} over {plan['world_size']} ranks{final}"
    )
    return figure


def save(figure, out):
    """Writes `figure` as the PNG `out` whole or not at all (an OSError leaves it as it was); closes it."""
    try:
        figure.savefig(f"{out}.tmp", dpi=100, format="png")
        os.replace(f"{out}.tmp", out)
    finally:
        plt.close(figure)
        faults.remove_quietly(f"{out}.tmp")  # left by a failed write


def plot_run(run_dir, out=None):
    """Writes the figure of `run_dir` to `out` (default `RUN_DIR/run.png`); returns that path."""
    save(make_figure(run_dir), out := out or os.path.join(run_dir, "run.png"))
    return out


def main(argv=None):
    """`hvd-lars-plot`: logs the path written (or that no epoch has finished yet); exit 2 for bad input."""
    from hvd_lars.main import EXIT_BAD_INPUT, configure_logging, log

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory of hvd_lars.main")
    parser.add_argument("--out", help="PNG to write (default: RUN_DIR/run.png)")
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
    raise SystemExit(main())
