"""What switching Horovod's response cache off costs: the main program on 2 Gloo ranks
with `HOROVOD_CACHE_CAPACITY=0` (what launch/elastic.sh and `hvd_lars.training.train` set for elastic
jobs) against Horovod's default capacity (1,024 cached responses).

With the cache, a tensor reduced before is announced by a bit in a bit vector that the ranks allreduce
each cycle; without it, every rank sends rank 0 a request per tensor per step and rank 0 broadcasts the
fused responses (Horovod's negotiation), so the cost grows with the number of gradient tensors and with
the ranks. Two models: flags/smoke.flags' small CNN (18 gradient tensors, fc1's 1 MiB among them: the
elastic case) and ResNet-50 at 32 x 32 (161 tensors), both on synthetic data.

Arms alternate, `--repeats` launches each (`horovodrun --gloo -np 2`, the transport elastic jobs use);
each launch's figure is the run's images/s over its epochs after the first (summary.json: the first
includes tracing). Reported: the median of each arm and their ratio.

Usage (from the repository root, with the machine to itself; about 10 minutes):
    python -m benchmarks.response_cache            # writes results/response_cache.md
    python -m benchmarks.response_cache --cases=smoke --repeats=1 --out=/tmp/rc.md   # a check, 1 minute
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks import common

REPO = common.REPO
CASES = {
    # name: (flags after flags/smoke.flags, gradient tensors)
    "smoke": (["--steps_per_epoch=100", "--epochs=3"], 18),
    "resnet50": (
        ["--model=resnet50", "--global_batch_size=16", "--steps_per_epoch=20", "--epochs=3"],
        161,
    ),
}
ARMS = {"cache off (capacity 0)": "0", "cache on (capacity 1024, Horovod's default)": "1024"}


def _images_per_second(case, capacity, workdir):
    flags, _ = CASES[case]
    cmd = [common.HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", "--network-interface", "lo"]
    cmd += [sys.executable, "-m", "hvd_lars.main", "--flagfile=flags/smoke.flags", *flags]
    cmd += ["--max_eval_examples=32", "--checkpoint_every_steps=0", f"--workdir={workdir}", "--verbose=0"]
    env = common.worker_env(HOROVOD_CACHE_CAPACITY=capacity)
    common.run(cmd, env=env, timeout=1800)
    with open(os.path.join(workdir, "smoke", "summary.json")) as f:
        return json.load(f)["images_per_second"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "response_cache.md"))
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; valid: {', '.join(CASES)}")
    start = time.time()
    figures = {case: {arm: [] for arm in ARMS} for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            for i in range(args.repeats):
                for arm, capacity in ARMS.items():
                    rate = _images_per_second(case, capacity, os.path.join(tmp, f"{case}-{capacity}-{i}"))
                    figures[case][arm].append(rate)
                    print(
                        f"[response_cache] {case} {arm} {i + 1}/{args.repeats}: {rate:.1f} images/s",
                        flush=True,
                    )
    command = common.command_line("response_cache", argv)
    lines = [
        "# What switching Horovod's response cache off costs (elastic jobs)",
        "",
        *common.provenance_lines(command, common.matmul_rate()),
        f"- {time.time() - start:.0f} s; 2 Gloo ranks (`horovodrun --gloo -np 2`) on this machine, synthetic "
        f"data, flags/smoke.flags; arms alternated, {args.repeats} launches each; 1-minute load average at "
        f"the end {os.getloadavg()[0]:.1f}.",
        "",
        "| model | gradient tensors | arm | images/s per launch | median | median / cache on |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        on = statistics.median(figures[case]["cache on (capacity 1024, Horovod's default)"])
        for arm in ARMS:
            rates = figures[case][arm]
            mid = statistics.median(rates)
            lines.append(
                f"| {case} | {CASES[case][1]} | {arm} | {', '.join(f'{r:.1f}' for r in rates)} | {mid:.1f} | "
                f"{mid / on:.3f} |"
            )
    lines += [
        "",
        "images/s: summary.json's, the run's mean over its epochs after the first. Only elastic jobs run "
        "with the cache off (launch/elastic.sh, `hvd_lars.training.train`); every other launch keeps "
        "Horovod's default.",
    ]
    common.write_report(args.out, "\n".join(lines))
    print(f"[response_cache] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
