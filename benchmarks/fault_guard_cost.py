"""What the per-update fault check costs: `hvd_lars.training.faults.FaultGuard` vs none, 2 ranks.

At every update boundary the main program's `FaultGuard` checks that the loss and every float variable
(weights, batch-norm statistics, optimizer slots) are finite, then sums 2 numbers over the ranks (the
divergence and stop-signal votes), so every update ends with a host-side decision. This script measures
what that adds to a training step, on 2 Horovod ranks (horovodrun, Open MPI) on this machine, with the
main program's settings (`launch/env.sh` and `hvd_lars.training.threads`: 5 ms Horovod cycle, MPI yielding):

- small_cnn at flags/fashion_mnist_lars.flags' global batch 4,096 (2,048 per rank, 28x28x1): the product's
  own Fashion-MNIST run;
- ResNet-50 at 224x224, 8 images per rank: 25.6M weights to check per update, the largest check relative
  to a step that this machine can afford.

Arms "none" (no callback) and "guard" (`FaultGuard`) alternate, `--repeats` times each, `--steps` timed
updates per fit (after an untimed fit per arm for tracing), each update timed from the first callback's
batch begin to the last one's batch end. Reported per arm: the fastest fit's and the median fit's median
seconds per update, and the ratios guard / none.

Usage (from the repository root, with the machine to itself, nothing else running; about 6 minutes):
    python -m benchmarks.fault_guard_cost       # writes results/fault_guard_cost.md (raw: its folder)

`--cases=small_cnn --steps=2 --repeats=1 --raw=/tmp/fg.json --out=/tmp/fg.md` checks the script (a minute).
"""

import argparse
import json
import os
import statistics
import time

from benchmarks import common

REPO = common.REPO
CASES = {
    # name: (model, per-rank batch, input shape, classes)
    "small_cnn": ("small_cnn", 2048, (28, 28, 1), 10),
    "resnet50": ("resnet50", 8, (224, 224, 3), 1000),
}
ARMS = ("none", "guard")


def _step_seconds(model, data, steps, callbacks):
    """Median seconds per update of one fit, each from the first callback's batch begin to the last
    callback's batch end (so the guard's own work counts, and the fit's start and end do not)."""
    import keras

    started, durations = [0.0], []

    class Start(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            started[0] = time.perf_counter()

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            durations.append(time.perf_counter() - started[0])

    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Start(), *callbacks, Stop()])
    return statistics.median(durations)


def worker(args):
    import keras
    import numpy as np
    import tensorflow as tf

    from hvd_lars import LARS, DistributedOptimizer
    from hvd_lars.models import get_model
    from hvd_lars.parallel import collectives
    from hvd_lars.training import faults, threads

    rank, size = collectives.init()
    # The main program's thread pools: this rank's share of the cores (1 of 2 here), not TensorFlow's
    # default of every core per rank, which oversubscribes the cores and stalls steps by seconds.
    from hvd_lars.training.config import TrainConfig
    from hvd_lars.training.threads import configure_threads

    threads_used = configure_threads(TrainConfig(), size)
    results = {}
    for case in args.cases.split(","):
        name, per_rank, shape, classes = CASES[case]
        keras.utils.set_random_seed(0)
        model = get_model(name, num_classes=classes, input_shape=shape)
        optimizer = DistributedOptimizer(LARS(0.01, momentum=0.9, weight_decay=5e-4))
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        optimizer.build(model.trainable_variables)
        rng = np.random.default_rng(rank)
        x = rng.normal(size=(per_rank, *shape)).astype("float32")
        y = rng.integers(0, classes, per_rank).astype("int32")
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        arms = {"none": lambda: [], "guard": lambda: [faults.FaultGuard(faults.StopSignals(), None)]}
        for arm in ARMS:  # tracing and first allocations
            _step_seconds(model, data, 2, arms[arm]())
        times = {arm: [] for arm in ARMS}
        for _ in range(args.repeats):
            for arm in ARMS:
                times[arm].append(_step_seconds(model, data, args.steps, arms[arm]()))
        checked = sum(int(np.prod(v.shape)) for v in model.variables + optimizer.variables)
        results[case] = {"per_rank_batch": per_rank, "seconds_per_update": times, "values_checked": checked}
        if rank == 0:
            print(f"[fault_guard_cost] {case}: {json.dumps(times)}", flush=True)
    if rank == 0:
        horovod = {k: os.environ.get(k) for k in threads.HOROVOD_CPU_DEFAULTS}
        with open(args.raw, "w") as f:
            json.dump(
                {"world_size": size, "threads": threads_used, "results": results, "environment": horovod},
                f,
                indent=1,
            )


