"""The input pipeline against what training consumes, both measured in one run on this machine.

Each pipeline (`hvd_lars.data.encoded_images.train_dataset`) runs in a subprocess pinned to one core on
JPEG fixtures of about ImageNet's weight (`make_fixtures`): ResNet-50's `inception` preprocessing at 224
and AlexNet-BN's `caffe_scaled` at 227 (on 500x375 and on 256x256 files), and the bare JPEG decode.
Training (the main program's model and optimizer, precision "auto", synthetic batches) runs on every core;
consumption per core = images/s / cores. What a socket needs = the paper's images/s per socket (You et
al., ICPP 2018: 94.8 for AlexNet, 46.9 for ResNet-50) x the decode cost per image.

    python -m benchmarks.benchmark_input --out results/input_pipeline.md   # about 6 minutes
"""

import glob
import io
import json
import os
import time

import numpy as np

from benchmarks import common

NOISE_STD = 30.0  # pixel noise (0-255 scale) that brings 500x375 files to ImageNet's ~110 KB at quality 90
JPEG_QUALITY = 90
NUM_FILES = 200
CLASSES = 10
FIXTURES = {"500x375": (500, 375), "256x256": (256, 256)}
IMAGENET_TRAIN_IMAGES = 1281167
# The paper's runs (You et al. 2018): (epochs, minutes, sockets) -> images/s per socket.
PAPER_RUNS = {"resnet50": (90, 20, 2048), "alexnet_bn": (100, 11, 2048)}
VARIANTS = {
    "ResNet-50: inception, 224x224, 500x375 files": {
        "kind": "train", "fixture": "500x375", "preprocessing": "inception", "size": 224, "model": "resnet50",
    },
    "AlexNet-BN: caffe_scaled, 227x227, 500x375 files (tfds)": {
        "kind": "train", "fixture": "500x375", "preprocessing": "caffe_scaled", "size": 227,
        "model": "alexnet_bn",
    },
    "AlexNet-BN: caffe_scaled, 227x227, 256x256 files (Caffe's LMDB)": {
        "kind": "train", "fixture": "256x256", "preprocessing": "caffe_scaled", "size": 227,
        "model": "alexnet_bn",
    },
    "JPEG decode alone, 500x375 files": {"kind": "decode", "fixture": "500x375"},
}  # fmt: skip
MODELS = {"resnet50": 224, "alexnet_bn": 227}


def make_fixtures(root, width, height):
    """Writes NUM_FILES JPEGs under root/train/<class>/; returns their mean size in bytes."""
    from PIL import Image

    from hvd_lars.data import fashion_mnist_files

    images, labels = fashion_mnist_files.load("test")
    rng = np.random.default_rng(0)
    tint = rng.uniform(0.5, 1.0, size=(CLASSES, 3))
    sizes = []
    for i in range(NUM_FILES):
        grey = Image.fromarray(images[i, :, :, 0]).resize((width, height), Image.BILINEAR)
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


def _files(root):
    paths = sorted(glob.glob(os.path.join(root, "train", "*", "*.JPEG")))
    return paths, [int(os.path.basename(os.path.dirname(p))[1:]) for p in paths]


