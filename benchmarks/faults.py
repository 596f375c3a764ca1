"""Fault scenarios on 2 real Horovod ranks, each repeated: time from the fault to the end of the job, what was
left (exit status, checkpoints, summary.json) and whether the resumed run matched an uninterrupted one.
Faults are injected by tests/support/kill_at_step.py and mismatch_worker.py (the library has no hooks).

    python -m benchmarks.faults          # results/faults.md; the machine to itself, about 45 minutes
    python -m benchmarks.faults --repetitions=1 --scenarios=sigterm,sigkill --out=/tmp/faults.md

Scenarios (Fashion-MNIST subset: 2,048 images, global batch 256, 16 updates), each with what must hold:
  sigkill / sigterm / usr1  rank 1 SIGKILLed / SIGTERMed, rank 0 SIGUSR1ed after a random update: the job
      ends (signals: at the next update, checkpointed, status 75) and the resumed run ends where the
      uninterrupted one does
  damaged_checkpoint  a kill, then the newest checkpoint cut to half: a warning, the one before it resumed
  diverge    peak rate 1,000: every rank stops at one update, status 3, finite checkpoints, strict JSON
  mismatch   rank 1's model has one more layer: an error naming the first difference, no hang
  exit       a complete run: rank 0's final line to the end of the job
  elastic    launch/elastic.sh, 2 -> 1 -> 2 workers: status 0, 3 attempts, the joined worker's weights equal
  join_smoke / join_resnet50  a worker joining flags/smoke.flags / ResNet-50 at 32 x 32
  restarts   one run stopped five times (--stop_schedule) and restarted: it ends equal to an uninterrupted one
  silent_host / host_readd  (root, launch/emulated_cluster.sh) node2's link goes down: the job ends within
      90 s; an elastic job of 3 hosts loses one and takes it back
--scenarios replaces those rows of the existing report and keeps the others.
"""

import datetime
import functools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import common

REPO = common.REPO
TWO_RANKS = [common.HOROVODRUN, "-np", "2", "-H", "localhost:2"]
KILLER = os.path.join(REPO, "tests", "support", "kill_at_step.py")
MISMATCH = os.path.join(REPO, "tests", "support", "mismatch_worker.py")
FLAGS = [
    "--flagfile=flags/fashion_mnist_lars.flags", "--max_train_examples=2048", "--max_eval_examples=500",
    "--global_batch_size=256", "--epochs=2", "--warmup_epochs=1", "--run_name=r", "--verbose=0",
]  # fmt: skip
TOTAL_STEPS = 16
SIGNALS = ("sigkill", "sigterm", "usr1")
SCENARIOS = (
    "sigkill", "sigterm", "usr1", "damaged_checkpoint", "diverge", "mismatch", "exit", "elastic",
    "join_smoke", "join_resnet50", "silent_host", "host_readd", "restarts",
)  # fmt: skip
CLUSTER_SCENARIOS = {"silent_host": 2, "host_readd": 3}  # emulated hosts each needs
TIMEOUT_S = 600


