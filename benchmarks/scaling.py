"""Section `overlap_compression` of results/scaling.md: the step of ResNet-50 and AlexNet-BN with grouped
against overlapped gradient allreduce, 1 rank per host on 1 core, beside the same batch's compute alone
(exposed communication = step - compute), and ResNet-50's gradients allreduced with and without float16
compression. Each run writes results/scaling/overlap_compression_<label>.json and rewrites the section from
every such file.

    python -m benchmarks.scaling overlap_compression --link_rate=1gbit   # as root (and =10gbit)
    python -m benchmarks.scaling overlap_compression --local             # 2 ranks here, no root
    python -m benchmarks.scaling overlap_compression --report_only       # the section from the JSON
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from statistics import mean

from benchmarks import common

REPO = common.REPO
RAW_DIR = os.path.join(common.RESULTS, "scaling")
MARKDOWN = os.path.join(common.RESULTS, "scaling.md")
CLUSTER_SUBNET = "198.18.0.0/24"  # launch/emulated_cluster.sh's bridge network

# Per-rank batches small enough that a run of both models, both modes and both link rates stays within
# minutes on one core per rank, large enough that compute is of the order of the 1 Gbit/s allreduce.
MODELS = {
    "resnet50": {"image_size": 224, "per_rank_batch": 8},
    "alexnet_bn": {"image_size": 227, "per_rank_batch": 16},
}
WARMUP_STEPS = 3  # tracing, first allocations, Horovod's first negotiations
TIMED_STEPS = 10


# ------------------------------------------------------------------------------------------- the worker


def synthetic_data(batch, image_size):
    """One fixed batch of `batch` random images and labels (1,000 classes), repeated."""
    import tensorflow as tf

    shape = (batch, image_size, image_size, 3)
    images = tf.random.stateless_uniform(shape, seed=(1, 2))
    labels = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=1000, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


def step_times(model, optimizer, data):
    """Seconds of each of the TIMED_STEPS steps of `model.fit` after WARMUP_STEPS."""
    import keras

    stamps = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            if step == 0:
                stamps.append(time.perf_counter())

        def on_train_batch_end(self, step, logs=None):
            stamps.append(time.perf_counter())

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    model.fit(data, epochs=1, steps_per_epoch=WARMUP_STEPS + TIMED_STEPS, verbose=0, callbacks=[Stamp()])
    return [b - a for a, b in zip(stamps, stamps[1:])][WARMUP_STEPS:]


def worker_overlap_compression(role, out, core=0):
    """Runs on every rank ("ranks") or as one process of world size 1 on core `core` ("compute"); rank 0
    writes the JSON `out`."""
    # One core per rank, as one rank per host of a 1-core cluster; pinned before Horovod starts its
    # background thread, which then shares the rank's core.
    core = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) if role == "ranks" else core
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[core % len(cores)]})
    from hvd_lars.parallel import collectives

    if role == "ranks":
        rank, size = collectives.init()
    else:
        rank, size = 0, 1
    import keras
    import tensorflow as tf

    from hvd_lars import DistributedOptimizer
    from hvd_lars.models import get_model
    from hvd_lars.training.config import resolve_precision

    precision = resolve_precision("auto")
    keras.mixed_precision.set_global_policy(precision)
    result = {
        "role": role,
        "world_size": size,
        "precision": precision,
        "hostname": os.uname().nodename,
        "cores": sorted(os.sched_getaffinity(0)),
        "horovod_env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
        "models": {},
    }
    modes = ("grouped", "overlap") if role == "ranks" else ("compute",)
    for name, spec in MODELS.items():
        keras.utils.set_random_seed(0)
        model = get_model(name, input_shape=(spec["image_size"], spec["image_size"], 3))
        batch = spec["per_rank_batch"]
        data = synthetic_data(batch, spec["image_size"])
        entry = {"per_rank_batch": batch, "image_size": spec["image_size"], "modes": {}}
        entry["parameters"] = int(sum(int(tf.size(v)) for v in model.trainable_variables))
        entry["tensors"] = len(model.trainable_variables)
        for mode in modes:
            reduction = "grouped" if mode == "compute" else mode
            optimizer = DistributedOptimizer(common.mlperf_lars(), gradient_reduction=reduction)
            entry["modes"][mode] = times = step_times(model, optimizer, data)
            if rank == 0:
                print(f"[scaling] {name} {mode}: {mean(times):.3f} s/step", flush=True)
        result["models"][name] = entry
        del model
        keras.backend.clear_session()

    if role == "ranks":
        result["allreduce"] = _allreduce_times(get_model, tf)
    if rank == 0:
        common.write_json(out, result)


def _allreduce_times(get_model, tf):
    """Seconds to average ResNet-50's gradient tensors over the ranks, per compression (grouped)."""
    from hvd_lars.parallel import collectives

    shapes = [v.shape for v in get_model("resnet50", input_shape=(224, 224, 3)).trainable_variables]
    grads = [tf.random.stateless_normal(s, seed=(i, 7)) * 1e-3 for i, s in enumerate(shapes)]
    out = {"values": int(sum(int(tf.size(g)) for g in grads))}
    for compression in ("none", "fp16"):

        @tf.function
        def reduce(gs, c=compression):
            return collectives.allreduce_gradients(gs, reduction="grouped", compression=c)

        times = []
        for _ in range(WARMUP_STEPS + TIMED_STEPS):
            start = time.perf_counter()
            reduced = reduce(grads)
            reduced[-1].numpy()  # wait for the result
            times.append(time.perf_counter() - start)
        out[compression] = times[WARMUP_STEPS:]
        if collectives.rank() == 0:
            print(f"[scaling] allreduce {compression}: {mean(out[compression]):.3f} s", flush=True)
    return out


