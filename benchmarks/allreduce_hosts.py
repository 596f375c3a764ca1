"""Horovod's allreduce across p = 2, 4 and 8 emulated hosts (issue 22, items 2 and 3): the time of a plain
`hvd.allreduce` of a float32 tensor against message size, per transport and setting, beside the
bandwidth-optimal ring bound 2(p - 1)/p x S / (0.9 x link rate).

Run as root from the repository root with the machine to itself (it brings up launch/emulated_cluster.sh
with NODES=8 at --link_rate, 1 rank per host, and takes it down at the end):

    python -m benchmarks.allreduce_hosts                                   # writes results/allreduce_hosts.md
    python -m benchmarks.allreduce_hosts --ps=4 --sizes_mib=16 --variants=mpi,mpi_yield --out=/tmp/a.md

Variants (each a launch of p ranks, `horovodrun -H node1:1,...`, HOROVOD_CYCLE_TIME=5 as the launch scripts
set it):
  mpi          Open MPI as horovodrun starts it, nothing else set
  mpi_yield    + OMPI_MCA_mpi_yield_when_idle=1 (a rank waiting in MPI yields its core instead of polling)
  mpi_ring     + Open MPI's tuned allreduce forced to the ring (coll_tuned_allreduce_algorithm=4)
  mpi_rules    + launch/ompi_allreduce_rules.conf (from 1 MiB on 3+ ranks the ring, below: Open MPI's)
  launch_env   launch/env.sh sourced first, as launch/horovodrun.sh, mpirun.sh and train.sbatch do
  gloo         horovodrun --gloo from node1 (Gloo's ring)
Each size: 2 untimed allreduces, then `--repeats` timed ones, each after a barrier; the median is reported.
Raw timings: results/allreduce_hosts.json (--raw).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import common

REPO = common.REPO
SCRIPT = os.path.join(REPO, "launch", "emulated_cluster.sh")
RULES = os.path.join(REPO, "launch", "ompi_allreduce_rules.conf")
VARIANTS = {
    "mpi": {},
    "mpi_yield": {"OMPI_MCA_mpi_yield_when_idle": "1"},
    "mpi_ring": {
        "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
        "OMPI_MCA_coll_tuned_allreduce_algorithm": "4",
    },
    "mpi_rules": {
        "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
        "OMPI_MCA_coll_tuned_dynamic_rules_filename": RULES,
    },
    "launch_env": {},
    "gloo": {},
}
LINK_EFFICIENCY = 0.9  # TCP/IP payload of a shaped Ethernet link


def worker(args):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    hvd.init()
    result = {"sizes": [], "times_s": []}
    for size in [int(s) for s in args.sizes.split(",")]:
        x = tf.fill([size // 4], float(hvd.rank() + 1))
        name = f"allreduce_{size}"
        for _ in range(2):
            y = hvd.allreduce(x, op=hvd.Sum, name=name)
        expected = hvd.size() * (hvd.size() + 1) / 2
        if float(tf.reduce_min(y)) != expected or float(tf.reduce_max(y)) != expected:
            raise RuntimeError(f"allreduce of {size} B: wrong sum (expected {expected})")
        times = []
        for _ in range(args.repeats):
            hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="barrier")
            start = time.perf_counter()
            hvd.allreduce(x, op=hvd.Sum, name=name)
            times.append(time.perf_counter() - start)
        result["sizes"].append(size)
        result["times_s"].append(times)
    if hvd.rank() == 0:
        result["controller"] = "mpi" if hvd.mpi_enabled() else "gloo"
        with open(args.out, "w") as f:
            json.dump(result, f)


def launch(variant, p, sizes, repeats, timeout=1200):
    hosts = ",".join(f"node{k}:1" for k in range(1, p + 1))
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_allreduce_") as shared:
        out = os.path.join(shared, "result.json")
        argv = [common.HOROVODRUN, *(["--gloo"] if variant == "gloo" else []), "-np", str(p), "-H", hosts]
        argv += [sys.executable, "-m", "benchmarks.allreduce_hosts", "--worker", f"--sizes={sizes}"]
        argv += [f"--repeats={repeats}", f"--out={out}"]
        settings = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO, "HOROVOD_CYCLE_TIME": "5"}
        settings.update(VARIANTS[variant])
        if variant == "gloo":
            assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items())
            cmd = ["ssh", "node1", f"cd {shlex.quote(REPO)} && env {assignments} {shlex.join(argv)}"]
        elif variant == "launch_env":
            assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items())
            cmd = ["bash", "-c", f"source launch/env.sh && env {assignments} {shlex.join(argv)}"]
        else:
            cmd = argv
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_MCA_"))}
        env.update(settings, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{shlex.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def bound_s(size, p, link_bits):
    return 2 * (p - 1) / p * size * 8 / (LINK_EFFICIENCY * link_bits)


def _rate_bits(rate):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"--link_rate={rate!r}: expected e.g. 200mbit or 1gbit")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ps", default="2,4,8")
    parser.add_argument("--sizes_mib", default="0.001,0.0625,1,4,16,64")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--link_rate", default="200mbit")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--raw", default=os.path.join(common.RESULTS, "allreduce_hosts.json"))
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "allreduce_hosts.md"))
    parser.add_argument("--worker", action="store_true", help="internal: run as one rank")
    parser.add_argument("--sizes", default="", help="internal: bytes, for --worker")
    args, _ = parser.parse_known_args(argv)
    if args.worker:
        worker(args)
        return
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    ps = [int(p) for p in args.ps.split(",")]
    sizes = [max(4, int(round(float(m) * 2**20 / 4)) * 4) for m in args.sizes_mib.split(",")]
    link_bits = _rate_bits(args.link_rate)
    env = dict(os.environ, NODES=str(max(ps)), LINK_RATE=args.link_rate)
    up = subprocess.run([SCRIPT, "up"], env=env, capture_output=True, text=True, timeout=300)
    if up.returncode:
        raise RuntimeError(f"emulated_cluster.sh up: {up.stdout}{up.stderr}")
    matmul = common.matmul_rate()
    results = []
    try:
        for p in ps:
            for variant in variants:
                data = launch(variant, p, ",".join(map(str, sizes)), args.repeats)
                for size, times in zip(data["sizes"], data["times_s"]):
                    median = statistics.median(times)
                    results.append(dict(p=p, variant=variant, size=size, times_s=times, median_s=median,
                                        bound_s=bound_s(size, p, link_bits)))  # fmt: skip
                    print(f"[allreduce_hosts] p={p} {variant} {size} B: {median:.4f} s "
                          f"({median / bound_s(size, p, link_bits):.2f}x the bound)", flush=True)  # fmt: skip
    finally:
        subprocess.run([SCRIPT, "down"], env=env, capture_output=True, text=True, timeout=300)
    command = common.command_line("allreduce_hosts", argv)
    with open(args.raw, "w") as f:
        json.dump({"command": command, "link_rate": args.link_rate, "results": results}, f, indent=1)
    lines = [
        "# Horovod's allreduce across 2, 4 and 8 emulated hosts (issue 22)",
        "",
        *common.provenance_lines(command, matmul),
        f"- launch/emulated_cluster.sh, {max(ps)} hosts, every link shaped to {args.link_rate} (tc tbf, both "
        f"directions), 1 rank per host; HOROVOD_CYCLE_TIME=5; {args.repeats} timed allreduces after 2, "
        f"each after a barrier. Bound: 2(p-1)/p x S / ({LINK_EFFICIENCY} x link).",
        "",
        "| p | variant | size | median s | bound s | median / bound |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['p']} | {r['variant']} | {r['size'] / 2**20:.4g} MiB | {r['median_s']:.4f} | "
            f"{r['bound_s']:.4f} | {r['median_s'] / r['bound_s']:.2f} |"
        )
    common.write_report(args.out, "\n".join(lines))
    print(f"[allreduce_hosts] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
