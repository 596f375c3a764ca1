"""What the emulated links carry with no MPI at all: a ring of plain TCP streams across p emulated hosts.

The ring allreduce's bound, 2(p - 1)/p x S / (0.9 x link), assumes that every host's link carries its
ring edge at the link's payload rate in both directions at once. On the emulated cluster all p links,
their TCP stacks, the bridge and the token buckets are forwarded by the one kernel of this machine, on
the same 2 cores that run the ranks. This benchmark measures that path alone: each host k sends to host
k + 1 and receives from host k - 1 at the same time, over one TCP connection each way, in one of two
patterns:
  stream  one transfer of 2(p - 1)/p x S bytes each way: what the links carry at all
  steps   the ring allreduce's pattern without its arithmetic: 2(p - 1) steps of S/p bytes, each step
          ending when its receive has arrived (so one slow host holds up the ring, as in the allreduce)
If the stream takes more than the bound, no allreduce over these links can meet it on this machine.

Run as root from the repository root with the machine to itself (it brings up launch/emulated_cluster.sh
with as many hosts as the largest p, every link at --link_rate, and takes it down at the end):

    python -m benchmarks.tcp_ring --ps=2,4,8 --sizes_mib=16 --link_rate=200mbit --burst_ms=2,10

--burst_ms sets the depth of each link's token bucket (launch/emulated_cluster.sh's LINK_BURST_MS); one
cluster is brought up for each value, in the order given.

Each (p, size, pattern): 2 untimed transfers, then --repeats timed ones, each after a token has gone twice
round the ring (a barrier); a repeat's time is its slowest host's; the median is reported.
"""

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time

from benchmarks import common
from benchmarks.allreduce_hosts import bound_s

PORT = 29517
PATTERNS = ("stream", "steps")


def node_address(k):
    """Host k's (1-based) address on launch/emulated_cluster.sh's subnet."""
    return f"198.18.0.{10 + k}"


def cluster_addresses(p):
    """'host:port' of the p ranks, rank k on node k + 1 of the emulated cluster."""
    return [f"{node_address(k + 1)}:{PORT}" for k in range(p)]


