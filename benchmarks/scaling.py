"""Scale-out measurements for results/scaling.md, one section per command; each writes its raw figures to
results/scaling/<section>_<label>.json and rewrites its section from every JSON file of that section.

Section `overlap_compression`: the step of ResNet-50 and AlexNet-BN with grouped against overlapped
gradient allreduce, 1 rank per host on 1 core, beside the same batch's compute alone (exposed
communication = step - compute), and ResNet-50's gradients allreduced with and without float16 compression.
Section `threads`: 2 ranks x 1 thread against 1 rank x 2 threads at the same global batch.

    python -m benchmarks.scaling overlap_compression --link_rate=1gbit   # as root (and =10gbit)
    python -m benchmarks.scaling overlap_compression --local             # 2 ranks here, no root
    python -m benchmarks.scaling threads                                 # no root
    python -m benchmarks.scaling threads --report_only                   # the section from the JSON
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


def step_times(model, optimizer, data, snapshot=None):
    """Seconds of each of the TIMED_STEPS steps of `model.fit` after WARMUP_STEPS; `snapshot()` is called
    as the timed steps begin and as they end."""
    import keras

    stamps = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            if step == 0:
                stamps.append(time.perf_counter())
            if step == WARMUP_STEPS and snapshot:
                snapshot()

        def on_train_batch_end(self, step, logs=None):
            stamps.append(time.perf_counter())
            if step == WARMUP_STEPS + TIMED_STEPS - 1 and snapshot:
                snapshot()

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


def _machine(run):
    """`common.describe` of a run's record (older records: the CPU a string, no tf.matmul rate)."""
    return common.describe(run["cpu"], run.get("matmul"), run["provenance"]["machine"])


