"""Training throughput on this CPU: hvd_lars's ResNet-50 and AlexNet-BN + LARS (`DistributedOptimizer(LARS)`,
the MLPerf recipe) against plain Keras (`keras.applications.ResNet50`, stock `alexnet_bn`, SGD momentum
0.9), float32 and mixed_bfloat16, each configuration in its own subprocess, twice, in the order B32 B16 O32
O16 B32 B16 O32 O16. Ratio = ours / the baseline's best precision; fraction of peak = images/s x training
FLOPs per image (`hvd_lars.models.flops`) / this run's `tf.matmul` rate.

Each run writes results/models_throughput/<cpu>_<model>.json; results/models_throughput.md is rebuilt from
every such file, one section per CPU (`cpu_section`, keyed by `common.cpu`).

    python -m benchmarks.benchmark_models --model resnet50    # about 14 minutes, the machine to itself
    python -m benchmarks.benchmark_models --model alexnet_bn  # about 7
    python -m benchmarks.benchmark_models --report_only       # the markdown from the JSON files
"""

import argparse
import hashlib
import json
import os
import re
import resource
import statistics
import time

from benchmarks import common

RAW_DIR = os.path.join(common.RESULTS, "models_throughput")
MARKDOWN = os.path.join(common.RESULTS, "models_throughput.md")
BATCH = 32
WARMUP_STEPS = 3  # tracing, oneDNN primitive creation, first allocations
TIMED_STEPS = 10
IMAGE_SIZES = {"resnet50": 224, "alexnet_bn": 227}
PRECISIONS = ("float32", "mixed_bfloat16")
# ------------------------------------------------------------------------------------- worker processes