# ------------------------------------------------------------------------------------- the orchestrator


def _run(*commands, env, timeout=1200):
    """Runs `commands` at once from the repository root, echoing their "[scaling]" lines; RuntimeError
    with the last 40 lines of one that fails."""
    print(f"[scaling] $ {len(commands)} at once: {shlex.join(commands[0])}", flush=True)
    procs = [
        subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, output in zip(procs, outputs):
        print("\n".join("   " + line for line in output.splitlines() if "[scaling]" in line), flush=True)
        if p.returncode:
            raise RuntimeError(f"{p.args[0]} exited {p.returncode}:\n" + "\n".join(output.splitlines()[-40:]))


def overlap_compression(args):
    """Section `overlap_compression` (the module docstring)."""
    if args.report_only:
        return write_section(args.out)
    from hvd_lars.training import epoch_logs

    label = "local" if args.local else args.link_rate
    os.makedirs(RAW_DIR, exist_ok=True)
    compute_json = os.path.join(RAW_DIR, f".overlap_compression_{label}_compute.json")
    busy_json = os.path.join(RAW_DIR, f".overlap_compression_{label}_busy.json")
    ranks_json = os.path.join(RAW_DIR, f".overlap_compression_{label}_ranks.json")
    me = common.worker_command("scaling")
    worker = me + ["_worker", "overlap_compression", "--role=compute"]
    env = common.worker_env()
    started = time.time()
    # 1. Compute alone: one process of world size 1 on rank 0's core, the other core idle.
    _run(worker + ["--core=0", f"--out={compute_json}"], env=env)
    # 2. Compute with both cores busy: two such processes at once, one per core, as the two ranks load
    # this one machine (memory bandwidth, shared cache), but without communication.
    busy_workers = [
        worker + [f"--core={c}", f"--out={busy_json}{suffix}"] for c, suffix in ((0, ""), (1, ".1"))
    ]
    _run(*busy_workers, env=env)
    # 3. Two ranks, one per host. Each shares its core with Horovod's background thread, which negotiates
    # every cycle in blocking MPI calls: a 5 ms cycle and MPI yielding keep the step about training and
    # communication (results/archive/scaling_threads.md measures the cost of Horovod's defaults).
    env["HOROVOD_CYCLE_TIME"] = str(args.cycle_time_ms)
    mpirun = ["mpirun", "-np", "2", "--bind-to", "none", "--tag-output", "-mca", "mpi_yield_when_idle", "1"]
    mpirun += ["-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "HOROVOD_CYCLE_TIME"]
    ranks_worker = me + ["_worker", "overlap_compression", "--role=ranks", f"--out={ranks_json}"]
    if args.local:
        hosts, link = "localhost (2 ranks, unshaped loopback)", "loopback (not shaped)"
        _run(mpirun + ["-H", "localhost:2"] + ranks_worker, env=env)
    else:
        hosts = "node1, node2 (launch/emulated_cluster.sh, 1 rank each)"
        with common.emulated_cluster(2, args.link_rate) as cluster_env:
            status = [common.EMULATED_CLUSTER, "status"]
            status = subprocess.run(
                status, env=cluster_env, capture_output=True, text=True, timeout=60
            ).stdout
            mca = ["-mca", "btl_tcp_if_include", CLUSTER_SUBNET, "-mca", "oob_tcp_if_include", CLUSTER_SUBNET]
            _run(mpirun + mca + ["-H", "node1:1,node2:1"] + ranks_worker, env=env)
        shaped = re.findall(r"rate ([0-9.]+[kmgt]?bit)", status)
        link = f"veth pair per host, tc tbf {args.link_rate} each way"
        if shaped:
            link += f" (tc reports {shaped[0]})"
    compute, busy, ranks = (common.read_json(path) for path in (compute_json, busy_json, ranks_json))
    record = {
        "section": "overlap_compression",
        "label": label,
        "command": common.command_line("scaling", args.argv),
        "provenance": epoch_logs.provenance(),
        "cpu": common.cpu(),
        "matmul": common.matmul_rate(),
        "hosts": hosts,
        "link": link,
        "horovod_settings": f"HOROVOD_CYCLE_TIME={args.cycle_time_ms} ms, Open MPI mpi_yield_when_idle=1",
        "wall_time_s": round(time.time() - started),
        "compute": compute,
        "compute_both_cores_busy": busy,
        "ranks": ranks,
    }
    common.write_json(os.path.join(RAW_DIR, f"overlap_compression_{label}.json"), record)
    for path in (compute_json, busy_json, busy_json + ".1", ranks_json):
        os.remove(path)
    write_section(args.out)


def write_section(markdown):
    """Rewrites section `overlap_compression` of `markdown` from every run's JSON, keeping the rest."""
    body = _overlap_compression_markdown()
    common.write_section(markdown, "overlap_compression", body, title="# Scale-out measurements")
    print(f"[scaling] wrote section overlap_compression of {markdown}", flush=True)


def _overlap_compression_markdown():
    names = sorted(
        n for n in os.listdir(RAW_DIR) if n.startswith("overlap_compression_") and n.endswith(".json")
    )
    runs = [common.read_json(os.path.join(RAW_DIR, n)) for n in names]
    order = {"1gbit": 0, "10gbit": 1, "local": 2}
    runs.sort(key=lambda r: order.get(r["label"], 3))
    lines = []
    for run in runs:
        prov, ranks, compute = run["provenance"], run["ranks"], run["compute"]
        machine = common.describe(run["cpu"], run.get("matmul"), prov["machine"])
        lines += [
            f"### {run['label']}: {run['link']}",
            "",
            f"`{run['command']}` at git {common.sha_text(prov['git_sha'])}, {prov['date']}; "
            f"{machine}; hosts: {run['hosts']}; precision {ranks['precision']}; Horovod "
            f"{prov['horovod']}, TensorFlow {prov['tensorflow']}; {run['horovod_settings']}; whole run "
            f"{run['wall_time_s']} s.",
            "",
            "| model (parameters) | per-rank batch | compute alone | compute, both busy | grouped "
            "| overlap | exposed grouped | exposed overlap | overlap / grouped |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        busy = run["compute_both_cores_busy"]
        for name, entry in ranks["models"].items():
            alone = mean(compute["models"][name]["modes"]["compute"])
            c = mean(busy["models"][name]["modes"]["compute"])
            g, o = entry["modes"]["grouped"], entry["modes"]["overlap"]
            lines.append(
                f"| {name} ({entry['parameters'] / 1e6:.1f}M) | {entry['per_rank_batch']} | {alone:.3f} "
                f"| {c:.3f} | {mean(g):.3f} [{min(g):.3f}-{max(g):.3f}] "
                f"| {mean(o):.3f} [{min(o):.3f}-{max(o):.3f}] | {mean(g) - c:.3f} | {mean(o) - c:.3f} "
                f"| {mean(o) / mean(g):.2f} |"
            )
        lines += ["", "Seconds per step (mean of the timed steps)."]
        reduce = ranks["allreduce"]
        values = reduce["values"]
        none, fp16 = mean(reduce["none"]), mean(reduce["fp16"])
        # Ring allreduce: each rank sends 2 (N-1)/N of the buffer.
        factor = 2 * (ranks["world_size"] - 1) / ranks["world_size"]
        lines += [
            "",
            f"Allreduce of ResNet-50's gradients ({values / 1e6:.1f}M values, grouped, 10 timed after 3):",
            "",
            "| compression | bytes per rank | seconds | sent per rank per second | fp16 / none |",
            "|---|---|---|---|---|",
            f"| none (float32) | {4 * values / 1e6:.0f} MB | {none:.3f} "
            f"| {factor * 4 * values / none / 1e6:.0f} MB/s | |",
            f"| fp16 | {2 * values / 1e6:.0f} MB | {fp16:.3f} | {factor * 2 * values / fp16 / 1e6:.0f} MB/s "
            f"| {fp16 / none:.2f} |",
            "",
        ]
    return "\n".join(lines)


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "_worker":
        parser = argparse.ArgumentParser()
        parser.add_argument("section", choices=["overlap_compression"])
        parser.add_argument("--role", choices=("compute", "ranks"), required=True)
        parser.add_argument("--out", required=True)
        parser.add_argument("--core", type=int, default=0)
        args = parser.parse_args(argv[1:])
        return worker_overlap_compression(args.role, args.out, args.core)
    parser = common.argument_parser(__doc__)
    parser.add_argument("section", choices=["overlap_compression"])
    parser.add_argument("--link_rate", default="1gbit", help="tc rate of each emulated host's link")
    parser.add_argument("--local", action="store_true", help="2 ranks on this host, no emulated cluster")
    parser.add_argument("--cycle_time_ms", type=float, default=5.0, help="HOROVOD_CYCLE_TIME of the ranks")
    parser.add_argument("--report_only", action="store_true", help="the section from its JSON files")
    parser.add_argument("--out", default=MARKDOWN, help="the markdown file whose section is rewritten")
    args = parser.parse_args(argv)
    args.argv = argv
    if not args.local and not re.fullmatch(r"[0-9.]+(bit|kbit|mbit|gbit|tbit)", args.link_rate):
        parser.error(f"--link_rate={args.link_rate!r}: expected a tc rate such as 1gbit or 10gbit.")
    overlap_compression(args)


if __name__ == "__main__":
    main()
