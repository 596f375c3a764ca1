"""Where a ResNet-50 training step spends its time on this CPU: TensorFlow's profiler, op by op, for ours
(hvd_lars's ResNet-50 v1.5 + DistributedOptimizer(LARS)) and plain Keras (keras.applications.ResNet50 +
SGD momentum), side by side in one run.

Each configuration runs in its own process: the configuration of benchmarks/benchmark_models.py (`build`,
one synthetic batch of 32 at 224x224 repeated), WARMUP_STEPS steps of `fit`, then PROFILED_STEPS steps
under `tf.profiler.experimental`. The trace (an XSpace protocol buffer) is read back with TensorFlow's own
`xplane_pb2`: every op executed on TensorFlow's inter-op threads (`tf_Compute` lines) with its duration,
named `scope/.../name:OpType`. Ops are put into categories:

  conv forward       Conv2D (and the oneDNN fused forms: _FusedConv2D, _MklNativeConv2D...)
  conv backward      Conv2DBackpropInput, Conv2DBackpropFilter
  matmul             MatMul (the classifier, forward and backward)
  batch norm         FusedBatchNorm* and its gradients
  update             every op under the optimizer's scope (LARS's norms and trust ratios, momentum, the
                     weight update), whatever its type
  element-wise       everything else (ReLU and its gradient, the residual adds, casts, the loss)

Reported per configuration and category: milliseconds per step (sum of op durations: ops that run at the
same time on two inter-op threads are both counted, so the sum can exceed the step), its share, and for
the convolutions and matmuls their GFLOP/s against `tf.matmul` in the same run (FLOPs from
`hvd_lars.models.flops`: forward 1/3, backward 2/3 of the training FLOPs). The step's wall time is the
mean over the profiled steps.

    python -m benchmarks.step_profile                         # results/step_profile.md (about 5 minutes)
    python -m benchmarks.step_profile --precision=mixed_bfloat16 --out=results/step_profile/bfloat16.md
    python -m benchmarks.step_profile --inter_op_threads=1 --out=results/step_profile/inter_op_1.md
    python -m benchmarks.step_profile --wall_only=0,1 --out=results/step_threads.md   # no profiler

Each report's raw data goes to common.data_path of --out (results/step_profile/step_profile.json for the
first; beside any other); a run in another precision, thread setting or on another CPU goes into the
question's folder, results/step_profile/, and results/step_profile.md links it.

`--inter_op_threads` and `--intra_op_threads` set TensorFlow's thread pools in both processes (0:
TensorFlow's own choice, one thread per core for each pool). With 1 inter-op thread ops run one at a time,
so each op's duration is its own and the category sums add up to the step.
"""

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

from benchmarks import common

WARMUP_STEPS, PROFILED_STEPS = 4, 5
WALL_STEPS = 8  # --wall_only: steps timed one by one, without the profiler
KINDS = {"ours": "hvd_lars: resnet50 (v1.5, fused BN) + DistributedOptimizer(LARS)",
         "keras": "plain Keras: keras.applications.ResNet50 (v1) + SGD momentum"}  # fmt: skip
CATEGORIES = ("conv forward", "conv backward", "matmul", "batch norm", "update", "element-wise")
UPDATE_SCOPES = ("optimizer", "lars", "sgd", "momentum", "assignadd", "resourceapply")


def category(name):
    """The category (one of CATEGORIES) of a traced op `scope/.../name:OpType`."""
    scope, _, op_type = name.rpartition(":")
    lowered, kind = scope.lower(), op_type.lower()
    if any(s in lowered for s in UPDATE_SCOPES[:4]) or kind.startswith(UPDATE_SCOPES[4:]):
        return "update"
    if "backprop" in kind and "conv" in kind:
        return "conv backward"
    if "conv" in kind:
        return "conv forward"
    if "matmul" in kind:
        return "matmul"
    if "batchnorm" in kind:
        return "batch norm"
    return "element-wise"


