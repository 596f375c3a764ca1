"""Does LARS hold accuracy where momentum SGD loses it? Fashion-MNIST, global batch 512 to 8,192.

One command runs the whole study from the repository root and resumes it after an interruption;
`--networks` and `--arms` train a part (the report always covers the whole study):

    python -m benchmarks.large_batch_study --output_dir=results/runs/hvd_lars_study
    python -m benchmarks.large_batch_study --networks=small_cnn_nobn --arms=momentum,lars

Networks `small_cnn` (at `--batches`) and `small_cnn_nobn` (at `--nobn_batches`), each run one process of
`python -m hvd_lars.main`; arms: momentum SGD with the linear scaling rule and warmup (Goyal et al. 2017,
arXiv 1706.02677), LARS (You et al., ICPP 2018), Nesterov momentum (Nado et al. 2021, arXiv 2102.06356; at
`--nesterov_batches`, its sweep centred on the momentum arm's rate). Each arm's rate is chosen on a
validation split (the last 5,000 training images) by a sweep of `--sweep_points` rates `--sweep_ratio`
apart on seed 0, extended while the best is at an edge (`next_sweep_index`); the chosen rate then runs
`--seeds` seeds, and only those report test scores. A run is done when its summary.json or the records
file (`records_path`) holds it; a restart skips done runs and resumes a half-finished one. After every run
the report (`--report` and its PNG) and the records file are rewritten.
"""

import dataclasses
import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import time

from benchmarks import common, large_batch_report
from hvd_lars.training.checkpoints import read_json, strict

REPO = common.REPO
# The study's name: its default output folder and the prefix of every run's name.
STUDY_TAG = "hvd_lars_study"
FASHION_MNIST_TRAIN = 60000
# Goyal et al.'s reference batch for the linear scaling rule (lr = base x batch / 256).
REFERENCE_BATCH = 256


@dataclasses.dataclass(frozen=True)
class Network:
    """One model of the study: `name` is its `hvd_lars.models.MODELS` key (`--model`), `tag` the infix of
    its run names (empty for the first network, whose 34 runs were named before there was a second)."""

    name: str
    tag: str
    label: str
    description: str  # for the report's set-up


NETWORKS = {
    "small_cnn": Network(
        "small_cnn",
        "",
        "small_cnn (batch norm)",
        "4 convolutions 16-16-32-32 and dense 128, each with batch norm, momentum 0.9 so that the running "
        "statistics follow the few updates of the largest batches; 0.22M parameters",
    ),
    "small_cnn_nobn": Network(
        "small_cnn_nobn",
        "nobn_",
        "small_cnn_nobn (no batch norm)",
        "the same layers without batch norm (a bias in each convolution in place of batch norm's shift), "
        "He-normal kernels (variance 2 / fan_in, He et al. 2015) so that the signal keeps its scale through "
        "the 5 ReLU layers without normalisation; 0.217M parameters",
    ),
}


@dataclasses.dataclass(frozen=True)
class Arm:
    """One optimizer recipe. `centre(batch)` is the middle of the first sweep, in the arm's rate flag."""

    name: str
    label: str
    optimizer: str
    rate_flag: str  # the main program's flag the swept rate goes to
    centre_rule: str  # how the sweep's centre follows the batch (for the report)
    extra_flags: tuple = ()
    starts_from: str = ""  # an arm whose chosen grid index centres this arm's first sweep

    def centre(self, batch):
        """The rate of grid index 0 (the first sweep's centre unless `starts_from` moves it)."""
        if self.rate_flag == "base_learning_rate":
            return 0.1  # per 256 images: Goyal et al.'s base rate, scaled linearly by the main program
        # LARS: square-root scaling from 10 at batch 512, between the paper's solver rates (2 at 1K,
        # 10 at 8K, 32 at 32K) and the project's recorded run (20 at 4K, results/fashion_mnist_lars.md).
        return 10.0 * math.sqrt(batch / 512)

    def peak(self, rate, batch):
        """The peak learning rate the optimizer reaches for swept value `rate`."""
        return rate * batch / REFERENCE_BATCH if self.rate_flag == "base_learning_rate" else rate


