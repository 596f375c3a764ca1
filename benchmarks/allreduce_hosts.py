"""Horovod's allreduce across 2, 4 and 8 emulated hosts.

--mode=sizes: the time of a plain `hvd.allreduce` of a float32 tensor against message size,
per layout (hosts x ranks per host), transport and setting, beside the bandwidth-optimal ring bound
2(p - 1)/p x S / (0.9 x link rate), and a fit per layout of t = 2(p - 1) alpha + 2(p - 1)/p x S / beta.
--mode=negotiation: a step of 161 separate small allreduce requests (as the overlapped
reduction sends ResNet-50's gradients) against one grouped allreduce of the same tensors, no compute,
with Horovod's response cache on and off: what the coordination of many requests costs per step.

Run as root from the repository root with the machine to itself (it brings up launch/emulated_cluster.sh
with as many hosts as the largest layout, every link at --link_rate, and takes it down at the end):

    python -m benchmarks.allreduce_hosts                    # results/allreduce_hosts.md, raw in its folder
    python -m benchmarks.allreduce_hosts --mode=negotiation # results/negotiation_hosts.md, raw in its folder
    python -m benchmarks.allreduce_hosts --layouts=4x1 --sizes_mib=16 --variants=mpi,mpi_yield --out=/tmp/a.md

A run on another CPU or with other settings goes into the question's folder, its raw timings beside it
(`--out=results/allreduce_hosts/<cpu or setting>.md`), and results/allreduce_hosts.md links it.

Variants (each a launch of p ranks, `horovodrun -H node1:r,...`, HOROVOD_CYCLE_TIME=5):
  mpi          Open MPI as horovodrun starts it, nothing else set
  mpi_yield    + OMPI_MCA_mpi_yield_when_idle=1 (a rank waiting in MPI yields its core instead of polling)
  mpi_ring     + Open MPI's tuned allreduce forced to the ring (coll_tuned_allreduce_algorithm=4)
  mpi_rules    + hvd_lars/parallel/ompi_allreduce_rules.conf (from 1 MiB on 3+ ranks the ring, below:
               Open MPI's own choice)
  launch_env   launch/env.sh sourced first, as launch/horovodrun.sh, mpirun.sh and train.sbatch do, and each
               rank sets what hvd_lars.main sets before MPI starts (hvd_lars.training.threads'
               HOROVOD_CPU_DEFAULTS: the rules file, MPI yielding, a 5 ms cycle): a job of the launch scripts
  main         a bare horovodrun, each rank setting what hvd_lars.main sets: `horovodrun python -m
               hvd_lars.main`
  gloo         horovodrun --gloo from node1 (Gloo's ring)
  horovod_keras  a ported Horovod Keras script: a bare horovodrun, Horovod's own cycle time, each rank
               starting Horovod with `hvd_lars.parallel.horovod_keras.init()` (which gives a CPU-only Open
               MPI job the rules file unless the user or site chose an allreduce)
  horovod_keras_off  the same with `init(ompi_allreduce_rules=False)`: Open MPI's own choice, the baseline
  mpich        MPICH: `mpiexec.mpich -launcher ssh -hosts node1:r,...`, from node1, of the Python of
               --mpich_venv, an environment whose Horovod install/setup.sh built against MPICH, each rank
               set as the main program sets it (MPICH ignores the Open MPI settings among them). Not in
               the default list;
               make the environment once, with MPICH's programs first on PATH as `module load mpich` puts
               them:
                 mkdir -p /var/tmp/mpich_bin && for n in mpicc mpicxx mpirun mpiexec; do
                   ln -sf /usr/bin/$n.mpich /var/tmp/mpich_bin/$n; done
                 ln -sf /usr/bin/hydra_pmi_proxy /var/tmp/mpich_bin/   # what mpiexec starts next to it
                 PATH=/var/tmp/mpich_bin:$PATH VENV=/var/tmp/hvd_lars_mpich_venv bash install/setup.sh
                 python -m benchmarks.allreduce_hosts --variants=main,mpich,mpich_rsag,mpich_eager \\
                   --mpich_venv=/var/tmp/hvd_lars_mpich_venv --out=results/allreduce_hosts/mpich.md
  mpich_rsag   mpich with MPICH's allreduce set to reduce-scatter + allgather, its bandwidth-optimal one
               (MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=reduce_scatter_allgather; MPICH 4.0.2 has no "ring" value)
  mpich_eager  mpich with UCX_RNDV_THRESH=inf: UCX sends every message eagerly, never by rendezvous
               (benchmarks/mpich_allreduce.py measures these settings on MPICH alone, without Horovod)
Each size: 2 untimed allreduces, then `--repeats` timed ones, each after a barrier; the median is reported.
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
RULES = os.path.join(REPO, "hvd_lars", "parallel", "ompi_allreduce_rules.conf")
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
    "main": {},
    "gloo": {},
    "horovod_keras": {},
    "horovod_keras_off": {},
    # MPICH's ch4:ucx (Debian's) moves data between processes of one kernel through shared memory, past
    # the emulated links (16 MiB in 7-14 ms at 200 Mbit/s, 18 KB on the link); over TCP it takes the links.
    "mpich": {"UCX_TLS": "tcp,self"},
    "mpich_rsag": {"UCX_TLS": "tcp,self", "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "reduce_scatter_allgather"},
    "mpich_eager": {"UCX_TLS": "tcp,self", "UCX_RNDV_THRESH": "inf"},
}
MPICH_VARIANTS = ("mpich", "mpich_rsag", "mpich_eager")  # these need --mpich_venv
DEFAULT_VARIANTS = [v for v in VARIANTS if v not in MPICH_VARIANTS]
# Launched from node1, since the hosts cannot reach this machine's own name.
FROM_NODE1 = ("gloo", *MPICH_VARIANTS)
# Variants whose ranks set what hvd_lars.main sets before Horovod starts MPI (threads.HOROVOD_CPU_DEFAULTS).
AS_THE_MAIN_PROGRAM = ("launch_env", "main", *MPICH_VARIANTS)
# Variants whose ranks start Horovod as a ported Horovod script does (horovod_keras.init, Horovod's cycle).
AS_A_PORTED_SCRIPT = {"horovod_keras": "on", "horovod_keras_off": "off"}
LINK_EFFICIENCY = 0.9  # TCP/IP payload of a shaped Ethernet link


def worker(args):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    if args.main_defaults:
        from hvd_lars.training import threads

        threads.apply_horovod_cpu_defaults()
    if args.horovod_keras_init:
        import hvd_lars.parallel.horovod_keras as horovod_keras

        horovod_keras.init(ompi_allreduce_rules=args.horovod_keras_init == "on")
        result_rules = os.environ.get("OMPI_MCA_coll_tuned_dynamic_rules_filename")
    else:
        hvd.init()
        result_rules = None
    if args.mode == "negotiation":
        result = _negotiation(hvd, tf, args)
    else:
        result = _sizes(hvd, tf, args)
    if hvd.rank() == 0:
        result["rules_file"] = result_rules
        result["controller"] = "mpi" if hvd.mpi_enabled() else "gloo"
        result["size"], result["local_size"], result["cross_size"] = (
            hvd.size(),
            hvd.local_size(),
            hvd.cross_size(),
        )
        with open(args.out, "w") as f:
            json.dump(result, f)


def _barrier(hvd, tf):
    hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="barrier")


def _sizes(hvd, tf, args):
    """One allreduce of each size in turn: 2 untimed, then `args.repeats` timed, each after a barrier."""
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
            _barrier(hvd, tf)
            start = time.perf_counter()
            hvd.allreduce(x, op=hvd.Sum, name=name)
            times.append(time.perf_counter() - start)
        result["sizes"].append(size)
        result["times_s"].append(times)
    return result


def _negotiation(hvd, tf, args):
    """Steps of `args.tensors` separate allreduce requests of `args.tensor_bytes` each (as the overlapped
    reduction sends a model's gradients: every request negotiated by Horovod's controller, then fused),
    against steps of one grouped allreduce of the same tensors (one negotiation for all). Compute is nil:
    the difference is what the requests' coordination costs per step."""
    tensors = [tf.fill([args.tensor_bytes // 4], float(hvd.rank() + 1) + k) for k in range(args.tensors)]

    @tf.function
    def separate():
        return [hvd.allreduce(t, op=hvd.Sum, name=f"g{k}") for k, t in enumerate(tensors)]

    @tf.function
    def grouped():
        return hvd.grouped_allreduce(tensors, op=hvd.Sum, name="grouped")

    result = {"tensors": args.tensors, "tensor_bytes": args.tensor_bytes}
    for name, step in (("separate", separate), ("grouped", grouped)):
        for _ in range(3):
            out = step()
        expected = hvd.size() * (hvd.size() + 1) / 2
        if float(tf.reduce_max(tf.abs(out[0] - expected))) != 0.0:
            raise RuntimeError(f"{name}: wrong sum")
        times = []
        for _ in range(args.repeats):
            _barrier(hvd, tf)
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        result[f"{name}_s"] = times
    return result


def parse_layout(text):
    """ "HxR" -> (hosts, ranks per host); ValueError naming the value otherwise."""
    try:
        hosts, ranks = (int(v) for v in text.split("x"))
    except ValueError:
        raise ValueError(f"layout {text!r}: expected HOSTSxRANKS, e.g. 4x1 or 4x2") from None
    if not (1 <= hosts <= 8 and ranks >= 1 and hosts * ranks >= 2):
        raise ValueError(f"layout {text!r}: 1-8 hosts (the emulated cluster's), 2 ranks or more in all")
    return hosts, ranks


def launch(variant, layout, worker_args, cache="on", timeout=1200, mpich_venv=None):
    hosts, ranks = layout
    p = hosts * ranks
    host_list = ",".join(f"node{k}:{ranks}" for k in range(1, hosts + 1))
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_allreduce_") as shared:
        out = os.path.join(shared, "result.json")
        if variant in MPICH_VARIANTS:
            python = os.path.join(mpich_venv, "bin", "python")
            argv = ["mpiexec.mpich", "-launcher", "ssh", "-hosts", host_list, "-n", str(p), python]
        else:
            python = sys.executable
            argv = [
                common.HOROVODRUN,
                *(["--gloo"] if variant == "gloo" else []),
                "-np",
                str(p),
                "-H",
                host_list,
            ]
            argv += [python]
        argv += ["-m", "benchmarks.allreduce_hosts", "--worker", *worker_args, f"--out={out}"]
        argv += ["--main_defaults"] if variant in AS_THE_MAIN_PROGRAM else []
        argv += (
            [f"--horovod_keras_init={AS_A_PORTED_SCRIPT[variant]}"] if variant in AS_A_PORTED_SCRIPT else []
        )
        settings = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
        if variant not in AS_A_PORTED_SCRIPT:
            settings["HOROVOD_CYCLE_TIME"] = "5"  # a ported script keeps Horovod's own
        if cache == "off":
            settings["HOROVOD_CACHE_CAPACITY"] = "0"
        settings.update(VARIANTS[variant])
        if variant in FROM_NODE1:
            assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items())
            cmd = ["ssh", "node1", f"cd {shlex.quote(REPO)} && env {assignments} {shlex.join(argv)}"]
        elif variant == "launch_env":
            assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items())
            cmd = ["bash", "-c", f"source launch/env.sh && env {assignments} {shlex.join(argv)}"]
        else:
            cmd = argv
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_MCA_"))}
        env.update(settings, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        try:
            result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            # Only the launcher was killed: its ranks (on this machine's one kernel) would keep spinning
            # and take the cores from every later launch.
            for pattern in ("benchmarks.allreduce_hosts --worker", "hydra_pmi_proxy", "mpiexec.mpich"):
                subprocess.run(["pkill", "-9", "-f", pattern], capture_output=True)
            raise
        if result.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{shlex.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        with open(out) as f:
            data = json.load(f)
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


def mib(size):
    return f"{size / 2**20:.4g} MiB" if size >= 2**20 else f"{size / 2**10:.4g} KiB"


def sizes_report(args, layouts, variants, sizes, link_bits, matmul, results, command):
    lines = [
        "# Horovod's allreduce across 2, 4 and 8 emulated hosts",
        "",
        *common.provenance_lines(command, matmul, args.raw),
        f"- launch/emulated_cluster.sh, {max(h for h, _ in layouts)} hosts, every link shaped to "
        f"{args.link_rate} (tc tbf, both directions, a {args.burst_ms} ms bucket); layouts hosts x ranks per "
        "host; HOROVOD_CYCLE_TIME=5 (horovod_keras variants: Horovod's own); "
        f"{args.repeats} timed allreduces after 2, each after a barrier. Bound: 2(p-1)/p x S / "
        f"({LINK_EFFICIENCY} x link); p = hosts x ranks per host.",
        "",
        "## Time against size, p and variant",
        "",
        "| layout | p | variant | size | median s | bound s | median / bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['layout']} | {r['p']} | {r['variant']} | {mib(r['size'])} | {r['median_s']:.4f} | "
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


def negotiation_report(args, results, matmul, command):
    lines = [
        "# Horovod's per-step coordination of many small tensors against p",
        "",
        *common.provenance_lines(command, matmul, args.raw),
        f"- launch/emulated_cluster.sh, every link shaped to {args.link_rate}; a step is {args.tensors} "
        f"allreduce requests of {args.tensor_bytes} B each (ResNet-50 has 161 gradients), issued at once in "
        "one tf.function as the overlapped reduction issues them, against one grouped allreduce of the same "
        f"tensors; no compute. HOROVOD_CYCLE_TIME=5; {args.repeats} timed steps after 3, each after a "
        "barrier; medians. Overhead = separate - grouped: what negotiating the requests one by one costs.",
        "",
        "| layout | p | variant | response cache | separate s | grouped s | overhead per step ms | "
        "per request us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        over = r["separate_s"] - r["grouped_s"]
        lines.append(
            f"| {r['layout']} | {r['p']} | {r['variant']} | {r['cache']} | {r['separate_s']:.4f} | "
            f"{r['grouped_s']:.4f} | {over * 1e3:.1f} | {over / args.tensors * 1e6:.0f} |"
        )
    return lines


def measure(args, layout, variant, cache, sizes, link_bits):
    """One launch of `layout` for `variant`: its result rows (one per size, or one negotiation row)."""
    p, name = layout[0] * layout[1], f"{layout[0]}x{layout[1]}"
    if args.mode == "negotiation":
        worker_args = ["--mode=negotiation", f"--tensors={args.tensors}"]
        worker_args += [f"--tensor_bytes={args.tensor_bytes}", f"--repeats={args.repeats}"]
        data = launch(variant, layout, worker_args, cache, mpich_venv=args.mpich_venv)
        separate, grouped = statistics.median(data["separate_s"]), statistics.median(data["grouped_s"])
        print(f"[allreduce_hosts] {name} {variant} cache {cache}: {separate:.4f} s, grouped {grouped:.4f} s")
        row = dict(layout=name, p=p, variant=variant, cache=cache, separate_s=separate, grouped_s=grouped)
        return [dict(row, raw=data)]
    worker_args = [f"--sizes={','.join(map(str, sizes))}", f"--repeats={args.repeats}"]
    data = launch(variant, layout, worker_args, cache, mpich_venv=args.mpich_venv)
    rows = []
    for size, times in zip(data["sizes"], data["times_s"]):
        median, bound = statistics.median(times), bound_s(size, p, link_bits)
        rows.append(
            dict(
                layout=name,
                p=p,
                variant=variant,
                size=size,
                times_s=times,
                median_s=median,
                bound_s=bound,
                rules_file=data.get("rules_file"),
            )
        )
        print(
            f"[allreduce_hosts] {name} {variant} {size} B: {median:.4f} s ({median / bound:.2f}x the bound)"
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="sizes", choices=("sizes", "negotiation"))
    parser.add_argument("--layouts", default="2x1,4x1,8x1,4x2", help="HOSTSxRANKS per host, comma-separated")
    parser.add_argument("--sizes_mib", default="0.0009765625,0.015625,0.25,1,4,16,64")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument(
        "--mpich_venv", default=None, help="variant mpich: the environment built against MPICH"
    )
    parser.add_argument("--cache", default=None, help="on, off or on,off (default: on; negotiation: on,off)")
    parser.add_argument("--tensors", type=int, default=161, help="negotiation: requests per step")
    parser.add_argument("--tensor_bytes", type=int, default=4096, help="negotiation: bytes per request")
    parser.add_argument("--link_rate", default="200mbit")
    common.add_burst_ms_argument(parser)
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (sizes 5, negotiation 20)")
    parser.add_argument("--raw", default=None, help="raw timings (default: common.data_path of --out)")
    parser.add_argument("--out", default=None, help="allreduce_hosts.md; negotiation: negotiation_hosts.md")
    parser.add_argument("--worker", action="store_true", help="internal: run as one rank")
    parser.add_argument("--sizes", default="", help="internal: bytes, for --worker")
    parser.add_argument(
        "--main_defaults", action="store_true", help="internal: as hvd_lars.main, for --worker"
    )
    parser.add_argument(
        "--horovod_keras_init", default="", help="internal: on/off, horovod_keras.init's rules, for --worker"
    )
    args, _ = parser.parse_known_args(argv)
    if args.repeats is None:
        args.repeats = 20 if args.mode == "negotiation" else 5
    if args.worker:
        worker(args)
        return
    stem = "negotiation_hosts" if args.mode == "negotiation" else "allreduce_hosts"
    args.out = args.out or os.path.join(common.RESULTS, f"{stem}.md")
    args.raw = args.raw or common.data_path(args.out)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; valid: {', '.join(VARIANTS)}")
    if set(variants) & set(MPICH_VARIANTS) and not (
        args.mpich_venv and os.path.exists(os.path.join(args.mpich_venv, "bin", "python"))
    ):
        parser.error(
            f"--variants=mpich needs --mpich_venv, an environment with bin/python (got {args.mpich_venv!r})"
        )
    caches = (args.cache or ("on,off" if args.mode == "negotiation" else "on")).split(",")
    if set(caches) - {"on", "off"}:
        parser.error(f"--cache={args.cache!r}: expected on, off or on,off")
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
                for cache in caches:
                    results += measure(args, layout, variant, cache, sizes, link_bits)
    command = common.command_line("allreduce_hosts", argv)
    with open(args.raw, "w") as f:
        json.dump(
            {"command": command, "link_rate": args.link_rate, "burst_ms": args.burst_ms, "results": results},
            f,
            indent=1,
        )
    if args.mode == "negotiation":
        lines = negotiation_report(args, results, matmul, command)
    else:
        lines = sizes_report(args, layouts, variants, sizes, link_bits, matmul, results, command)
    common.write_report(args.out, "\n".join(lines))
    print(f"[allreduce_hosts] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
