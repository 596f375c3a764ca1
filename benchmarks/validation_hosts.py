"""The time-to-train model's step time, predicted against measured at p = 2, 4 and 8 emulated hosts.

benchmarks/time_to_train.py predicts a step as compute + the allreduce not hidden behind backprop (its
eqs. 1, 4, 5). Its own validation ran on 2 hosts only, where the ring's 2(p - 1)/p is 1. This one runs
the same check at 1 rank per host on p = 2, 4 and 8 hosts, for one model and per-rank batch:

  compute     the training step of p processes of world size 1 at once, pinned as the ranks are (rank r
              on core r mod 2), so the cores are as loaded as in training but nothing is communicated;
              their timed steps overlap (each waits for all to be warm, and steps on until all are done)
  allreduce   eq. (4) with this p's own fit, t = 2(p - 1) alpha + 2(p - 1)/p x n / beta, made by
              benchmarks.allreduce_hosts' fit of allreduces of 1 KiB-16 MiB at this link rate, launched
              here in the same run (the main program's settings, `main`)
  measured    `horovodrun -np p -H node1:1,...` of the same step with hvd_lars.DistributedOptimizer(LARS),
              gradients grouped (one allreduce after backprop) and overlapped (one per gradient)
  predicted   grouped: compute + allreduce; overlapped: compute + max(0, allreduce - overlap x 2/3 x
              compute), with time_to_train's overlap share as calibrated (ResNet-50 on 2 hosts at 1 Gbit/s;
              nothing is fitted to these runs)
  predicted, overlap on idle cores: the same, but backprop is hidden only on the share of the cores the
              allreduce leaves idle: hidden = overlap x 2/3 x compute x (1 - b / cores), b the cores the
              grouped allreduce keeps busy by itself (host-wide CPU seconds of /proc/stat over its wall
              time: the ranks' MPI progress, Horovod's threads and the kernel's TCP and link forwarding,
              all on this machine's cores in the emulation); on a cluster a rank's network work has cores
              and NICs of its own
  beside them, not used by the model: the compute of the p Horovod ranks stepping unreduced ("unreduced":
              does Horovod's background thread slow the step?) and the grouped allreduce of the model's
              gradient tensors with no compute ("reduce_only": does the real tensor list take eq. 4's time?
              how many cores does it keep busy?), and the grouped step taken in its three parts on every
              rank (compute, allreduce, update, each a tf.function waited for: "split"), which places a
              step's excess over its parts in one of them

The model is CIFAR ResNet-20 (`resnet20`, 32x32x3, per-rank batch 32, float32):
59 gradient tensors from convolutions and batch norm as ResNet-50's 161 are, 8 copies of its step fit in
these 2 cores' memory and time, and at the link rate chosen for the CPU at hand (--link_rate=auto: 80-140
Mbit/s on this project's Xeons) its 1.03 MiB of gradients take about as long to average
as its step to compute (about 1:1 at p = 2, up to 2-3:1 at p = 8, where 4 ranks share each core), as
ResNet-50's and AlexNet-BN's do at the paper's per-socket batch on Omni-Path (results/time_to_train.md).

    python -m benchmarks.validation_hosts        # as root, the machine to itself; results/validation_hosts.md

Its raw data goes to results/validation_hosts/validation_hosts.json (common.data_path of --out); a run kept
beside the current one (another CPU, link rate or fit) goes into results/validation_hosts/, and
results/validation_hosts.md links it.
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import allreduce_hosts, common, scaling

MODEL, IMAGE_SIZE, CLASSES = "resnet20", 32, 10
# The link rate: "auto" (the default) picks it on the CPU at hand, since compute is what differs between
# CPUs (0.118 s per step at p = 2 on one Xeon, 0.092 s on another, where a fixed 80 Mbit/s gave 0.74 : 1,
# outside the 1:1 to 3:1 aimed at): the rate, to 10 Mbit/s, at which eq. 4's ring term at the smallest p,
# 2(p - 1)/p x n at 0.9 x the link, takes compute / AUTO_RATIO, compute measured first (before the hosts
# are up) at that p. With 1.1 there, p = 8's compute : allreduce (4 ranks per core, eq. 4's growth) stays
# under 3 : 1. A larger per-rank batch does not raise the ratio instead: batch 48 took 0.148 s of compute
# at p = 2 against batch 32's 0.143 s (ResNet-20's step at this size is mostly per-op cost).
PER_RANK_BATCH, LINK_RATE, AUTO_RATIO = 32, "auto", 1.1
# A process's first 15-20 s of steps ran up to 5x slower here (the first model's grouped steps at 2 local
# ranks: 1.2-1.5 s against 0.25 s once warm, in either mode), so every mode warms up for 10 steps.
# Medians of 30 timed steps: with 10 and their means, two runs of the same command differed by up to 18%
# in one p's measured step (one slow step of 2x in ten moves a mean by a tenth).
WARMUP_STEPS, TIMED_STEPS = 10, 30
# Eq. 4's fit: alpha from 1 KiB, beta from 4 and 16 MiB. Each timed allreduce follows a barrier, so the
# emulated link's token bucket (LINK_BURST_MS, 175 KB at 140 Mbit/s with 10 ms) is full when it starts and
# passes that much at memory speed, which a real link does not: with 256 KiB and 1 MiB in the fit, beta
# came out 1.33-1.38x the link's payload rate at p = 2 (results/validation_hosts/earlier/
# amd_epyc_family26_140mbit_fit_from_256kib*.md; results/validation_hosts/allreduce_p2_140mbit_bucket_*.md).
# From 4 MiB
# the bucket is at most about 5% of an allreduce (p = 2, 160 Mbit/s), less at larger p and for 16 MiB.
FIT_SIZES_MIB = "0.0009765625,4,16"
ERROR_GOAL = 0.15
CORES = os.cpu_count()  # every emulated host's ranks share this machine's cores
# What each worker role times ("reduce_only" times its allreduce outside these modes), and the steps an
# "unreduced" rank takes past its timed ones, so that each timed step has all p ranks busy.
ROLE_MODES = {
    "compute": ("grouped",),
    "ranks": ("grouped", "overlap"),
    "unreduced": ("grouped",),
    "reduce_only": (),
    "split": (),
}
UNREDUCED_EXTRA_STEPS = 5


def worker(role, out, core, batch):
    """role "compute": world size 1 on `core`; role "ranks": one Horovod rank, on core rank mod 2, set up
    as the main program sets a rank (threads.apply_horovod_cpu_defaults before Horovod starts); role
    "unreduced": such a rank stepping with the plain LARS optimizer, its gradients never reduced, while
    Horovod's background thread cycles beside it as in training; role "reduce_only": such a rank reducing
    tensors of the model's gradients' shapes as the grouped step reduces them (one grouped allreduce,
    `collectives.allreduce_gradients`), with no compute: what the step's allreduce takes by itself; role
    "split": such a rank taking the grouped step in its three parts, each a tf.function waited for before
    the next starts (`split_step_times`)."""
    from hvd_lars.training import threads

    if role != "compute":
        core = int(os.environ["OMPI_COMM_WORLD_RANK"])
        threads.apply_horovod_cpu_defaults()
    scaling.pin_to_core(core)
    import keras
    import tensorflow as tf

    from hvd_lars import DistributedOptimizer
    from hvd_lars.models import get_model
    from hvd_lars.parallel import collectives

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank, size = collectives.init() if role != "compute" else (0, 1)
    shape = (IMAGE_SIZE, IMAGE_SIZE, 3)
    images = tf.random.stateless_uniform((batch, *shape), seed=(1, 2))
    labels = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=CLASSES, dtype=tf.int32)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    result = {"role": role, "world_size": size, "host": os.uname().nodename, "modes": {}}
    if role == "reduce_only":
        model = get_model(MODEL, num_classes=CLASSES, input_shape=shape)
        grads = [tf.ones_like(v) * 1e-3 for v in model.trainable_variables]

        @tf.function
        def reduce_step():
            return collectives.allreduce_gradients(grads, reduction="grouped")[0][..., :1]

        stamps, cpu = [], {}
        for step in range(WARMUP_STEPS + TIMED_STEPS):
            if step == WARMUP_STEPS:
                cpu["start"] = host_cpu_seconds()
            stamps.append(time.perf_counter())
            reduce_step().numpy()
        stamps.append(time.perf_counter())
        cpu["end"] = host_cpu_seconds()
        result["modes"]["grouped"] = [b - a for a, b in zip(stamps, stamps[1:])][WARMUP_STEPS:]
        wall = stamps[-1] - stamps[WARMUP_STEPS]
        result["busy_cores"] = {k: (cpu["end"][k] - cpu["start"][k]) / wall for k in ("user", "kernel")}
        result["gradient_bytes"] = _float32_bytes(model.trainable_variables)
        result["tensors"] = len(model.trainable_variables)
    if role == "split":
        per_rank = collectives.gather_objects(split_step_times(images, labels), "validation_hosts.split")
        result["split"] = per_rank
    for mode in ROLE_MODES[role]:
        keras.utils.set_random_seed(0)
        model = get_model(MODEL, num_classes=CLASSES, input_shape=shape)
        if role == "unreduced":  # the plain LARS: nothing reduced
            optimizer = common.mlperf_lars()
        else:
            optimizer = DistributedOptimizer(common.mlperf_lars(), gradient_reduction=mode)
        if role == "compute":
            result["modes"][mode] = busy_step_times(model, optimizer, data, os.path.dirname(out), core)
        elif role == "unreduced":
            # They start together (collectives.init waits for all).
            steps = WARMUP_STEPS + TIMED_STEPS + UNREDUCED_EXTRA_STEPS
            times = scaling.step_times(model, optimizer, data, steps)
            result["modes"][mode] = times[WARMUP_STEPS : WARMUP_STEPS + TIMED_STEPS]
            per_rank = collectives.gather_objects(result["modes"][mode], "validation_hosts.unreduced")
            result["modes"][mode] = [t for ts in per_rank for t in ts]
        else:
            result["modes"][mode] = scaling.step_times(model, optimizer, data, WARMUP_STEPS + TIMED_STEPS)[
                WARMUP_STEPS:
            ]
        result["gradient_bytes"] = _float32_bytes(model.trainable_variables)
        result["tensors"] = len(model.trainable_variables)
        keras.backend.clear_session()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def split_step_times(images, labels):
    """This rank's grouped step in three parts, each a tf.function whose result is waited for before the
    next starts: "compute" (forward and backprop: the gradients), "allreduce" (their grouped allreduce,
    `collectives.allreduce_gradients`) and "update" (LARS applying the averaged gradients). The step of
    the model's "measured" row does the same work in one tf.function.

    Returns:
        {"compute": [s], "allreduce": [s], "update": [s]}, TIMED_STEPS values each (after WARMUP_STEPS).
        A rank that finishes its compute first waits for the others inside its "allreduce", so the
        allreduce proper of step k is the smallest of the ranks' k-th "allreduce" values.
    """
    import keras
    import tensorflow as tf

    from hvd_lars.models import get_model
    from hvd_lars.parallel import collectives

    keras.utils.set_random_seed(0)
    model = get_model(MODEL, num_classes=CLASSES, input_shape=tuple(images.shape[1:]))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = common.mlperf_lars()
    optimizer.build(model.trainable_variables)

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            value = loss(labels, model(images, training=True))
        return tape.gradient(value, model.trainable_variables)

    @tf.function
    def allreduce(grads):
        return collectives.allreduce_gradients(grads, reduction="grouped")

    @tf.function
    def update(grads):
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    parts = {"compute": [], "allreduce": [], "update": []}
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        start = time.perf_counter()
        grads = gradients()
        grads[-1].numpy()
        computed = time.perf_counter()
        grads = allreduce(grads)
        grads[-1].numpy()
        reduced = time.perf_counter()
        update(grads)
        model.trainable_variables[-1].numpy()
        if step >= WARMUP_STEPS:
            parts["compute"].append(computed - start)
            parts["allreduce"].append(reduced - computed)
            parts["update"].append(time.perf_counter() - reduced)
    return parts


def split_parts(per_rank):
    """Medians of `split_step_times` of every rank (rank order), step by step: {"compute": the slowest
    rank's, "allreduce": the fastest rank's (the allreduce proper), "update": every rank's, "step": rank 0's
    three parts together}, in seconds."""
    steps = range(len(per_rank[0]["compute"]))
    return {
        "compute": statistics.median(max(r["compute"][k] for r in per_rank) for k in steps),
        "allreduce": statistics.median(min(r["allreduce"][k] for r in per_rank) for k in steps),
        "update": statistics.median(u for r in per_rank for u in r["update"]),
        "step": statistics.median(sum(per_rank[0][part][k] for part in ("compute", "allreduce", "update"))
                                  for k in steps),
    }  # fmt: skip


def busy_step_times(model, optimizer, data, scratch, me, timeout_s=1200):
    """TIMED_STEPS step times of one of the compute processes, all of whose timed steps overlap.

    The processes start at different times (imports, tracing), so each, after WARMUP_STEPS, writes
    `ready.<me>` in `scratch` and waits until every process's is there (their number: `count`), times its
    steps, writes `done.<me>`, and keeps stepping until every process is done: the cores stay as loaded as
    in training for every timed step. Raises TimeoutError when the others do not appear in `timeout_s`.
    """
    import keras

    with open(os.path.join(scratch, "count")) as f:
        count = int(f.read())
    stamps = []

    def wait_for(name):
        deadline = time.monotonic() + timeout_s
        while len(glob.glob(os.path.join(scratch, f"{name}.*"))) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"compute process {me}: fewer than {count} {name} files in {timeout_s} s")
            time.sleep(0.02)

    def mark(name):
        with open(os.path.join(scratch, f"{name}.{me}"), "w"):
            pass

    class Busy(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == WARMUP_STEPS:
                mark("ready")
                wait_for("ready")
                stamps.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            if WARMUP_STEPS <= batch < WARMUP_STEPS + TIMED_STEPS:
                stamps.append(time.perf_counter())
            if batch == WARMUP_STEPS + TIMED_STEPS - 1:
                mark("done")
            if batch >= WARMUP_STEPS + TIMED_STEPS - 1:
                self.model.stop_training = len(glob.glob(os.path.join(scratch, "done.*"))) >= count

    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    model.fit(data, epochs=1, steps_per_epoch=10**6, verbose=0, callbacks=[Busy()])
    return [b - a for a, b in zip(stamps, stamps[1:])]


def compute_busy(p, batch, scratch, env):
    """Step times of p world-size-1 processes at once, process r on core r mod 2, their timed steps
    overlapping (`busy_step_times`)."""
    scratch = os.path.join(scratch, "compute")
    os.makedirs(scratch)
    with open(os.path.join(scratch, "count"), "w") as f:
        f.write(str(p))
    outs = [os.path.join(scratch, f"compute{r}.json") for r in range(p)]
    procs = [
        subprocess.Popen(
            common.worker_command(
                "validation_hosts", "--worker=compute", f"--out={o}", f"--core={r}",
                f"--per_rank_batch={batch}",
            ),
            cwd=common.REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for r, o in enumerate(outs)
    ]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode:
            raise RuntimeError(f"compute process: exit {proc.returncode}\n{err[-3000:]}")
    times = []
    for o in outs:
        with open(o) as f:
            times += json.load(f)["modes"]["grouped"]
    return times


def ranks(p, batch, scratch, env, role="ranks"):
    """`horovodrun -np p` of `worker(role)`, 1 rank per host: rank 0's JSON."""
    out = os.path.join(scratch, f"{role}.json")
    hosts = ",".join(f"node{k}:1" for k in range(1, p + 1))
    command = [common.HOROVODRUN, "-np", str(p), "-H", hosts]
    command += common.worker_command(
        "validation_hosts", f"--worker={role}", f"--out={out}", f"--per_rank_batch={batch}"
    )
    common.run(command, env=env, timeout=1800)
    with open(out) as f:
        return json.load(f)


