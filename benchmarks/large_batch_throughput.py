"""Training images/s of the large-batch study's runs per global batch: one process against 2 Horovod ranks.

Run from the repository root with the machine to itself (a few minutes):

    PYTHONPATH=. bench .venv/bin/python results/large_batch_throughput.py

For each global batch it trains the study's LARS run (`results/large_batch_study.py`, the centre rate,
float32) briefly through the main program, once as one process and once as 2 ranks on the same cores,
one right after the other: 3 epochs of about 16,384 images each (`--steps_per_epoch`), the first left out
of the rate (graph tracing); evaluation only after the last, on 1,000 test images. The study's epoch
budget and its choice of one process per run come from this table.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import large_batch_report  # noqa: E402
import large_batch_study as study  # noqa: E402

from hvd_lars.training import provenance  # noqa: E402

IMAGES_PER_EPOCH = 16384


def measure(batch, ranks, workdir):
    args = study.parse_args(["--output_dir", workdir])
    cell = study.Cell("lars", batch, 0, 0)
    flags = study.main_flags(args, cell)
    steps = max(2, IMAGES_PER_EPOCH // batch)
    replace = {"--steps_per_epoch": steps, "--epochs": 3, "--warmup_epochs": 0, "--eval_every_epochs": 3}
    flags = [f for f in flags if f.split("=")[0] not in replace]
    flags += [f"{k}={v}" for k, v in replace.items()]
    flags += ["--max_eval_examples=1000", "--noresume", f"--run_name=throughput_b{batch}_r{ranks}"]
    command = [sys.executable, "-m", "hvd_lars.main", *flags]
    if ranks > 1:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        command = [horovodrun, "-np", str(ranks), "-H", f"localhost:{ranks}", *command]
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    with open(os.path.join(workdir, "runs", f"throughput_b{batch}_r{ranks}", "summary.json")) as f:
        return json.load(f)["images_per_second"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="128,512,2048,8192")
    parser.add_argument("--out", default=os.path.join("results", "large_batch_throughput.md"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model, flags = large_batch_report.cpu()
    record = provenance.record()
    lines = [
        "# Large-batch study: training images/s per global batch, one process vs 2 Horovod ranks",
        "",
        f"- Command: `PYTHONPATH=. bench python results/large_batch_throughput.py --batches {args.batches}`",
        f"- Git SHA: `{record['git_sha']}`; date (UTC): {record['date']}",
        f"- Machine: {record['machine']}; bf16/AMX-related CPU flags: {', '.join(flags) or 'none'}",
        "- `small_cnn`, LARS, float32, Fashion-MNIST; images/s of training (evaluation excluded), mean of 2 "
        f"epochs of about {IMAGES_PER_EPOCH:,} images after a first one; 1 process and 2 ranks run one after "
        "the other for each batch.",
        "",
        "| global batch | 1 process (images/s) | 2 ranks x half batch (images/s) | 1 process / 2 ranks |",
        "|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as workdir:
        for batch in batches:
            one = measure(batch, 1, workdir)
            two = measure(batch, 2, workdir)
            lines.append(f"| {batch} | {one:.0f} | {two:.0f} | {one / two:.2f} |")
            print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