def _train(workdir, *flags, fault=(), lines=None):
    """Runs 2 ranks; returns (exit status, output, time.time() at the end, time of `lines`' match)."""
    program = [KILLER, *fault] if fault else ["-m", "hvd_lars.main"]
    cmd = TWO_RANKS + [sys.executable] + program + FLAGS + [f"--workdir={workdir}", *flags]
    p = subprocess.Popen(
        cmd, cwd=REPO, env=common.worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out, seen = [], None
    deadline = time.time() + TIMEOUT_S
    for line in p.stdout:
        out.append(line)
        if lines and seen is None and lines in line:
            seen = time.time()
        if time.time() > deadline:
            p.kill()
    p.wait()
    return p.returncode, "".join(out), time.time(), seen


def _checkpoints(run_dir):
    folder = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    return sorted(int(f.split("-")[1].split(".")[0]) for f in os.listdir(folder) if f.endswith(".index"))


def _load(run_dir, step=None):
    import tensorflow as tf

    folder = os.path.join(run_dir, "checkpoints")
    reader = tf.train.load_checkpoint(os.path.join(folder, f"ckpt-{step}") if step else folder)
    names = [n for n in reader.get_variable_to_shape_map() if "model" in n or "optimizer" in n]
    return {n: reader.get_tensor(n) for n in names}


def _compare(a, b):
    """(exact: weights, slots and step equal; the largest difference of a batch-norm moving statistic
    relative to that tensor's largest magnitude)."""
    if a.keys() != b.keys():
        return False, float("inf")
    exact, moving = True, 0.0
    for name in a:
        if "moving_" in name:
            scale = float(np.max(np.abs(a[name]))) or 1.0
            moving = max(moving, float(np.max(np.abs(a[name] - b[name]))) / scale)
        elif not np.array_equal(a[name], b[name]):
            exact = False
    return exact, moving


def _strict(path):
    def refuse(token):
        raise ValueError(token)

    try:
        with open(path) as f:
            return json.load(f, parse_constant=refuse)
    except (OSError, ValueError):
        return None


def _rank_weights_match(run_dir, ranks):
    """(every rank's trainable weights equal rank 0's bit for bit, the names of those tensors), from the
    files tests/support/rank_weights_main.py saved under `run_dir`/rank_weights."""
    saved = [np.load(os.path.join(run_dir, "rank_weights", f"rank{r}.npz")) for r in range(ranks)]
    trainable = [k for k in saved[0].files if k.startswith("t")]
    same = all(np.array_equal(saved[0][k], saved[r][k]) for r in range(1, ranks) for k in trainable)
    return same, trainable


def _elastic_end(run_dir, ranks, status):
    """(every rank's weights equal rank 0's, the final step, the `left` column) of a finished elastic job."""
    same, _ = _rank_weights_match(run_dir, ranks)
    final = int(_load(run_dir)["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"])
    summary = _strict(os.path.join(run_dir, "summary.json")) or {}
    return same, final, f"status {status}; final step {final}; test top-1 {summary.get('final_test_top1')}"


def _record(workdir):
    return os.path.join(workdir, "fault_time")


def run_signal(workdir, reference, kind):
    k = random.randint(1, TOTAL_STEPS - 2)
    signal_name, rank = {"sigkill": ("KILL", 1), "sigterm": ("TERM", 1), "usr1": ("USR1", 0)}[kind]
    flags = ["--checkpoint_every_steps=5"] if kind == "sigkill" else []
    fault = [f"--kill_at_step={k}", f"--kill_signal={signal_name}", f"--kill_rank={rank}"]
    status, out, ended, _ = _train(workdir, *flags, fault=fault + [f"--kill_record={_record(workdir)}"])
    with open(_record(workdir)) as f:
        to_exit = ended - float(f.read())
    run_dir = os.path.join(workdir, "r")
    steps = _checkpoints(run_dir)
    expected = k + 1 if kind != "sigkill" else None
    left = f"status {status}; checkpoints {steps}"
    ok = status != 0 and to_exit < 60
    if expected is not None:
        ok = ok and f"stopped at step {expected}," in out and expected in steps
        left += f"; stopped at step {expected}" if f"stopped at step {expected}," in out else "; NO STOP LINE"
    # Killed before the first checkpoint (every 5 updates): nothing to keep, the rerun starts at step 0.
    latest = _load(run_dir) if steps else {}
    ok = ok and all(np.isfinite(v).all() for v in latest.values())
    resumed_status, out2, _, _ = _train(workdir, *flags)
    found = re.search(r"\(step (\d+)\)", out2)
    resumed_from = found.group(1) if found else ("0" if not steps else "?")
    exact, moving = _compare(reference, _load(run_dir))
    matched = resumed_status == 0 and exact and moving < 1e-5
    detail = f"signal after update {k}, resumed from step {resumed_from}"
    detail += "" if exact else ", WEIGHTS DIFFER"
    return dict(ok=ok and matched, to_exit=to_exit, left=left, matched=matched, moving=moving, detail=detail)


def run_diverge(workdir):
    flags = ["--optimizer=momentum", "--peak_learning_rate=1000", "--checkpoint_every_steps=1"]
    status, out, ended, _ = _train(workdir, *flags, "--keep_checkpoints=3")
    match = re.search(r"training diverged at step (\d+) \(learning rate ([0-9.e+-]+)\)", out)
    run_dir = os.path.join(workdir, "r")
    steps = _checkpoints(run_dir)
    finite = all(all(np.isfinite(v).all() for v in _load(run_dir, s).values()) for s in steps)
    summary = _strict(os.path.join(run_dir, "summary.json"))
    both = match and out.count(f"training diverged at step {match.group(1)} ") >= 2
    ok = bool(status != 0 and both and finite and summary and summary.get("stopped"))
    left = f"status {status}; kept checkpoints {steps}, all finite: {finite}; "
    left += f"strict summary.json: {bool(summary)}"
    detail = f"stopped at step {match.group(1)}, rate {match.group(2)}" if match else "no divergence line"
    return dict(ok=ok, to_exit=None, left=left, matched=None, moving=None, detail=detail)


def run_mismatch(workdir):
    start = time.time()
    p = subprocess.run(
        TWO_RANKS + [sys.executable, MISMATCH, workdir], cwd=REPO, env=common.worker_env(),
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    errors = [str(np.load(os.path.join(workdir, f"rank{r}.npz"))["error"]) for r in range(2)]
    ok = p.returncode == 0 and all("first difference at position 2" in e for e in errors)
    left = "both ranks raised: " + (errors[0].split(";")[1].strip() if ok else "NO ERROR")
    return dict(ok=ok, to_exit=time.time() - start, left=left, matched=None, moving=None, detail="")


def run_exit(workdir):
    status, _, ended, final = _train(workdir, lines="final test top-1")
    ok = status == 0 and final is not None and ended - final < 10
    to_exit = ended - final if final else None
    return dict(ok=ok, to_exit=to_exit, left=f"status {status}", matched=None, moving=None, detail="")


def run_elastic(workdir):
    import pathlib

    from tests.support.elastic_job import TOTAL_STEPS as ELASTIC_STEPS
    from tests.support.elastic_job import remove_and_add

    status, out, updates, taken_up = remove_and_add(pathlib.Path(workdir))
    same, final, left = _elastic_end(os.path.join(workdir, "r"), 2, status)
    batches = re.findall(r"elastic attempt \d: \d worker\(s\) from update \d+, (\d+) images per rank", out)
    ok = (
        status == 0
        and len(updates) == 3
        and batches == ["32", "64", "32"]
        and same
        and final == ELASTIC_STEPS
    )
    ok = ok and all(u % 5 == 0 for u in updates)
    detail = (
        f"attempts from updates {updates}, per-rank batches {batches}, taken up after "
        f"{taken_up[0]:.0f} / {taken_up[1]:.0f} s; the joined worker's weights "
        f"{'identical' if same else 'DIFFER'}"
    )
    return dict(ok=ok, to_exit=None, left=left, matched=None, moving=None, detail=detail, taken_up=taken_up)


def run_damaged_checkpoint(workdir, reference):
    k = random.randint(3, TOTAL_STEPS - 2)
    flags = ["--checkpoint_every_steps=1", "--noasync_checkpoints"]
    fault = [f"--kill_at_step={k}", "--kill_signal=KILL", "--kill_rank=1"]
    status, _, _, _ = _train(workdir, *flags, fault=fault + [f"--kill_record={_record(workdir)}"])
    run_dir = os.path.join(workdir, "r")
    steps = _checkpoints(run_dir)
    newest = max(steps, default=None)
    if newest is None:
        return dict(ok=False, to_exit=None, left=f"status {status}; no checkpoint", matched=None,
                    moving=None, detail=f"killed after update {k}")  # fmt: skip
    data = os.path.join(run_dir, "checkpoints", f"ckpt-{newest}.data-00000-of-00001")
    os.truncate(data, os.path.getsize(data) // 2)
    resumed_status, out2, _, _ = _train(workdir, *flags)
    warned = [line for line in out2.splitlines() if "warning:" in line and f"ckpt-{newest}" in line]
    found = re.search(r"\(step (\d+)\)", out2)
    resumed_from = int(found.group(1)) if found else None
    exact, moving = _compare(reference, _load(run_dir))
    matched = resumed_status == 0 and exact and moving < 1e-5
    ok = status != 0 and len(warned) == 1 and resumed_from is not None and resumed_from < newest and matched
    left = f"status {status}, then {resumed_status}; ckpt-{newest} cut to half"
    detail = (
        f"killed after update {k}; resumed from step {resumed_from} with {len(warned)} warning line(s) "
        f"naming ckpt-{newest}"
    )
    detail += "" if exact else ", WEIGHTS DIFFER"
    return dict(ok=ok, to_exit=None, left=left, matched=matched, moving=moving, detail=detail)


# The joining-worker scenarios: 1 worker, then 2 once the first has started (tests/test_elastic.py's).
JOIN_SMOKE = [
    "--steps_per_epoch=200", "--epochs=3", "--checkpoint_every_steps=100", "--elastic_commit_every_steps=5",
    "--run_name=r", "--verbose=2",
]  # fmt: skip
JOIN_RESNET50 = [
    "--model=resnet50", "--global_batch_size=16", "--steps_per_epoch=20", "--epochs=2",
    "--max_eval_examples=32", "--checkpoint_every_steps=0", "--elastic_commit_every_steps=5", "--run_name=r",
    "--verbose=2",
]  # fmt: skip


def run_join(workdir, flags):
    import pathlib

    from tests.support.elastic_job import ElasticJob

    job = ElasticJob(
        pathlib.Path(workdir), "localhost:1", 1, 2, flagfile="flags/smoke.flags", base_flags=flags
    )
    try:
        job.wait_for("elastic attempt 1: 1 worker(s) from update 0", timeout=TIMEOUT_S)
        changed = time.time()
        job.set_hosts("localhost:2")
        job.wait_for("elastic attempt 2: 2 worker(s) from update ", timeout=TIMEOUT_S)
        taken_up = time.time() - changed
        status = job.finish(timeout=TIMEOUT_S)
    finally:
        if job.process.poll() is None:
            job.process.kill()
    out = job.output()
    run_dir = os.path.join(workdir, "r")
    same, trainable = _rank_weights_match(run_dir, 2)
    same = same and bool(trainable)
    final = "[hvd_lars] final test top-1 " in out
    aborted = "gloo::EnforceNotMet" in out
    update = re.search(r"elastic attempt 2: 2 worker\(s\) from update (\d+)", out)
    ok = status == 0 and final and same and not aborted
    left = f"status {status}; final test line {'printed' if final else 'MISSING'}"
    detail = (
        f"2 workers from update {update.group(1) if update else '?'}, taken up after {taken_up:.0f} s; "
        f"{len(trainable)} trainable tensors {'identical' if same else 'DIFFER'} on the joined worker"
    )
    detail += "; GLOO ABORT" if aborted else ""
    return dict(ok=ok, to_exit=None, left=left, matched=None, moving=None, detail=detail)


def run_host_readd(workdir, cluster):
    import pathlib

    from tests.support.elastic_job import HOSTS_TOTAL_STEPS, host_removed_and_added

    status, out, attempts, taken_up = host_removed_and_added(cluster, pathlib.Path(workdir))
    same, final, left = _elastic_end(os.path.join(workdir, "r"), 3, status)
    shape = [(w, b) for w, _, b in attempts]
    ok = status == 0 and shape == [(3, 32), (2, 48), (3, 32)] and same and final == HOSTS_TOTAL_STEPS
    detail = (
        f"attempts (workers, from update, per-rank batch) {attempts}; taken up after "
        + " / ".join(f"{t:.0f}" for t in taken_up)
        + f" s; every rank's weights {'identical' if same else 'DIFFER'}"
    )
    return dict(ok=ok, to_exit=None, left=left, matched=None, moving=None, detail=detail)


def run_silent_host(workdir, cluster):
    from tests.support.emulated_cluster import silent_host_run

    env = common.worker_env(OMPI_MCA_mpi_yield_when_idle="1")
    r = silent_host_run(cluster, workdir, 60, 90, env)
    run_dir = os.path.join(workdir, "smoke")
    steps = _checkpoints(run_dir)
    loads = bool(steps) and all(np.isfinite(v).all() for v in _load(run_dir).values())
    ok = r["status"] not in (None, 0) and r["ended_after"] < 90 and not r["left_on_node2"] and loads
    left = f"status {r['status']}; checkpoints up to {max(steps, default=None)} (latest loads: {loads})"
    detail = (
        f"node2's ranks ended {r['ranks_ended_after']:.0f} s after"
        if not r["left_on_node2"]
        else (f"node2's ranks {r['left_on_node2']} STILL RAN")
    )
    return dict(ok=ok, to_exit=r["ended_after"], left=left, matched=None, moving=None, detail=detail)


def run_restarts(workdir, reference):
    from tests.support import small_runs

    starts = small_runs.run_restart_sequence(workdir, env=common.worker_env())
    run_dir = os.path.join(workdir, "smoke")
    resumed = [s["resumed"] for s in starts]
    stopped = [s["stopped"] for s in starts if s["stopped"] is not None]
    expected = [None] + [step for _, step in small_runs.STOPS]
    finished = [s["returncode"] == 0 for s in starts] == [False] * len(small_runs.STOPS) + [True]
    ours = small_runs.final_tensors(run_dir) if finished else {}
    theirs = reference()
    equal = ours.keys() == theirs.keys() and all(np.array_equal(ours[n], theirs[n]) for n in ours)
    rows = [(r["epoch"], r["step"]) for r in small_runs.metrics_rows(run_dir)] if finished else []
    once = rows == [("0", "4"), ("1", "8"), ("2", "12"), ("3", "16")]
    ok = finished and resumed == expected and stopped == [10, 12] and equal and once
    seconds = ", ".join(f"{s['seconds']:.0f}" for s in starts)
    detail = (
        f"resumed from {resumed[1:]}, stopped at {stopped}; {len(ours)} tensors "
        f"{'equal' if equal else 'DIFFER'}; rows {'once' if once else rows}; starts of {seconds} s"
    )
    left = f"status {starts[-1]['returncode']} after {len(starts)} starts"
    return dict(
        ok=ok, to_exit=None, left=left, matched=equal and once, moving=0.0 if equal else None, detail=detail
    )


def _earlier_rows(out, rerun):
    """(the earlier report's provenance lines, each reduced to its rows that stay; its table rows of the
    scenarios not in `rerun`)."""
    if not os.path.exists(out):
        return [], []
    with open(out) as f:
        text = f.read().split(common.HAND_WRITTEN)[0].splitlines()
    kept = set(SCENARIOS) - set(rerun)
    rows = [line for line in text if line.startswith("| ") and line.split("|")[1].strip() in kept]
    names = {row.split("|")[1].strip() for row in rows}
    made = []
    for line in text:
        found = re.match(r"Rows ([a-z0-9_, ]+): made by (.*)", line)
        if not found:
            continue
        stay = [n.strip() for n in found.group(1).split(",") if n.strip() in names]
        if stay:
            made.append(f"Rows {', '.join(stay)}: made by {found.group(2)}")
    return made, rows


def report(results, args, out):
    command = common.command_line("faults", args.argv)
    earlier_made, earlier_rows = _earlier_rows(out, results)
    lines = [
        "# Faults on 2 Horovod ranks",
        "",
        f"Rows {', '.join(results)}: made by `{command}` at git {common.sha_text(common.git_sha())}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, on "
        f"{common.machine(common.matmul_rate())}; 1-minute load average at the "
        f"end {os.getloadavg()[0]:.1f} (2 cores: above 2, other work shared the machine and times to exit "
        "stretch with it).",
        "",
    ]
    for line in earlier_made:
        lines += [line, ""]
    lines += [
        "| scenario | repetitions | passed | time to exit (min / median / max, s) | what was left | "
        "resume matched (largest moving-statistics difference) | details |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        times = [r["to_exit"] for r in runs if r["to_exit"] is not None]
        timing = f"{min(times):.1f} / {statistics.median(times):.1f} / {max(times):.1f}" if times else "-"
        matched = [r["matched"] for r in runs if r["matched"] is not None]
        moving = max((r["moving"] for r in runs if r["moving"] is not None), default=None)
        match_text = f"{sum(matched)} of {len(matched)} ({moving:.1e})" if matched else "-"
        lines.append(
            f"| {name} | {len(runs)} | {sum(r['ok'] for r in runs)} | {timing} | {runs[-1]['left']} | "
            f"{match_text} | {'; '.join(r['detail'] for r in runs if r['detail'])} |"
        )
    header = lines.index("|---|---|---|---|---|---|---|") + 1
    order = {name: i for i, name in enumerate(SCENARIOS)}
    rows = sorted(lines[header:] + earlier_rows, key=lambda row: order[row.split("|")[1].strip()])
    common.write_report(out, "\n".join(lines[:header] + rows) + "\n")


def main(argv=None):
    parser = common.argument_parser(__doc__)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "faults.md"))
    args = parser.parse_args(argv)
    args.argv = argv
    scenarios = args.scenarios.split(",")
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; valid: {', '.join(SCENARIOS)}")
    results = {}
    cluster = None
    nodes = max((CLUSTER_SCENARIOS[name] for name in scenarios if name in CLUSTER_SCENARIOS), default=0)
    if nodes:
        # The emulated hosts each have a /tmp of their own: their run directories live under /var/tmp.
        from tests.support.emulated_cluster import EmulatedCluster, require_root

        require_root()
        cluster = EmulatedCluster(nodes=nodes)
        cluster.up()
    try:
        _run_scenarios(scenarios, args, results, cluster)
    finally:
        if cluster is not None:
            cluster.down()
    report(results, args, args.out)
    print(f"[faults] wrote {args.out}", flush=True)


def _run_scenarios(scenarios, args, results, cluster):
    with tempfile.TemporaryDirectory(dir="/var/tmp" if cluster else None) as tmp:
        reference = None
        if {*SIGNALS, "damaged_checkpoint"} & set(scenarios):
            status, *_ = _train(os.path.join(tmp, "reference"))
            assert status == 0, "the uninterrupted reference run failed"
            reference = _load(os.path.join(tmp, "reference", "r"))

        @functools.cache
        def restart_reference():
            from tests.support import small_runs

            workdir = os.path.join(tmp, "restart_reference")
            command = small_runs.uninterrupted_command(workdir)
            result = subprocess.run(
                command, cwd=REPO, env=common.worker_env(), capture_output=True, text=True, timeout=TIMEOUT_S
            )
            assert result.returncode == 0, (
                f"the uninterrupted restart reference failed: {result.stderr[-2000:]}"
            )
            return small_runs.final_tensors(os.path.join(workdir, "smoke"))

        signals = {kind: functools.partial(run_signal, reference=reference, kind=kind) for kind in SIGNALS}
        runs = {
            **signals, "damaged_checkpoint": lambda w: run_damaged_checkpoint(w, reference),
            "diverge": run_diverge, "mismatch": run_mismatch, "exit": run_exit, "elastic": run_elastic,
            "join_smoke": lambda w: run_join(w, JOIN_SMOKE),
            "join_resnet50": lambda w: run_join(w, JOIN_RESNET50),
            "silent_host": lambda w: run_silent_host(w, cluster),
            "host_readd": lambda w: run_host_readd(w, cluster),
            "restarts": lambda w: run_restarts(w, restart_reference),
        }  # fmt: skip
        for name in scenarios:
            results[name] = []
            for i in range(args.repetitions):
                workdir = os.path.join(tmp, f"{name}{i}")
                os.makedirs(workdir)
                r = runs[name](workdir)
                print(f"[faults] {name} {i + 1}/{args.repetitions}: {r}", flush=True)
                results[name].append(r)


if __name__ == "__main__":
    main()
