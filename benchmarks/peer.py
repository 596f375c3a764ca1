"""hvd_lars against the peer a Horovod user would otherwise run: Keras 2 (`tf_keras`, TF_USE_LEGACY_KERAS=1)
beside the same TensorFlow and the same Horovod build, with Horovod 0.28.1's own `horovod.tensorflow.keras`.

One training script, run on both sides: `applications.ResNet50(weights=None)` of each Keras, per-rank batch
16, SGD with momentum 0.9 (rate 0.01 x world size) in `hvd.DistributedOptimizer`, synthetic data (one
random batch per rank, repeated, as Horovod's synthetic benchmarks), `BroadcastGlobalVariablesCallback(0)`
and `MetricAverageCallback()`, `model.fit` of one epoch: `--warmup` steps, then a timed window of `--steps`.
hvd_lars's side is the same script ported with one import (`import hvd_lars.parallel.horovod_keras as
hvd`), with three models: Keras 3's ResNet50 as it is ("as is"), the same after
`hvd_lars.fuse_batch_norm(model)` ("fused"), and the project's own ResNet-50
(`hvd_lars.models.get_model("resnet50")`, float32 logits, "own"). The applications models are compared with
the peer's `tf_keras.applications.ResNet50` measured in the same repetition; the project's ResNet-50 (v1.5:
6% more multiply-adds than applications' v1) with the same network on the peer's side ("peer_own":
`hvd_lars/models/resnet.py` run with `keras` bound to tf_keras, whose `BatchNormalization` is fused on NHWC
inputs, in place of the project's layer).

Per run: images/s (images of all ranks over the slowest rank's wall time of the window) and images per
CPU-second (the same images over the summed process CPU time, `time.process_time`, of all ranks in the
window: the figure that holds on a loaded machine). Per layout and repetition one launch per side runs its
models and dtypes in turn (peer; as is, fused, own), the side that goes first and the order inside reversed
every other repetition; `--repetitions` of each, medians reported. At the end every rank hashes
its trainable weights (SHA-256 of their bytes) and the run fails unless all ranks' hashes agree; the batch
norm moving statistics are each rank's own on both sides (Horovod averages gradients, not them).

The peer's environment is made here: `pip install --no-deps --target ~/.cache/hvd_lars/peer/tf_keras-X
tf_keras==X` once (X = TensorFlow's version), that folder on PYTHONPATH of the peer's processes only, and
TF_USE_LEGACY_KERAS=1 there. Horovod's `MetricAverageCallback` fails on TensorFlow 2.21 at the first epoch
end (`module 'keras.backend' has no attribute 'constant'`: TF 2.21 installs Keras 3 as `keras`, and
TF_USE_LEGACY_KERAS redirects only `tf.keras`), so the peer's worker sets
`horovod.tensorflow.keras.callbacks.K = tf_keras.backend` first, as such a user must.

Layouts (`--layouts`): `1` one process (no launcher), `2` two ranks on this machine (`horovodrun -np 2 -H
localhost:2`), `2h` and `4h` 2 and 4 emulated hosts, one rank each, on `--link_rate` links
(launch/emulated_cluster.sh, needs root; a smaller `--image_size` where ResNet-50's steps are too long there,
the same on both sides).

`--profile` (after a run, same `--out`) adds a profile of one step per side: the peer's
`applications.ResNet50` and each of the run's hvd_lars models, 1 process, the run's workload, the step after
warm-up under tf.profiler, op time by layer kind (batch norm, convolution, other) and by op type.

    python -m benchmarks.peer                                    # 1 process and 2 ranks, float32 and bf16
    python -m benchmarks.peer --image_size=112 --steps=6         # smaller images, shorter window
    python -m benchmarks.peer --layouts=2h,4h --link_rate=1gbit  # as root: emulated hosts
    python -m benchmarks.peer --profile  # after a run: a profile of one step per side, into its report
    python -m benchmarks.peer --report_only  # the report again from its JSON (written after every launch)
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

# The worker imports nothing of this project at module level: the peer's processes must see Keras 2 only.

SIDES = {  # run name -> (side, model)
    "peer": ("peer", "applications"),
    "peer_own": ("peer", "resnet50"),
    "as_is": ("hvd_lars", "applications"),
    "fused": ("hvd_lars", "applications_fused"),
    "own": ("hvd_lars", "resnet50"),
}
ROW_NAMES = {
    "as_is": "`applications.ResNet50`, as is",
    "fused": "`applications.ResNet50`, `fuse_batch_norm`",
    "own": "project's `get_model('resnet50')`",
    "peer": "peer",
    "peer_own": "peer, project's ResNet-50 in Keras 2",
}
OURS = ("as_is", "fused", "own")


def peers(models):
    """The peer's runs that `models` (of OURS) are compared with."""
    return ["peer"] * bool({"as_is", "fused"} & set(models)) + ["peer_own"] * ("own" in models)


