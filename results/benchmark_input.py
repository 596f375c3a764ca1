"""Input pipeline speed per core against ResNet-50 training speed per core, side by side.

The training pipeline (read file, decode only the Inception random crop, resize to 224x224, flip,
normalise, batch; `hvd_lars.data.pipeline.train_dataset` as `--dataset=image_folder` builds it) runs in a
subprocess pinned to ONE core with a private tf.data pool of one thread, on a folder of JPEG fixtures
made from Fashion-MNIST test images: enlarged to 500x375 (about ImageNet's mean size), tinted per channel
and with pixel noise added so the files weigh about as much as ImageNet's (~110 KB; smooth enlarged
images would decode unrealistically fast). ResNet-50 (`keras.applications.ResNet50(weights=None)`,
`model.fit`, SGD momentum, float32, synthetic 224x224 batch) trains in a subprocess using every core;
its rate per core is images/s / cores. Measurements alternate (pipeline, ResNet, pipeline, ResNet, ...)
so a shared machine's load hits both; the verdict uses the ratio of the means.
The goal (issue 6): one core of input supplies >= 2x what one core of training consumes.

Usage (writes the markdown report to --out and prints it):
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python results/benchmark_input.py --out results/input_pipeline.md
"""

import argparse
import io
import json
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

IMAGE_WIDTH, IMAGE_HEIGHT = 500, 375  # near ImageNet's mean training image (about 400x350 to 500x375)
NOISE_STD = 30.0  # pixel noise (0-255 scale) that brings the files to ImageNet's ~110 KB at quality 90
JPEG_QUALITY = 90
NUM_FILES = 200
CLASSES = 10
VARIANTS = {
    "train, deterministic": {"kind": "train", "deterministic": True},
    "train, out of order": {"kind": "train", "deterministic": False},
    "train, without the corrupt-file guard": {"kind": "train_unguarded", "deterministic": True},
    "eval (resize 256, centre crop 224)": {"kind": "eval", "deterministic": True},
}


def make_fixtures(root):
    """Writes NUM_FILES JPEGs under root/train/<class>/; returns their mean size in bytes."""
    from PIL import Image

    from hvd_lars.data import fashion_mnist

    images, labels = fashion_mnist.load("test")
    rng = np.random.default_rng(0)
    tint = rng.uniform(0.5, 1.0, size=(CLASSES, 3))
    sizes = []
    for i in range(NUM_FILES):
        grey = Image.fromarray(images[i, :, :, 0]).resize((IMAGE_WIDTH, IMAGE_HEIGHT), Image.BILINEAR)
        rgb = np.asarray(grey, np.float32)[..., None] * tint[labels[i]]
        rgb = np.clip(rgb + rng.normal(0, NOISE_STD, rgb.shape), 0, 255).astype(np.uint8)
        folder = os.path.join(root, "train", f"n{labels[i]:08d}")
        os.makedirs(folder, exist_ok=True)
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, "JPEG", quality=JPEG_QUALITY)
        with open(os.path.join(folder, f"img_{i}.JPEG"), "wb") as f:
            f.write(buffer.getvalue())
        sizes.append(len(buffer.getvalue()))
    return float(np.mean(sizes))


def pipeline_worker(root, kind, deterministic, batch, batches):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from hvd_lars.data import listing, order, pipeline, preprocessing

    found = listing.list_split(os.path.join(root, "train"))
    paths, labels = found.paths(), found.labels
    source = tf.data.Dataset.from_tensor_slices((paths, paths, labels))
    if kind == "train":
        stream = order.index_stream(len(paths), 0).map(
            lambda i: (tf.gather(paths, i), tf.gather(paths, i), tf.gather(labels, i))
        )
        ds = pipeline.train_dataset(
            stream, batch, 0, 224, read=tf.io.read_file, deterministic=deterministic, threads=1
        )
    elif kind == "train_unguarded":
        ds = source.shuffle(len(paths), seed=0).repeat().enumerate()
        ds = ds.map(
            lambda i, e: (
                preprocessing.preprocess_train(
                    tf.io.read_file(e[1]), tf.stack([tf.constant(0, tf.int64), i])
                ),
                e[2],
            ),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        ds = ds.batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
        ds = ds.with_options(pipeline.options(deterministic, threads=1))
    else:
        ds = pipeline.eval_dataset(source, batch, 224, read=tf.io.read_file, threads=1).repeat()
    iterator = iter(ds)
    for _ in range(3):  # warm-up: tracing, AUTOTUNE's first decisions
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        images, _ = next(iterator)
    elapsed = time.perf_counter() - start
    assert images.shape == (batch, 224, 224, 3)
    return {"images_per_second": batch * batches / elapsed}


def resnet_worker(batch, steps, warmup_steps):
    import keras
    import tensorflow as tf

    cores = len(os.sched_getaffinity(0))
    model = keras.applications.ResNet50(weights=None)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False),
        jit_compile=False,
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 224, 224, 3), dtype=np.float32)
    y = rng.integers(0, 1000, size=batch).astype(np.int32)
    ds = tf.data.Dataset.from_tensors((x, y)).repeat()

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            if step + 1 == warmup_steps:
                self.start = time.perf_counter()

    timer = Timer()
    model.fit(ds, steps_per_epoch=warmup_steps + steps, epochs=1, verbose=0, callbacks=[timer])
    rate = batch * steps / (time.perf_counter() - timer.start)
    return {"images_per_second": rate, "cores": cores, "per_core": rate / cores}