ARMS = {
    "momentum": Arm(
        "momentum",
        "momentum SGD (linear scaling + warmup)",
        "momentum",
        "base_learning_rate",
        "base rate per 256 images 0.1 (Goyal et al.), peak = base x batch / 256",
    ),
    "lars": Arm(
        "lars",
        "LARS (warmup + poly decay)",
        "lars",
        "peak_learning_rate",
        "peak rate 10 x sqrt(batch / 512)",
        ("--eta=0.001", "--trust_ratio_mode=paper"),
    ),
    "nesterov": Arm(
        "nesterov",
        "Nesterov momentum SGD (linear scaling + warmup)",
        "nesterov",
        "base_learning_rate",
        "the momentum arm's chosen base rate at the same network and batch, on its grid 0.1 x 2^k per 256 "
        "images; peak = base x batch / 256",
        starts_from="momentum",
    ),
}


@dataclasses.dataclass(frozen=True)
class Group:
    """The runs of one arm on one network at one global batch: its sweep, then the chosen rate's seeds."""

    network: str
    arm: str
    batch: int


@dataclasses.dataclass(frozen=True)
class Cell:
    """One training run: an arm at a global batch, a swept rate (grid index k: centre x ratio**k), a seed,
    on a network."""

    arm: str
    batch: int
    k: int
    seed: int
    network: str = "small_cnn"


def rate_of(args, cell):
    """The swept value of `cell` (rounded to 6 significant digits so names and flags are stable)."""
    value = ARMS[cell.arm].centre(cell.batch) * args.sweep_ratio**cell.k
    return float(f"{value:.6g}")


def run_name(args, cell):
    tag = NETWORKS[cell.network].tag
    return f"{STUDY_TAG}_{tag}{cell.arm}_b{cell.batch}_lr{rate_of(args, cell):g}_s{cell.seed}"


def train_examples(args):
    """Training images per epoch: the 60,000 less the validation split (or --max_train_examples)."""
    held_in = FASHION_MNIST_TRAIN - args.validation_examples
    return min(held_in, args.max_train_examples) if args.max_train_examples else held_in


def steps_per_epoch(args, batch):
    # Rounded, not floored: every batch then sees within 4% of the same images per epoch (floor would
    # drop 11% of each epoch at 8,192); the input stream is one endless shuffled sequence.
    return max(1, round(train_examples(args) / batch))


def main_flags(args, cell):
    """The main program's flags for one run (everything a run's result depends on)."""
    arm = ARMS[cell.arm]
    flags = [
        "--dataset=fashion_mnist",
        f"--model={NETWORKS[cell.network].name}",
        f"--optimizer={arm.optimizer}",
        f"--global_batch_size={cell.batch}",
        f"--steps_per_epoch={steps_per_epoch(args, cell.batch)}",
        f"--epochs={args.epochs}",
        f"--warmup_epochs={args.warmup_epochs:g}",
        "--schedule=mlperf_poly",
        "--warmup_start_learning_rate=0",
        "--end_learning_rate=0",
        "--decay_power=2",
        f"--{arm.rate_flag}={rate_of(args, cell):g}",
        "--momentum=0.9",
        f"--weight_decay={args.weight_decay:g}",
        *arm.extra_flags,
        f"--validation_examples={args.validation_examples}",
        "--eval_every_epochs=1",
        "--precision=float32",
        "--deterministic",
        f"--seed={cell.seed}",
        f"--workdir={os.path.join(args.output_dir, 'runs')}",
        f"--run_name={run_name(args, cell)}",
        "--verbose=2",
    ]
    if args.max_train_examples:
        flags.append(f"--max_train_examples={args.max_train_examples}")
    if args.max_eval_examples:
        flags.append(f"--max_eval_examples={args.max_eval_examples}")
    return flags


def run_dir(args, cell):
    return os.path.join(args.output_dir, "runs", run_name(args, cell))


def load_summary(args, cell):
    path = os.path.join(run_dir(args, cell), "summary.json")
    if not os.path.exists(path):
        return None
    return read_json(path)  # strict JSON; a diverged run's "NaN" loss comes back as a float