PROVENANCE_PREFIXES = ("- Command (from the repository root)", "- Git SHA:", "- Machine:", "- Raw data:")
LAYOUT_NAMES = {"1": "1 process", "2": "2 ranks", "2h": "2 emulated hosts", "4h": "4 emulated hosts"}


def peer_dir(version):
    return os.path.join(os.path.expanduser("~"), ".cache", "hvd_lars", "peer", f"tf_keras-{version}")


def ensure_peer(version, folder):
    """Installs tf_keras==`version` (no dependencies: the peer uses this environment's TensorFlow and
    Horovod) into `folder` unless it is there; returns `folder`."""
    if os.path.isdir(os.path.join(folder, "tf_keras")):
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".", dir=os.path.dirname(folder))
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", staging]
    subprocess.run([*command, f"tf_keras=={version}"], check=True, timeout=600)
    try:
        os.rename(staging, folder)
    except OSError:  # another run installed it meanwhile
        if not os.path.isdir(os.path.join(folder, "tf_keras")):
            raise
    return folder


# --------------------------------------------------------------------------------------------- worker


def worker(args):
    """Runs `args.runs` (NAME:DTYPE, ...; names of SIDES, all of one side) one after another in this
    process, each a fresh model; writes each rank's record of each to RESULT.NAME_DTYPE.rankR.json."""
    import tensorflow as tf

    if args.side == "peer":
        import horovod.tensorflow.keras as hvd
        import horovod.tensorflow.keras.callbacks as hvd_callbacks
        import tf_keras as keras

        hvd_callbacks.K = keras.backend  # else MetricAverageCallback fails on TF 2.21 (module docstring)
    else:
        import keras

        import hvd_lars.parallel.horovod_keras as hvd
    hvd.init()
    for run in args.runs.split(","):
        name, dtype = run.split(":")
        keras.backend.clear_session()
        record = train(keras, hvd, tf, SIDES[name][1], dtype, args)
        with open(f"{args.result}.{name}_{dtype}.rank{record['rank']}.json", "w") as f:
            json.dump(record, f)


