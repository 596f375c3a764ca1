"""What every benchmark shares: the machine a report names, running workers, writing reports (keeping what
a person wrote: from the line `HAND_WRITTEN` on, or outside a section's markers), and the alpha-beta fits of
an allreduce's time. Benchmarks and their workers run from the repository root as `python -m benchmarks.X`.

    python -m benchmarks.common                  # prints this machine's description (CPU and tf.matmul rate)
    python -m benchmarks.common --machine_line   # only the line a report names (install/*.sh use it)
"""

import contextlib
import datetime
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys

import numpy as np

from hvd_lars.training import epoch_logs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "results")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
EMULATED_CLUSTER = os.path.join(REPO, "launch", "emulated_cluster.sh")

# CPU flags that decide training speed here (/proc/cpuinfo): AVX-512, native bfloat16, AMX tiles.
CPU_FLAGS = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8")
# What a report says of a figure its run did not record (checks/test_results_files.py looks for it).
NOT_RECORDED = "not recorded for this run"
# ... and of a git SHA ending in "-dirty": no commit holds the code that ran.
DIRTY = f"uncommitted changes when it ran: its exact source {NOT_RECORDED}"
# The line from which a whole-file report's text is a person's and survives a regeneration.
HAND_WRITTEN = "<!-- written by hand from here on: kept when the file is regenerated -->"


# --------------------------------------------------------------------------------------------- machine


def cpu(cpuinfo_path="/proc/cpuinfo"):
    """This machine's CPU (/proc/cpuinfo): `model` name, `vendor`, `family`, `model_number`, `stepping`,
    `flags` (those of CPU_FLAGS), a short `name` and `key` (the identity and a hash of every flag), which
    tells apart two CPUs that share a model name."""
    info = epoch_logs.cpuinfo(cpuinfo_path)
    model = info.get("model name", "unknown")
    flags = set(info.get("flags", "").split())
    have = [f for f in CPU_FLAGS if f in flags]
    name = "AMD EPYC" if "EPYC" in model else ("Intel Xeon" if "Xeon" in model else model)
    if "amx_bf16" in have:
        name += " with AMX"
    elif "avx512_bf16" in have:
        name += " with AVX-512 BF16"
    ident = {
        "vendor": info.get("vendor_id", "unknown"),
        "family": info.get("cpu family", "?"),
        "model_number": info.get("model", "?"),
        "stepping": info.get("stepping", "?"),
    }
    flag_hash = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:8]
    key = f"{ident['vendor']} family {ident['family']} model {ident['model_number']}"
    key += f" stepping {ident['stepping']}"
    return {"model": model, **ident, "flags": have, "name": name, "key": f"{key}, flags {flag_hash}"}


def matmul_rate(size=4096, repeats=5, budget_s=2.0):
    """GFLOP/s of `tf.matmul` on (size, size) operands (2 size^3 FLOPs), {"float32", "bfloat16", "size"},
    measured in a fresh process: per precision the best of up to `repeats` products after a warm-up, within
    `budget_s` s; a warm-up over `budget_s` (bfloat16 without bf16 instructions) is the measurement."""
    command = worker_command("common", "--matmul", str(size), "--repeats", str(repeats))
    result = run([*command, "--budget_s", str(budget_s)], timeout=600)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _best_product_seconds(product, repeats, budget_s):
    """The shortest of up to `repeats` timed calls of `product()` after a warm-up (that warm-up where it
    alone exceeds `budget_s`); no call starts once the timed ones have run `budget_s`."""
    import time

    start = time.perf_counter()
    product()  # warm up: thread pools, oneDNN primitive creation
    warm_up = time.perf_counter() - start
    if warm_up > budget_s:
        return warm_up
    best, spent = float("inf"), 0.0
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        product()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent >= budget_s:
            break
    return best


def _matmul_worker(size, repeats, budget_s):
    import tensorflow as tf

    rates = {}
    for dtype in (tf.float32, tf.bfloat16):
        a = tf.random.stateless_uniform((size, size), seed=(1, 2), dtype=tf.float32)
        a = tf.cast(a, dtype)
        seconds = _best_product_seconds(lambda a=a: tf.matmul(a, a).numpy(), repeats, budget_s)
        rates[dtype.name] = 2 * size**3 / seconds / 1e9
    print(json.dumps({**rates, "size": size}))


