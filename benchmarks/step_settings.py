"""Process-wide settings against the training step on this CPU: the memory
allocator, TensorFlow's CPU allocator and thread pools, and XLA, measured side by side in one run.

Every setting trains benchmarks/benchmark_models.py's configuration (hvd_lars's ResNet-50 v1.5 + LARS, one
synthetic batch of 32 at 224x224 repeated, `fit`, its warm-up then timed steps; float32 unless
--precision=mixed_bfloat16) in a fresh process, with only the setting changed:

  default        what a job gets with nothing set
  jemalloc       LD_PRELOAD of jemalloc (Debian's libjemalloc2): memory kept for reuse instead of returned
  tcmalloc       LD_PRELOAD of gperftools' tcmalloc (Debian's libtcmalloc-minimal4)
  glibc_hugetlb  GLIBC_TUNABLES=glibc.malloc.hugetlb=1: glibc's malloc asks for transparent huge pages
  tf_bfc         TF_CPU_ALLOCATOR_USE_BFC=true: TensorFlow's best-fit allocator for CPU tensors
  inter_op_1     TF_NUM_INTEROP_THREADS=1: one op at a time, each on every core
  xla            the step compiled by XLA (`model.compile(jit_compile=True)`)

The settings run in turn, ROUNDS times over (default 2), so that drift and a noisy neighbour weigh on all
alike; each row gives every run's images/s, their mean over the default's, the fraction of `tf.matmul`'s
rate in the same precision (measured at the start and the end, best) and the minor page faults per step
(the cost the allocators are meant to remove). A setting whose library is not installed is reported as
such, not run.

Writes results/step_settings.md (the hand-written reading after the marker is kept) and its raw data,
results/step_settings/step_settings.json (common.data_path of --out: beside any other report). A run of other
settings, rounds or precision goes into the question's folder, results/step_settings/, and
results/step_settings.md links it.

    python -m benchmarks.step_settings                    # about 20 minutes, the machine to itself
    python -m benchmarks.step_settings --settings=default,jemalloc --rounds=1
    python -m benchmarks.step_settings --settings=default,tf_bfc --rounds=4 --precision=mixed_bfloat16 \
        --out=results/step_settings/bfloat16.md
"""

import argparse
import json
import os
import statistics
import time

from benchmarks import benchmark_models, common

LIBRARIES = "/usr/lib/x86_64-linux-gnu"
SETTINGS = {
    "default": ({}, "nothing set"),
    "jemalloc": ({"LD_PRELOAD": f"{LIBRARIES}/libjemalloc.so.2"}, "LD_PRELOAD=libjemalloc.so.2"),
    "tcmalloc": (
        {"LD_PRELOAD": f"{LIBRARIES}/libtcmalloc_minimal.so.4"},
        "LD_PRELOAD=libtcmalloc_minimal.so.4",
    ),
    "glibc_hugetlb": ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"),
    "tf_bfc": ({"TF_CPU_ALLOCATOR_USE_BFC": "true"}, "TF_CPU_ALLOCATOR_USE_BFC=true"),
    "inter_op_1": ({"TF_NUM_INTEROP_THREADS": "1"}, "TF_NUM_INTEROP_THREADS=1"),
    "xla": ({}, "model.compile(jit_compile=True)"),
}
MODEL = "resnet50"
MATMUL_DTYPE = {
    "float32": "float32",
    "mixed_bfloat16": "bfloat16",
}  # the tf.matmul rate a precision is held to
MARKDOWN = os.path.join(common.RESULTS, "step_settings.md")


def missing_library(name):
    """The LD_PRELOAD library of setting `name` when it is not on this machine, else None."""
    path = SETTINGS[name][0].get("LD_PRELOAD")
    return path if path and not os.path.exists(path) else None