def op_times(xspace_path):
    """{op name: total picoseconds} of the ops on TensorFlow's inter-op threads in a trace."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xspace_path, "rb") as f:
        space.ParseFromString(f.read())
    totals = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" in name and not name.startswith(("ExecutorState", "ThreadpoolListener")):
                    totals[name] += event.duration_ps
    return totals


def worker(kind, precision, out, inter_op=0, intra_op=0, profile=True):
    import keras
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    tf.config.threading.set_intra_op_parallelism_threads(intra_op)

    from benchmarks import benchmark_models
    from hvd_lars.models import flops

    keras.mixed_precision.set_global_policy(precision)
    model, optimizer, loss = benchmark_models.build("resnet50", kind)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    batch = benchmark_models.BATCH
    images = tf.random.stateless_uniform((batch, 224, 224, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=1000, dtype=tf.int32)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    model.fit(data, epochs=1, steps_per_epoch=WARMUP_STEPS, verbose=0)
    if not profile:  # wall time alone: WALL_STEPS steps, each timed
        stamps = [time.perf_counter()]
        timer = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs=None: stamps.append(time.perf_counter())
        )
        model.fit(data, epochs=1, steps_per_epoch=WALL_STEPS, verbose=0, callbacks=[timer])
        result = {
            "kind": kind,
            "precision": precision,
            "steps_ms": [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])],
            "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
            "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        }
        with open(out, "w") as f:
            json.dump(result, f)
        return
    logdir = tempfile.mkdtemp(prefix="hvd_lars_profile_")
    tf.profiler.experimental.start(logdir)
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=PROFILED_STEPS, verbose=0)
    wall = (time.perf_counter() - start) / PROFILED_STEPS
    tf.profiler.experimental.stop()
    (trace,) = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    totals = op_times(trace)
    by_category = collections.Counter()
    for name, ps in totals.items():
        by_category[category(name)] += ps / 1e9 / PROFILED_STEPS  # ms per step
    top = [(n, ps / 1e9 / PROFILED_STEPS) for n, ps in totals.most_common(12)]
    result = {
        "kind": kind, "precision": precision, "step_ms": wall * 1e3, "by_category_ms": dict(by_category),
        "top_ops_ms": top, "train_gflop_per_image": flops.training_flops_per_image(model) / 1e9,
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
    }  # fmt: skip
    with open(out, "w") as f:
        json.dump(result, f)


def _threads(n):
    return str(n) if n else "TensorFlow's choice"


def markdown(results, matmul, command, precision, inter_op=0, intra_op=0, raw=None):
    threads = f"inter-op threads {_threads(inter_op)}, intra-op threads {_threads(intra_op)}"
    lines = [
        f"# Where ResNet-50's training step goes on this CPU ({precision}, batch 32): ours and plain Keras",
        "",
        *common.provenance_lines(command, matmul, raw),
        f"- {WARMUP_STEPS} steps of `fit` left out, then {PROFILED_STEPS} under TensorFlow's profiler; op "
        "durations summed per category (ops run at once on two inter-op threads both count, so a sum can "
        f"exceed the step). Threads: {threads}.",
        "",
        "| category | " + " | ".join(f"{KINDS[r['kind']]} ms/step (share)" for r in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for c in CATEGORIES:
        cells = []
        for r in results:
            ms = r["by_category_ms"].get(c, 0.0)
            cells.append(f"{ms:.0f} ({ms / sum(r['by_category_ms'].values()):.0%})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append(
        "| sum of ops | " + " | ".join(f"{sum(r['by_category_ms'].values()):.0f}" for r in results) + " |"
    )
    lines.append("| step (wall) | " + " | ".join(f"{r['step_ms']:.0f}" for r in results) + " |")
    rate = matmul["float32" if precision == "float32" else "bfloat16"]
    lines += ["", f"Convolutions and matmuls against `tf.matmul` ({rate:.0f} GFLOP/s in this run):", ""]
    for r in results:
        gflop = r["train_gflop_per_image"] * 32
        conv = sum(r["by_category_ms"].get(c, 0.0) for c in ("conv forward", "conv backward", "matmul"))
        lines.append(
            f"- {KINDS[r['kind']]}: {gflop:.0f} GFLOP per step in {conv:.0f} ms of conv/matmul ops = "
            f"{gflop / conv * 1e3:.0f} GFLOP/s ({gflop / conv * 1e3 / rate:.2f} of tf.matmul); the whole "
            f"step {gflop / r['step_ms'] * 1e3:.0f} GFLOP/s ({gflop / r['step_ms'] * 1e3 / rate:.2f})."
        )
    for r in results:
        lines += ["", f"The 12 longest ops of {KINDS[r['kind']]} (ms per step):", ""]
        lines += [f"- `{name}`: {ms:.1f}" for name, ms in r["top_ops_ms"]]
    return lines


def wall_times(args, inter_ops, argv):
    """Step wall times without the profiler, for each inter-op thread count and both configurations, in
    one run; a Markdown report at args.out."""
    import statistics

    matmul = common.matmul_rate()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for inter_op in inter_ops:
            for kind in ("keras", "ours"):
                out = os.path.join(scratch, f"{kind}{inter_op}.json")
                command = common.worker_command(
                    "step_profile", f"--worker={kind}", f"--precision={args.precision}", "--no_profile",
                    f"--inter_op_threads={inter_op}", f"--intra_op_threads={args.intra_op_threads}",
                    f"--json={out}",
                )  # fmt: skip
                common.run(command, timeout=1800)
                with open(out) as f:
                    rows.append(json.load(f))
                median = statistics.median(rows[-1]["steps_ms"])
                print(f"[step_profile] {kind}, inter-op {inter_op}: {median:.0f} ms/step", flush=True)
    command = common.command_line("step_profile", argv)
    raw = common.data_path(args.out)
    lines = [
        f"# ResNet-50's training step against TensorFlow's inter-op threads ({args.precision}, batch 32), "
        "without the profiler",
        "",
        *common.provenance_lines(command, matmul, raw),
        f"- {WARMUP_STEPS} steps of `fit` left out, then {WALL_STEPS} timed one by one; intra-op threads "
        f"{_threads(args.intra_op_threads)}.",
        "",
        "| configuration | inter-op threads (asked) | inter-op threads (TensorFlow) | median ms/step "
        "| min-max ms/step | images/s |",
        "|---|---|---|---|---|---|",
    ]
    for inter_op, row in zip([n for n in inter_ops for _ in (0, 1)], rows):
        median = statistics.median(row["steps_ms"])
        lines.append(
            f"| {KINDS[row['kind']]} | {_threads(inter_op)} | {row['inter_op_threads']} | {median:.0f} | "
            f"{min(row['steps_ms']):.0f}-{max(row['steps_ms']):.0f} | {32e3 / median:.2f} |"
        )
    common.write_report(args.out, "\n".join(lines))
    with open(raw, "w") as f:
        json.dump({"command": command, "results": rows}, f, indent=1)
    print(f"[step_profile] wrote {args.out}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", default="float32", choices=("float32", "mixed_bfloat16"))
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "step_profile.md"))
    parser.add_argument("--inter_op_threads", type=int, default=0, help="0: TensorFlow's choice")
    parser.add_argument("--intra_op_threads", type=int, default=0, help="0: TensorFlow's choice")
    parser.add_argument(
        "--wall_only",
        default="",
        help="inter-op thread counts to compare without the profiler, e.g. 0,1 (0: TensorFlow's choice): "
        "step wall times only, side by side in one run",
    )
    parser.add_argument("--worker", choices=tuple(KINDS), help="internal")
    parser.add_argument("--json", help="internal")
    parser.add_argument("--no_profile", action="store_true", help="internal")
    args = parser.parse_args(argv)
    try:
        wall_only = [int(v) for v in args.wall_only.split(",") if v]
    except ValueError:
        parser.error(f"--wall_only={args.wall_only!r}: expected inter-op thread counts such as 0,1")
    if any(n < 0 for n in wall_only):
        parser.error(
            f"--wall_only={args.wall_only!r}: each count must be 0 (TensorFlow's choice) or positive"
        )
    if min(args.inter_op_threads, args.intra_op_threads) < 0:
        parser.error(
            f"--inter_op_threads={args.inter_op_threads}, --intra_op_threads={args.intra_op_threads}: "
            "each must be 0 (TensorFlow's choice) or a positive count."
        )
    threads = (args.inter_op_threads, args.intra_op_threads)
    if args.worker:
        worker(args.worker, args.precision, args.json, *threads, profile=not args.no_profile)
        return
    if wall_only:
        wall_times(args, wall_only, argv)
        return
    matmul = common.matmul_rate()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for kind in ("keras", "ours"):
            out = os.path.join(scratch, f"{kind}.json")
            command = common.worker_command(
                "step_profile", f"--worker={kind}", f"--precision={args.precision}",
                f"--inter_op_threads={args.inter_op_threads}", f"--intra_op_threads={args.intra_op_threads}",
            )  # fmt: skip
            common.run([*command, f"--json={out}"], timeout=1800)
            with open(out) as f:
                results.append(json.load(f))
            print(f"[step_profile] {kind}: {results[-1]['step_ms']:.0f} ms/step", flush=True)
    command = common.command_line("step_profile", argv)
    raw = common.data_path(args.out)
    lines = markdown(results, matmul, command, args.precision, *threads, raw=raw)
    common.write_report(args.out, "\n".join(lines))
    with open(raw, "w") as f:
        json.dump({"command": command, "results": results}, f, indent=1)
    print(f"[step_profile] wrote {args.out}")


if __name__ == "__main__":
    main()