def diverged(summary):
    """The step at which the main program stopped the run as diverged (exit status 3, summary.json's
    "stopped"), or None."""
    stopped = (summary or {}).get("stopped") or {}
    return stopped.get("step") if stopped.get("reason") == "TrainingDiverged" else None


def is_complete(summary, epochs):
    """A run is done when its summary holds epochs 1..`epochs`, the last with validation and test scores,
    or when the main program stopped it as diverged (a result of the sweep: the rate is too high)."""
    if not summary:
        return False
    if diverged(summary) is not None:
        return True
    done = [e["epoch"] for e in summary.get("epochs", [])]
    last = summary["epochs"][-1] if done else {}
    return done == list(range(1, epochs + 1)) and "val_top1" in last and "test_top1" in last


def settings_of(args, cell):
    """The settings a run's result depends on beyond its name, as its summary's config records them."""
    return {
        "model": NETWORKS[cell.network].name,
        "optimizer": ARMS[cell.arm].optimizer,
        "global_batch_size": cell.batch,
        "epochs": float(args.epochs),
        "warmup_epochs": float(args.warmup_epochs),
        "weight_decay": float(args.weight_decay),
        ARMS[cell.arm].rate_flag: rate_of(args, cell),
        "seed": cell.seed,
        "validation_examples": args.validation_examples,
        "max_train_examples": args.max_train_examples,
        "steps_per_epoch": steps_per_epoch(args, cell.batch),
    }


def check_same_run(args, cell, saved, where=None):
    """SystemExit, naming `where` (default: the run's directory) and the settings that differ, where the
    `saved` settings (a summary's "config" or a record's "settings") are not this study's for `cell`."""
    changed = {k: (saved.get(k), v) for k, v in settings_of(args, cell).items() if saved.get(k) != v}
    if changed:
        raise SystemExit(
            f"{where or run_dir(args, cell)} holds {run_name(args, cell)} trained with other settings "
            f"({changed}, as (saved, now)). Use another --output_dir (or --report), or the settings it was "
            "made with."
        )


def records_path(args):
    """The records file of the report (`common.data_path`): every finished run's record, kept when run
    directories go."""
    return common.data_path(args.report)


def load_records(args):
    """{run name: record} from the records file ({} when there is none)."""
    path = records_path(args)
    if not os.path.exists(path):
        return {}
    return {r["run_name"]: r for r in read_json(path)["records"]}


