"""MPI_Allreduce alone, no Horovod, MPICH and Open MPI, across 2, 4 and 8 emulated hosts.

Horovod's allreduce at p >= 4 took ~1.85x the ring bound on Open MPI's own choices, and on MPICH (Debian's
4.0.2, ch4:ucx) 1.65x at p = 4 and hung at p >= 4 (`results/allreduce_hosts/mpich.md`). This measures the MPI
libraries alone, to tell their part from Horovod's and to find the mechanism: benchmarks/mpi_allreduce.c,
built with each MPI's `mpicc`, launched from node1 (the hosts cannot reach this machine's own name), one rank
per host, under each setting below, `--launches` times each.

Settings (MPICH: `mpiexec.mpich -launcher ssh`, UCX kept on TCP with UCX_TLS=tcp,self, since between the
processes of one kernel UCX would otherwise move the data through shared memory, past the emulated links;
Open MPI: `mpirun`, OMPI_MCA_btl=tcp,self for the same reason):
  mpich              MPICH's and UCX's own choices
  mpich_rsag         MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=reduce_scatter_allgather (Rabenseifner's, bandwidth-
                     optimal; MPICH 4.0.2 has no value "ring" for it: every rank aborts on it)
  mpich_eager        UCX_RNDV_THRESH=inf: UCX sends every message eagerly, never by its rendezvous protocol
  mpich_eager_rsag   both
  mpich_yield        MPIR_CVAR_POLLS_BEFORE_YIELD=1: MPICH yields the core at every poll of its progress loop
  mpich_eager_yield  eager and yield
  ompi               Open MPI's own choices
  ompi_yield         OMPI_MCA_mpi_yield_when_idle=1
  ompi_rules         hvd_lars/parallel/ompi_allreduce_rules.conf (the ring from 1 MiB on 3+ ranks)
  ompi_rules_yield   the rules file and yielding: what hvd_lars.main sets for Open MPI

A launch whose rank 0 printed "finalize" but did not end within --finalize_s is recorded as hung in
MPI_Finalize, its figures kept, and every process of it killed (they run on this machine's one kernel).

Run as root from the repository root with the machine to itself, after `bash install/test_services.sh`
(which installs MPICH beside Open MPI):

    python -m benchmarks.mpi_allreduce                  # results/mpi_allreduce.md, raw in its folder
    python -m benchmarks.mpi_allreduce --hosts=4 --settings=mpich,mpich_eager --launches=1 --out=/tmp/m.md
"""

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time

from benchmarks import common
from benchmarks.allreduce_hosts import LINK_EFFICIENCY, bound_s, mib, sizes_and_link_rate

SOURCE = os.path.join(common.REPO, "benchmarks", "mpi_allreduce.c")
RULES = os.path.join(common.REPO, "hvd_lars", "parallel", "ompi_allreduce_rules.conf")
ON_TCP = {"mpich": {"UCX_TLS": "tcp,self"}, "ompi": {"OMPI_MCA_btl": "tcp,self"}}
RSAG = {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "reduce_scatter_allgather"}
EAGER = {"UCX_RNDV_THRESH": "inf"}
MPICH_YIELD = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}
OMPI_YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}
OMPI_RULES = {
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_dynamic_rules_filename": RULES,
}
# name -> (MPI, what the setting adds to the environment)
SETTINGS = {
    "mpich": ("mpich", {}),
    "mpich_rsag": ("mpich", RSAG),
    "mpich_eager": ("mpich", EAGER),
    "mpich_eager_rsag": ("mpich", {**EAGER, **RSAG}),
    "mpich_yield": ("mpich", MPICH_YIELD),
    "mpich_eager_yield": ("mpich", {**EAGER, **MPICH_YIELD}),
    "ompi": ("ompi", {}),
    "ompi_yield": ("ompi", OMPI_YIELD),
    "ompi_rules": ("ompi", OMPI_RULES),
    "ompi_rules_yield": ("ompi", {**OMPI_RULES, **OMPI_YIELD}),
}
COMPILERS = {"mpich": ("mpicc.mpich", "mpiexec.mpich"), "ompi": ("mpicc.openmpi", "mpirun.openmpi")}