def overlap_share():
    """time_to_train's overlap share, calibrated on ResNet-50's overlapped run on 2 hosts at 1 Gbit/s."""
    from benchmarks import time_to_train

    measurements = time_to_train.load_measurements(time_to_train.DEFAULT_CPU)
    grads = {m: time_to_train.gradient_bytes(m) for m in time_to_train.MODEL_NAMES}
    _, share = time_to_train.validate(measurements, grads)
    return share


def host_cpu_seconds():
    """CPU seconds this machine's cores have spent since boot, from /proc/stat's "cpu" line: {"user": user
    + nice, "kernel": system + irq + softirq, "idle": idle + iowait}. Host-wide: network namespaces share
    the one kernel's counters, so every emulated host's ranks and links are in it."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:8]]
    user, nice, system, idle, iowait, irq, softirq = fields
    tick = os.sysconf("SC_CLK_TCK")
    return {
        "user": (user + nice) / tick,
        "kernel": (system + irq + softirq) / tick,
        "idle": (idle + iowait) / tick,
    }


def _float32_bytes(variables):
    """Bytes of float32 gradients of `variables`."""
    return 4 * sum(int(v.shape.num_elements()) for v in variables)


def gradient_bytes():
    """Bytes of MODEL's float32 gradients."""
    from hvd_lars.models import get_model

    model = get_model(MODEL, num_classes=CLASSES, input_shape=(IMAGE_SIZE, IMAGE_SIZE, 3))
    return _float32_bytes(model.trainable_variables)