def build(name, kind):
    """(model, optimizer, loss) of a configuration: kind "keras" (baseline) or "ours"."""
    import keras

    from hvd_lars import DistributedOptimizer
    from hvd_lars.models import get_model

    shape = (IMAGE_SIZES[name], IMAGE_SIZES[name], 3)
    if kind == "keras":
        if name == "resnet50":
            model = keras.applications.ResNet50(weights=None, input_shape=shape)
            loss = keras.losses.SparseCategoricalCrossentropy()  # the application ends in a softmax
        else:
            model = get_model(name, input_shape=shape)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return model, keras.optimizers.SGD(0.01, momentum=0.9), loss
    model = get_model(name, input_shape=shape)
    lars = common.mlperf_lars()
    return model, DistributedOptimizer(lars), keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_throughput(name, kind, precision):
    """Images/s of `model.fit` on one synthetic batch repeated, the step times and the minor page faults
    per timed step (RUSAGE_SELF); in a fresh process."""
    import keras
    import tensorflow as tf

    from hvd_lars.models.flops import training_flops_per_image

    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(0)
    model, optimizer, loss = build(name, kind)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    size = IMAGE_SIZES[name]
    images = tf.random.stateless_uniform((BATCH, size, size, 3), seed=(5, 6))
    labels = tf.random.stateless_uniform((BATCH,), seed=(7, 8), maxval=1000, dtype=tf.int32)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    stamps, faults = [], []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    model.fit(data, epochs=1, steps_per_epoch=WARMUP_STEPS + TIMED_STEPS, verbose=0, callbacks=[Stamp()])
    steps = [b - a for a, b in zip(stamps[WARMUP_STEPS - 1 :], stamps[WARMUP_STEPS:])]
    return {
        "images_per_second": BATCH * len(steps) / sum(steps),
        "step_s": steps,
        "minor_faults_per_step": (faults[-1] - faults[WARMUP_STEPS - 1]) / len(steps),
        "train_gflop_per_image": training_flops_per_image(model) / 1e9,
        "threads": {
            "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        },
    }


def run_worker(spec, timeout, env=None):
    """One configuration `spec` in a fresh process: spec and its result in one dict."""
    start = time.perf_counter()
    if spec["kind"] == "matmul":
        result = {"gflops": common.matmul_rate()}
        print(f"[benchmark] {spec}: {result} ({time.perf_counter() - start:.0f} s)", flush=True)
        return {**spec, **result}
    proc = common.run(
        common.worker_command("benchmark_models", "--worker", json.dumps(spec)), env=env, timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{spec} printed no result:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in result.items() if k != "step_s"}
    print(f"[benchmark] {spec}: {shown} ({time.perf_counter() - start:.0f} s)", flush=True)
    return {**spec, **result}


# ------------------------------------------------------------------------------------------- the report


def raw_name(cpu, model):
    """The JSON file of one CPU's run of `model`: the CPU's short name and a hash of its identity."""
    slug = re.sub(r"[^a-z0-9]+", "_", cpu["name"].lower()).strip("_")
    return f"{slug}_{hashlib.sha256(cpu['key'].encode()).hexdigest()[:8]}_{model}.json"


def cpu_section(cpu):
    """A CPU's section heading, "<short name>: <model name> (<common.cpu key>)"; for older records (no key;
    the short name stored as `family`) "(identity not recorded)" in place of the key."""
    if "key" in cpu:
        return f"{cpu['name']}: {cpu['model']} ({cpu['key']})"
    return f"{cpu['family']}: {cpu['model']} (identity not recorded)"


def sections(text):
    """{heading: body} of a models_throughput.md text, one per CPU (`## <cpu_section>`)."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {heading: body for heading, body in zip(parts[1::2], parts[2::2])}


def measure(args):
    from hvd_lars.training import epoch_logs

    started = time.time()
    runs = [run_worker({"kind": "matmul"}, args.timeout)]
    order = 2 * ([("keras", p) for p in PRECISIONS] + [("ours", p) for p in PRECISIONS])
    for kind, precision in order:
        runs.append(run_worker({"kind": kind, "model": args.model, "precision": precision}, args.timeout))
    runs.append(run_worker({"kind": "matmul"}, args.timeout))
    record = {
        "model": args.model,
        "command": common.command_line("benchmark_models", args.argv),
        "provenance": epoch_logs.provenance(),
        "cpu": common.cpu(),
        "batch": BATCH,
        "warmup_steps": WARMUP_STEPS,
        "timed_steps": TIMED_STEPS,
        "wall_time_s": round(time.time() - started),
        "load_average": os.getloadavg(),
        "runs": runs,
    }
    os.makedirs(args.raw_dir, exist_ok=True)
    common.write_json(os.path.join(args.raw_dir, raw_name(record["cpu"], args.model)), record)


def summarise(record):
    """(rows of one record, one per (kind, precision), and its matmul peaks)."""
    peaks = [r["gflops"] for r in record["runs"] if r["kind"] == "matmul"]
    peak = {p: max(x[d] for x in peaks) for p, d in (("float32", "float32"), ("mixed_bfloat16", "bfloat16"))}
    rows = {}
    for r in record["runs"]:
        if r["kind"] != "matmul":
            rows.setdefault((r["kind"], r["precision"]), []).append(r)
    best_baseline = max(
        statistics.mean(x["images_per_second"] for x in rows[("keras", p)]) for p in PRECISIONS
    )
    table = []
    for (kind, precision), group in rows.items():
        rate = statistics.mean(x["images_per_second"] for x in group)
        gflop = group[0]["train_gflop_per_image"]
        table.append(
            {
                "kind": kind,
                "precision": precision,
                "rates": [x["images_per_second"] for x in group],
                "images_per_second": rate,
                "ratio": rate / best_baseline,
                "gflop_per_image": gflop,
                "achieved_gflops": rate * gflop,
                "fraction_of_peak": rate * gflop / peak[precision],
                "peak_rss_gib": max(x["peak_rss_gib"] for x in group),
                "step_spread": max(max(x["step_s"]) / min(x["step_s"]) for x in group),
            }
        )
    return table, peak


NAMES = {"resnet50": "ResNet-50", "alexnet_bn": "AlexNet-BN"}
KINDS = {
    ("keras", "resnet50"): "plain Keras: keras.applications.ResNet50 (v1) + SGD",
    ("keras", "alexnet_bn"): "plain Keras: the same stock-Keras AlexNet-BN + SGD",
    ("ours", "resnet50"): "hvd_lars: resnet50 (v1.5, fused BN) + DistributedOptimizer(LARS)",
    ("ours", "alexnet_bn"): "hvd_lars: alexnet_bn + DistributedOptimizer(LARS)",
}


def report(raw_dir=RAW_DIR, out=MARKDOWN):
    """Writes `out` from every JSON file in `raw_dir`: a section per CPU, a table per model."""
    records = []
    for name in sorted(os.listdir(raw_dir)):
        if name.endswith(".json"):
            records.append(common.read_json(os.path.join(raw_dir, name)))
    lines = [
        "# Training throughput on CPU: hvd_lars against plain Keras (images/s per process)",
        "",
        "Made by `python -m benchmarks.benchmark_models` (its docstring says how): per model, each",
        f"configuration in a fresh process, synthetic data (a batch of {BATCH} repeated), `fit`, "
        f"{WARMUP_STEPS} warm-up",
        f"then {TIMED_STEPS} timed steps; the plain-Keras baseline is measured before and after ours in the",
        "same run.",
        "*ratio*: images/s over the plain-Keras baseline in its best precision on that CPU. *fraction of",
        "peak*: images/s x training GFLOP per image (counted from the model's own layers by",
        "`hvd_lars.models.flops`: 3 passes x 2 FLOPs per multiply-add; ResNet-50 v1.5 24.5 GFLOP, the",
        "baseline's ResNet-50 v1 23.1, AlexNet-BN (one tower, 227x227) 6.8) / the `tf.matmul` 4096x4096",
        "GFLOP/s of the same precision in the same run. Raw figures: "
        f"`{os.path.relpath(os.path.abspath(raw_dir), common.REPO)}/*.json`.",
        "",
        "One section per CPU, headed `<short name>: <model name> (<vendor_id> family F model M stepping S,",
        "flags <hash of the whole /proc/cpuinfo flag list>)`: a run replaces only its own CPU's tables.",
        'Sections measured before that identity was recorded say "(identity not recorded)".',
    ]
    cpus = {}
    for record in records:
        cpus.setdefault(cpu_section(record["cpu"]), []).append(record)
    for heading, group in sorted(cpus.items()):
        lines += ["", f"## {heading}", ""]
        for record in sorted(group, key=lambda r: r["model"]):
            table, peak = summarise(record)
            prov = record["provenance"]
            lines += [
                f"### {NAMES[record['model']]}",
                "",
                f"- command: `{record['command']}`; git {common.sha_text(prov['git_sha'])}, {prov['date']}, "
                f"{record['wall_time_s']} s; load average at the end {record['load_average'][0]:.1f}",
                f"- Machine: {common.cpu_text(record['cpu'], prov['machine'])}; TensorFlow "
                f"{prov['tensorflow']}, Keras {prov['keras']}",
                f"- `tf.matmul` 4096x4096: {peak['float32']:.0f} GFLOP/s float32, "
                f"{peak['mixed_bfloat16']:.0f} GFLOP/s bfloat16 (best of the start and the end of the run)",
                "",
                "| configuration | precision | images/s (each run) | ratio | GFLOP/image | GFLOP/s "
                "| fraction of peak | slowest / fastest step | peak RSS (GiB) |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for row in table:
                lines.append(
                    f"| {KINDS[(row['kind'], record['model'])]} | {row['precision']} | "
                    f"{row['images_per_second']:.2f} ({', '.join(f'{r:.2f}' for r in row['rates'])}) | "
                    f"{row['ratio']:.2f}x | {row['gflop_per_image']:.1f} | {row['achieved_gflops']:.0f} | "
                    f"{row['fraction_of_peak']:.2f} | {row['step_spread']:.2f} | {row['peak_rss_gib']:.2f} |"
                )
            lines.append("")
    common.write_report(out, "\n".join(lines).rstrip())
    print(f"[benchmark] wrote {out}", flush=True)


def main(argv=None):
    parser = common.argument_parser(__doc__)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(IMAGE_SIZES), help="the model of this run")
    parser.add_argument("--report_only", action="store_true", help="rebuild the markdown from the JSON files")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per worker process")
    parser.add_argument("--raw_dir", default=RAW_DIR, help="folder of the JSON files")
    parser.add_argument("--out", default=MARKDOWN, help="the markdown file")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.worker:
        spec = json.loads(args.worker)
        result = train_throughput(spec["model"], spec["kind"], spec["precision"])
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return print("RESULT " + json.dumps(result), flush=True)
    if not args.report_only:
        if not args.model:
            parser.error("--model is required (resnet50 or alexnet_bn), or --report_only")
        measure(args)
    report(args.raw_dir, args.out)


if __name__ == "__main__":
    main()