def build(directory, mpis):
    """Compiles mpi_allreduce.c with each of `mpis`' mpicc into `directory`; returns {mpi: program path}.
    Raises RuntimeError naming what is missing when an MPI's compiler or launcher is not installed."""
    programs = {}
    for mpi in mpis:
        mpicc, launcher = COMPILERS[mpi]
        if not shutil.which(mpicc) or not shutil.which(launcher):
            raise RuntimeError(f"{mpicc} / {launcher} not found: run `bash install/test_services.sh` first")
        programs[mpi] = os.path.join(directory, f"mpi_allreduce_{mpi}")
        subprocess.run(
            [mpicc, "-O2", "-o", programs[mpi], SOURCE], check=True, capture_output=True, text=True
        )
    return programs


def kill_leftovers(program):
    """Kills every process of a launch of `program`: its ranks, and MPICH's or Open MPI's launcher and
    daemons (hydra proxies, orted)."""
    for pattern in (program, "hydra_pmi_proxy", "mpiexec.mpich", "orted", "mpirun.openmpi"):
        subprocess.run(["pkill", "-9", "-f", pattern], capture_output=True)


def parse(stdout):
    """Rank 0's lines -> ({size: [times in s]}, whether it reached MPI_Finalize, whether it left it); a size
    with no time printed yet is left out."""
    times, reached, left = {}, False, False
    for line in stdout.splitlines():
        words = line.split()
        if words[:1] == ["size"] and "times_s" in words and words[-1] != "times_s":
            times[int(words[1])] = [float(w) for w in words[words.index("times_s") + 1 :]]
        reached |= line.strip() == "finalize"
        left |= line.strip() == "finalized"
    return times, reached, left


def launch(programs, hosts, setting, sizes, repeats, finalize_s, timeout_s, ompi_bind_to=""):
    """One launch over node1..node<hosts>, 1 rank each (Open MPI's ranks bound `--bind-to ompi_bind_to`, ""
    for mpirun's own choice: to a core up to 2 ranks, to the socket beyond). Returns its record: times per
    size, the outcome ('exited', 'hung in MPI_Finalize', 'failed', 'timed out'), the exit status and the end
    of its output."""
    mpi, added = SETTINGS[setting]
    program = programs[mpi]
    settings = {**ON_TCP[mpi], **added}
    host_list = ",".join(f"node{k}:1" for k in range(1, hosts + 1))
    if mpi == "mpich":
        argv = ["mpiexec.mpich", "-launcher", "ssh", "-hosts", host_list, "-n", str(hosts), program]
    else:
        settings.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        argv = ["mpirun.openmpi", "-H", host_list, "-np", str(hosts)]
        argv += [*(["--bind-to", ompi_bind_to] if ompi_bind_to else []), program]
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in settings.items())
    argv += [str(repeats), *map(str, sizes)]
    cmd = ["ssh", "node1", f"env {assignments} {shlex.join(argv)}"]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        start, finalize_seen = time.monotonic(), None
        while proc.poll() is None:
            time.sleep(0.5)
            out.seek(0)
            _, reached, _ = parse(out.read())
            if reached and finalize_seen is None:
                finalize_seen = time.monotonic()
            if (finalize_seen and time.monotonic() - finalize_seen > finalize_s) or (
                time.monotonic() - start > timeout_s
            ):
                break
        rc = proc.poll()
        if rc is None:
            os.killpg(proc.pid, 9)
            kill_leftovers(program)
            proc.wait()
        out.seek(0)
        text = out.read()
    times, reached, left = parse(text)
    if rc is None:
        outcome = "hung in MPI_Finalize" if reached else "timed out"
    else:
        outcome = "exited" if rc == 0 and left else "failed"
    return dict(hosts=hosts, setting=setting, times_s=times, outcome=outcome, rc=rc, tail=text[-1500:])


