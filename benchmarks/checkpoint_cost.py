"""Training time a checkpoint costs, written synchronously against asynchronously: AlexNet-BN (a checkpoint of
about 0.5 GB with LARS's velocities) trained by `model.fit` on synthetic data, the main program's
`PeriodicCheckpoint` saving every `--every` updates; arms none, synchronous and asynchronous in rotation,
`--repeats` times. Per arm: how long each save keeps training waiting, and the time lost per checkpoint
(fit time - the same rotation's baseline) / saves.

    python -m benchmarks.checkpoint_cost   # results/scaling.md, section checkpoints; about 5 minutes
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from benchmarks import common, scaling
from hvd_lars.training import epoch_logs

RAW = os.path.join(scaling.RAW_DIR, "checkpoints_local.json")
ARMS = ("none", "synchronous", "asynchronous")


def _timed_checkpoint_class():
    from hvd_lars.training.checkpoints import PeriodicCheckpoint

    class TimedCheckpoint(PeriodicCheckpoint):
        """The main program's callback, timing how long each save keeps training waiting."""

        blocked = []

        def save(self):
            saves = int(self.model.optimizer.iterations) != self._last_saved
            start = time.perf_counter()
            super().save()
            if saves:
                TimedCheckpoint.blocked.append(time.perf_counter() - start)

    return TimedCheckpoint


def _fit_seconds(model, data, steps, arm, directory, every, checkpoints):
    import tensorflow as tf

    PeriodicCheckpoint = _timed_checkpoint_class()
    PeriodicCheckpoint.blocked = []
    callbacks = []
    if arm != "none":
        # One tf.train.Checkpoint per arm for the whole run, as in a training job: the asynchronous
        # writer's one-time set-up (host copies of the variables, tracing) is paid in the warm-up.
        manager = tf.train.CheckpointManager(checkpoints[arm], directory, max_to_keep=2)
        callbacks.append(
            PeriodicCheckpoint(manager, every, at_epoch_end=False, asynchronous=arm == "asynchronous")
        )
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
    return time.perf_counter() - start, list(PeriodicCheckpoint.blocked)


def measure(args):
    import keras
    import numpy as np
    import tensorflow as tf

    from hvd_lars import LARS
    from hvd_lars.models import get_model

    keras.utils.set_random_seed(0)
    model = get_model("alexnet_bn", num_classes=1000, input_shape=(227, 227, 3))
    optimizer = LARS(0.01, momentum=0.9, weight_decay=5e-4)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, 227, 227, 3)).astype("float32")
    y = rng.integers(0, 1000, args.batch).astype("int32")
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    state_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.weights + optimizer.variables)
    scratch = tempfile.mkdtemp(prefix="hvd_lars_checkpoint_cost-", dir=args.scratch)
    try:
        checkpoints = {arm: tf.train.Checkpoint(model=model, optimizer=optimizer) for arm in ARMS[1:]}
        for arm in ARMS:  # tracing, first allocations, the asynchronous writer's set-up
            warm = os.path.join(scratch, f"warm_{arm}")
            _fit_seconds(model, data, args.every, arm, warm, args.every, checkpoints)
        _fit_seconds(model, data, args.every, "asynchronous", warm, args.every, checkpoints)
        runs = []
        for repeat in range(args.repeats):
            for arm in ARMS:
                directory = os.path.join(scratch, f"{arm}_{repeat}")
                seconds, blocked = _fit_seconds(
                    model, data, args.steps, arm, directory, args.every, checkpoints
                )
                size = (
                    sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
                    if arm != "none"
                    else 0
                )
                runs.append(
                    {
                        "repeat": repeat,
                        "arm": arm,
                        "seconds": seconds,
                        "blocked_s": blocked,
                        "checkpoint_dir_bytes": size,
                    }
                )
                print(
                    f"[checkpoints] repeat {repeat} {arm}: {seconds:.2f} s, saves blocked {blocked}",
                    flush=True,
                )
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"state_bytes": state_bytes, "runs": runs}


