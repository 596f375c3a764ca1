"""Start-up across 2, 4 and 8 emulated hosts: from launch to the first update, and where it goes.

One rank per host, `horovodrun -np p -H node1:1,...` (Open MPI) of the main program, unchanged, on
`--flagfile` (default flags/smoke.flags; `--model=resnet50 --image_size=64` for a larger first trace).
Each rank runs `python -m benchmarks.startup_hosts --worker`, which notes the wall clock (every emulated
host shares this machine's clock) at:

  python      the worker's first line (after the interpreter started; before any import)
  imported    TensorFlow, Horovod and hvd_lars imported
  init        Horovod initialised (MPI_Init, Horovod's background thread)
  input       the input pipeline built (listing or synthetic data)
  built       model built and compiled, optimizer built, checkpoints opened (`train.start`)
  broadcast   rank 0's weights and optimizer state broadcast to every rank
  first       the end of the first update (the first trace of the training step included)

and the launcher notes when it started horovodrun. Reported per p: each phase's duration (from the one
before; `launch -> python` is horovodrun's host checks, mpirun's ssh to every host and the interpreter's
start), the slowest rank's and the median rank's, over `--repeats` launches (median).

    python -m benchmarks.startup_hosts                           # as root; writes results/startup_hosts.md
"""

import time

_PYTHON = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

PHASES = ("python", "imported", "init", "input", "built", "broadcast", "first")


def worker(argv):
    marks = {"python": _PYTHON}
    out = argv.pop(argv.index("--worker") + 1)
    argv.remove("--worker")
    import keras

    import hvd_lars.main
    from hvd_lars.training import train

    marks["imported"] = time.time()

    def marking(function, name):
        def wrapped(*args, **kwargs):
            result = function(*args, **kwargs)
            marks.setdefault(name, time.time())  # the first call's end
            return result

        return wrapped

    train.collectives.init = marking(train.collectives.init, "init")
    train.get_input = marking(train.get_input, "input")
    train.start = marking(train.start, "built")
    train.broadcast_model_and_optimizer = marking(train.broadcast_model_and_optimizer, "broadcast")

    class FirstUpdate(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks.setdefault("first", time.time())

    run = hvd_lars.main.run_training

    def run_training(config, extra_callbacks=()):
        try:
            return run(config, [*extra_callbacks, FirstUpdate()])
        finally:
            rank = train.collectives.rank()
            with open(f"{out}.rank{rank}.json", "w") as f:
                json.dump(dict(marks, rank=rank, host=os.uname().nodename), f)

    hvd_lars.main.run_training = run_training
    sys.argv = [sys.argv[0], *argv]
    hvd_lars.main.main()


def launch(p, flags, workdir):
    from benchmarks import common

    hosts = ",".join(f"node{k}:1" for k in range(1, p + 1))
    out = os.path.join(workdir, "marks")
    argv = [common.HOROVODRUN, "-np", str(p), "-H", hosts, sys.executable, "-m", "benchmarks.startup_hosts"]
    argv += ["--worker", out, *flags, f"--workdir={workdir}", "--intra_op_threads=1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_MCA_"))}
    env.update(PYTHONPATH=common.REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    launched = time.time()
    result = subprocess.run(argv, cwd=common.REPO, env=env, capture_output=True, text=True, timeout=1200)
    ended = time.time()
    if result.returncode:
        raise RuntimeError(f"p={p}: exit {result.returncode}\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    ranks = []
    for r in range(p):
        with open(f"{out}.rank{r}.json") as f:
            ranks.append(json.load(f))
    hosts_seen = sorted({m["host"] for m in ranks})
    if len(hosts_seen) != p:
        raise RuntimeError(f"p={p}: ranks ran on {hosts_seen}")
    return {"launched": launched, "ended": ended, "ranks": ranks}


def durations(run):
    """{phase: [seconds from the phase before, per rank]}, the first phase counted from the launch."""
    result = {}
    for k, phase in enumerate(PHASES):
        before = [run["launched"]] * len(run["ranks"]) if k == 0 else [m[PHASES[k - 1]] for m in run["ranks"]]
        result[phase] = [m[phase] - b for m, b in zip(run["ranks"], before)]
    return result


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        worker(argv)
        return
    from benchmarks import common

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ps", default="2,4,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--link_rate", default="1gbit")
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "startup_hosts.md"))
    args, flags = parser.parse_known_args(argv)
    flags = flags or ["--flagfile=flags/smoke.flags"]
    ps = [int(p) for p in args.ps.split(",")]
    matmul = common.matmul_rate()
    runs = {p: [] for p in ps}
    with common.emulated_cluster(max(ps), args.link_rate):
        for repeat in range(args.repeats):
            for p in ps:
                with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_startup_") as workdir:
                    runs[p].append(launch(p, flags, workdir))
                total = max(m["first"] for m in runs[p][-1]["ranks"]) - runs[p][-1]["launched"]
                print(f"[startup_hosts] p={p} repeat {repeat}: first update {total:.1f} s after launch")
    command = common.command_line("startup_hosts", argv)
    raw = common.data_path(args.out)
    header = " | ".join(f"p={p} slowest rank | p={p} median rank" for p in ps)
    lines = [
        "# Start-up across 2, 4 and 8 emulated hosts: launch to the first update",
        "",
        *common.provenance_lines(command, matmul, raw),
        f"- `{' '.join(flags)}`, 1 rank per host (Open MPI via horovodrun), links {args.link_rate}; "
        f"{args.repeats} launches per p, p alternated; each cell the median over launches of the slowest "
        "(or the median) rank's seconds in that phase, counted from the end of the phase before.",
        "",
        f"| phase | {header} |",
        "|---|" + "---|" * (2 * len(ps)),
    ]
    per_p = {p: [durations(run) for run in runs[p]] for p in ps}
    for k, phase in enumerate(PHASES):
        name = f"launch -> {phase}" if k == 0 else f"{PHASES[k - 1]} -> {phase}"
        cells = []
        for p in ps:
            slowest = statistics.median(max(d[phase]) for d in per_p[p])
            median = statistics.median(statistics.median(d[phase]) for d in per_p[p])
            cells.append(f"{slowest:.2f} | {median:.2f}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    totals = []
    for p in ps:
        first = statistics.median(max(m["first"] for m in run["ranks"]) - run["launched"] for run in runs[p])
        totals.append(f"**{first:.2f}** | ")
    lines.append(f"| launch -> first update of every rank | {' | '.join(totals)} |")
    common.write_report(args.out, "\n".join(lines))
    with open(raw, "w") as f:
        json.dump({"command": command, "runs": {str(p): runs[p] for p in ps}}, f, indent=1)
    print(f"[startup_hosts] wrote {args.out}")


if __name__ == "__main__":
    main()