def overlap_compression(args):
    """Section `overlap_compression` (the module docstring)."""
    if args.report_only:
        return write_section("overlap_compression", _overlap_compression_markdown(), args.out)
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
    # communication (section `threads` measures the cost of Horovod's defaults).
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
    write_section("overlap_compression", _overlap_compression_markdown(), args.out)


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
        lines += [
            f"### {run['label']}: {run['link']}",
            "",
            f"`{run['command']}` at git {common.sha_text(prov['git_sha'])}, {prov['date']}; "
            f"{_machine(run)}; hosts: {run['hosts']}; precision {ranks['precision']}; Horovod "
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


def write_section(name, body, markdown=None):
    """Rewrites section `name` of results/scaling.md (or `markdown`), keeping the rest of the file."""
    markdown = markdown or MARKDOWN
    title = (
        "# Scale-out measurements\n\nEach section is written by `python -m benchmarks.scaling SECTION` "
        "(see its docstring); the command, git SHA, date and "
        "machine of every run stand beside its figures. Text outside the section markers is written by hand "
        "and kept when a section is rewritten."
    )
    common.write_section(markdown, name, body, title=title)
    print(f"[scaling] wrote section {name} of {markdown}", flush=True)


# ------------------------------------------------------------- section threads: 2 ranks x 1 vs 1 x 2

# ResNet-50 at a global batch of 32 images per step: the measurement of section `threads`.
THREADS_MODEL = "resnet50"
THREADS_GLOBAL_BATCH = 32


def _thread_cpu():
    """{thread id: (name, CPU seconds)} of this process's threads, from /proc/self/task."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (
            stat[stat.index("(") + 1 : stat.rindex(")")],
            (int(fields[11]) + int(fields[12])) / ticks,
        )
    return out


def _cpu_by_group(before, after, horovod_tids):
    """CPU seconds spent between two `_thread_cpu` snapshots, grouped: the main Python thread, the threads
    `hvd.init()` started (Horovod's background loop, MPI's progress threads), and the rest by name."""
    groups = {}
    for tid, (name, seconds) in after.items():
        spent = seconds - before.get(tid, (name, 0.0))[1]
        if tid == os.getpid():
            group = "main Python thread (Keras loop, op dispatch)"
        elif tid in horovod_tids:
            group = "Horovod background loop + MPI threads"
        else:
            group = name
        groups[group] = groups.get(group, 0.0) + spent
    return {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}


def worker_threads(role, out, core=0, batch=THREADS_GLOBAL_BATCH, inter_op=-1):
    """One process of section `threads` (world size 1, "compute", or a Horovod rank, "ranks"): ResNet-50's
    step times at `batch` with the main program's thread sizing (`inter_op` >= 0 overrides the inter-op
    pool), the threads TensorFlow applied and CPU seconds per thread group; rank 0 writes `out`."""
    if os.environ.get("HVD_LARS_BIND_LOCAL_RANK"):
        # horovodrun --gloo cannot bind: each rank binds itself to the core of its local rank.
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ["HOROVOD_LOCAL_RANK"]) % len(cores)]})
    import tensorflow as tf  # noqa: F401  (its own threads are not Horovod's)

    from hvd_lars.parallel import collectives

    before_init = set(_thread_cpu())
    rank, size = collectives.init() if role == "ranks" else (0, 1)
    horovod_tids = set(_thread_cpu()) - before_init if role == "ranks" else set()
    import keras

    from hvd_lars import DistributedOptimizer
    from hvd_lars.models import get_model
    from hvd_lars.training.config import TrainConfig, resolve_precision
    from hvd_lars.training.threads import applied_threads, configure_threads, placement

    configure_threads(TrainConfig(inter_op_threads=max(0, inter_op)), size)
    if inter_op == 0:
        tf.config.threading.set_inter_op_parallelism_threads(0)  # TensorFlow's default (the former setting)
    precision = resolve_precision("auto")
    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(0)
    model = get_model(THREADS_MODEL, input_shape=(224, 224, 3))
    data = synthetic_data(batch, 224)
    snapshots = []
    times = step_times(
        model, DistributedOptimizer(common.mlperf_lars()), data, lambda: snapshots.append(_thread_cpu())
    )
    result = {
        "role": role,
        "world_size": size,
        "batch": batch,
        "precision": precision,
        "placement": placement(),
        "threads": applied_threads(data),
        "horovod_env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
        "mca_env": {k: v for k, v in os.environ.items() if k.startswith("OMPI_MCA_")},
        "step_s": times,
        "cpu_s": _cpu_by_group(snapshots[0], snapshots[1], horovod_tids),
        "timed_wall_s": sum(times),
    }
    print(
        f"[scaling] {role} rank {rank}: {mean(times):.3f} s/step, CPU {result['cpu_s']}",
        flush=True,
    )
    results = collectives.gather_objects(result, name="scaling.threads") if size > 1 else [result]
    if rank == 0:
        common.write_json(out, {"ranks": results})


# name -> how the arm runs: "ranks" (mpirun, 2 ranks), or "compute" processes (world size 1) on "cores".
THREADS_ARMS = {
    "1 rank x 2 threads": {"role": "compute", "cores": ["0,1"], "batch": 32},
    "2 ranks x 1 thread, unbound, inter-op default (before)": {
        "role": "ranks", "bind": False, "inter_op": 0, "env": {}, "mca": {},
    },
    "2 ranks x 1 thread, bound (launch/mpirun.sh), Horovod defaults": {
        "role": "ranks", "bind": True, "env": {}, "mca": {},
    },
    "2 ranks x 1 thread, bound, 5 ms cycle, MPI yields": {
        "role": "ranks", "bind": True, "env": {"HOROVOD_CYCLE_TIME": "5"},
        "mca": {"mpi_yield_when_idle": "1"},
    },
    "2 ranks x 1 thread, bound, Gloo controller": {"role": "ranks", "gloo": True, "env": {}},
    "2 processes x 1 thread, batch 16 each, no Horovod": {
        "role": "compute", "cores": ["0", "1"], "batch": 16,
    },
    "1 rank x 2 threads, batch 16": {"role": "compute", "cores": ["0,1"], "batch": 16},
}  # fmt: skip
THREADS_BASELINE = "1 rank x 2 threads"


def _threads_arm(name, spec, me, env, scratch):
    out = os.path.join(scratch, f".threads_{abs(hash(name))}.json")
    worker = me + ["_worker", "threads", f"--role={spec['role']}"]
    if spec["role"] == "compute":
        outs = [f"{out}.{i}" for i in range(len(spec["cores"]))]
        commands = [
            ["taskset", "-c", cores, *worker, f"--batch={spec['batch']}", f"--out={o}"]
            for cores, o in zip(spec["cores"], outs)
        ]
        _run(*commands, env=env)
    else:
        outs = [out]
        worker += [f"--batch={THREADS_GLOBAL_BATCH // 2}", f"--out={out}"]
        if spec.get("gloo"):
            launcher = [common.HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2"]
            env = dict(env, HVD_LARS_BIND_LOCAL_RANK="1", **spec["env"])
        else:
            launcher = ["mpirun", "-np", "2", "-H", "localhost:2", "--tag-output"]
            launcher += ["--map-by", "core", "--bind-to", "core"] if spec["bind"] else ["--bind-to", "none"]
            for key, value in spec["mca"].items():
                launcher += ["-mca", key, value]
            env = dict(env, **spec["env"])
            for variable in ["PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", *spec["env"]]:
                launcher += ["-x", variable]
            worker += [f"--inter_op={spec.get('inter_op', -1)}"]
        _run(launcher + worker, env=env)
    runs = [process for o in outs for process in common.read_json(o)["ranks"]]
    for o in outs:
        os.remove(o)
    return {"processes": runs}


def threads(args):
    """Section `threads`: 2 ranks x 1 thread against 1 rank x 2 threads at the same global batch;
    the baseline is measured before, between and after the other arms."""
    raw = os.path.join(RAW_DIR, "threads_local.json")
    if args.report_only:
        return write_section("threads", _threads_markdown(common.read_json(raw)), args.out)
    from hvd_lars.training import epoch_logs

    os.makedirs(RAW_DIR, exist_ok=True)
    me = common.worker_command("scaling")
    env = common.worker_env()
    started = time.time()
    names = [n for n in THREADS_ARMS if n != THREADS_BASELINE]
    order = [THREADS_BASELINE]
    for i, name in enumerate(names):
        order.append(name)
        if i % 2 == 1 or i == len(names) - 1:
            order.append(THREADS_BASELINE)
    runs = []
    for name in order:
        try:
            runs.append({"arm": name, **_threads_arm(name, THREADS_ARMS[name], me, env, RAW_DIR)})
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # one failed arm does not void the others
            print(f"[scaling] {name} failed: {str(e)[-2000:]}", flush=True)
    record = {
        "section": "threads",
        "label": "local",
        "command": common.command_line("scaling", args.argv),
        "provenance": epoch_logs.provenance(),
        "cpu": common.cpu(),
        "matmul": common.matmul_rate(),
        "model": THREADS_MODEL,
        "global_batch": THREADS_GLOBAL_BATCH,
        "warmup_steps": WARMUP_STEPS,
        "timed_steps": TIMED_STEPS,
        "arms": {n: {k: v for k, v in s.items()} for n, s in THREADS_ARMS.items()},
        "wall_time_s": round(time.time() - started),
        "runs": runs,
    }
    common.write_json(raw, record)
    write_section("threads", _threads_markdown(record), args.out)


def _threads_rates(record):
    """Per run: global images/s (the ranks' batches over rank 0's mean step; for separate processes the
    sum of their rates), in run order."""
    rates = []
    for run in record["runs"]:
        procs = run["processes"]
        if procs[0]["role"] == "ranks":
            rate = sum(p["batch"] for p in procs) / mean(procs[0]["step_s"])
        else:
            rate = sum(p["batch"] / mean(p["step_s"]) for p in procs)
        rates.append(rate)
    return rates


def _threads_markdown(record):
    prov = record["provenance"]
    rates = _threads_rates(record)
    runs = record["runs"]
    baseline_at = [i for i, r in enumerate(runs) if r["arm"] == THREADS_BASELINE]
    lines = [
        "## 2 ranks x 1 thread against 1 rank x 2 threads",
        "",
        f"`{record['command']}` at git {common.sha_text(prov['git_sha'])}, {prov['date']}; "
        f"{_machine(record)}; TensorFlow {prov['tensorflow']}, Horovod {prov['horovod']}; whole run "
        f"{record['wall_time_s']} s. Raw figures: `results/scaling/threads_local.json`.",
        "",
        f"ResNet-50 (224x224, {runs[0]['processes'][0]['precision']}, synthetic data) trained by `model.fit`",
        "with `hvd_lars.DistributedOptimizer(LARS)` (overlapped allreduce) at a global batch of "
        f"{record['global_batch']} images per step,",
        "each process sized by the main program's `hvd_lars.training.threads.configure_threads` (the CPUs it "
        "may use);",
        f"{record['warmup_steps']} warm-up then {record['timed_steps']} timed steps per run. Ranks are",
        "started by `mpirun -np 2` (bound: `--map-by core --bind-to core`, as `launch/mpirun.sh` and",
        "`launch/horovodrun.sh` place them); world-size-1 processes by `taskset`. The baseline runs before,",
        "between and after the others; each ratio is against the mean of the baselines just before and after",
        "it. *CPU s per step* is CPU time over the timed steps from /proc/<pid>/task, per thread group, of",
        "rank 0 (or the first process); Horovod + MPI = the threads `hvd.init()` started.",
        "",
        "| run | configuration | threads (intra / inter, read back) | CPUs | images/s | vs baseline "
        "| step s (min-max) | CPU s per step: compute pool / Python / Horovod + MPI |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (run, rate) in enumerate(zip(runs, rates)):
        before = max([j for j in baseline_at if j < i] or [baseline_at[0]])
        after = min([j for j in baseline_at if j > i] or [baseline_at[-1]])
        base = mean({rates[before], rates[after]}) if run["arm"] != THREADS_BASELINE else None
        first = run["processes"][0]
        steps = first["step_s"]
        timed = len(steps)
        cpu = first["cpu_s"]
        pool = sum(v for k, v in cpu.items() if k.startswith("tf_")) / timed
        python = sum(v for k, v in cpu.items() if k.startswith("main Python")) / timed
        horovod = sum(v for k, v in cpu.items() if k.startswith("Horovod")) / timed
        threads = first["threads"]
        cores = "; ".join(",".join(map(str, p["placement"]["cores"])) for p in run["processes"])
        lines.append(
            f"| {i + 1} | {run['arm']} | {threads['intra_op']} / {threads['inter_op']} | {cores} "
            f"| {rate:.2f} | {'' if base is None else f'{rate / base:.2f}'} | {mean(steps):.2f} "
            f"({min(steps):.2f}-{max(steps):.2f}) | {pool:.2f} / {python:.2f} / {horovod:.2f} |"
        )
    return "\n".join(lines)


SECTIONS = {"overlap_compression": overlap_compression, "threads": threads}
WORKERS = {"overlap_compression": worker_overlap_compression, "threads": worker_threads}


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "_worker":
        parser = argparse.ArgumentParser()
        parser.add_argument("section", choices=sorted(WORKERS))
        parser.add_argument("--role", choices=("compute", "ranks"), required=True)
        parser.add_argument("--out", required=True)
        parser.add_argument("--core", type=int, default=0)
        parser.add_argument("--batch", type=int, default=THREADS_GLOBAL_BATCH)
        parser.add_argument("--inter_op", type=int, default=-1)
        args = parser.parse_args(argv[1:])
        if args.section == "threads":
            return worker_threads(args.role, args.out, batch=args.batch, inter_op=args.inter_op)
        return WORKERS[args.section](args.role, args.out, args.core)
    parser = common.argument_parser(__doc__)
    parser.add_argument("section", choices=sorted(SECTIONS))
    parser.add_argument("--link_rate", default="1gbit", help="tc rate of each emulated host's link")
    parser.add_argument("--local", action="store_true", help="2 ranks on this host, no emulated cluster")
    parser.add_argument("--cycle_time_ms", type=float, default=5.0, help="HOROVOD_CYCLE_TIME of the ranks")
    parser.add_argument("--report_only", action="store_true", help="the section from its JSON files")
    parser.add_argument("--out", default=MARKDOWN, help="the markdown file whose section is rewritten")
    args = parser.parse_args(argv)
    args.argv = argv
    if not args.local and not re.fullmatch(r"[0-9.]+(bit|kbit|mbit|gbit|tbit)", args.link_rate):
        parser.error(f"--link_rate={args.link_rate!r}: expected a tc rate such as 1gbit or 10gbit.")
    SECTIONS[args.section](args)


if __name__ == "__main__":
    main()