def chunks(size, p, pattern):
    """(bytes per step, steps) of `pattern` for an allreduce of `size` bytes over p hosts.

    Raises:
        ValueError: an unknown pattern, or p < 2.
    """
    if p < 2:
        raise ValueError(f"p = {p}: a ring needs 2 hosts or more")
    if pattern == "stream":
        return 2 * (p - 1) * (size // p), 1
    if pattern == "steps":
        return size // p, 2 * (p - 1)
    raise ValueError(f"pattern {pattern!r}: expected one of {', '.join(PATTERNS)}")


def _receive(sock, view):
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the previous host closed the connection")
        got += n


def _exchange(to_next, from_prev, out, into):
    """Sends `out` to the next host while receiving len(into) bytes from the previous one."""
    sender = threading.Thread(target=to_next.sendall, args=(out,))
    sender.start()
    _receive(from_prev, into)
    sender.join()


def _barrier(rank, to_next, from_prev):
    """A token twice round the ring: when it returns the second time every host has passed the first."""
    token = bytearray(1)
    for _ in range(2):
        if rank == 0:
            to_next.sendall(b"t")
            _receive(from_prev, memoryview(token))
        else:
            _receive(from_prev, memoryview(token))
            to_next.sendall(b"t")


def worker(args):
    """One rank: listens on its address's port, connects to the next rank's, runs every size and pattern;
    prints {rank, results: [{size, pattern, times_s}]} as JSON."""
    addresses = [a.rsplit(":", 1) for a in args.addresses.split(",")]
    rank, p = args.rank, len(addresses)
    listener = socket.create_server(("", int(addresses[rank][1])))
    nxt_host, nxt_port = addresses[(rank + 1) % p]
    deadline = time.monotonic() + args.timeout
    while True:  # the next host's listener may not be up yet: retry until it accepts, or the timeout
        try:
            to_next = socket.create_connection((nxt_host, int(nxt_port)), timeout=args.timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    listener.settimeout(args.timeout)
    from_prev, _ = listener.accept()
    for s in (to_next, from_prev):
        s.settimeout(args.timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    results = []
    for size in map(int, args.sizes.split(",")):
        for pattern in args.patterns.split(","):
            step_bytes, steps = chunks(size, p, pattern)
            # Each rank sends its own byte value, so that a receive can be checked to come from rank - 1.
            out, into = bytearray([rank % 256]) * step_bytes, bytearray(step_bytes)
            expected = (rank - 1) % p % 256
            times = []
            for i in range(2 + args.repeats):
                _barrier(rank, to_next, from_prev)
                start = time.perf_counter()
                for _ in range(steps):
                    _exchange(to_next, from_prev, out, memoryview(into))
                if i >= 2:
                    times.append(time.perf_counter() - start)
                if into[0] != expected or into[-1] != expected:
                    raise RuntimeError(f"rank {rank}: received bytes {into[0]}..{into[-1]}, not {expected}")
            results.append(dict(size=size, pattern=pattern, times_s=times))
    _barrier(rank, to_next, from_prev)
    json.dump(dict(rank=rank, results=results), sys.stdout)


def worker_argv(rank, addresses, sizes, patterns, repeats, timeout):
    """The command line of rank `rank`'s worker (a list)."""
    return [
        *common.worker_command("tcp_ring", "--worker", f"--rank={rank}"),
        f"--addresses={','.join(addresses)}",
        f"--sizes={','.join(map(str, sizes))}",
        f"--patterns={','.join(patterns)}",
        f"--repeats={repeats}",
        f"--timeout={timeout}",
    ]


def run_ring(p, sizes, patterns, repeats, timeout, addresses=None):
    """Starts one worker per rank: by default on node1..node<p> of the emulated cluster over ssh, or, with
    `addresses` ('host:port' each), on this machine. Returns each rank's results, in rank order.

    Raises:
        RuntimeError: a worker exited non-zero, with its output; the others are killed.
    """
    procs = []
    local = addresses is not None
    addresses = addresses or cluster_addresses(p)
    for rank in range(p):
        argv = worker_argv(rank, addresses, sizes, patterns, repeats, timeout)
        if not local:
            argv = [
                "ssh",
                f"node{rank + 1}",
                f"cd {common.REPO} && PYTHONPATH={common.REPO} {shlex.join(argv)}",
            ]
        procs.append(
            subprocess.Popen(
                argv, cwd=common.REPO, env=common.worker_env(), text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
        )  # fmt: skip
    outputs = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=timeout * 4)
        if proc.returncode:
            for other in procs:
                other.kill()
            raise RuntimeError(
                f"tcp_ring rank {rank} on node{rank + 1} exited {proc.returncode}: {err[-2000:]}"
            )
        outputs.append(json.loads(out))
    return outputs


def combine(p, outputs, link_bits):
    """Rows (one per size and pattern): each repeat's time is the slowest host's; the median of those."""
    rows = []
    for i, first in enumerate(outputs[0]["results"]):
        per_repeat = [
            max(o["results"][i]["times_s"][r] for o in outputs) for r in range(len(first["times_s"]))
        ]
        median = statistics.median(per_repeat)
        bound = bound_s(first["size"], p, link_bits)
        rows.append(
            dict(p=p, size=first["size"], pattern=first["pattern"], times_s=per_repeat, median_s=median,
                 bound_s=bound, ratio=median / bound)
        )  # fmt: skip
    return rows


def report(args, rows, matmul, command, raw=None):
    lines = [
        "# Plain TCP rings across emulated hosts: what the links carry without MPI",
        "",
        *common.provenance_lines(command, matmul, raw),
        f"- launch/emulated_cluster.sh, every link shaped to {args.link_rate} (tc tbf, both directions, "
        "a token bucket as deep as the row says, in ms at the rate, at least 64 KiB); one "
        "process per host; host k sends to k + 1 and receives from k - 1 at once over TCP. `stream`: one "
        "transfer of 2(p - 1)/p x S; `steps`: 2(p - 1) steps of S/p, each waiting for its receive. "
        f"{args.repeats} timed after 2, each after a barrier; a repeat's time is its slowest host's. "
        "Bound: 2(p - 1)/p x S / (0.9 x link).",
        "",
        "| bucket | p | size | pattern | median s | bound s | median / bound | slowest repeat / bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['burst_ms']} ms | {r['p']} | {r['size'] / 2**20:g} MiB | {r['pattern']} | "
            f"{r['median_s']:.4f} | {r['bound_s']:.4f} | {r['ratio']:.2f} | "
            f"{max(r['times_s']) / r['bound_s']:.2f} |"
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ps", default="2,4,8", help="numbers of hosts, 2-8, one process each")
    parser.add_argument("--sizes_mib", default="16", help="allreduce sizes S in MiB")
    parser.add_argument("--patterns", default=",".join(PATTERNS), help=f"of {', '.join(PATTERNS)}")
    parser.add_argument("--link_rate", default="200mbit", help="each host's link, as emulated_cluster.sh")
    parser.add_argument(
        "--burst_ms", default=f"2,{common.LINK_BURST_MS}", help="token bucket depths in ms, one cluster each"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300, help="seconds a socket may wait")
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "tcp_ring.md"))
    parser.add_argument("--worker", action="store_true", help="internal")
    parser.add_argument("--rank", type=int, default=0, help="internal")
    parser.add_argument("--addresses", default="", help="internal: host:port of every rank")
    parser.add_argument("--sizes", default="", help="internal: bytes")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    try:
        ps = [int(x) for x in args.ps.split(",")]
        bursts = [int(x) for x in args.burst_ms.split(",")]
        sizes = [int(float(x) * 2**20) for x in args.sizes_mib.split(",")]
        link_bits = common.link_rate_bits(args.link_rate)
    except ValueError as e:
        parser.error(str(e))
    if not all(2 <= p <= 8 for p in ps):
        parser.error(f"--ps={args.ps}: each p must be 2-8 (the emulated cluster's hosts here)")
    patterns = args.patterns.split(",")
    if set(patterns) - set(PATTERNS):
        parser.error(f"--patterns={args.patterns}: expected some of {', '.join(PATTERNS)}")
    matmul = common.matmul_rate()
    rows = []
    for burst in bursts:
        with common.emulated_cluster(max(ps), args.link_rate, burst):
            for p in ps:
                new = combine(p, run_ring(p, sizes, patterns, args.repeats, args.timeout), link_bits)
                for r in new:
                    r["burst_ms"] = burst
                    print(f"[tcp_ring] {burst} ms bucket, p={p} {r['size']} B {r['pattern']}: "
                          f"{r['median_s']:.4f} s ({r['ratio']:.2f}x the bound)", flush=True)  # fmt: skip
                rows += new
    command = common.command_line("tcp_ring", argv)
    raw = common.data_path(args.out)
    with open(raw, "w") as f:
        json.dump({"command": command, "link_rate": args.link_rate, "rows": rows}, f, indent=1)
    common.write_report(args.out, "\n".join(report(args, rows, matmul, command, raw)))
    print(f"[tcp_ring] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