def cpu_text(c, host=None):
    """ "<host or model name>; CPU: <vendor> family F model M stepping S; CPU flags: ..." of a `cpu()` dict;
    of an older record (no identity, or a string) what it holds, and that the identity is NOT_RECORDED."""
    if isinstance(c, dict):
        flags = ", ".join(c.get("flags", [])) or "none of " + ", ".join(CPU_FLAGS)
        head = host or c.get("model", "unknown")
        if c.get("vendor"):
            identity = (
                f"{c['vendor']} family {c['family']} model {c['model_number']} stepping {c['stepping']}"
            )
            return f"{head}; CPU: {identity}; CPU flags: {flags}"
        return f"{head}; CPU flags: {flags}; CPU vendor, family and model {NOT_RECORDED}"
    head = f"{host}; {c}" if host else str(c)
    return f"{head}; CPU vendor, family and model {NOT_RECORDED}"


def describe(c, matmul, host=None):
    """The machine of a recorded run in one line: `cpu_text(c, host)`, then its tf.matmul rate; what the
    record lacks is said to be NOT_RECORDED, never filled in."""
    if not matmul:
        return f"{cpu_text(c, host)}; tf.matmul rate {NOT_RECORDED}"
    size = f" {matmul['size']}^2" if matmul.get("size") else ""  # older records lack it
    rate = f"{matmul['float32']:.0f} GFLOP/s float32, {matmul['bfloat16']:.0f} bfloat16"
    return f"{cpu_text(c, host)}; tf.matmul{size}: {rate}"


def machine(matmul):
    """This machine in one line (`describe`) with `matmul`, this run's `matmul_rate()`; ValueError if empty:
    a report names the rate of its own run."""
    if not matmul:
        raise ValueError(f"machine: matmul={matmul!r}; pass this run's common.matmul_rate()")
    return describe(cpu(), matmul, epoch_logs.machine())


def sha_text(sha):
    """A git SHA for a report, in backticks; one with "-dirty" is followed by "(DIRTY)"."""
    return f"`{sha}` ({DIRTY})" if "-dirty" in sha else f"`{sha}`"


def git_sha():
    """This checkout's commit, "-dirty" (with a warning: results/ refuses such a report) for uncommitted
    changes."""
    sha = epoch_logs.git_sha(REPO)
    if sha.endswith("-dirty"):
        print(
            f"[benchmarks] warning: git SHA {sha}: uncommitted changes; commit, then run again for a report "
            "for results/",
            file=sys.stderr,
        )
    return sha


# --------------------------------------------------------------------------------------------- workers


def argument_parser(doc):
    """An argparse parser whose --help shows the benchmark's docstring `doc` as written."""
    import argparse

    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def command_line(name, argv=None):
    """The command that ran benchmark `name`, as a reader types it from the repository root."""
    argv = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", f"benchmarks.{name}", *argv])


def worker_command(name, *args):
    """[python, -m, benchmarks.<name>, *args]: a worker of benchmark `name` (run it with `worker_env`)."""
    return [sys.executable, "-m", f"benchmarks.{name}", *map(str, args)]


def worker_env(**extra):
    """os.environ with this checkout first on PYTHONPATH, quiet TensorFlow, Open MPI allowed as root, and
    `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(command, env=None, timeout=1200, **kwargs):
    """Runs `command` from the repository root (env: `worker_env()` unless given), its text output captured;
    RuntimeError with the end of its output for a non-zero exit."""
    result = subprocess.run(
        command,
        cwd=REPO,
        env=worker_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
    if result.returncode:
        raise RuntimeError(
            f"{shlex.join(map(str, command))} exited {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def horovod_rank():
    """horovod.tensorflow and tensorflow in a benchmark's rank, TensorFlow on 1 intra-op and 2 inter-op
    threads (Horovod not initialised yet)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    return hvd, tf