def auto_link_bits(p, compute_s, n_bytes):
    """The link rate (bits/s, to 10 Mbit/s, at least 10) at which eq. 4's ring term 2(p - 1)/p x n at
    0.9 x the link takes compute_s / AUTO_RATIO."""
    bits = 2 * (p - 1) / p * n_bytes * 8 / (allreduce_hosts.LINK_EFFICIENCY * compute_s / AUTO_RATIO)
    return max(10e6, round(bits / 10e6) * 10e6)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ps", default="2,4,8")
    parser.add_argument("--link_rate", default=LINK_RATE)
    common.add_burst_ms_argument(parser)
    parser.add_argument("--per_rank_batch", type=int, default=PER_RANK_BATCH)
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "validation_hosts.md"))
    parser.add_argument("--worker", choices=tuple(ROLE_MODES), help="internal")
    parser.add_argument("--core", type=int, default=0, help="internal")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.out, args.core, args.per_rank_batch)
        return
    ps = [int(p) for p in args.ps.split(",")]
    share = overlap_share()
    if args.link_rate != "auto":
        try:
            link_bits = common.link_rate_bits(args.link_rate)
        except ValueError as e:
            parser.error(f"--link_rate: {e}")
    env = common.worker_env()
    env = {k: v for k, v in env.items() if not k.startswith(("HOROVOD_", "OMPI_MCA_"))}
    matmul = common.matmul_rate()
    rows, started = [], time.time()
    busy_at = {}
    if args.link_rate == "auto":
        with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_validation_") as scratch:
            busy_at[ps[0]] = compute_busy(ps[0], args.per_rank_batch, scratch, env)
        link_bits = auto_link_bits(ps[0], statistics.median(busy_at[ps[0]]), gradient_bytes())
        args.link_rate = f"{link_bits / 1e6:.0f}mbit"
        ratio = f"compute : ring term {AUTO_RATIO} : 1 at p = {ps[0]}"
        print(f"[validation_hosts] link rate {args.link_rate}: {ratio}", flush=True)
    fit_sizes = [int(float(m) * 2**20) for m in FIT_SIZES_MIB.split(",")]
    fit_args = [f"--sizes={','.join(map(str, fit_sizes))}", "--repeats=5"]
    with common.emulated_cluster(max(ps), args.link_rate, args.burst_ms):
        for p in ps:
            with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_validation_") as scratch:
                busy = busy_at.get(p) or compute_busy(p, args.per_rank_batch, scratch, env)
                unreduced = ranks(p, args.per_rank_batch, scratch, env, role="unreduced")
                alone = ranks(p, args.per_rank_batch, scratch, env, role="reduce_only")
                measured = ranks(p, args.per_rank_batch, scratch, env)
                parts = split_parts(ranks(p, args.per_rank_batch, scratch, env, role="split")["split"])
            fit = allreduce_hosts.launch("main", (p, 1), fit_args)
            medians = [statistics.median(t) for t in fit["times_s"]]
            alpha, beta, _ = common.ring(p, fit["sizes"], medians)
            n = measured["gradient_bytes"]
            reduce = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / beta
            compute = statistics.median(busy)
            busy_cores = sum(alone["busy_cores"].values())
            for mode in ("grouped", "overlap"):
                hidden = 0.0 if mode == "grouped" else share * (2.0 / 3.0) * compute
                predicted = compute + max(0.0, reduce - hidden)
                # Backprop overlaps the allreduce only on the cores the allreduce leaves idle: here its
                # CPU work (MPI progress, Horovod's threads, the TCP stack, the links' forwarding) runs on
                # the same cores as every rank's compute. A rank of a real cluster has its own cores.
                idle_share = max(0.0, 1.0 - busy_cores / CORES)
                predicted_idle = compute + max(0.0, reduce - hidden * idle_share)
                step = statistics.median(measured["modes"][mode])
                row = dict(p=p, mode=mode, compute_s=compute, allreduce_s=reduce, alpha_s=alpha, beta=beta)
                row.update(unreduced_s=statistics.median(unreduced["modes"]["grouped"]))
                row.update(reduce_only_s=statistics.median(alone["modes"]["grouped"]))
                row.update(predicted_s=predicted, measured_s=step, error=predicted / step - 1)
                row.update(busy_cores=busy_cores, busy_cores_user=alone["busy_cores"]["user"])
                row.update(predicted_idle_s=predicted_idle, error_idle=predicted_idle / step - 1)
                row.update({f"split_{k}_s": v for k, v in parts.items()})
                rows.append(dict(row, steps_s=measured["modes"][mode], compute_steps_s=busy,
                                 unreduced_steps_s=unreduced["modes"]["grouped"],
                                 reduce_only_steps_s=alone["modes"]["grouped"]))  # fmt: skip
                print(f"[validation_hosts] p={p} {mode}: predicted {predicted:.3f} s, measured {step:.3f} s, "
                      f"compute {compute:.3f} s, allreduce {reduce:.3f} s", flush=True)  # fmt: skip
    command = common.command_line("validation_hosts", argv)
    raw = common.data_path(args.out)
    lines = [
        "# The step-time model at p = 2, 4 and 8 emulated hosts",
        "",
        *common.provenance_lines(command, matmul, raw),
        f"- {MODEL} ({IMAGE_SIZE}x{IMAGE_SIZE}x3, per-rank batch {args.per_rank_batch}, float32, "
        f"{measured['tensors']} gradient tensors, {measured['gradient_bytes'] / 2**20:.2f} MiB), "
        f"hvd_lars.DistributedOptimizer(LARS); 1 rank per host on core rank mod 2, links {args.link_rate} "
        f"({link_bits / 1e6:g} Mbit/s, a {args.burst_ms} ms token bucket); medians of {TIMED_STEPS} timed "
        f"steps after {WARMUP_STEPS}; eq. 4 fitted to allreduces of "
        f"{FIT_SIZES_MIB.replace('0.0009765625', '1/1024')} MiB; wall time "
        f"{time.time() - started:.0f} s.",
        f"- Overlap share (time_to_train's calibration, ResNet-50 on 2 hosts at 1 Gbit/s): {share:.2f}.",
        "- Beside the model's inputs, two measurements it does not use, to place what it leaves out: the "
        "compute of the p Horovod ranks stepping with their gradients unreduced (Horovod's background thread "
        "cycling beside each step as in training), and the step's grouped allreduce of the model's gradient "
        "tensors by itself (no compute), both medians of the same counts, and the cores that allreduce "
        "keeps busy by itself (host-wide /proc/stat CPU seconds over its timed steps' wall time; of "
        f"{CORES}; user time in brackets, the rest the kernel's).",
        "- Predicted, overlap on idle cores: backprop hides the allreduce only on the cores it leaves idle, "
        f"hidden = overlap share x 2/3 x compute x (1 - busy cores / {CORES}).",
        "",
        "| p | gradients | compute s (all ranks busy) | allreduce s (eq. 4, this p's fit) | compute : "
        "allreduce | alpha ms | beta MB/s | predicted s | measured s | error | predicted s, overlap on "
        "idle cores | its error | compute s, ranks unreduced | grouped allreduce s by itself | cores busy "
        "during it (user) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = "" if abs(r["error"]) <= ERROR_GOAL else " (over 15%)"
        ok_idle = "" if abs(r["error_idle"]) <= ERROR_GOAL else " (over 15%)"
        lines.append(
            f"| {r['p']} | {r['mode']} | {r['compute_s']:.3f} | {r['allreduce_s']:.3f} | "
            f"{r['compute_s'] / r['allreduce_s']:.1f} : 1 | {r['alpha_s'] * 1e3:.2f} | "
            f"{r['beta'] / 1e6:.1f} | "
            f"{r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['error']:+.1%}{ok} | "
            f"{r['predicted_idle_s']:.3f} | {r['error_idle']:+.1%}{ok_idle} | "
            f"{r['unreduced_s']:.3f} | {r['reduce_only_s']:.3f} | {r['busy_cores']:.2f} "
            f"({r['busy_cores_user']:.2f}) |"
        )
    lines += [
        "",
        "The grouped step in its parts (role `split`, same counts): each rank takes the step as three "
        "tf.functions, each waited for before the next starts. *compute*: forward and backprop, the "
        "slowest rank's in each step; *allreduce*: the grouped allreduce proper, the smallest of the ranks' "
        "times in each step (a rank that finishes its compute first waits for the others inside it); "
        "*update*: LARS applying the averaged gradients; *split step*: rank 0's three parts together. "
        "Medians over the timed steps.",
        "",
        "| p | measured grouped step s (one tf.function) | split step s | compute s (slowest rank) | "
        "allreduce s (proper) | update s | compute + allreduce + update s | compute s, world size 1 (the "
        "model's) | grouped allreduce s by itself |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["mode"] != "grouped":
            continue
        total = r["split_compute_s"] + r["split_allreduce_s"] + r["split_update_s"]
        lines.append(
            f"| {r['p']} | {r['measured_s']:.3f} | {r['split_step_s']:.3f} | {r['split_compute_s']:.3f} | "
            f"{r['split_allreduce_s']:.3f} | {r['split_update_s']:.3f} | {total:.3f} | "
            f"{r['compute_s']:.3f} | {r['reduce_only_s']:.3f} |"
        )
    common.write_report(args.out, "\n".join(lines))
    with open(raw, "w") as f:
        json.dump(
            {"command": command, "burst_ms": args.burst_ms, "overlap_share": share, "rows": rows}, f, indent=1
        )
    print(f"[validation_hosts] wrote {args.out}")


if __name__ == "__main__":
    main()