def save_records(args, store):
    path = records_path(args)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ordered = [store[name] for name in sorted(store)]
    with open(path + ".tmp", "w") as f:
        json.dump(strict({"study": STUDY_TAG, "records": ordered}), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(path + ".tmp", path)


def finished(args, cell, store):
    """The record of `cell` if it is done (its summary complete, or its record in `store`), else None;
    SystemExit (`check_same_run`) where either holds it with other settings."""
    summary = load_summary(args, cell)
    if summary:
        check_same_run(args, cell, summary["config"])
        if is_complete(summary, args.epochs):
            record = _record(args, cell, summary)
            # The machine the study measured when it trained this run is in its stored record only.
            stored = store.get(record["run_name"], {})
            if stored.get("date") == record["date"]:
                record.update({k: stored[k] for k in ("cpu", "matmul") if k in stored})
            return record
    record = store.get(run_name(args, cell))
    if record is not None:
        check_same_run(args, cell, record["settings"], where=records_path(args))
    return record


def _die_with_parent():
    # A run never outlives the study (a killed study must not leave a run writing its directory).
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_cell(args, cell, journal):
    """Trains `cell` unless it is done (resuming its checkpoint if it has one) and returns its summary;
    each attempt is appended to the JSON-lines file `journal`. SystemExit with the log's tail if it fails."""
    summary = load_summary(args, cell)
    if summary:
        check_same_run(args, cell, summary["config"])
    if is_complete(summary, args.epochs):
        return summary
    name = run_name(args, cell)
    log_path = os.path.join(args.output_dir, "logs", f"{name}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    command = [sys.executable, *args.train_program.split(), *main_flags(args, cell)]
    if args.ranks > 1:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        command = [horovodrun, "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", *command]
    env = common.worker_env()
    print(f"[study] {name}: training ({'resuming' if summary else 'new'}), log {log_path}", flush=True)
    start = time.time()
    with open(log_path, "a") as log:
        log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
        log.flush()
        try:
            returncode = subprocess.run(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout_s,
                preexec_fn=_die_with_parent,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    seconds = time.time() - start
    attempt = {"run": name, "start": start, "seconds": seconds, "returncode": returncode}
    with open(journal, "a") as f:
        f.write(json.dumps({**attempt, "command": args.command}) + "\n")
    summary = load_summary(args, cell)
    if returncode == 3 and diverged(summary) is not None:
        print(f"[study] {name}: diverged at step {diverged(summary)} (recorded at chance level), "
              f"{seconds:.0f} s", flush=True)  # fmt: skip
        return summary
    if returncode != 0 or not is_complete(summary, args.epochs):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(
            f"[study] {name} failed (exit status {returncode}) after {seconds:.0f} s; log {log_path}:\n"
            f"{tail}\n"
            "Fix the cause and start the study again: finished runs are kept, this one resumes."
        )
    print(
        f"[study] {name}: validation top-1 {summary['final_val_top1']:.4f}, test top-1 "
        f"{summary['final_test_top1']:.4f}, {seconds:.0f} s",
        flush=True,
    )
    return summary


def next_sweep_index(scores, points, max_extensions, start=0, learned_above=None, untrained_extensions=0):
    """The grid index to train next in one sweep (rate = centre x ratio**k), or None when it is finished.

    Args:
        scores: {k: validation top-1} of the finished runs.
        points: rates in the first sweep, k in [start - points // 2, start + points - points // 2).
        max_extensions: rates the sweep may add, one at a time, past the edge where the best lies (the
            best: the highest validation top-1, ties to the smaller rate).
        learned_above: a validation top-1 at most this learned nothing; None: no such rule.
        untrained_extensions: while no rate learned anything, the sweep goes below its lowest rate; each
            rate that learned nothing adds one to `max_extensions`, at most this many.
    """
    first = range(start - points // 2, start + points - points // 2)
    for k in first:
        if k not in scores:
            return k
    budget = max_extensions
    if learned_above is not None:
        budget += min(untrained_extensions, sum(1 for v in scores.values() if v <= learned_above))
    if len(scores) - points >= budget:
        return None
    if learned_above is not None and max(scores.values()) <= learned_above:
        return min(scores) - 1
    best = chosen_index(scores)
    if best == min(scores):
        return best - 1
    if best == max(scores):
        return best + 1
    return None


def chosen_index(scores):
    """The grid index of the best validation top-1 in `scores` ({k: top-1}); ties: the smaller rate."""
    return max(scores, key=lambda k: (scores[k], -k))


def groups(args, networks=None, arms=None):
    """The study's groups (of `networks` and `arms`; default: all) in the order they run: by network, by
    batch as `--batches` orders them, by arm in `ARMS` order (momentum before the Nesterov arm)."""
    out = []
    for network in NETWORKS:
        if networks is not None and network not in networks:
            continue
        for batch in args.network_batches[network]:
            for arm in ARMS:
                if arms is not None and arm not in arms:
                    continue
                if arm == "nesterov" and batch not in args.nesterov_batches:
                    continue
                out.append(Group(network, arm, batch))
    return out


@dataclasses.dataclass
class Outcome:
    """What is done of one group: its records (sweep, then seeds; chosen ones marked), the chosen grid
    index (None until the sweep is finished), and None or why it cannot start yet."""

    records: list
    chosen: object = None
    blocked: str = ""


def walk(args, group, obtain, store):
    """The `Outcome` of `group`'s sweep and seeds; `obtain(cell)` gives a finished run's record (training
    it first, when the study trains) or None, which stops the walk there."""
    arm = ARMS[group.arm]
    start = 0
    if arm.starts_from:
        before = walk(
            args, Group(group.network, arm.starts_from, group.batch), obtain_done(args, store), store
        )
        if before.chosen is None:
            return Outcome(
                [],
                blocked=f"waits for the {arm.starts_from} arm's sweep ({group.network}, batch {group.batch})",
            )
        start = before.chosen
    scores, records = {}, []
    sweep = (args.sweep_points, args.max_extensions, start, args.learned_above, args.untrained_extensions)
    while (k := next_sweep_index(scores, *sweep)) is not None:
        record = obtain(Cell(group.arm, group.batch, k, 0, group.network))
        if record is None:
            return Outcome(records)
        records.append(dict(record, role="sweep", chosen=False, edge=False))
        scores[k] = record["val_top1"]
    best = chosen_index(scores)
    edge = best in (min(scores), max(scores))
    for r in records:
        if r["k"] == best:
            r.update(chosen=True, edge=edge)
    for seed in range(1, args.seeds):
        record = obtain(Cell(group.arm, group.batch, best, seed, group.network))
        if record is None:
            break
        records.append(dict(record, role="seed", chosen=True, edge=edge))
    return Outcome(records, best)


def obtain_done(args, store):
    """`walk`'s obtain that trains nothing: the record of a finished run, else None."""
    return lambda cell: finished(args, cell, store)


def collect(args, store):
    """{Group: Outcome} of every group of the study, from the finished runs only (the report's)."""
    obtain = obtain_done(args, store)
    return {group: walk(args, group, obtain, store) for group in groups(args)}


def study(args):
    """Trains (or resumes) the groups `--networks` and `--arms` select; returns the whole study's
    {Group: Outcome} (the report's)."""
    journal = os.path.join(args.output_dir, "attempts.jsonl")
    store = load_records(args)

    def report():
        outcomes = collect(args, store)
        for outcome in outcomes.values():
            for r in outcome.records:
                # The walk's marks (role, chosen, edge) are recomputed each time; not stored.
                store[r["run_name"]] = {k: v for k, v in r.items() if k not in ("role", "chosen", "edge")}
        save_records(args, store)
        large_batch_report.write(args, outcomes, _read_journal(journal), NETWORKS, ARMS)
        return outcomes

    measured = {}

    def machine_of_this_run():
        """This machine's CPU and tf.matmul rate, measured once, the first time a run is trained."""
        if not measured:
            measured.update(cpu=common.cpu(), matmul=common.matmul_rate())
        return measured

    def obtain(cell):
        record = finished(args, cell, store)
        if record is None:
            record = {**_record(args, cell, run_cell(args, cell, journal)), **machine_of_this_run()}
            store[record["run_name"]] = record
            report()
        return record

    for group in [] if args.report_only else groups(args, args.networks, args.arms):
        outcome = walk(args, group, obtain, store)
        if outcome.blocked:
            raise SystemExit(
                f"[study] {group.arm} on {group.network} at batch {group.batch} {outcome.blocked}: add "
                f"--arms={ARMS[group.arm].starts_from} (or run it first)."
            )
    return report()


def _record(args, cell, summary):
    arm = ARMS[cell.arm]
    step = diverged(summary)
    if step is not None:
        # Stopped at its first non-finite update: its model predicts nothing, so it scores chance (1 in
        # the 10 classes, top-5 5 in 10), as the first study's diverged runs did when trained on to the end.
        classes = 10
        last = {"val_loss": None, "loss": None, "top1": None}
        summary = dict(summary, final_val_top1=1 / classes, final_test_top1=1 / classes,
                       final_test_top5=5 / classes)  # fmt: skip
    else:
        last = summary["epochs"][-1]
    return {
        "diverged_at_step": step,
        "network": cell.network,
        "arm": cell.arm,
        "batch": cell.batch,
        "k": cell.k,
        "seed": cell.seed,
        "rate": rate_of(args, cell),
        "rate_flag": arm.rate_flag,
        "peak_learning_rate": summary["plan"]["peak_learning_rate"],
        "val_top1": summary["final_val_top1"],
        "val_loss": last["val_loss"],
        "test_top1": summary["final_test_top1"],
        "test_top5": summary["final_test_top5"],
        "train_loss": last["loss"],
        "train_top1": last["top1"],
        "images_per_second": summary["images_per_second"],
        "steps_per_epoch": summary["plan"]["steps_per_epoch"],
        "total_steps": summary["plan"]["total_steps"],
        "warmup_steps": summary["plan"]["warmup_steps"],
        "git_sha": summary["git_sha"],
        "date": summary["date"],
        "machine": summary["machine"],
        "run_name": run_name(args, cell),
        "settings": settings_of(args, cell),
        "source": "run directory",
    }


def _read_journal(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def parse_args(argv=None):
    parser = common.argument_parser(__doc__)
    ints = lambda text: [int(v) for v in text.split(",") if v]
    parser.add_argument("--output_dir", default=os.path.join("results", "runs", STUDY_TAG))
    parser.add_argument("--report", default=os.path.join("results", "large_batch_study.md"))
    names = lambda text: [v for v in text.split(",") if v]
    parser.add_argument("--batches", type=ints, default=[8192, 2048, 512], help="small_cnn's, in this order")
    parser.add_argument("--nobn_batches", type=ints, default=[8192, 512], help="small_cnn_nobn's")
    parser.add_argument("--nesterov_batches", type=ints, default=[8192], help="the Nesterov arm's")
    parser.add_argument("--networks", type=names, default=list(NETWORKS), help="to train now (report: all)")
    parser.add_argument("--arms", type=names, default=list(ARMS), help="to train now (report: all)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--warmup_epochs", type=float, default=1.0)
    parser.add_argument("--weight_decay", type=float, default=5e-4)
    parser.add_argument("--seeds", type=int, default=2, help="seeds of each chosen rate (the sweep's is 0)")
    parser.add_argument("--sweep_points", type=int, default=3)
    parser.add_argument("--sweep_ratio", type=float, default=2.0)
    parser.add_argument("--max_extensions", type=int, default=2)
    parser.add_argument("--learned_above", type=float, default=0.2, help="top-1 at which nothing learned")
    parser.add_argument("--untrained_extensions", type=int, default=4, help="see next_sweep_index")
    parser.add_argument("--validation_examples", type=int, default=5000)
    parser.add_argument("--ranks", type=int, default=1, help="Horovod ranks per run (1: one process)")
    parser.add_argument("--run_timeout_s", type=float, default=6 * 3600)
    parser.add_argument("--train_program", default="-m hvd_lars.main", help="what Python runs for a run")
    parser.add_argument("--report_only", action="store_true", help="rewrite the report; train nothing")
    parser.add_argument("--max_train_examples", type=int, default=0, help="smoke tests only")
    parser.add_argument("--max_eval_examples", type=int, default=0, help="smoke tests only")
    args = parser.parse_args(argv)
    for flag, given, valid in (("--arms", args.arms, ARMS), ("--networks", args.networks, NETWORKS)):
        unknown = [a for a in given if a not in valid]
        if unknown or not given:
            parser.error(f"{flag}={','.join(given)}: unknown {unknown}; valid: {', '.join(valid)}.")
    batches = (args.batches, args.nobn_batches, args.nesterov_batches)
    if not all(batches) or min(min(b) for b in batches) < 1:
        parser.error(
            f"--batches={args.batches}, --nobn_batches={args.nobn_batches} and --nesterov_batches="
            f"{args.nesterov_batches} must each be one or more positive batches."
        )
    if args.ranks < 1 or args.seeds < 1 or args.sweep_points < 1:
        parser.error("--ranks, --seeds and --sweep_points must be positive.")
    args.network_batches = {"small_cnn": args.batches, "small_cnn_nobn": args.nobn_batches}
    if not 0 < args.validation_examples < FASHION_MNIST_TRAIN:
        parser.error(f"--validation_examples must be in [1, {FASHION_MNIST_TRAIN - 1}].")
    args.output_dir = os.path.abspath(args.output_dir)
    args.report = os.path.abspath(args.report)
    args.command = common.command_line("large_batch_study", sys.argv[1:] if argv is None else argv)
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    # One study per output folder at a time: two would train the same runs into the same directories.
    lock = open(os.path.join(args.output_dir, ".lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"Another study is running in {args.output_dir}; wait for it or stop it.") from None
    outcomes = study(args)
    selected = groups(args, args.networks, args.arms)
    runs = sum(len(outcomes[g].records) for g in selected)
    if args.report_only:
        runs = sum(len(o.records) for o in outcomes.values())
        print(f"[study] report rewritten from {runs} finished runs: {args.report}", flush=True)
        return
    print(f"[study] done: {runs} runs of the selected part; report {args.report}", flush=True)


if __name__ == "__main__":
    main()