def parse_settings(text):
    """The setting names of a comma-separated list, in order. Raises ValueError naming an unknown one."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        raise ValueError(f"settings {unknown or text!r}: expected some of {', '.join(SETTINGS)}")
    return names


def measure(names, rounds, timeout, precision):
    matmul = [common.matmul_rate()]
    runs = []
    for round_ in range(rounds):
        for name in names:
            if missing_library(name):
                continue
            extra, _ = SETTINGS[name]
            spec = {"kind": "ours", "model": MODEL, "precision": precision, "jit_compile": name == "xla"}
            result = benchmark_models.run_worker(spec, timeout, env=common.worker_env(**extra))
            runs.append({"setting": name, "round": round_, **result})
    matmul.append(common.matmul_rate())
    return {"matmul": matmul, "runs": runs}


def rows(record):
    """Per setting: its runs' images/s, mean, ratio to the default's mean, fraction of the matmul rate of
    the record's precision (best of its two measurements), minor faults per step (mean); in SETTINGS'
    order."""
    dtype = MATMUL_DTYPE[record.get("precision", "float32")]
    peak = max(m[dtype] for m in record["matmul"])
    by_setting = {}
    for run in record["runs"]:
        by_setting.setdefault(run["setting"], []).append(run)
    base = statistics.mean(r["images_per_second"] for r in by_setting.get("default", [])) or None
    out = []
    for name in SETTINGS:
        if name not in by_setting:
            continue
        runs = by_setting[name]
        rate = statistics.mean(r["images_per_second"] for r in runs)
        out.append({
            "setting": name, "rates": [r["images_per_second"] for r in runs], "mean": rate,
            "ratio": rate / base if base else None,
            "fraction": rate * runs[0]["train_gflop_per_image"] / peak,
            "faults": statistics.mean(r["minor_faults_per_step"] for r in runs),
        })  # fmt: skip
    return out


def report(record, markdown):
    """Writes `markdown` from `record` (its provenance lines name where its raw data is)."""
    precision = record.get("precision", "float32")
    dtype = MATMUL_DTYPE[precision]
    lines = [
        f"# Process-wide settings against ResNet-50's {precision} training step on this CPU",
        "",
        *record["provenance"],
        f"- hvd_lars's ResNet-50 v1.5 + DistributedOptimizer(LARS), batch {benchmark_models.BATCH}, "
        f"{precision}, "
        f"{benchmark_models.WARMUP_STEPS} steps of `fit` left out then {benchmark_models.TIMED_STEPS} timed; "
        f"each setting in a fresh process, the settings in turn, {record['rounds']} round(s); `tf.matmul` "
        f"4096x4096 {dtype} at the start and the end: "
        + ", ".join(f"{m[dtype]:.0f}" for m in record["matmul"])
        + " GFLOP/s (the fraction uses the best).",
        "",
        "| setting | what is set | images/s (each run) | mean / default | fraction of tf.matmul "
        "| minor page faults per step |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows(record):
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        lines.append(
            f"| {r['setting']} | {SETTINGS[r['setting']][1]} | {r['mean']:.2f} "
            f"({', '.join(f'{x:.2f}' for x in r['rates'])}) | {ratio} | {r['fraction']:.2f} | "
            f"{r['faults']:,.0f} |"
        )
    for name, path in record.get("missing", {}).items():
        lines.append(f"| {name} | {SETTINGS[name][1]} | not run: {path} is not installed | | | |")
    common.write_report(markdown, "\n".join(lines))
    print(f"[step_settings] wrote {markdown}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated; default: all")
    parser.add_argument("--rounds", type=int, default=2, help="times every setting runs, in turn")
    parser.add_argument("--precision", default="float32", choices=tuple(MATMUL_DTYPE))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per worker process")
    parser.add_argument("--json", default=None, help="raw data (default: common.data_path of --out)")
    parser.add_argument("--out", default=MARKDOWN)
    parser.add_argument("--report_only", action="store_true", help="the markdown from --json")
    args = parser.parse_args(argv)
    args.json = args.json or common.data_path(args.out)
    if args.report_only:
        with open(args.json) as f:
            return report(json.load(f), args.out)
    try:
        names = parse_settings(args.settings)
    except ValueError as e:
        parser.error(f"--settings={args.settings}: {e}")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: must be 1 or more")
    started = time.time()
    record = {
        "command": common.command_line("step_settings", argv),
        "rounds": args.rounds,
        "precision": args.precision,
        "missing": {n: missing_library(n) for n in names if missing_library(n)},
        **measure(names, args.rounds, args.timeout, args.precision),
    }
    record["wall_time_s"] = round(time.time() - started)
    record["provenance"] = common.provenance_lines(record["command"], record["matmul"][-1], args.json)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    report(record, args.out)


if __name__ == "__main__":
    main()
