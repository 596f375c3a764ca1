"""Training images/s of the large-batch study's LARS runs per global batch (through the main program, 3
epochs of about 16,384 images, the first left out): one process against 2 Horovod ranks on the same cores.

    python -m benchmarks.large_batch_throughput      # a few minutes, the machine to itself
"""

import json
import os
import sys
import tempfile

from benchmarks import common
from benchmarks import large_batch_study as study

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
        command = [common.HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", *command]
    common.run(command, timeout=900)
    with open(os.path.join(workdir, "runs", f"throughput_b{batch}_r{ranks}", "summary.json")) as f:
        return json.load(f)["images_per_second"]


def main(argv=None):
    parser = common.argument_parser(__doc__)
    parser.add_argument("--batches", default="128,512,2048,8192")
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "large_batch_throughput.md"))
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    lines = [
        "# Large-batch study: training images/s per global batch, one process vs 2 Horovod ranks",
        "",
        *common.provenance_lines(common.command_line("large_batch_throughput", argv), common.matmul_rate()),
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
    common.write_report(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
