"""Are two runs of the same job bit-identical when Open MPI's allreduce is the ring?

With the allreduce rules file (hvd_lars/parallel/ompi_allreduce_rules.conf) set by launch/env.sh, two
tests of tests/test_cluster.py found the launch scripts' weights 1e-7 relative away from a bare
horovodrun's, with the same rules given to both. This runs
one job several times over, changing nothing, to tell "the launch scripts train differently" from "the
same job is not reproducible with the ring": the smoke job (flags/smoke.flags, 6 updates) on 2 emulated
hosts x 2 ranks, `horovodrun -np 4 -H node1:2,node2:2`, each rank's final weights saved by
tests/support/rank_weights_main.py, each arm `--repeats` times, arms alternated:

  default          Open MPI's own allreduce choice (its fixed decision), gradients overlapped (one
                   allreduce request per gradient, fused by Horovod as they come: the main program's default)
  rules            + the rules file (from 1 MiB on 3+ ranks the ring)
  rules_grouped    + the rules file, --gradient_reduction=grouped (one grouped allreduce of every gradient)
  rules_nofusion   + the rules file, HOROVOD_FUSION_THRESHOLD=0 (each gradient reduced alone)

Reported per arm: whether every repeat ends with the first repeat's weights bit for bit, and the largest
difference relative to the tensor's norm. Every repeat's ranks must agree with each other bit for bit (an
allreduce gives every rank the same sum), which is checked too. Run as root from the repository root:

    python -m benchmarks.allreduce_order                # writes results/allreduce_order.md
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks import common

REPO = common.REPO
RULES = os.path.join(REPO, "hvd_lars", "parallel", "ompi_allreduce_rules.conf")
RULES_ENV = {
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_dynamic_rules_filename": RULES,
}
ARMS = {
    "default": ({}, []),
    "rules": (RULES_ENV, []),
    "rules_grouped": (RULES_ENV, ["--gradient_reduction=grouped"]),
    "rules_nofusion": ({**RULES_ENV, "HOROVOD_FUSION_THRESHOLD": "0"}, []),
}
RANKS = 4
HOSTS = "node1:2,node2:2"


def run_once(arm, workdir):
    settings, flags = ARMS[arm]
    argv = [common.HOROVODRUN, "-np", str(RANKS), "-H", HOSTS, sys.executable]
    argv += ["tests/support/rank_weights_main.py", "--flagfile=flags/smoke.flags", "--intra_op_threads=1"]
    argv += [*flags, f"--workdir={workdir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_MCA_"))}
    # The main program's own rules default is switched off, and each arm says what it uses.
    env.update(PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", OMPI_MCA_mpi_yield_when_idle="1")
    env.update(OMPI_MCA_coll_tuned_use_dynamic_rules="0")
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **settings)
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        raise RuntimeError(f"{arm}: exit {result.returncode}\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    folder = os.path.join(workdir, "smoke", "rank_weights")
    ranks = []
    for r in range(RANKS):
        arrays = np.load(os.path.join(folder, f"rank{r}.npz"))
        ranks.append({k: arrays[k] for k in arrays.files if not k.startswith("init_")})  # final weights
    for r in range(1, RANKS):
        for name, value in ranks[0].items():
            if not np.array_equal(ranks[r][name], value):
                raise RuntimeError(f"{arm}: rank {r}'s final {name} differs from rank 0's")
    return ranks[0]


def relative_difference(a, b):
    """The largest |a - b| / |a| (Euclidean norms) over the tensors of two weight sets."""
    return max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(a[k]), 1e-30)) for k in a)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "allreduce_order.md"))
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; valid: {', '.join(ARMS)}")
    matmul = common.matmul_rate()
    weights = {arm: [] for arm in arms}
    with common.emulated_cluster(2):
        for repeat in range(args.repeats):
            for arm in arms:
                workdir = tempfile.mkdtemp(prefix=f"hvd_lars_order_{arm}_", dir="/var/tmp")
                try:
                    weights[arm].append(run_once(arm, workdir))
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                print(f"[allreduce_order] {arm} repeat {repeat} done", flush=True)
    command = common.command_line("allreduce_order", argv)
    lines = [
        "# Two runs of one job with Open MPI's ring allreduce: bit-identical or not",
        "",
        *common.provenance_lines(command, matmul),
        f"- flags/smoke.flags (6 updates, global batch 32), {RANKS} ranks on 2 emulated hosts ({HOSTS}), "
        f"Open MPI through horovodrun; {args.repeats} repeats per arm, arms alternated. Every repeat's 4 "
        "ranks ended bit-identical to each other (checked).",
        "",
        "| arm | repeats equal to the first, bit for bit | largest relative difference from the first |",
        "|---|---|---|",
    ]
    for arm in arms:
        first = weights[arm][0]
        same = sum(all(np.array_equal(w[k], first[k]) for k in first) for w in weights[arm][1:])
        worst = max((relative_difference(first, w) for w in weights[arm][1:]), default=0.0)
        lines.append(f"| {arm} | {same} of {len(weights[arm]) - 1} | {worst:.2e} |")
    common.write_report(args.out, "\n".join(lines))
    print(f"[allreduce_order] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
