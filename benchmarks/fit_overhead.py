"""What each `model.fit` call costs beyond its updates, on 2 Horovod ranks: a loop that
fits per epoch, and every attempt of an elastic job, pays it once per call.

`results/fault_guard_cost.md` found about 5 s per `fit` on 2 ranks. It was the fault guard's finite check
(`hvd_lars.training.faults.FaultGuard`): a `tf.function` over every model and optimizer variable, traced
anew in each `on_train_begin`. It is now traced once per model and variable list. This script shows the
before and after side by side in one run: the arm "before" empties that cache before every fit, which is
exactly the old behaviour; "after" keeps it; "no guard" is the fit alone.

Each arm: `--fits` calls of `model.fit` of 1 update each (after 2 untimed ones), with the main program's
thread settings, ResNet-50 at 32 x 32 (8 images per rank) and the small CNN at 28 x 28 (64 per rank), LARS,
synthetic data. Reported: the median seconds per fit call and the difference to "no guard".

Usage (from the repository root, with the machine to itself; about 4 minutes):
    python -m benchmarks.fit_overhead          # writes results/fit_overhead.md (raw: fit_overhead/)
"""

import argparse
import json
import os
import statistics
import time

from benchmarks import common

REPO = common.REPO
CASES = {"resnet50": (8, (32, 32, 3)), "small_cnn": (64, (28, 28, 1))}
ARMS = ("no guard", "before: traced at every fit", "after: traced once")


def worker(args):
    import keras
    import numpy as np
    import tensorflow as tf

    from hvd_lars import LARS, DistributedOptimizer
    from hvd_lars.models import get_model
    from hvd_lars.parallel import collectives
    from hvd_lars.training import faults
    from hvd_lars.training.config import TrainConfig
    from hvd_lars.training.threads import configure_threads

    rank, size = collectives.init()
    configure_threads(TrainConfig(), size)
    results = {}
    for case, (per_rank, shape) in CASES.items():
        keras.utils.set_random_seed(0)
        model = get_model(case, num_classes=10, input_shape=shape)
        model.compile(
            optimizer=DistributedOptimizer(LARS(0.01, momentum=0.9, weight_decay=5e-4)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        rng = np.random.default_rng(rank)
        x = rng.normal(size=(per_rank, *shape)).astype("float32")
        data = tf.data.Dataset.from_tensors((x, rng.integers(0, 10, per_rank).astype("int32"))).repeat()
        times = {arm: [] for arm in ARMS}
        for i in range(args.fits + 2):
            for arm in ARMS:
                callbacks = [] if arm == "no guard" else [faults.FaultGuard(faults.StopSignals(), None)]
                if arm.startswith("before"):
                    faults._CHECKS.clear()
                start = time.perf_counter()
                model.fit(data, epochs=1, steps_per_epoch=1, verbose=0, callbacks=callbacks)
                if i >= 2:
                    times[arm].append(time.perf_counter() - start)
        results[case] = {"per_rank_batch": per_rank, "seconds_per_fit": times}
        if rank == 0:
            print(f"[fit_overhead] {case}: {json.dumps(times)}", flush=True)
    if rank == 0:
        with open(args.raw, "w") as f:
            json.dump({"world_size": size, "results": results}, f, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fits", type=int, default=5)
    parser.add_argument("--raw", default=None, help="raw timings (default: common.data_path of --out)")
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "fit_overhead.md"))
    parser.add_argument("--worker", action="store_true", help="internal: run as one of the ranks")
    args = parser.parse_args(argv)
    args.raw = args.raw or common.data_path(args.out)
    if args.worker:
        worker(args)
        return
    from hvd_lars.training import threads

    env = common.worker_env()
    threads.apply_horovod_cpu_defaults(env)
    start = time.time()
    cmd = [common.HOROVODRUN, "-np", "2", "-H", "localhost:2", *common.worker_command("fit_overhead")]
    cmd += ["--worker", f"--fits={args.fits}", f"--raw={args.raw}"]
    common.run(cmd, env=env, timeout=3600)
    with open(args.raw) as f:
        raw = json.load(f)
    command = common.command_line("fit_overhead", argv)
    lines = [
        "# What each model.fit call costs beyond its updates (2 Horovod ranks)",
        "",
        *common.provenance_lines(command, common.matmul_rate(), args.raw),
        f"- {time.time() - start:.0f} s; 2 ranks (horovodrun, Open MPI) on this machine; {args.fits} timed "
        f"fit calls of 1 update per arm, arms interleaved; 1-minute load average at the end "
        f"{os.getloadavg()[0]:.1f}.",
        "",
        "| model | per-rank batch | arm | median s per fit | min / max | minus no guard (s) |",
        "|---|---|---|---|---|---|",
    ]
    for case, r in raw["results"].items():
        base = statistics.median(r["seconds_per_fit"]["no guard"])
        for arm in ARMS:
            t = r["seconds_per_fit"][arm]
            lines.append(
                f"| {case} | {r['per_rank_batch']} | {arm} | {statistics.median(t):.3f} | {min(t):.3f} / "
                f"{max(t):.3f} | {statistics.median(t) - base:+.3f} |"
            )
    lines += [
        "",
        "Where the time went: `FaultGuard.on_train_begin` built its finite check, a `tf.function` reducing "
        "`is_finite` over every float variable (ResNet-50: weights, batch-norm statistics, LARS momentum), "
        "and the first update of every fit traced it. It is now kept per model and variable list "
        "(`hvd_lars.training.faults._all_finite`), so only a model's first fit pays it.",
    ]
    common.write_report(args.out, "\n".join(lines))
    print(f"[fit_overhead] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
