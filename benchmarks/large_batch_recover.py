"""The large-batch study's first 34 runs as records, read back from the tables of its report.

Those runs (small_cnn, momentum SGD and LARS at 512, 2,048 and 8,192) were made on 2026-11-30/12-01 in a
run folder that was not kept, so their summaries are gone; the report's sweep table (validation top-1 and
loss, train loss, images/s of every seed-0 run) and its chosen-rates table (validation, test top-1 and
top-5 of every chosen run) are what is left. This writes them as the records file
`benchmarks.large_batch_study` keeps for its report (`records_path`), so that a study started again skips
those runs instead of training them again (5.9 h) and its report still shows them. That report, as it was
at commit 52653ed (before the study grew a second network), is kept verbatim as
`tests/support/large_batch_study_first_report.md`. Run once, from the repository root:

    python -m benchmarks.large_batch_recover     # writes results/large_batch_study/large_batch_study.json

It refuses to overwrite an existing records file. Fields the tables do not give (train top-1, each run's own
git SHA and date) are None; `source` says where each record came from.
"""

import argparse
import math
import os
import re
import subprocess
import sys

from benchmarks import large_batch_study as study

SHAS = re.compile(r"Git SHA of the runs: (.*?); report written")


def _rows(text, header):
    """The rows (lists of cells) of the Markdown table under the heading line `header`."""
    lines = text[text.index(header) :].splitlines()[1:]
    rows = [line for line in lines if line.startswith("|")]
    table = []
    for line in lines[lines.index(rows[0]) :]:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip("|").split("|")])
    return table[2:]  # without the header and the |---| line


def recover(text, args, source):
    """{run name: record} of every run named in the report `text`, for the study's arguments `args`."""
    shas = SHAS.search(text).group(1).replace("`", "")
    records = {}
    for arm, batch, swept, peak, val, val_loss, train_loss, images, _ in _rows(
        text, "## Learning-rate sweep"
    ):
        rate = float(swept.split()[0])
        cell = _cell(args, arm, int(batch), rate, seed=0)
        records[study.run_name(args, cell)] = _record(
            args, cell, shas, source, peak_learning_rate=float(peak), val_top1=float(val),
            val_loss=float(val_loss), train_loss=float(train_loss), images_per_second=float(images),
        )  # fmt: skip
    for arm, batch, peak, seed, val, test1, test5, run in _rows(text, "## Chosen rates, every seed"):
        name = run.strip("`")
        record = records.get(name)
        if record is None:
            rate = float(re.search(r"_lr([0-9.e-]+)_s", name).group(1))
            cell = _cell(args, arm, int(batch), rate, seed=int(seed))
            assert study.run_name(args, cell) == name, (name, study.run_name(args, cell))
            record = records[name] = _record(
                args, cell, shas, source, peak_learning_rate=float(peak), val_top1=float(val),
                val_loss=None, train_loss=None, images_per_second=None,
            )  # fmt: skip
        assert math.isclose(record["val_top1"], float(val)), name
        record.update(test_top1=float(test1), test_top5=float(test5))
    return records


def _cell(args, arm, batch, rate, seed):
    k = round(math.log(rate / study.ARMS[arm].centre(batch), args.sweep_ratio))
    cell = study.Cell(arm, batch, k, seed)
    assert study.rate_of(args, cell) == rate, (arm, batch, rate)
    return cell


def _record(args, cell, shas, source, **scores):
    steps = study.steps_per_epoch(args, cell.batch)
    return {
        "network": cell.network,
        "arm": cell.arm,
        "batch": cell.batch,
        "k": cell.k,
        "seed": cell.seed,
        "rate": study.rate_of(args, cell),
        "rate_flag": study.ARMS[cell.arm].rate_flag,
        "test_top1": None,
        "test_top5": None,
        "train_top1": None,
        "steps_per_epoch": steps,
        "total_steps": steps * args.epochs,
        "warmup_steps": round(args.warmup_epochs * steps),
        "git_sha": f"one of {shas}",
        "date": None,
        "machine": "AMD EPYC (avx512f, avx512_bf16)",
        "run_name": study.run_name(args, cell),
        "settings": study.settings_of(args, cell),
        "source": source,
        **scores,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--report",
        default=os.path.join("tests", "support", "large_batch_study_first_report.md"),
        help="the first report, whose tables are read",
    )
    parser.add_argument(
        "--study_report",
        default=os.path.join("results", "large_batch_study.md"),
        help="the study's report whose records file (large_batch_study.records_path) is written; refused "
        "if that file exists",
    )
    own = parser.parse_args(argv)
    # The study's defaults (the grid those runs used), with the records file of --study_report.
    args = study.parse_args([f"--report={own.study_report}"])
    if os.path.exists(study.records_path(args)):
        raise SystemExit(f"{study.records_path(args)} exists; not overwritten.")
    inside = os.path.relpath(os.path.abspath(own.report), study.REPO)
    commit = subprocess.run(
        ["git", "log", "-1", "--format=%h", "--", inside], cwd=study.REPO, capture_output=True, text=True
    ).stdout.strip()
    source = (
        f"recovered from the tables of {inside} at commit {commit or 'none (not in git)'} by "
        "benchmarks/large_batch_recover.py (run directories not kept)"
    )
    with open(own.report) as f:
        text = f.read()
    wall = re.search(r"Wall time: ([0-9.]+ h over [0-9]+ run attempts)", text)
    if wall:
        source += f"; {wall.group(1)} as that report gives"
    records = recover(text, args, source)
    study.save_records(args, records)
    print(f"{len(records)} records -> {study.records_path(args)}", file=sys.stderr)


if __name__ == "__main__":
    main()
