"""Host lists for MPI launchers from a Slurm allocation (`SLURM_JOB_NODELIST`, `SLURM_TASKS_PER_NODE`).

`python launch/slurm/hosts.py [--format=openmpi|horovod]` prints an Open MPI hostfile ("node01 slots=2"
per line) or a horovodrun `-H` list ("node01:2,node02:2") for the current job. Used by
launch/slurm/train.sbatch when LAUNCHER=mpirun or horovodrun; `srun` needs neither.
"""

import argparse
import os
import re
import sys


def expand_hostlist(hostlist):
    """Expands Slurm's compressed host list syntax.

    `"node[01-03,07],login1"` -> `["node01", "node02", "node03", "node07", "login1"]`; zero padding is kept.
    Several bracket groups in one name (`"rack[1-2]-n[1-2]"`) expand as a product, in Slurm's order.

    Raises:
        ValueError: unbalanced brackets or a malformed range, quoting the host list.
    """
    hosts = []
    for item in _split_top_level(hostlist):
        hosts.extend(_expand_item(item, hostlist))
    return hosts


def expand_tasks_per_node(spec, num_nodes):
    """Expands `SLURM_TASKS_PER_NODE` (`"2(x3),1"` -> `[2, 2, 2, 1]`) and checks it covers `num_nodes`.

    Raises:
        ValueError: malformed, or a count of nodes other than `num_nodes`.
    """
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE={spec!r}: cannot read {part!r} (expected N or N(xK)).")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if len(counts) != num_nodes:
        raise ValueError(
            f"SLURM_TASKS_PER_NODE={spec!r} describes {len(counts)} nodes, the node list {num_nodes}."
        )
    return counts


def _split_top_level(text):
    items, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r}: unbalanced ']'.")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise ValueError(f"host list {text!r}: unbalanced '['.")
    return [i for i in (items + [current]) if i]


def _expand_item(item, whole):
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    prefix, suffix = item[: m.start()], item[m.end() :]
    out = []
    for part in m.group(1).split(","):
        r = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not r:
            raise ValueError(f"host list {whole!r}: bad range {part!r}.")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"host list {whole!r}: range {part!r} runs backwards.")
        for n in range(int(lo), int(hi) + 1):
            out.extend(_expand_item(f"{prefix}{n:0{len(lo)}d}{suffix}", whole))
    return out


def hosts_from_environment(environ=os.environ):
    """[(host, ranks)] of the current Slurm job.

    Raises:
        ValueError: not inside a Slurm allocation (SLURM_JOB_NODELIST unset), or malformed variables.
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("SLURM_JOB_NODELIST is not set: run inside a Slurm job (sbatch or salloc).")
    hosts = expand_hostlist(nodelist)
    spec = (
        environ.get("SLURM_TASKS_PER_NODE") or f"{environ.get('SLURM_NTASKS_PER_NODE', '1')}(x{len(hosts)})"
    )
    return list(zip(hosts, expand_tasks_per_node(spec, len(hosts))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=("openmpi", "horovod"), default="openmpi")
    args = parser.parse_args(argv)
    try:
        hosts = hosts_from_environment()
    except ValueError as e:
        print(f"hvd_lars.slurm_hosts: error: {e}", file=sys.stderr)
        return 2
    if args.format == "openmpi":
        print("\n".join(f"{h} slots={n}" for h, n in hosts))
    else:
        print(",".join(f"{h}:{n}" for h, n in hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