def lost_per_checkpoint(record):
    """{arm: [seconds lost per checkpoint, one per repeat]} against the same repeat's baseline."""
    saves = record["steps"] // record["every"]
    base = {r["repeat"]: r["seconds"] for r in record["runs"] if r["arm"] == "none"}
    lost = {arm: [] for arm in ARMS[1:]}
    for r in record["runs"]:
        if r["arm"] in lost:
            lost[r["arm"]].append((r["seconds"] - base[r["repeat"]]) / saves)
    return lost


def markdown(record):
    lost = lost_per_checkpoint(record)
    prov = record["provenance"]
    base = statistics.median(r["seconds"] for r in record["runs"] if r["arm"] == "none")
    step = base / record["steps"]
    lines = [
        "## Checkpoints that do not stop the job",
        "",
        f"- Command: `{record['command']}`",
        f"- Git SHA {common.sha_text(prov['git_sha'])}, {prov['date']}; "
        f"{common.describe(record['cpu'], record.get('matmul'), prov['machine'])}",
        f"- Raw data: `{os.path.relpath(RAW, common.REPO)}`",
        f"- AlexNet-BN, 227x227, 1,000 classes, LARS, float32, batch {record['batch']}, one process on every "
        f"core; {record['steps']} updates per fit, a checkpoint every {record['every']} "
        f"({record['steps'] // record['every']} saves); model + optimizer state "
        f"{record['state_bytes'] / 2**20:.0f} MiB; {record['repeats']} rotations of the three arms; "
        f"checkpoint directory on {record['scratch']}",
        f"- Baseline (no checkpoint): {step:.2f} s per update (median fit {base:.1f} s)",
        "",
        "| arm | training held by each save, s (median) | time lost per checkpoint, s (median; each "
        "rotation) | in updates |",
        "|---|---|---|---|",
    ]
    for arm in ARMS[1:]:
        values = lost[arm]
        median = statistics.median(values)
        held = statistics.median(b for r in record["runs"] if r["arm"] == arm for b in r["blocked_s"])
        lines.append(
            f"| {arm} | {held:.2f} | {median:.2f} ({', '.join(f'{v:.2f}' for v in values)}) | "
            f"{median / step:.2f} |"
        )
    sync, asyn = statistics.median(lost["synchronous"]), statistics.median(lost["asynchronous"])
    lines += [
        "",
        f"Time lost per checkpoint: {asyn:.2f} s asynchronous against {sync:.2f} s synchronous (ratio "
        f"{asyn / sync:.2f}). The checkpoint directory is on a local disk whose writes land in the page "
        "cache, so writing is CPU work (serialising, copying) that the background writer still takes from "
        "training on these 2 busy cores; what asynchronous saving removes is the time training is held by "
        "the write, the part that grows with a slow or remote file system (a cluster's parallel file "
        "system). Only rank 0 pays either; the other ranks wait for it at the next allreduce.",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch", default="/var/tmp", help="the disk the checkpoints are written to")
    parser.add_argument("--report_only", action="store_true", help="rewrite the section from the JSON")
    args = parser.parse_args(argv)
    if args.steps % args.every:
        parser.error(f"--steps={args.steps} must be a multiple of --every={args.every}.")
    if not args.report_only:
        record = measure(args)
        record.update(
            command=common.command_line("checkpoint_cost", argv),
            provenance=epoch_logs.provenance(),
            cpu=common.cpu(),
            matmul=common.matmul_rate(),
            batch=args.batch,
            steps=args.steps,
            every=args.every,
            repeats=args.repeats,
            scratch=args.scratch,
        )
        os.makedirs(os.path.dirname(RAW), exist_ok=True)
        with open(RAW, "w") as f:
            json.dump(record, f, indent=1)
    with open(RAW) as f:
        record = json.load(f)
    scaling.write_section("checkpoints", markdown(record))


if __name__ == "__main__":
    main()