def report(args, raw, wall):
    command = common.command_line("fault_guard_cost", args.argv)
    lines = [
        "# What the per-update fault check costs (FaultGuard)",
        "",
        *common.provenance_lines(command, common.matmul_rate()),
        f"- {wall:.0f} s; 2 Horovod ranks (horovodrun, Open MPI) on this machine's cores, {args.steps} "
        f"timed updates per fit, arms alternated {args.repeats} times; synthetic data, LARS, float32; "
        f"TensorFlow threads per rank (intra-op, inter-op) {raw.get('threads')}, as the main program "
        f"sizes them. 1-minute load average at the end {os.getloadavg()[0]:.1f}.",
        "",
        "| model | per-rank batch | values checked per update | seconds per update, no check (fastest "
        "fit / median of fits) | with FaultGuard (fastest / median) | ratio of the fastest | of the "
        "medians |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, r in raw["results"].items():
        times = r["seconds_per_update"]
        fast = {arm: min(times[arm]) for arm in ARMS}
        mid = {arm: statistics.median(times[arm]) for arm in ARMS}
        lines.append(
            f"| {case} | {r['per_rank_batch']} | {r['values_checked'] / 1e6:.2f}M | "
            f"{fast['none']:.3f} / {mid['none']:.3f} | {fast['guard']:.3f} / {mid['guard']:.3f} | "
            f"{fast['guard'] / fast['none']:.3f} | {mid['guard'] / mid['none']:.3f} |"
        )
    lines += [
        "",
        "Each fit's figure is the median of its updates, each timed from the first callback's batch begin "
        "to the last one's batch end (the guard's work included, the fit's start and end not: timing whole "
        "fits, an overhead of about 5 s per fit on 2 ranks swamped the updates); every figure is in "
        f"`{os.path.relpath(args.raw, REPO)}`. The check is one "
        "pass over the variables (a `tf.function` reducing `is_finite`), the loss read from the step's logs, "
        "and one eager 2-number allreduce, which waits for Horovod's next cycle (5 ms).",
    ]
    common.write_report(args.out, "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--raw", default=None, help="raw timings (default: common.data_path of --out)")
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "fault_guard_cost.md"))
    parser.add_argument("--worker", action="store_true", help="internal: run as one of the ranks")
    args = parser.parse_args(argv)
    args.argv = argv
    args.raw = args.raw or common.data_path(args.out)
    if args.worker:
        worker(args)
        return
    unknown = sorted(set(args.cases.split(",")) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; valid: {', '.join(CASES)}")
    from hvd_lars.training import threads

    env = common.worker_env()
    threads.apply_horovod_cpu_defaults(env)
    start = time.time()
    cmd = [common.HOROVODRUN, "-np", "2", "-H", "localhost:2", *common.worker_command("fault_guard_cost")]
    cmd += ["--worker"]
    cmd += [
        f"--cases={args.cases}",
        f"--steps={args.steps}",
        f"--repeats={args.repeats}",
        f"--raw={args.raw}",
    ]
    common.run(cmd, env=env, timeout=3600)
    with open(args.raw) as f:
        raw = json.load(f)
    report(args, raw, time.time() - start)
    print(f"[fault_guard_cost] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
