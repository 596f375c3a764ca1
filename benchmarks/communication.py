"""Horovod allreduce between 2 emulated hosts (launch/emulated_cluster.sh, 1 rank each): time against message
size on unshaped, 10 Gbit/s and 1 Gbit/s links with MPI and Gloo, an alpha-beta fit per setting.

Run as root (it brings the emulated cluster up and takes it down for every link setting) from the repository
root, with the machine to itself (nothing else running):

    python -m benchmarks.communication

Writes results/communication.md and .png; raw timings go to results/communication/communication.json, one
entry per (link, backend). A run measures only the entries missing there (--force: all it is asked for), so
`--links 1gbit` splits the work; --report_only rewrites the .md and .png from the .json. Each measurement
launches 2 ranks, one per host: horovodrun from this machine for MPI, `ssh node1 horovodrun --gloo` for Gloo
(its rendezvous must be on the cluster network).
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time

from benchmarks import common

REPO = common.REPO
RAW = os.path.join(common.RESULTS, "communication", "communication.json")
MD = os.path.join(common.RESULTS, "communication.md")
PNG = os.path.join(common.RESULTS, "communication.png")
HOROVODRUN = common.HOROVODRUN

LINKS = {"unshaped": "", "10gbit": "10gbit", "1gbit": "1gbit"}
LINK_RATE_BITS = {"unshaped": None, "10gbit": 10e9, "1gbit": 1e9}
BACKENDS = ("mpi", "gloo")
SIZES = [2**k for k in range(10, 28)]  # message sizes in bytes: 1 KiB .. 128 MiB
REPEATS = {True: 20, False: 5}  # timed allreduces up to 1 MiB, and above


# --- worker: one rank ------------------------------------------------------------------------------------
def worker_sweep(out):
    """Times one allreduce (Average) of a float32 tensor of each size after a barrier; rank 0 writes `out`."""
    import socket

    hvd, tf = common.horovod_rank()
    hvd.init()
    times = [common.allreduce_times(hvd, tf, size, REPEATS[size <= 2**20], hvd.Average) for size in SIZES]
    hosts = hvd.allgather_object(socket.gethostname())
    seen = hvd.allgather_object(
        {k: os.environ.get(k) for k in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME")}
    )
    if hvd.rank() == 0:
        result = {"sizes": SIZES, "times_s": times, "hosts": hosts, "horovod_environment": seen}
        result["controller"] = "mpi" if hvd.mpi_enabled() else "gloo"
        common.write_json(out, result, indent=None)


# --- driver ----------------------------------------------------------------------------------------------
# The token bucket of each shaped link (the emulated cluster's default). Entries of communication.json
# measured before it was recorded had a 2 ms bucket.
BURST_MS = common.LINK_BURST_MS
BURST_MS_BEFORE_RECORDED = 2


def launch(backend, timeout=900):
    """Runs this script's worker on node1 and node2 (1 rank each); returns rank 0's JSON result."""
    settings = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_communication_") as shared:
        out = os.path.join(shared, "result.json")
        argv = [HOROVODRUN, *(["--gloo"] if backend == "gloo" else []), "-np", "2", "-H", "node1:1,node2:1"]
        argv += [*common.worker_command("communication"), "--worker", "--out", out]
        # Horovod's defaults: an env.sh sourced by the caller must not leak into the measurement.
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        if backend == "mpi":
            cmd = argv
            env.update(settings)
        else:
            cmd = common.on_node1(argv, settings)
        start = time.time()
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        data = common.read_json(out)
    data["wall_s"] = round(time.time() - start, 1)
    return data


def _save(raw):
    os.makedirs(os.path.dirname(RAW), exist_ok=True)
    tmp = RAW + ".tmp"
    common.write_json(tmp, raw)
    os.replace(tmp, RAW)


def measure(args, raw):
    from hvd_lars.training import epoch_logs

    stamp = {
        "command": common.command_line("communication", args.argv),
        "git_sha": common.git_sha(),
        "date": common.now(),
        "cpu": common.cpu(),
        "matmul": common.matmul_rate(),
        "machine": epoch_logs.machine(),
        "burst_ms": BURST_MS,
    }
    for link in args.links:
        todo = [b for b in args.backends if args.force or f"sweep|{link}|{b}" not in raw]
        if not todo:
            continue
        with common.emulated_cluster(2, LINKS[link], BURST_MS):
            for backend in todo:
                key = f"sweep|{link}|{backend}"
                print(f"[communication] {key}", flush=True)
                data = launch(backend)
                raw[key] = {**data, **stamp, "link": link, "backend": backend}
                _save(raw)


# --- report ------------------------------------------------------------------------------------------------
def _prose(text):
    """A paragraph written as an indented triple-quoted string, as one markdown line."""
    return " ".join(text.split())


def _bursts(entries):
    """The token-bucket depths `entries` were measured with, as prose ("2 ms", "2 ms or 10 ms")."""
    depths = sorted({e.get("burst_ms", BURST_MS_BEFORE_RECORDED) for e in entries})
    return " or ".join(f"{b} ms" for b in depths)


def _ms(x):
    return f"{x * 1e3:.3g}" if x < 1 else f"{x * 1e3:,.0f}"


def report(raw):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sweeps = {k: v for k, v in raw.items() if k.startswith("sweep|")}
    if not sweeps:
        raise SystemExit(f"{RAW} holds no measurement; run without --report_only first")
    entries = list(sweeps.values())

    def distinct(key):
        return ", ".join(f"`{v}`" if key == "command" else v for v in sorted({e[key] for e in entries}))

    # Older entries hold the CPU as a string and no tf.matmul rate: `describe` says so.
    machines = sorted({common.describe(e["cpu"], e.get("matmul"), e["machine"]) for e in entries})

    lines = [
        "# Horovod allreduce between 2 emulated hosts: message size, link rate, MPI and Gloo",
        "",
        f"- commands (as root, with the machine to itself, from the repository root): {distinct('command')}",
        f"- git SHA: {', '.join(common.sha_text(sha) for sha in sorted({e['git_sha'] for e in entries}))}",
        f"- dates: {distinct('date')}",
        f"- machine: {'; or '.join(machines)}",
        f"- this report rendered from `results/communication/communication.json` at "
        f"{common.sha_text(common.git_sha())} "
        "(`python -m benchmarks.communication --report_only`)",
        _prose(
            """
            - set-up: `launch/emulated_cluster.sh up` with NODES=2: hosts node1 and node2 in their own
            network, UTS and mount namespaces, a veth pair each into one bridge; 1 rank per host; LINK_RATE
            shapes both directions of each host's link with `tc tbf` (burst BURSTS at the rate, at least
            64 KiB; 50 ms queue).
            Both hosts share this machine's 2 cores and memory bandwidth, so an unshaped link is as fast as
            the kernel copies bytes.
            """
        ).replace("BURSTS", _bursts(entries)),
        "- MPI: `horovodrun -np 2 -H node1:1,node2:1` from this machine (Open MPI, TCP); Gloo: "
        "`ssh node1 horovodrun --gloo ...`.",
        "",
    ]
    lines += _sweep_section(sweeps, np, plt)
    common.write_report(MD, "\n".join(lines))
    print(f"[communication] wrote {MD} and {PNG}")


def _sweep_section(sweeps, np, plt):
    lines = [
        "## Allreduce time against message size",
        "",
        _prose(
            """
            One `hvd.allreduce` (Average) of a float32 tensor, timed on rank 0 after a barrier; median of 20
            repetitions up to 1 MiB, 5 above, after 2 warm-ups; Horovod's default fusion and cycle settings.
            Fit: t = alpha + n / B by least squares on the relative error. With 2 ranks each direction of
            each link carries n bytes per allreduce (ring: 2 (p - 1) / p n), so B is comparable to the link
            rate. n1/2 = alpha B is the message size at which latency and bandwidth terms are equal: below
            it, alpha dominates.
            """
        ),
        "",
        "| link | backend | alpha (us) | fitted B (Gbit/s) | configured (Gbit/s) | B / configured | "
        "n1/2 = alpha B | max fit error | up to 256 KiB (ms) | 1 MiB (ms) | 128 MiB (ms) | "
        "n / t at 128 MiB (Gbit/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colours = {"unshaped": "tab:green", "10gbit": "tab:blue", "1gbit": "tab:red"}
    markers = {"mpi": "o", "gloo": "s"}
    for link in LINKS:
        for backend in BACKENDS:
            entry = sweeps.get(f"sweep|{link}|{backend}")
            if not entry:
                continue
            sizes = entry["sizes"]
            medians = [statistics.median(t) for t in entry["times_s"]]
            alpha, bandwidth, residual = common.alpha_beta(sizes, medians)
            rate = LINK_RATE_BITS[link]
            configured, ratio = (f"{rate / 1e9:.0f}", f"{bandwidth * 8 / rate:.2f}") if rate else ("-", "-")
            at = dict(zip(sizes, medians))
            small = [t for n, t in at.items() if n <= 2**18]
            lines.append(
                f"| {link} | {backend} | {alpha * 1e6:.0f} | {bandwidth * 8 / 1e9:.2f} | {configured} | "
                f"{ratio} | {alpha * bandwidth / 2**10:,.0f} KiB | {residual:.0%} | "
                f"{_ms(min(small))}-{_ms(max(small))} | {_ms(at[2**20])} | {_ms(at[2**27])} | "
                f"{2**27 * 8 / at[2**27] / 1e9:.2f} |"
            )
            style = dict(color=colours[link], marker=markers[backend], linestyle="none", markersize=4)
            ax.loglog(sizes, medians, label=f"{link}, {backend}", **style)
            fit = np.geomspace(sizes[0], sizes[-1], 100)
            line = "-" if backend == "mpi" else "--"
            ax.loglog(fit, alpha + fit / bandwidth, color=colours[link], linestyle=line, linewidth=1)
    wire = np.geomspace(SIZES[0], SIZES[-1], 100)
    for link, rate in LINK_RATE_BITS.items():
        if rate and any(k.startswith(f"sweep|{link}|") for k in sweeps):
            ax.loglog(wire, wire * 8 / rate, color=colours[link], linestyle=":", linewidth=1,
                      label=f"n / {link} (wire time)")  # fmt: skip
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("allreduce time (s)")
    ax.set_title("Horovod allreduce, 2 emulated hosts x 1 rank (points: median; lines: alpha-beta fit)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PNG, dpi=120)
    lines += ["", f"![allreduce time against size]({os.path.basename(PNG)})", ""]
    lines += ["Median times (ms) at every size:", ""]
    keys = [k for k in (f"sweep|{link}|{b}" for link in LINKS for b in BACKENDS) if k in sweeps]
    lines.append("| size | " + " | ".join(k.split("|", 1)[1].replace("|", ", ") for k in keys) + " |")
    lines.append("|---" * (len(keys) + 1) + "|")
    for i, size in enumerate(SIZES):
        row = [_ms(statistics.median(sweeps[k]["times_s"][i])) for k in keys]
        named = f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 2**10} KiB"
        lines.append(f"| {named} | " + " | ".join(row) + " |")
    lines.append("")
    return lines


def main(argv=None):
    parser = common.argument_parser(__doc__)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--links", default=",".join(LINKS), help=f"among {', '.join(LINKS)}")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="mpi, gloo or both")
    parser.add_argument("--force", action="store_true", help="measure again entries already in the .json")
    parser.add_argument("--report_only", action="store_true", help="only rewrite .md and .png from the .json")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.worker:
        return worker_sweep(args.out)
    args.links, args.backends = args.links.split(","), args.backends.split(",")
    for name, values, valid in (("links", args.links, LINKS), ("backends", args.backends, BACKENDS)):
        bad = [v for v in values if v not in valid]
        if bad:
            parser.error(f"--{name} {','.join(bad)}: expected among {', '.join(valid)}")
    raw = {}
    if os.path.exists(RAW):
        raw = common.read_json(RAW)
    if not args.report_only:
        if os.geteuid() != 0:
            parser.error("needs root: it brings up the emulated cluster (launch/emulated_cluster.sh)")
        measure(args, raw)
    report(raw)


if __name__ == "__main__":
    main()