def pipeline_worker(root, kind, batch, batches, preprocessing=None, size=224, **_):
    """Images/s of one pipeline on one core (this process pinned to it, one tf.data thread)."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from hvd_lars.data import encoded_images, order, tfdata_options

    paths, labels = _files(root)
    if kind == "train":
        # The main program's stream: each epoch's permutation of this rank's files, then read and decoded.
        paths_t, labels_t = tf.constant(paths), tf.constant(labels, tf.int32)
        stream = order.index_stream(len(paths), 0).map(
            lambda i: (tf.gather(paths_t, i), tf.gather(paths_t, i), tf.gather(labels_t, i))
        )
        ds = encoded_images.train_dataset(
            stream, batch, 0, size, read=tf.io.read_file, threads=1, preprocessing=preprocessing
        )
    else:
        ds = tf.data.Dataset.from_tensor_slices(paths).repeat()
        ds = ds.map(lambda path: tf.io.decode_jpeg(tf.io.read_file(path)))
        ds = ds.map(lambda image: tf.reduce_sum(tf.cast(image[0, 0], tf.int32))).batch(batch)
        ds = ds.prefetch(tf.data.AUTOTUNE).with_options(tfdata_options.options(True, threads=1))
    iterator = iter(ds)
    for _ in range(3):  # warm-up: tracing, AUTOTUNE's first decisions
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return {"images_per_second": batch * batches / (time.perf_counter() - start)}


def training_worker(model_name, batch, steps, warmup_steps):
    """Images/s of the main program's training step on every core of this process."""
    import keras
    import tensorflow as tf

    from hvd_lars import LARS, DistributedOptimizer, mlperf_exclusions
    from hvd_lars.models import get_model
    from hvd_lars.training.config import resolve_precision

    precision = resolve_precision("auto")
    keras.mixed_precision.set_global_policy(precision)
    size = MODELS[model_name]
    model = get_model(model_name, input_shape=(size, size, 3))
    lars = LARS(0.1, momentum=0.9, weight_decay=1e-4, exclude_from_weight_decay=mlperf_exclusions())
    model.compile(
        optimizer=DistributedOptimizer(lars),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    images = tf.random.stateless_uniform((batch, size, size, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=1000, dtype=tf.int32)
    stamps = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            stamps.append(time.perf_counter())

    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    model.fit(data, steps_per_epoch=warmup_steps + steps, epochs=1, verbose=0, callbacks=[Stamp()])
    rate = batch * steps / (stamps[-1] - stamps[warmup_steps - 1])
    cores = len(os.sched_getaffinity(0))
    return {"images_per_second": rate, "cores": cores, "per_core": rate / cores, "precision": precision}


def _run(spec):
    result = common.run(common.worker_command("benchmark_input", "--worker", json.dumps(spec)), timeout=1200)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = common.argument_parser(__doc__)
    parser.add_argument("--out", default="")
    parser.add_argument("--workdir", default="/tmp/hvd_lars_input_benchmark")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--pipeline_batches", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="timed training steps")
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--worker", default="")
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        if spec.pop("what") == "pipeline":
            print(json.dumps(pipeline_worker(**spec)))
        else:
            print(json.dumps(training_worker(**spec)))
        return

    from hvd_lars.training import epoch_logs

    started = time.time()
    mean_bytes = {}
    for name, (width, height) in FIXTURES.items():
        mean_bytes[name] = make_fixtures(os.path.join(args.workdir, name), width, height)
    load_before = os.getloadavg()[0]
    rates = {name: [] for name in VARIANTS}
    training = {name: [] for name in MODELS}
    for round_ in range(args.rounds):
        for name, variant in VARIANTS.items():
            root = os.path.join(args.workdir, variant["fixture"])
            spec = dict(variant, what="pipeline", root=root, batch=args.batch, batches=args.pipeline_batches)
            rates[name].append(_run(spec)["images_per_second"])
            print(f"round {round_}: {name}: {rates[name][-1]:.1f} images/s on one core", flush=True)
        for model_name in MODELS:
            spec = dict(what="train", model_name=model_name, batch=args.batch, steps=args.steps)
            training[model_name].append(_run({**spec, "warmup_steps": args.warmup_steps}))
            print(f"round {round_}: {model_name} training: {training[model_name][-1]}", flush=True)
    load_after = os.getloadavg()[0]
    record = epoch_logs.provenance()
    matmul = common.matmul_rate()
    consumed = {m: float(np.mean([r["per_core"] for r in runs])) for m, runs in training.items()}
    command = common.command_line("benchmark_input", argv)
    lines = [
        "# Input pipeline per core against what training consumes per core",
        "",
        *common.provenance_lines(command, matmul),
        f"- {time.time() - started:.0f} s; TensorFlow {record['tensorflow']}, Keras {record['keras']}",
        f"- fixtures: {NUM_FILES} JPEGs each of "
        + ", ".join(f"{k} (mean {v / 1024:.0f} KiB)" for k, v in mean_bytes.items())
        + f", quality {JPEG_QUALITY} (Fashion-MNIST test images enlarged, tinted, noise std {NOISE_STD:g}; "
        "ImageNet's training JPEGs average about 110 KB)",
        f"- pipelines: one core (process pinned), private tf.data pool of 1 thread, batch {args.batch}, "
        f"{args.pipeline_batches} batches timed after 3; training: the main program's step "
        f"({training['resnet50'][0]['precision']}), batch {args.batch}, {args.steps} steps timed after "
        f"{args.warmup_steps}, on {training['resnet50'][0]['cores']} cores; {args.rounds} alternating "
        f"rounds; 1-minute load average {load_before:.1f} at the start, {load_after:.1f} at the end",
        "",
        "| pipeline | images/s on one core, per round | mean | core-ms per image | x what its model's "
        "training consumes per core | cores a socket needs at the paper's rate |",
        "|---|---|---|---|---|---|",
    ]
    for name, values in rates.items():
        mean = float(np.mean(values))
        model = VARIANTS[name].get("model")
        if model:
            epochs, minutes, sockets = PAPER_RUNS[model]
            per_socket = epochs * IMAGENET_TRAIN_IMAGES / (minutes * 60) / sockets
            ratio = f"{mean / consumed[model]:.0f}x"
            need = f"{per_socket / mean:.2f} ({per_socket:.1f} images/s)"
        else:
            ratio = need = ""
        joined = ", ".join(f"{v:.1f}" for v in values)
        lines.append(f"| {name} | {joined} | {mean:.1f} | {1000 / mean:.2f} | {ratio} | {need} |")
    lines += ["", "| training (all cores) | images/s per round | per core |", "|---|---|---|"]
    for model, runs in training.items():
        per_round = ", ".join(f"{r['images_per_second']:.2f}" for r in runs)
        lines.append(f"| {model} | {per_round} | {consumed[model]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        common.write_report(args.out, text)


if __name__ == "__main__":
    main()
