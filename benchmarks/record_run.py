"""Writes a Markdown record of one training run from its summary.json (command, SHA, date, machine, table).

summary.json names the machine by its CPU's model name (hvd_lars.training.provenance.machine); the record
adds the CPU's identity (vendor, family, model, stepping) and its tf.matmul rate, measured here right after
the run (`make train` runs this on the machine that trained). A summary.json from another machine gets
neither: the record says they were not recorded for that run.

Usage (from the repository root; `make train` calls it):
    python -m benchmarks.record_run results/runs/<run>/summary.json results/<name>.md "<command that ran>"
"""

import sys

from benchmarks import common
from hvd_lars.training import provenance
from hvd_lars.training.strict_json import read as read_json


def machine_line(summary_machine):
    """The record's machine: `common.describe` of this machine with its tf.matmul rate when summary.json's
    machine line is this machine's; else summary.json's line, the rest said to be not recorded."""
    if summary_machine == provenance.machine():
        line = common.describe(common.cpu(), common.matmul_rate(), summary_machine)
        return f"{line} (tf.matmul measured by benchmarks/record_run.py right after the run)"
    return (
        f"{summary_machine}; CPU vendor, family and model {common.NOT_RECORDED}; tf.matmul rate "
        f"{common.NOT_RECORDED} (this record was written on another machine)"
    )


def main(summary_path, out_path, command):
    s = read_json(summary_path)  # non-finite values come back as floats (nan prints as "nan")
    lines = [
        f"# {s['run_name']}",
        "",
        f"- Command: `{command}`",
        f"- Git SHA: {common.sha_text(s['git_sha'])}; date (UTC): {s['date']}",
        f"- Machine: {machine_line(s['machine'])}",
        f"- Software: Python {s['python']}, TensorFlow {s['tensorflow']}, Keras {s['keras']}, "
        f"Horovod {s['horovod']}",
        f"- World size {s['world_size']}, global batch {s['global_batch_size']}, per-rank batch "
        f"{s['per_rank_batch_size']}, {s['plan']['steps_per_epoch']} steps per epoch, "
        f"{s['plan']['total_steps']} steps, warmup {s['plan']['warmup_steps']} steps, peak learning rate "
        f"{s['plan']['peak_learning_rate']:g}",
        f"- **Final test top-1 {s['final_test_top1']:.4f}**, top-5 {s['final_test_top5']:.4f}; "
        f"{s['images_per_second']:.0f} images/s (mean over epochs after the first); "
        f"wall time {s['wall_time_s']:.0f} s (training + per-epoch evaluation, after start-up)",
        "",
        "| epoch | train loss | train top-1 | test top-1 | test top-5 | learning rate | images/s |",
        "|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for e in s["epochs"]:
        lines.append(
            f"| {e['epoch']} | {e['loss']:.4f} | {e['top1']:.4f} | {e.get('test_top1', nan):.4f} | "
            f"{e.get('test_top5', nan):.4f} | {e['learning_rate']:.4g} | {e['images_per_second']:.0f} |"
        )
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