def train(keras, hvd, tf, model_name, dtype, args):
    """Builds, compiles and fits one model under policy `dtype`; returns this rank's record."""
    import hashlib

    import numpy as np

    rank, size = hvd.rank(), hvd.size()
    keras.mixed_precision.set_global_policy(dtype)
    shape = (args.image_size, args.image_size, 3)
    if model_name == "resnet50":
        if args.side == "peer":
            model = own_resnet50(keras, shape)
        else:
            from hvd_lars.models import get_model

            model = get_model("resnet50", num_classes=1000, input_shape=shape)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        model = keras.applications.ResNet50(weights=None, input_shape=shape)
        if model_name == "applications_fused":
            import hvd_lars

            hvd_lars.fuse_batch_norm(model)
        loss = "sparse_categorical_crossentropy"
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * size, momentum=0.9))
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])

    images = tf.random.stateless_uniform((args.batch_size, *shape), seed=(rank, 1))
    labels = tf.random.stateless_uniform((args.batch_size, 1), seed=(rank, 2), maxval=1000, dtype=tf.int64)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()

    marks = {}

    profile = f"{args.profile_dir}/{model_name}_{dtype}" if args.profile_dir else None

    class Window(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if profile and batch == args.warmup:
                tf.profiler.experimental.start(profile)

        def on_train_batch_end(self, batch, logs=None):
            if profile and batch == args.warmup:
                tf.profiler.experimental.stop()
            if batch in (args.warmup - 1, args.warmup + args.steps - 1):
                marks[batch] = (time.perf_counter(), time.process_time())

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        Window(),
    ]
    steps = args.warmup + args.steps
    history = model.fit(data, steps_per_epoch=steps, epochs=1, callbacks=callbacks, verbose=0, shuffle=False)
    (t0, c0), (t1, c1) = marks[args.warmup - 1], marks[steps - 1]
    digest = hashlib.sha256()
    for weight in model.trainable_weights:
        digest.update(np.ascontiguousarray(weight.numpy()).tobytes())
    return {
        "profile": op_times(profile) if profile else None,
        "rank": rank,
        "size": size,
        "wall_s": t1 - t0,
        "cpu_s": c1 - c0,
        "images": args.batch_size * args.steps,
        "weights_sha256": digest.hexdigest(),
        "trainable_parameters": sum(int(np.prod(w.shape)) for w in model.trainable_weights),
        "loss": float(history.history["loss"][-1]),
        "keras": keras.__version__,
        "tensorflow": tf.__version__,
        "horovod": __import__("horovod").__version__,
    }