def _run(args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(args)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="")
    parser.add_argument("--workdir", default="/tmp/hvd_lars_input_benchmark")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--pipeline_batches", type=int, default=15)
    parser.add_argument("--resnet_steps", type=int, default=4)
    parser.add_argument("--resnet_warmup_steps", type=int, default=2)
    parser.add_argument("--worker", default="")
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        if spec.pop("what") == "pipeline":
            print(json.dumps(pipeline_worker(**spec)))
        else:
            print(json.dumps(resnet_worker(**spec)))
        return

    from hvd_lars import provenance

    mean_bytes = make_fixtures(args.workdir)
    load_before = os.getloadavg()[0]
    rates = {name: [] for name in VARIANTS}
    resnet = []
    for round_ in range(args.rounds):
        for name, variant in VARIANTS.items():
            spec = dict(what="pipeline", root=args.workdir, batch=args.batch, batches=args.pipeline_batches)
            rates[name].append(_run({**spec, **variant})["images_per_second"])
            print(f"round {round_}: {name}: {rates[name][-1]:.1f} images/s on one core", flush=True)
        spec = dict(
            what="resnet", batch=args.batch, steps=args.resnet_steps, warmup_steps=args.resnet_warmup_steps
        )
        resnet.append(_run(spec))
        print(f"round {round_}: ResNet-50: {resnet[-1]}", flush=True)

    per_core = float(np.mean([r["per_core"] for r in resnet]))
    load_after = os.getloadavg()[0]
    record = provenance.record()
    command = "TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python results/benchmark_input.py " + " ".join(sys.argv[1:])
    lines = [
        "# Input pipeline speed per core against ResNet-50 training per core",
        "",
        f"Command: `{command}`  ",
        f"Git SHA: {record['git_sha']}; date: {record['date']}  ",
        f"Machine: {record['machine']}; TensorFlow {record['tensorflow']}, Keras {record['keras']}  ",
        f"Fixtures: {NUM_FILES} JPEGs {IMAGE_WIDTH}x{IMAGE_HEIGHT} (Fashion-MNIST test images enlarged, "
        f"tinted, noise std {NOISE_STD:g}), quality {JPEG_QUALITY}, mean {mean_bytes / 1024:.0f} KiB per "
        "file (ImageNet: ~110 KB).  ",
        f"Pipeline: one core (process pinned), private tf.data pool of 1 thread, batch {args.batch}, "
        f"{args.pipeline_batches} batches timed after 3 warm-up batches. ResNet-50: "
        "`keras.applications.ResNet50(weights=None)`, SGD momentum, float32, synthetic data, "
        f"batch {args.batch}, {args.resnet_steps} steps timed after {args.resnet_warmup_steps}, on "
        f"{resnet[0]['cores']} cores. {args.rounds} alternating rounds; the machine is shared, so the "
        "figures are noisy, the ratio less so. 1-minute load average (other engineers' jobs included): "
        f"{load_before:.1f} at the start, {load_after:.1f} at the end, on {os.cpu_count()} cores.",
        "",
        "| pipeline (224x224 output) | images/s on one core, per round | mean | x ResNet-50 per core |",
        "|---|---|---|---|",
    ]
    for name, values in rates.items():
        joined = ", ".join(f"{v:.1f}" for v in values)
        lines.append(f"| {name} | {joined} | {np.mean(values):.1f} | {np.mean(values) / per_core:.1f} |")
    resnet_rounds = ", ".join(f"{r['images_per_second']:.2f}" for r in resnet)
    lines += [
        "",
        f"ResNet-50 training: {resnet_rounds} images/s on {resnet[0]['cores']} cores per round, "
        f"so **{per_core:.2f} images/s per core** consumed.",
        "",
    ]
    ratio = np.mean(rates["train, deterministic"]) / per_core
    verdict = "meets" if ratio >= 2 else "does NOT meet"
    lines.append(
        f"Verdict: one core of the (default, deterministic) training pipeline supplies {ratio:.0f}x what "
        f"one core of ResNet-50 training consumes: it {verdict} the >= 2x goal."
    )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
