"""The Markdown record of a training run (command, git SHA, date, machine, software, plan, per-epoch table)
from its summary.json, with this machine's CPU identity and tf.matmul rate where the run was made here
(a summary.json from another machine: said to be not recorded).

    python -m benchmarks.record_run [--flagfile=flags/fashion_mnist_lars.flags] [--np=2]   # trains afresh
    python -m benchmarks.record_run --summary=RUN_DIR/summary.json --out=RUN_DIR/record.md --command="..."

The first writes results/<flagfile's name>.md (the committed reference records change only so); the
second a finished run's record, as `make train` does.
"""

import os
import subprocess
import sys
import time

from benchmarks import common
from hvd_lars.training import epoch_logs
from hvd_lars.training.checkpoints import read_json


def machine_line(summary_machine):
    """The record's machine: `common.describe` of this machine with its tf.matmul rate when summary.json's
    machine line is this machine's; else summary.json's line, the rest said to be not recorded."""
    if summary_machine == epoch_logs.machine():
        line = common.describe(common.cpu(), common.matmul_rate(), summary_machine)
        return f"{line} (tf.matmul measured by benchmarks/record_run.py right after the run)"
    return (
        f"{summary_machine}; CPU vendor, family and model {common.NOT_RECORDED}; tf.matmul rate "
        f"{common.NOT_RECORDED} (this record was written on another machine)"
    )


def write(summary_path, out_path, command):
    """Writes the record of the run whose summary.json is `summary_path` to `out_path`."""
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


def train(flagfile, ranks, workdir):
    """Trains `flagfile` afresh on `ranks` ranks of this machine in a new run directory under `workdir`;
    returns its summary.json path."""
    name = os.path.splitext(os.path.basename(flagfile))[0]
    run_name = f"{name}_reference_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    main_program = [sys.executable, "-m", "hvd_lars.main", f"--flagfile={flagfile}", f"--run_name={run_name}"]
    launcher = [common.HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}"]
    command = [*launcher, *main_program, f"--workdir={workdir}"]
    subprocess.run(command, env=common.worker_env(), check=True)
    return os.path.join(workdir, run_name, "summary.json")


def main(argv=None):
    parser = common.argument_parser(__doc__)
    parser.add_argument("--flagfile", default="flags/fashion_mnist_lars.flags", help="the run to train")
    parser.add_argument("--np", type=int, default=2, help="ranks on this machine")
    parser.add_argument("--workdir", default="results/runs", help="parent folder of the new run directory")
    parser.add_argument("--out", help="the record (default: results/<flagfile's name>.md)")
    parser.add_argument("--summary", help="summary.json of a finished run: its record, without training")
    parser.add_argument("--command", help="with --summary: the command that ran it")
    args = parser.parse_args(argv)
    if args.summary:
        if not (args.out and args.command):
            parser.error(
                f"--summary={args.summary} needs --out and --command (got {args.out!r}, {args.command!r})"
            )
        write(args.summary, args.out, args.command)
        return
    out = args.out or os.path.join("results", os.path.basename(args.flagfile).removesuffix(".flags") + ".md")
    summary = train(args.flagfile, args.np, args.workdir)
    write(summary, out, common.command_line("record_run", argv))
    print(f"record: {out}")


if __name__ == "__main__":
    main()