def report(args, sizes, link_bits, records, matmul, command, raw):
    lines = [
        "# MPICH's and Open MPI's own MPI_Allreduce across emulated hosts, no Horovod",
        "",
        *common.provenance_lines(command, matmul, raw),
        f"- launch/emulated_cluster.sh, every link shaped to {args.link_rate}; mpi_allreduce.c "
        "built with each MPI's `mpicc -O2`, run from node1: `ssh node1 env <setting> mpiexec.mpich -launcher "
        "ssh -hosts node1:1,... -n p` (MPICH 4.0.2, ch4:ucx) or `mpirun.openmpi -H node1:1,... -np p`; "
        f"{args.repeats} timed allreduces after 2 untimed, each after MPI_Barrier; rank 0's times, medians. "
        f"Bound: 2(p-1)/p x S / ({LINK_EFFICIENCY} x link).",
        "- Settings: "
        + "; ".join(f"`{name}`: {_assignments(SETTINGS[name])}" for name in args.settings.split(",")),
        "- Open MPI's ranks bound: "
        + (
            f"`--bind-to {args.ompi_bind_to}`"
            if args.ompi_bind_to
            else "mpirun's own choice (a core each up "
            "to 2 ranks, the socket beyond; horovodrun passes `--bind-to none`)"
        ),  # fmt: skip
        "",
        "| p | setting | size | median s per launch | median / bound per launch | how the launches ended |",
        "|---|---|---|---|---|---|",
    ]
    groups = {}
    for r in records:
        groups.setdefault((r["hosts"], r["setting"]), []).append(r)
    for (hosts, setting), runs in groups.items():
        outcomes = [r["outcome"] for r in runs]
        ends = ", ".join(f"{outcomes.count(o)} {o}" for o in dict.fromkeys(outcomes))
        for size in sizes:
            medians = [statistics.median(r["times_s"][size]) for r in runs if size in r["times_s"]]
            bound = bound_s(size, hosts, link_bits)
            shown = ", ".join(f"{m:.4g}" for m in medians) or "-"  # 1 KiB takes ~1e-4 s
            ratios = ", ".join(f"{m / bound:.2f}" for m in medians) or "-"
            lines.append(f"| {hosts} | {setting} | {mib(size)} | {shown} | {ratios} | {ends} |")
    return lines


def _assignments(setting):
    mpi, added = setting
    return " ".join(f"{k}={v}" for k, v in {**ON_TCP[mpi], **added}.items())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", default="2,4,8", help="p values: hosts, 1 rank each (2-8)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"of {', '.join(SETTINGS)}")
    parser.add_argument("--sizes_mib", default="0.0009765625,1,16")
    parser.add_argument("--launches", type=int, default=2, help="launches per p and setting")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--link_rate", default="200mbit")
    parser.add_argument("--finalize_s", type=float, default=10.0, help="how long MPI_Finalize may take")
    parser.add_argument("--timeout_s", type=float, default=300.0, help="how long one launch may take")
    parser.add_argument(
        "--ompi_bind_to",
        default="",
        help="Open MPI: mpirun --bind-to (none, as horovodrun passes); '' its own",
    )
    parser.add_argument("--out", default=os.path.join(common.RESULTS, "mpi_allreduce.md"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.settings.split(",")) - set(SETTINGS))
    if unknown:
        parser.error(f"--settings: unknown {unknown}; valid: {', '.join(SETTINGS)}")
    try:
        hosts = [int(h) for h in args.hosts.split(",")]
    except ValueError:
        parser.error(f"--hosts={args.hosts!r}: expected comma-separated integers 2-8")
    if not all(2 <= h <= 8 for h in hosts):
        parser.error(f"--hosts={args.hosts!r}: each 2-8 (the emulated cluster has up to 8 hosts)")
    if args.launches < 1 or args.repeats < 1:
        parser.error(f"--launches={args.launches}, --repeats={args.repeats}: each at least 1")
    sizes, link_bits = sizes_and_link_rate(parser, args)
    matmul = common.matmul_rate()
    records = []
    # The hosts share this machine's file system: a program under /var/tmp is on every one of them.
    settings = args.settings.split(",")
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="hvd_lars_mpi_") as directory:
        programs = build(directory, sorted({SETTINGS[name][0] for name in settings}))
        with common.emulated_cluster(max(hosts), args.link_rate):
            for p in hosts:
                for setting in settings:
                    for _ in range(args.launches):
                        r = launch(
                            programs,
                            p,
                            setting,
                            sizes,
                            args.repeats,
                            args.finalize_s,
                            args.timeout_s,
                            args.ompi_bind_to,
                        )
                        shown = {s: round(statistics.median(t) / bound_s(s, p, link_bits), 2)
                                 for s, t in r["times_s"].items()}  # fmt: skip
                        print(f"[mpi_allreduce] p={p} {setting}: x bound {shown}; {r['outcome']}")
                        records.append(r)
    command = common.command_line("mpi_allreduce", argv)
    raw = common.data_path(args.out)
    with open(raw, "w") as f:
        json.dump({"command": command, "link_rate": args.link_rate, "records": records}, f, indent=1)
    lines = report(args, sizes, link_bits, records, matmul, command, raw)
    common.write_report(args.out, "\n".join(lines))
    print(f"[mpi_allreduce] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
