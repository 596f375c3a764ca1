"""ResNet-50 training throughput on this CPU: hvd_lars's model + LARS against plain Keras, side by side.

Each configuration runs in its own subprocess (environment variables such as TF_ENABLE_ONEDNN_OPTS only
act before TensorFlow loads): synthetic 224x224x3 images and labels from a repeated constant batch,
`model.fit` for `--warmup-steps` + `--steps` steps, images/s over the last `--steps`, peak RSS of the
process. The baseline, `keras.applications.ResNet50(weights=None)` trained by plain `model.fit` with SGD
momentum in float32, is re-measured between candidates (B C C B C C B ...) and every candidate's ratio is
taken against the mean of the baselines just before and after it, so the load of a shared machine
cancels to first order. `tf.matmul` of 4096x4096 in float32 and bfloat16 gives the machine's measured peak;
ResNet-50 training costs ~12.3 GFLOP per 224x224 image (3x the 4.1 GFLOP forward pass), so
fraction of peak = images/s * 12.3 / (matmul GFLOP/s of the configuration's precision).

Usage (writes the markdown table to --out and prints it):
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python results/benchmark_models.py --out results/models_throughput.md
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_GFLOP_PER_IMAGE = 12.3  # 3 x 4.1 GFLOP forward (He et al. 2016, table 1; backward ~2x forward)

# name -> worker settings; "env" is added to the subprocess environment.
BASELINE = {"name": "keras_f32", "model": "keras", "precision": "float32"}
CANDIDATES = {
    "ours_f32_keras_bn": {"model": "ours", "fused": False, "precision": "float32"},
    "ours_f32": {"model": "ours", "precision": "float32"},
    "ours_bf16": {"model": "ours", "precision": "mixed_bfloat16"},
    # XLA (jit_compile) ran at 0.45x the baseline (results/models_throughput.md): one timed step suffices.
    "ours_f32_xla": {"model": "ours", "precision": "float32", "jit": True, "warmup_steps": 1, "steps": 1},
    "ours_f32_no_onednn": {"model": "ours", "precision": "float32", "env": {"TF_ENABLE_ONEDNN_OPTS": "0"}},
    "ours_f32_intra2_inter1": {"model": "ours", "precision": "float32", "intra": 2, "inter": 1},
    "ours_f32_omp": {
        "model": "ours",
        "precision": "float32",
        "env": {"OMP_NUM_THREADS": "2", "KMP_BLOCKTIME": "1", "KMP_AFFINITY": "granularity=fine,compact,1,0"},
    },
    "ours_f32_b64": {"model": "ours", "precision": "float32", "batch": 64},
    "ours_bf16_b64": {"model": "ours", "precision": "mixed_bfloat16", "batch": 64},
}


def matmul_peak(size=4096, repeats=5):
    """GFLOP/s of `tf.matmul` on (size, size) operands in float32 and bfloat16 (best of `repeats`)."""
    import tensorflow as tf

    out = {}
    for dtype in ("float32", "bfloat16"):
        a = tf.cast(tf.random.stateless_normal((size, size), seed=(1, 2)), dtype)
        b = tf.cast(tf.random.stateless_normal((size, size), seed=(3, 4)), dtype)
        tf.matmul(a, b).numpy()  # warm up: thread pools, oneDNN primitive creation
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            tf.matmul(a, b).numpy()
            best = min(best, time.perf_counter() - start)
        out[dtype] = 2 * size**3 / best / 1e9
    return out


def train_throughput(cfg, warmup_steps, steps, image_size):
    """Images/s of `model.fit` on one synthetic batch repeated; runs inside a fresh worker process."""
    import tensorflow as tf

    if cfg.get("intra"):
        tf.config.threading.set_intra_op_parallelism_threads(cfg["intra"])
    if cfg.get("inter"):
        tf.config.threading.set_inter_op_parallelism_threads(cfg["inter"])
    import keras

    keras.mixed_precision.set_global_policy(cfg["precision"])
    keras.utils.set_random_seed(0)
    batch = cfg.get("batch", 32)
    shape = (image_size, image_size, 3)
    if cfg["model"] == "keras":
        model = keras.applications.ResNet50(weights=None, input_shape=shape)
        optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
        loss = keras.losses.SparseCategoricalCrossentropy()  # the application ends in a softmax
    else:
        sys.path.insert(0, REPO)
        from hvd_lars import LARS, mlperf_exclusions
        from hvd_lars.models import get_model

        model = get_model("resnet50", input_shape=shape, fused_batch_norm=cfg.get("fused", True))
        # The MLPerf ResNet-50 LARS recipe (weight decay 1e-4, BN/bias excluded): the step the main
        # program runs, per-tensor norms included.
        optimizer = LARS(
            learning_rate=0.1,
            momentum=0.9,
            weight_decay=1e-4,
            exclude_from_weight_decay=mlperf_exclusions(),
            exclude_from_layer_adaptation=mlperf_exclusions(),
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=bool(cfg.get("jit", False)))
    images = tf.random.stateless_uniform((batch, *shape), seed=(5, 6))
    labels = tf.random.stateless_uniform((batch,), seed=(7, 8), maxval=1000, dtype=tf.int32)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()

    times = []

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter())

    model.fit(data, epochs=1, steps_per_epoch=warmup_steps + steps, verbose=0, callbacks=[StepTimer()])
    return batch * steps / (times[-1] - times[warmup_steps - 1]), batch


def worker(args):
    cfg = json.loads(args.worker)
    if cfg["model"] == "matmul":
        result = {"gflops": matmul_peak()}
    else:
        images_per_second, batch = train_throughput(cfg, args.warmup_steps, args.steps, args.image_size)
        result = {"images_per_second": images_per_second, "batch": batch}
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print("RESULT " + json.dumps(result), flush=True)


def run_worker(cfg, args):
    env = dict(os.environ, **cfg.get("env", {}))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        json.dumps(cfg),
        f"--warmup-steps={cfg.get('warmup_steps', args.warmup_steps)}",
        f"--steps={cfg.get('steps', args.steps)}",
        f"--image-size={args.image_size}",
    ]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(
            f"[benchmark] {cfg.get('name')} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
            flush=True,
        )
        return None
    result = json.loads(lines[-1][len("RESULT ") :])
    print(f"[benchmark] {cfg.get('name')}: {result} ({time.perf_counter() - start:.0f} s)", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--configs", default=",".join(CANDIDATES), help="comma-separated candidate names")
    parser.add_argument("--per-baseline", type=int, default=2, help="candidates between two baseline runs")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out (tracing, first runs)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per worker")
    parser.add_argument("--out", help="markdown file for the table")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise SystemExit(f"Unknown configurations {unknown}; valid: {', '.join(CANDIDATES)}.")

    sys.path.insert(0, REPO)
    from hvd_lars import provenance

    started = time.time()
    peaks = [run_worker({"name": "matmul", "model": "matmul"}, args)]
    baselines = [run_worker(BASELINE, args)]  # baselines[i] runs after the first i * per_baseline candidates
    measured = {}
    for i, name in enumerate(names):
        measured[name] = (run_worker({"name": name, **CANDIDATES[name]}, args), len(baselines) - 1)
        if (i + 1) % args.per_baseline == 0 or i == len(names) - 1:
            baselines.append(run_worker(BASELINE, args))
    peaks.append(run_worker({"name": "matmul", "model": "matmul"}, args))
    peak = {d: max(p["gflops"][d] for p in peaks if p) for d in ("float32", "bfloat16")}

    rows = []
    base_rates = [b["images_per_second"] for b in baselines if b]
    base_mean = sum(base_rates) / len(base_rates)
    rows.append(
        _row("keras_f32 (baseline, mean of all)", BASELINE, base_mean, 1.0, peak, baselines, args.image_size)
    )
    for name, (result, before) in measured.items():
        if result is None:
            rows.append(f"| {name} | {_describe(CANDIDATES[name])} | failed | | | |")
            continue
        around = [b["images_per_second"] for b in baselines[before : before + 2] if b]
        ratio = result["images_per_second"] / (sum(around) / len(around))
        rows.append(
            _row(name, CANDIDATES[name], result["images_per_second"], ratio, peak, [result], args.image_size)
        )

    record = provenance.record()
    command = "TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python " + " ".join(
        [os.path.relpath(os.path.abspath(__file__), REPO)] + sys.argv[1:]
    )
    text = "\n".join(
        [
            "# ResNet-50 training throughput on CPU (synthetic 224x224, images/s per process)",
            "",
            f"- command: `{command}`",
            f"- git SHA: {record['git_sha']}; date: {record['date']}; "
            f"wall time {time.time() - started:.0f} s",
            f"- machine: {record['machine']}; TensorFlow {record['tensorflow']}, Keras {record['keras']}",
            f"- measured `tf.matmul` 4096x4096 peak: {peak['float32']:.0f} GFLOP/s float32, "
            f"{peak['bfloat16']:.0f} GFLOP/s bfloat16 (best of the runs at start and end)",
            f"- {args.warmup_steps} warm-up steps, then {args.steps} timed steps per measurement; "
            f"baseline re-run every {args.per_baseline} candidates: "
            + ", ".join(f"{r:.2f}" for r in base_rates)
            + " images/s",
            "- ratio: candidate / mean of the baselines measured just before and after it; fraction of peak: "
            f"images/s x {TRAIN_GFLOP_PER_IMAGE} GFLOP / matmul peak of the configuration's precision",
            "",
            "| configuration | settings | images/s | ratio to baseline | fraction of peak | peak RSS (GiB) |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def _describe(cfg):
    parts = [
        "keras.applications.ResNet50 + SGD" if cfg["model"] == "keras" else "hvd_lars resnet50 + LARS",
        cfg["precision"],
        f"batch {cfg.get('batch', 32)}",
    ]
    if cfg["model"] == "ours":
        parts.append("fused BN" if cfg.get("fused", True) else "Keras BN")
    if cfg.get("jit"):
        parts.append("jit_compile")
    if cfg.get("intra") or cfg.get("inter"):
        parts.append(f"intra {cfg.get('intra')} / inter {cfg.get('inter')}")
    parts += [f"{k}={v}" for k, v in cfg.get("env", {}).items()]
    return ", ".join(parts)


def _row(name, cfg, rate, ratio, peak, results, image_size):
    peak_rate = peak["bfloat16" if cfg["precision"] == "mixed_bfloat16" else "float32"]
    # Convolution FLOPs scale with the pixel count (the 2 GFLOP/image of the fc layer is negligible).
    fraction = rate * TRAIN_GFLOP_PER_IMAGE * (image_size / 224) ** 2 / peak_rate
    rss = max(r["peak_rss_gib"] for r in results if r)
    return f"| {name} | {_describe(cfg)} | {rate:.2f} | {ratio:.2f}x | {fraction:.2f} | {rss:.2f} |"


if __name__ == "__main__":
    main()