def own_resnet50(tf_keras, shape):
    """The project's ResNet-50 built from Keras 2's layers: `hvd_lars/models/resnet.py` run as a new module
    while `keras` names tf_keras and the project's batch-norm module is one whose `FusedBatchNormalization`
    is tf_keras's `BatchNormalization` (fused on NHWC inputs: TensorFlow's FusedBatchNormV3, as the
    project's layer). Nothing of hvd_lars is imported."""
    import importlib.util
    import types

    names = ("keras", "hvd_lars.models.batch_norm")
    saved = {name: sys.modules.get(name) for name in names}
    batch_norm = types.ModuleType(names[1])
    batch_norm.FusedBatchNormalization = tf_keras.layers.BatchNormalization
    sys.modules.update(zip(names, (tf_keras, batch_norm)))
    try:
        path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "hvd_lars", "models", "resnet.py")
        spec = importlib.util.spec_from_file_location("peer_resnet", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, was in saved.items():
            sys.modules.pop(name) if was is None else sys.modules.__setitem__(name, was)
    return module.resnet(50, num_classes=1000, input_shape=shape)


def op_times(folder):
    """{"by_type": {op type: ms}, "by_layer": {"batch norm"|"convolution"|"other": ms}} of the TensorFlow
    ops in the profile (tf.profiler's XSpace) under `folder`: every op's duration summed over the threads
    that ran it, forward and backward (an op is a batch norm's where its name holds a `*_bn` scope, Keras 3's
    `*_bn_1` included, as every batch norm of applications.ResNet50 is named, or a `*_bnN` one, `*_bnN_1`
    included, as the project's ResNet-50 names them); executor events (`A::B`) are left out."""
    import collections
    import glob
    import re

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    by_type, by_layer = collections.Counter(), collections.Counter()
    for path in glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            if not plane.name.startswith("/host:CPU"):
                continue
            for line in plane.lines:
                for event in line.events:
                    name = plane.event_metadata[event.metadata_id].name
                    scope, _, kind = name.rpartition(":")
                    if (
                        not scope
                        or "::" in name
                        or " " in name
                        or "PartitionedCall" in kind
                        or kind.startswith("__")
                    ):
                        continue
                    ms = event.duration_ps / 1e9
                    by_type[kind] += ms
                    if re.search(r"_bn\d*(_\d+)?/", scope + "/"):
                        layer = "batch norm"
                    else:
                        layer = "convolution" if "conv" in kind.lower() else "other"
                    by_layer[layer] += ms
    return {"by_type": dict(by_type), "by_layer": dict(by_layer)}


# --------------------------------------------------------------------------------------------- driver


def launch(side, runs, layout, args, peer_path, env_base, shared, profile=False):
    """One process per rank of `side` ("peer" or "hvd_lars") doing `runs` ((name, dtype) pairs) in turn;
    returns one record per run, its ranks' figures summed (images, CPU time) or the slowest (wall)."""
    from benchmarks.common import HOROVODRUN

    result = os.path.join(shared, f"{side}_{layout}")
    worker_args = [
        "--worker", f"--side={side}", "--runs=" + ",".join(f"{n}:{d}" for n, d in runs),
        f"--image_size={args.image_size}", f"--batch_size={args.batch_size}", f"--warmup={args.warmup}",
        f"--steps={args.steps}", f"--result={result}",
    ]  # fmt: skip
    if profile:
        worker_args.append(f"--profile_dir={shared}/profile_{side}")
    python = [sys.executable, "-m", __spec__.name, *worker_args]
    if layout == "1":
        ranks, command = 1, python
    elif layout.endswith("h"):
        ranks = int(layout[:-1])
        hosts = ",".join(f"node{k}:1" for k in range(1, ranks + 1))
        command = [HOROVODRUN, "-np", str(ranks), "-H", hosts, *python]
    else:
        ranks = int(layout)
        command = [HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", *python]
    env = dict(env_base)
    if side == "peer":
        env["TF_USE_LEGACY_KERAS"] = "1"
        env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + peer_path
    files = {(n, d): [f"{result}.{n}_{d}.rank{r}.json" for r in range(ranks)] for n, d in runs}
    for path in sum(files.values(), []):
        if os.path.exists(path):
            os.remove(path)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    took = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")  # fmt: skip
    out = []
    for (name, dtype), paths in files.items():
        records = []
        for path in paths:
            with open(path) as f:
                records.append(json.load(f))
        hashes = {rec["weights_sha256"] for rec in records}
        if len(hashes) != 1:
            raise RuntimeError(f"{name} {layout} {dtype}: ranks' weights differ at the end: {sorted(hashes)}")
        images = sum(rec["images"] for rec in records)
        wall = max(rec["wall_s"] for rec in records)
        cpu = sum(rec["cpu_s"] for rec in records)
        out.append({
            "name": name, "layout": layout, "dtype": dtype, "ranks": ranks, "images": images, "wall_s": wall,
            "cpu_s": cpu, "images_per_s": images / wall, "images_per_cpu_s": images / cpu,
            "weights_identical": True, "loss": records[0]["loss"], "process_s": took, "load": os.getloadavg(),
            "keras": records[0]["keras"], "tensorflow": records[0]["tensorflow"],
            "horovod": records[0]["horovod"], "profile": records[0].get("profile"),
            "trainable_parameters": records[0]["trainable_parameters"],
        })  # fmt: skip
    return out


def measure(args, peer_path, save=None):
    """Every run of every layout and dtype; returns the list of run records. Per layout and repetition,
    one launch of the peer (its dtypes in turn) and one of hvd_lars (each model and dtype in turn): a
    process start, TensorFlow's import and the launcher are paid once per side. The side that goes first,
    and the order inside each, are reversed every other repetition."""
    from benchmarks.common import REPO, emulated_cluster, worker_env

    env_base = {k: v for k, v in worker_env().items() if not k.startswith(("HOROVOD_", "OMPI_MCA_"))}
    env_base.pop("TF_USE_LEGACY_KERAS", None)
    env_base["PYTHONPATH"] = REPO  # the peer's folder is added for its processes only
    all_runs = []
    for layout in args.layouts:
        nodes = int(layout[:-1]) if layout.endswith("h") else 0
        with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_peer_") as shared:
            os.chmod(shared, 0o777)
            cluster = emulated_cluster(nodes, args.link_rate) if nodes else _nothing()
            with cluster:
                for rep in range(args.repetitions):
                    sides = {
                        "peer": [(n, d) for d in args.dtypes for n in peers(args.models)],
                        "hvd_lars": [(n, d) for d in args.dtypes for n in args.models],
                    }
                    order = ["peer", "hvd_lars"]
                    if rep % 2:
                        order = order[::-1]
                        sides = {k: v[::-1] for k, v in sides.items()}
                    for side in order:
                        for run in launch(side, sides[side], layout, args, peer_path, env_base, shared):
                            run["repetition"] = rep
                            all_runs.append(run)
                            print(
                                f"[peer] {LAYOUT_NAMES[layout]} {run['dtype']} rep {rep} {run['name']}: "
                                f"{run['images_per_s']:.2f} images/s, {run['images_per_cpu_s']:.3f} "
                                f"images/CPU-s (load {run['load'][0]:.1f}, process {run['process_s']:.0f} s)",
                                flush=True,
                            )
                        if save:
                            save(all_runs)
    return all_runs


def profile(args, peer_path):
    """One process per side (1 process, no launcher), each of `args.dtypes`: the peer and each of
    `args.models`, the step after warm-up under tf.profiler; returns their run
    records with "profile" (`op_times`). Their timed windows are not the measurement's (the profiler ran
    in them)."""
    from benchmarks.common import REPO, worker_env

    env_base = {k: v for k, v in worker_env().items() if not k.startswith(("HOROVOD_", "OMPI_MCA_"))}
    env_base.pop("TF_USE_LEGACY_KERAS", None)
    env_base["PYTHONPATH"] = REPO
    runs = []
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_peer_profile_") as shared:
        for side, names in (("peer", peers(args.models)), ("hvd_lars", args.models)):
            todo = [(n, d) for d in args.dtypes for n in names]
            runs += launch(side, todo, "1", args, peer_path, env_base, shared, profile=True)
    return runs


def profile_lines(data):
    """The report's profile section of `data["profile"]` (a dict of command, sha, date, runs)."""
    from benchmarks.common import sha_text

    prof = data["profile"]
    lines = [
        "",
        "## Profile of one step per side",
        "",
        f"- Command (from the repository root): `{prof['command']}`; git SHA: {sha_text(prof['sha'])}; date "
        f"(UTC): {prof['date']}; machine: {prof['machine']}",
        "",
        "One training step after warm-up under `tf.profiler`, 1 process, the same workload: the TensorFlow "
        "ops' time (ms, summed over the threads that ran them, forward and backward), by layer kind (an op "
        "is a batch norm's where its scope is a `*_bn` or `*_bnN` layer) and the 8 op types that took "
        "longest.",
        "",
    ]
    for dtype in dict.fromkeys(r["dtype"] for r in prof["runs"]):
        these = [r for r in prof["runs"] if r["dtype"] == dtype]
        heads = [ROW_NAMES[r["name"]] for r in these]
        lines += [f"{dtype}:", "", "| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(these)]
        for kind in ("batch norm", "convolution", "other"):
            lines.append(
                f"| {kind} | "
                + " | ".join(f"{r['profile']['by_layer'].get(kind, 0):.0f}" for r in these)
                + " |"
            )
        lines.append(
            "| all ops | " + " | ".join(f"{sum(r['profile']['by_layer'].values()):.0f}" for r in these) + " |"
        )
        lines += ["", "| op type | " + " | ".join(heads) + " |", "|---|" + "---|" * len(these)]
        totals = {}
        for r in these:
            for kind, ms in r["profile"]["by_type"].items():
                totals[kind] = max(totals.get(kind, 0), ms)
        for kind in sorted(totals, key=totals.get, reverse=True)[:8]:
            lines.append(
                f"| `{kind}` | "
                + " | ".join(f"{r['profile']['by_type'].get(kind, 0):.0f}" for r in these)
                + " |"
            )
        lines.append("")
    return lines


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def rows(runs):
    """(layout, dtype, name, peer median images/s, ours, peer median images/CPU-s, ours) per row."""
    out = []
    keys = []
    for run in runs:
        key = (run["layout"], run["dtype"])
        if key not in keys:
            keys.append(key)
    for layout, dtype in keys:
        these = [r for r in runs if (r["layout"], r["dtype"]) == (layout, dtype)]

        def median(name, field, these=these):
            values = [r[field] for r in these if r["name"] == name]
            return statistics.median(values) if values else None

        for name in [n for n in OURS if any(r["name"] == n for r in these)]:
            peer = "peer_own" if name == "own" and median("peer_own", "wall_s") else "peer"
            out.append((layout, dtype, name, median(peer, "images_per_s"), median(name, "images_per_s"),
                        median(peer, "images_per_cpu_s"), median(name, "images_per_cpu_s")))  # fmt: skip
    return out


def report(args, runs, provenance, profile_section=()):
    first = runs[0]
    reps = max(r["repetition"] for r in runs) + 1
    loads = [r["load"][0] for r in runs]
    lines = [
        "# hvd_lars against Keras 2 + Horovod's own Keras layer",
        "",
        "Written by `benchmarks/peer.py` (its docstring says what runs). The peer: Keras "
        f"{next(r['keras'] for r in runs if r['name'] in peers(OURS))} (`tf_keras`, TF_USE_LEGACY_KERAS=1) "
        f"with Horovod {first['horovod']}'s `horovod.tensorflow.keras`, beside TensorFlow "
        f"{first['tensorflow']}; "
        f"hvd_lars: the same script with `import hvd_lars.parallel.horovod_keras as hvd`, Keras "
        f"{next(r['keras'] for r in runs if r['name'] in OURS)}. The peer's worker sets "
        "`horovod.tensorflow.keras.callbacks.K = tf_keras.backend`: without it Horovod's "
        "`MetricAverageCallback` fails at the first epoch end on TensorFlow 2.21 (`module 'keras.backend' "
        "has no attribute 'constant'`).",
        "",
        *provenance,
        f"- Workload: ResNet-50 at {args.image_size}x{args.image_size}x3, 1,000 classes, per-rank batch "
        f"{args.batch_size}, SGD momentum 0.9, synthetic data; {args.warmup} warm-up steps, then "
        f"{args.steps} timed steps; {reps} alternating repetitions, medians.",
        f"- Load average (1 min) over the runs: {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs "
        "(other work shared the machine: images per CPU-second is the figure to compare).",
        "- Every rank's trainable weights identical at the end in every run (SHA-256 of their bytes).",
        "",
        "Images per CPU-second (images over the summed process CPU time of all ranks in the timed window); "
        "images/s in the last columns. Ratio: hvd_lars / peer. The peer column of each layout and dtype is "
        "the same runs of `tf_keras.applications.ResNet50`"
        + (
            "; for the project's ResNet-50, of the same network built from Keras 2's layers (peer_own)."
            if any(r["name"] == "peer_own" for r in runs)
            else "."
        ),
        "",
        "| layout | dtype | hvd_lars model | peer img/CPU-s | hvd_lars img/CPU-s | ratio | peer img/s | "
        "hvd_lars img/s | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layout, dtype, name, p_s, o_s, p_c, o_c in rows(runs):
        lines.append(
            f"| {LAYOUT_NAMES[layout]} | {dtype} | {ROW_NAMES[name]} | {p_c:.3f} | {o_c:.3f} | "
            f"**{o_c / p_c:.2f}** | {p_s:.2f} | {o_s:.2f} | {o_s / p_s:.2f} |"
        )
    lines += ["", "Every run (images per CPU-second, by repetition):", ""]
    lines += ["| layout | dtype | run | " + " | ".join(f"rep {k}" for k in range(reps)) + " |"]
    lines += ["|---|---|---|" + "---|" * reps]
    seen = []
    for r in runs:
        key = (r["layout"], r["dtype"], r["name"])
        if key in seen:
            continue
        seen.append(key)
        values = [x["images_per_cpu_s"] for x in runs if (x["layout"], x["dtype"], x["name"]) == key]
        row_name = ROW_NAMES[r["name"]]
        lines.append(f"| {LAYOUT_NAMES[r['layout']]} | {r['dtype']} | {row_name} | "
                     + " | ".join(f"{v:.3f}" for v in values) + " |")  # fmt: skip
    lines += profile_section
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=("peer", "hvd_lars"), help=argparse.SUPPRESS)
    parser.add_argument("--runs", help=argparse.SUPPRESS)
    parser.add_argument("--profile_dir", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one step per side (1 process) and add it to the report of an earlier run (--out): "
        "its workload and dtypes",
    )
    parser.add_argument(
        "--report_only",
        action="store_true",
        help="rewrite the report (--out) from its JSON, measuring nothing",
    )
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default="1,2", help="of 1, 2, 2h, 4h (emulated hosts: root)")
    parser.add_argument("--dtypes", default="float32,mixed_bfloat16")
    parser.add_argument("--models", default="as_is,fused,own", help="hvd_lars's runs: of as_is, fused, own")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch_size", type=int, default=16, help="per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--link_rate", default="1gbit", help="the emulated hosts' links")
    parser.add_argument("--tf_keras", default=None, help="tf_keras version (default: TensorFlow's)")
    parser.add_argument("--peer_dir", default=None, help="where tf_keras is installed")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--out", default=None, help="report (default results/peer.md)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    from importlib.metadata import version

    from benchmarks.common import (
        RESULTS,
        command_line,
        data_path,
        git_sha,
        machine,
        matmul_rate,
        now,
        provenance_lines,
        write_report,
    )

    args.layouts = args.layouts.split(",")
    args.dtypes = args.dtypes.split(",")
    args.models = args.models.split(",")
    for value, valid in ((args.layouts, LAYOUT_NAMES), (args.models, OURS)):
        bad = [v for v in value if v not in valid]
        if bad:
            parser.error(f"{bad}: expected of {', '.join(valid)}")
    tf_keras = args.tf_keras or version("tensorflow")
    peer_path = ensure_peer(tf_keras, args.peer_dir or peer_dir(tf_keras))
    out = args.out or os.path.join(RESULTS, "peer.md")
    command = command_line("peer", sys.argv[1:] if argv is None else argv)
    raw = data_path(out)
    if args.profile:
        with open(raw) as f:
            data = json.load(f)
        data["profile"] = {
            "command": command,
            "sha": git_sha(),
            "date": now(),
            "machine": machine(matmul_rate()),
            "runs": profile(argparse.Namespace(**{**data["args"], "steps": 1}), peer_path),  # its workload
        }
    elif args.report_only:
        with open(raw) as f:
            data = json.load(f)
    else:
        matmul = matmul_rate()
        data = {"command": command, "matmul": matmul, "args": vars(args), "runs": []}
        data["provenance"] = provenance_lines(command, matmul, raw=raw)

        def save(runs):  # after every launch: a run stopped early keeps what it measured (--report_only)
            with open(raw, "w") as f:
                json.dump({**data, "runs": runs}, f, indent=1)

        data["runs"] = measure(args, peer_path, save)
    with open(raw, "w") as f:
        json.dump(data, f, indent=1)
    if "provenance" not in data:  # a run made before the JSON kept them: its report's lines
        with open(out) as f:
            data["provenance"] = [x for x in f.read().splitlines() if x.startswith(PROVENANCE_PREFIXES)]
    measured = argparse.Namespace(**data["args"])
    section = profile_lines(data) if data.get("profile") else ()
    write_report(out, report(measured, data["runs"], data["provenance"], section))
    print(f"[peer] wrote {out} and {raw}")


if __name__ == "__main__":
    main()
