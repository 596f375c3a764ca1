"""Horovod's allreduce of a float32 tensor against size across 2, 4 and 8 emulated hosts, per layout (hosts x
ranks per host) and variant, beside the ring bound 2(p - 1)/p x S / (0.9 x link rate), with a fit per layout
of t = 2(p - 1) alpha + 2(p - 1)/p x S / beta. Each size: 2 untimed allreduces, then `--repeats` timed ones,
each after a barrier; medians.

As root, the machine to itself (it brings launch/emulated_cluster.sh up with as many hosts as the largest
layout, every link at --link_rate, and down at the end):

    python -m benchmarks.allreduce_hosts      # results/allreduce_hosts.md, raw in its folder
    python -m benchmarks.allreduce_hosts --layouts=4x1 --sizes_mib=16 --variants=mpi,main --out=/tmp/a.md

Variants (each a launch of p ranks, `horovodrun -H node1:r,...`, HOROVOD_CYCLE_TIME=5):
  mpi          Open MPI as horovodrun starts it
  launch_env   launch/env.sh sourced first (as the launch scripts do), each rank set as hvd_lars.main sets it
  main         a bare horovodrun, each rank set as hvd_lars.main sets it (ompi_allreduce_rules.apply)
  gloo         horovodrun --gloo from node1
  horovod_keras      a ported Horovod Keras script: `horovod_keras.init()` (the same settings)
  horovod_keras_off  the same with `init(ompi_allreduce_rules=False)`
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

from benchmarks import common

REPO = common.REPO
VARIANTS = ("mpi", "launch_env", "main", "gloo", "horovod_keras", "horovod_keras_off")
# Variants whose ranks set what hvd_lars.main sets before Horovod starts MPI (ompi_allreduce_rules.apply).
AS_THE_MAIN_PROGRAM = ("launch_env", "main")
# Variants whose ranks start Horovod as a ported Horovod script does (horovod_keras.init).
AS_A_PORTED_SCRIPT = {"horovod_keras": "on", "horovod_keras_off": "off"}
LINK_EFFICIENCY = 0.9  # TCP/IP payload of a shaped Ethernet link


def worker(args):
    hvd, tf = common.horovod_rank()
    if args.main_defaults:
        from hvd_lars.parallel import ompi_allreduce_rules

        ompi_allreduce_rules.apply()
    if args.horovod_keras_init:
        import hvd_lars.parallel.horovod_keras as horovod_keras

        horovod_keras.init(ompi_allreduce_rules=args.horovod_keras_init == "on")
        rules = os.environ.get("OMPI_MCA_coll_tuned_dynamic_rules_filename")
    else:
        hvd.init()
        rules = None
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {
        "sizes": sizes,
        "times_s": [common.allreduce_times(hvd, tf, s, args.repeats, hvd.Sum) for s in sizes],
    }
    if hvd.rank() == 0:
        result.update(rules_file=rules, controller="mpi" if hvd.mpi_enabled() else "gloo", size=hvd.size(),
                      local_size=hvd.local_size(), cross_size=hvd.cross_size())  # fmt: skip
        common.write_json(args.out, result, indent=None)


def parse_layout(text):
    """ "HxR" -> (hosts, ranks per host); ValueError naming the value otherwise."""
    try:
        hosts, ranks = (int(v) for v in text.split("x"))
    except ValueError:
        raise ValueError(f"layout {text!r}: expected HOSTSxRANKS, e.g. 4x1 or 4x2") from None
    if not (1 <= hosts <= 8 and ranks >= 1 and hosts * ranks >= 2):
        raise ValueError(f"layout {text!r}: 1-8 hosts (the emulated cluster's), 2 ranks or more in all")
    return hosts, ranks


def launch(variant, layout, worker_args, timeout=1200):
    hosts, ranks = layout
    p = hosts * ranks
    host_list = ",".join(f"node{k}:{ranks}" for k in range(1, hosts + 1))
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_allreduce_") as shared:
        out = os.path.join(shared, "result.json")
        gloo = ["--gloo"] if variant == "gloo" else []
        argv = [common.HOROVODRUN, *gloo, "-np", str(p), "-H", host_list, sys.executable]
        argv += ["-m", "benchmarks.allreduce_hosts", "--worker", *worker_args, f"--out={out}"]
        argv += ["--main_defaults"] if variant in AS_THE_MAIN_PROGRAM else []
        argv += (
            [f"--horovod_keras_init={AS_A_PORTED_SCRIPT[variant]}"] if variant in AS_A_PORTED_SCRIPT else []
        )
        settings = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO, "HOROVOD_CYCLE_TIME": "5"}
        if variant == "gloo":
            cmd = common.on_node1(argv, settings)
        elif variant == "launch_env":
            sourced = f"source launch/env.sh && env {common.env_assignments(settings)} {shlex.join(argv)}"
            cmd = ["bash", "-c", sourced]
        else:
            cmd = argv
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_MCA_"))}
        env.update(settings, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        try:
            result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            # Only the launcher was killed: its ranks (on this machine's one kernel) would keep spinning
            # and take the cores from every later launch.
            subprocess.run(["pkill", "-9", "-f", "benchmarks.allreduce_hosts --worker"], capture_output=True)
            raise
        if result.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{shlex.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        data = common.read_json(out)
        if (data["size"], data["local_size"], data["cross_size"]) != (p, ranks, hosts):
            raise RuntimeError(f"{host_list}: Horovod saw size/local/cross {data['size']}/"
                               f"{data['local_size']}/{data['cross_size']}")  # fmt: skip
        return data


def bound_s(size, p, link_bits):
    """The bandwidth-optimal ring's time for `size` bytes over p ranks: 2(p - 1)/p x S at 0.9 x the link.
    With r ranks per host placed consecutively in the ring, each host's link still carries one ring edge
    each way, so the bound for p ranks is the same."""
    return 2 * (p - 1) / p * size * 8 / (LINK_EFFICIENCY * link_bits)


def sizes_and_link_rate(parser, args):
    """--sizes_mib as bytes (whole float32 elements, at least one) and --link_rate in bit/s; a bad link rate
    ends the program through `parser.error`, naming it."""
    sizes = [max(4, int(round(float(m) * 2**20 / 4)) * 4) for m in args.sizes_mib.split(",")]
    try:
        return sizes, common.link_rate_bits(args.link_rate)
    except ValueError as e:
        parser.error(f"--link_rate: {e}")


def sizes_report(args, layouts, variants, sizes, link_bits, matmul, results, command):
    lines = [
        "# Horovod's allreduce across 2, 4 and 8 emulated hosts",
        "",
        *common.provenance_lines(command, matmul, args.raw),
        f"- launch/emulated_cluster.sh, {max(h for h, _ in layouts)} hosts, every link shaped to "
        f"{args.link_rate} (tc tbf, both directions, a {args.burst_ms} ms bucket); layouts hosts x ranks per "
        "host; HOROVOD_CYCLE_TIME=5; "
        f"{args.repeats} timed allreduces after 2, each after a barrier. Bound: 2(p-1)/p x S / "
        f"({LINK_EFFICIENCY} x link); p = hosts x ranks per host.",
        "",
        "## Time against size, p and variant",
        "",
        "| layout | p | variant | size | median s | bound s | median / bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        size = f"{r['size'] / 2**20:.4g} MiB" if r["size"] >= 2**20 else f"{r['size'] / 2**10:.4g} KiB"
        lines.append(
            f"| {r['layout']} | {r['p']} | {r['variant']} | {size} | {r['median_s']:.4f} | "
            f"{r['bound_s']:.4f} | {r['median_s'] / r['bound_s']:.2f} |"
        )
    ported = sorted(
        {(r["variant"], r.get("rules_file")) for r in results if r["variant"] in AS_A_PORTED_SCRIPT}
    )
    if ported:
        lines += ["", "Open MPI's rules file after `horovod_keras.init()`, as rank 0 saw it:"]
        lines += [f"- {variant}: `{rules or 'none (Open MPI chooses)'}`" for variant, rules in ported]
    lines += [
        "",
        "## Fit per p: t = 2(p-1) alpha + 2(p-1)/p x S / beta",
        "",
        "alpha is the time per ring step (latency), beta the bandwidth each rank's ring edge reaches, beside "
        f"the link's payload rate {LINK_EFFICIENCY} x {args.link_rate} = "
        f"{LINK_EFFICIENCY * link_bits / 8e6:.1f} MB/s; fitted by least squares on relative residuals "
        "over every size.",
        "",
        "| layout | p | variant | alpha ms | beta MB/s | beta / link payload | worst relative residual |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout in layouts:
        name = f"{layout[0]}x{layout[1]}"
        for variant in variants:
            rows = [r for r in results if r["layout"] == name and r["variant"] == variant]
            if len(rows) < 2:
                continue
            p = rows[0]["p"]
            alpha, beta, worst = common.ring(p, [r["size"] for r in rows], [r["median_s"] for r in rows])
            lines.append(
                f"| {name} | {p} | {variant} | {alpha * 1e3:.3f} | {beta / 1e6:.1f} | "
                f"{beta / (LINK_EFFICIENCY * link_bits / 8):.2f} | {worst:.2f} |"
            )
    return lines


def measure(args, layout, variant, sizes, link_bits):
    """One launch of `layout` for `variant`: its result rows, one per size."""
    p, name = layout[0] * layout[1], f"{layout[0]}x{layout[1]}"
    worker_args = [f"--sizes={','.join(map(str, sizes))}", f"--repeats={args.repeats}"]
    data = launch(variant, layout, worker_args)
    rows = []
    for size, times in zip(data["sizes"], data["times_s"]):
        median, bound = statistics.median(times), bound_s(size, p, link_bits)
        rules_file = data.get("rules_file")
        rows.append(dict(layout=name, p=p, variant=variant, size=size, times_s=times, median_s=median,
                         bound_s=bound, rules_file=rules_file))  # fmt: skip
        print(
            f"[allreduce_hosts] {name} {variant} {size} B: {median:.4f} s ({median / bound:.2f}x the bound)"
        )
    return rows


def main(argv=None):
    parser = common.argument_parser(__doc__)
    parser.add_argument("--layouts", default="2x1,4x1,8x1,4x2", help="HOSTSxRANKS per host, comma-separated")
    parser.add_argument("--sizes_mib", default="0.0009765625,0.015625,0.25,1,4,16,64")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--link_rate", default="200mbit")
    parser.add_argument("--burst_ms", type=int, default=common.LINK_BURST_MS, help="token bucket, ms")
    parser.add_argument("--repeats", type=int, default=5, help="timed allreduces per size")
    parser.add_argument("--raw", default=None, help="raw timings (default: common.data_path of --out)")
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "allreduce_hosts.md"))
    parser.add_argument("--worker", action="store_true", help="internal: run as one rank")
    parser.add_argument("--sizes", default="", help="internal: bytes, for --worker")
    parser.add_argument("--main_defaults", action="store_true", help="internal: as hvd_lars.main")
    parser.add_argument(
        "--horovod_keras_init", default="", help="internal: on/off, horovod_keras.init's rules"
    )
    args, _ = parser.parse_known_args(argv)
    if args.worker:
        worker(args)
        return
    args.raw = args.raw or common.data_path(args.out)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; valid: {', '.join(VARIANTS)}")
    try:
        layouts = [parse_layout(text) for text in args.layouts.split(",")]
    except ValueError as e:
        parser.error(f"--layouts: {e}")
    sizes, link_bits = sizes_and_link_rate(parser, args)
    matmul = common.matmul_rate()
    results = []
    with common.emulated_cluster(max(h for h, _ in layouts), args.link_rate, args.burst_ms):
        for layout in layouts:
            for variant in variants:
                results += measure(args, layout, variant, sizes, link_bits)
    command = common.command_line("allreduce_hosts", argv)
    with open(args.raw, "w") as f:
        raw = {"command": command, "link_rate": args.link_rate, "burst_ms": args.burst_ms, "results": results}
        json.dump(raw, f, indent=1)
    lines = sizes_report(args, layouts, variants, sizes, link_bits, matmul, results, command)
    common.write_report(args.out, "\n".join(lines))
    print(f"[allreduce_hosts] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