def allreduce_times(hvd, tf, size, repeats, op):
    """Seconds of `repeats` allreduces (`op`) of `size` bytes of float32 (rank + 1 on every rank), each after
    a barrier, after 2 untimed ones (buffers, connections, response cache) whose result is checked."""
    import time

    x, name = tf.fill([size // 4], float(hvd.rank() + 1)), f"allreduce_{size}"
    for _ in range(2):
        y = hvd.allreduce(x, op=op, name=name)
    expected = (hvd.size() + 1) / 2 * (hvd.size() if op == hvd.Sum else 1)
    if not float(tf.reduce_min(y)) == float(tf.reduce_max(y)) == expected:
        raise RuntimeError(f"allreduce of {size} B: wrong result (expected {expected})")
    times = []
    for _ in range(repeats):
        hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="barrier")
        start = time.perf_counter()
        hvd.allreduce(x, op=op, name=name)
        times.append(time.perf_counter() - start)
    return times


# ------------------------------------------------------------------------------------ emulated cluster


def env_assignments(settings):
    """`settings` as `K=V` words for `env` in a shell command."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items())


def on_node1(argv, settings):
    """`argv` run from the repository on the emulated cluster's node1 with `settings` (launched from there:
    the hosts cannot reach this machine's own name)."""
    return ["ssh", "node1", f"cd {shlex.quote(REPO)} && env {env_assignments(settings)} {shlex.join(argv)}"]


def link_rate_bits(rate):
    """Bits per second of a tc rate ('200mbit' -> 2e8); ValueError unless a number and kbit, mbit or gbit."""
    for unit, factor in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if rate.endswith(unit):
            try:
                return float(rate[: -len(unit)]) * factor
            except ValueError:
                break
    raise ValueError(f"link rate {rate!r}: expected a number and kbit, mbit or gbit, e.g. 200mbit or 1gbit")


# The depth of each shaped link's token bucket, in ms at the rate: launch/emulated_cluster.sh's default
# LINK_BURST_MS (results/archive/tcp_ring.md says why 10 ms).
LINK_BURST_MS = 10


@contextlib.contextmanager
def emulated_cluster(nodes, link_rate="", burst_ms=None):
    """launch/emulated_cluster.sh up with `nodes` hosts (root), each link shaped to `link_rate` ('': not)
    with a `burst_ms` token bucket (None: LINK_BURST_MS), and down when the block ends, SIGTERM included;
    yields the script's environment. RuntimeError with its output if `up` fails."""
    env = dict(os.environ, NODES=str(nodes), LINK_RATE=link_rate)
    if burst_ms is not None:
        env["LINK_BURST_MS"] = str(burst_ms)
    up = subprocess.run([EMULATED_CLUSTER, "up"], env=env, capture_output=True, text=True, timeout=300)
    if up.returncode:
        subprocess.run([EMULATED_CLUSTER, "down"], env=env, capture_output=True, text=True, timeout=300)
        shaped = f"LINK_RATE={link_rate!r} LINK_BURST_MS={env.get('LINK_BURST_MS', 'default')}"
        raise RuntimeError(f"emulated_cluster.sh up (NODES={nodes}, {shaped}): {up.stdout}{up.stderr}")

    def terminated(signum, _):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield env
    finally:
        signal.signal(signal.SIGTERM, previous)
        subprocess.run([EMULATED_CLUSTER, "down"], env=env, capture_output=True, text=True, timeout=300)


# --------------------------------------------------------------------------------------------- reports


def now():
    """UTC now, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def provenance_lines(command, matmul, raw=None):
    """A report's first list items: the command, git SHA, date, machine (with `matmul`, this run's
    `matmul_rate()`) and, if any, where the raw data is (`raw`)."""
    lines = [
        f"- Command (from the repository root): `{command}`",
        f"- Git SHA: {sha_text(git_sha())}; date (UTC): {now()}",
        f"- Machine: {machine(matmul)}",
    ]
    if raw:
        lines.append(f"- Raw data: `{os.path.relpath(os.path.abspath(raw), REPO)}`")
    return lines


def data_path(report, ext=".json"):
    """Where the raw data of `report` goes (its folder made): results/NAME/NAME.json for a top report
    results/NAME.md, else beside the report."""
    folder, stem = os.path.split(os.path.splitext(os.path.abspath(report))[0])
    if folder == os.path.abspath(RESULTS):
        folder = os.path.join(folder, stem)
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, stem + ext)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, data, indent=1):
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)


def write_report(path, generated):
    """Writes `generated` (Markdown) to `path`, followed by the hand-written part of the file it replaces."""
    kept = ""
    if os.path.exists(path):
        with open(path) as f:
            previous = f.read()
        kept = previous[previous.find(HAND_WRITTEN) :] if HAND_WRITTEN in previous else ""
    with open(path, "w") as f:
        f.write(generated.rstrip("\n") + "\n" + ("\n" + kept if kept else ""))


def write_section(path, name, body, title="# Results"):
    """Rewrites section `name` of the Markdown file `path` (between `<!-- section: NAME -->` and
    `<!-- end: NAME -->`) with `body`, keeping the rest of the file (other sections, hand-written text);
    a new section is appended, a new file starts with `title`."""
    begin, end = f"<!-- section: {name} -->", f"<!-- end: {name} -->"
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = (text.rstrip() or title) + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


# ------------------------------------------------------------------------------ alpha-beta fits
# An allreduce of S bytes takes t = latency + bytes moved / bandwidth (Hockney's model; the ring allreduce of
# Patarasuk and Yuan, J. Parallel Distrib. Comput. 69(2), 2009, moves 2(p - 1)/p x S per rank in 2(p - 1)
# steps). Every fit minimises sum_i ((design_i . x - t_i) / t_i)^2, so that a 1 KiB allreduce of
# milliseconds weighs as much as a 64 MiB one of seconds. Sizes in bytes, times in s, bandwidths in bytes/s.


def fit(design, times):
    """The x minimising sum_i ((design_i . x - t_i) / t_i)^2 for an (n, k) design and n positive times,
    and each |design_i . x - t_i| / t_i; ValueError for fewer rows than unknowns, a shape mismatch or a
    time <= 0."""
    design, t = np.asarray(design, float), np.asarray(times, float)
    if design.ndim != 2 or design.shape[0] != t.shape[0] or design.shape[0] < design.shape[1]:
        raise ValueError(
            f"fit: design of shape {design.shape} and {t.shape[0]} times; one row per time and at least "
            f"as many rows as unknowns needed"
        )
    if not np.all(t > 0):
        raise ValueError(f"fit: times {t.tolist()}; every time must be positive (they weigh the residuals)")
    x, *_ = np.linalg.lstsq(design / t[:, None], np.ones_like(t), rcond=None)
    return x, np.abs(design @ x - t) / t


def alpha_beta(sizes, times):
    """t = alpha + S / B fitted to allreduces of `sizes` bytes that took `times` s: (alpha s, B bytes/s,
    the largest relative residual)."""
    sizes = np.asarray(sizes, float)
    (alpha, inverse_b), residual = fit(np.stack([np.ones_like(sizes), sizes], axis=1), times)
    return float(alpha), float(1 / inverse_b), float(np.max(residual))


def ring(p, sizes, times):
    """t = 2(p - 1) alpha + 2(p - 1)/p x S / B fitted to one p's allreduces: (alpha s per ring step,
    B bytes/s, the largest relative residual). Raises ValueError for fewer than 2 sizes, or a fitted alpha
    or 1/B that is not positive."""
    if len(sizes) < 2:
        raise ValueError(f"ring: {len(sizes)} size(s); 2 or more needed")
    steps = 2.0 * (p - 1)
    design = np.stack([np.full(len(sizes), steps), steps / p * np.asarray(sizes, float)], 1)
    (alpha, inverse_beta), residual = fit(design, times)
    if alpha <= 0 or inverse_beta <= 0:
        raise ValueError(f"ring: p={p}: fitted alpha={alpha:.3g} s, 1/beta={inverse_beta:.3g} s/B")
    return float(alpha), float(1.0 / inverse_beta), float(np.max(residual))


def ring_per_p(ps, sizes, times):
    """t = c_p + 2(p - 1)/p x S / B fitted to allreduces at several p at once (one entry per allreduce:
    ranks, bytes, s): ({p: c_p s}, 1/B s per byte, relative residuals in the order given). Raises
    ValueError, naming the p, for a fitted 1/B that is not positive."""
    p = np.asarray(ps, float)
    distinct = sorted(set(p.tolist()))
    latency_columns = [(p == q).astype(float) for q in distinct]
    design = np.stack(latency_columns + [2 * (p - 1) / p * np.asarray(sizes, float)], 1)
    x, residual = fit(design, times)
    if x[-1] <= 0:
        raise ValueError(f"ring_per_p: fitted 1/B = {x[-1]:.3g} s/B at p = {[int(q) for q in distinct]}")
    return {int(q): float(c) for q, c in zip(distinct, x[:-1])}, float(x[-1]), residual


def mlperf_lars(learning_rate=0.1):
    """LARS as the benchmarks train with it: momentum 0.9, weight decay 1e-4, batch-norm parameters and
    biases out of both the decay and the trust ratio (the MLPerf ResNet-50 recipe)."""
    from hvd_lars import LARS, mlperf_exclusions

    return LARS(
        learning_rate,
        momentum=0.9,
        weight_decay=1e-4,
        exclude_from_weight_decay=mlperf_exclusions(),
        exclude_from_layer_adaptation=mlperf_exclusions(),
    )


def main(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--matmul", type=int, default=0, help="worker: print the tf.matmul rate at this size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget_s", type=float, default=2.0, help="worker: seconds of timed products")
    parser.add_argument(
        "--machine_line", action="store_true", help="print only this machine's line (for install/*.sh)"
    )
    args = parser.parse_args(argv)
    if args.matmul:
        return _matmul_worker(args.matmul, args.repeats, args.budget_s)
    if not args.machine_line:
        print(json.dumps(cpu(), indent=1))
    print(machine(matmul_rate()))


if __name__ == "__main__":
    main()
