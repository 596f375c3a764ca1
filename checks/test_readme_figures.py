"""Every figure README.md and docs/*.md quote from results/ equals what its results file gives.

The rule: each claim in CLAIMS is a pattern of README text whose named groups are figures, the results file
they come from, and a function that reads that file's text and returns the same figures. A README figure
agrees when the source's value, rounded to as many decimals as the README prints, equals it (sizes, CPU and
section names: equal text; a figure the source gives several times, e.g. per backend: every one agrees).
Ratios the README quotes and the file does not print are computed from the file's printed figures.
So a result measured again and written to results/ without the README following fails
`test_readme_figures_match_their_results_files`, with the README line, the file and both values.

Covered (README or docs section / line: file):
- "Two commands": make train's test top-1, wall time and CPU: fashion_mnist_lars.md
- docs/cluster.md, "Where the launchers put ranks": 2 ranks x 1 thread against 1 rank x 2 threads,
  Horovod defaults and tuned: archive/scaling_threads.md; the allreduce of 16 MiB on 4-8 emulated hosts,
  Open MPI's choice and the ring: allreduce_hosts.md
- "With Horovod": a ported script's 16 MiB allreduce on 4 hosts, rules on and off: horovod_keras_allreduce.md
- docs/faults.md: time to exit of a silent host with the ssh keepalive: archive/faults.md, row silent_host;
  "Elastic training": the repetitions of 2 -> 1 -> 2 workers: archive/faults.md, row elastic
- "Results" table: models_throughput.md (the ResNet-50 ratios in the named CPU's section), lars_step.md
  (tensors, graph-mode ratio), large_batch_study.md (batch range, seeds, runs and wall time),
  time_to_train.md (the predictions with the paper's figure beside them), communication.md (sizes,
  1 Gbit/s share, the fast links' range); and every number
  in that table's rows is either in a claim or listed in NOT_RESULTS
  (`test_every_number_of_the_results_table_is_checked`).
Not covered: versions, flag defaults and configuration (batch 4,096, 2 ranks, HOROVOD_CYCLE_TIME=5), and
figures that no results file holds: the Horovod build time ("about 4-8 minutes"), and the emulated-cluster
and Slurm timings recorded in tests/test_cluster.py's comments (bound start-ups 40 s to over 4 minutes, 28 s
with SlurmdTimeout=10, mpirun's 240 s, 90 s in 4 tries of 4).
"""

import collections
import os
import re

import pytest

from benchmarks import benchmark_models
from tests.support import REPO

RESULTS = os.path.join(REPO, "results")
Claim = collections.namedtuple("Claim", "name readme source extract")


# ------------------------------------------------------------------------------------- reading sources


def tables(text):
    """Every Markdown table of `text` as (header cells, rows of cells)."""
    found = []
    for block in re.findall(r"(?:^\|.*\|[ \t]*\n?)+", text, re.M):
        lines = [line.strip() for line in block.strip().splitlines()]
        cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
        if len(cells) >= 2 and set("".join(cells[1])) <= set("-: "):
            found.append((cells[0], cells[2:]))
    return found


def table(text, first_header, *other_headers):
    """Rows ({header: cell}) of the one table whose first column is `first_header` and which has the
    columns `other_headers`."""
    matches = [(h, rows) for h, rows in tables(text) if h[0] == first_header and set(other_headers) <= set(h)]
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} tables with columns {[first_header, *other_headers]} (want 1)")
    header, rows = matches[0]
    return [dict(zip(header, row)) for row in rows]


def row(rows, **where):
    found = [r for r in rows if all(r[k] == v for k, v in where.items())]
    if len(found) != 1:
        raise LookupError(f"{len(found)} rows with {where} (want 1)")
    return found[0]


def first_number(cell):
    return float(re.match(r"[\d,.]+", cell.strip()).group().replace(",", ""))


def search(pattern, text, flags=re.M):
    found = re.search(pattern, text, flags)
    if not found:
        raise LookupError(f"no text matches {pattern!r}")
    return found


def short_cpu(machine_line):
    for short, word in (("Intel Xeon", "Xeon"), ("AMD EPYC", "EPYC")):
        if word in machine_line:
            return short
    return machine_line


# --------------------------------------------------------------------------------- what each file gives


def make_train(text, _):
    return {
        "cpu": short_cpu(search(r"^- Machine: (.*)$", text).group(1)),
        "top1": float(search(r"\*\*Final test top-1 ([\d.]+)\*\*", text).group(1)),
        "wall": float(search(r"wall time (\d+) s", text).group(1)),
    }


def threads(text, _):
    rows = table(text, "run")
    value = lambda configuration: float(row(rows, configuration=configuration)["vs baseline"])  # noqa: E731
    return {
        "defaults": value("2 ranks x 1 thread, bound (launch/mpirun.sh), Horovod defaults"),
        "tuned": value("2 ranks x 1 thread, bound, 5 ms cycle, MPI yields"),
    }


def fault_rows(text):
    return table(text, "scenario")


def silent_host(text, _):
    times = row(fault_rows(text), scenario="silent_host")["time to exit (min / median / max, s)"]
    low, _median, high = (float(t) for t in times.split(" / "))
    return {"low": low, "high": high}


def elastic(text, _):
    r = row(fault_rows(text), scenario="elastic")
    passed, repetitions = int(r["passed"]), int(r["repetitions"])
    return {"times": passed if passed == repetitions else f"{passed} passed of {repetitions}"}


def models_throughput(text, readme_match):
    heading = readme_match["section"]
    found = benchmark_models.sections(text)
    if heading not in found:
        raise LookupError(f"no section headed {heading!r}; its sections: {sorted(found)}")
    resnet = search(r"^### ResNet-50\n(.*?)(?=^### |\Z)", found[heading], re.M | re.S).group(1)
    by = {(r["configuration"].split(":")[0], r["precision"]): r for r in table(resnet, "configuration")}
    rate = {key: first_number(r["images/s (each run)"]) for key, r in by.items()}
    # The file's ratio column is against the baseline's best precision; where that is mixed_bfloat16
    # (1.00x) it is ours / plain Keras in mixed_bfloat16 unrounded.
    if by[("plain Keras", "mixed_bfloat16")]["ratio"] == "1.00x":
        bf16_vs_bf16 = float(by[("hvd_lars", "mixed_bfloat16")]["ratio"].rstrip("x"))
    else:
        bf16_vs_bf16 = rate[("hvd_lars", "mixed_bfloat16")] / rate[("plain Keras", "mixed_bfloat16")]
    faster = rate[("plain Keras", "mixed_bfloat16")] > rate[("plain Keras", "float32")]
    return {
        "f32": rate[("hvd_lars", "float32")] / rate[("plain Keras", "float32")],
        "bf16": rate[("hvd_lars", "mixed_bfloat16")] / rate[("plain Keras", "float32")],
        "bf16_vs_bf16": bf16_vs_bf16,
        "faster": "faster" if faster else "slower",
    }


def lars_step(text, _):
    return {
        "tensors": float(search(r"^- tensors: (\d+)", text).group(1)),
        "ratio": float(row(table(text, "mode"), mode="graph", optimizer="lars")["median ratio to SGD"]),
    }


def _study_findings(text, network):
    start = text.index(f"## Findings: {network}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def large_batch_study(text, _):
    # The findings tables of both networks: the batch range and seeds, and test top-1 at 8,192 per arm; the
    # points lost at 8,192 with batch norm (its findings line); how far below the linear scaling rule's
    # base rate (the momentum arm's centre) the momentum sweep without batch norm chose; the earlier runs'
    # count and hours from their line.
    with_bn, without_bn = (
        _study_findings(text, "small_cnn (batch norm)"),
        _study_findings(text, "small_cnn_nobn"),
    )
    rows = table(with_bn, "global batch", "LARS (warmup + poly decay)")
    batches = [first_number(r["global batch"]) for r in rows]
    seeds = {int(n) for n in re.findall(r"n=(\d+)", " ".join(" ".join(r.values()) for r in rows))}

    def top1(rows, arm):
        return first_number(row(rows, **{"global batch": "8192"})[arm].strip("*"))

    nobn_rows = table(without_bn, "global batch", "LARS (warmup + poly decay)")
    momentum, lars = "momentum SGD (linear scaling + warmup)", "LARS (warmup + poly decay)"
    nesterov = "Nesterov momentum SGD (linear scaling + warmup)"
    lost = [
        float(x)
        for x in re.findall(r"\(loses ([\d.]+) points\)", search(r"^- Batch 8192: .*$", with_bn).group())
    ]
    nobn_line = search(r"^- Batch 8192: .*$", without_bn).group()
    ahead = [float(x) for x in re.findall(r"LARS is ahead of [\w ]+? by ([\d.]+) points", nobn_line)]
    nobn_lars_lost = float(search(r"LARS [\d.]+ \(loses ([\d.]+) points\)", nobn_line).group(1))
    centre = float(search(r"centre base rate per 256 images ([\d.]+) \(Goyal", text).group(1))
    sweep = table(text, "network", "arm", "global batch", "swept rate")
    cell = ("small_cnn_nobn", "momentum", "8192")
    chosen = [
        r
        for r in sweep
        if (r["network"], r["arm"], r["global batch"]) == cell and r["chosen"].startswith("yes")
    ]
    wall = search(
        r"^- (\d+) earlier runs are known only by their records.*?; ([\d.]+) h over \d+ run attempts", text
    )
    return {
        "low": min(batches),
        "high": max(batches),
        "seeds": seeds.pop() if len(seeds) == 1 else f"n={sorted(seeds)}",
        "bn_lars": top1(rows, lars),
        "bn_momentum": top1(rows, momentum),
        "bn_nesterov": top1(rows, nesterov),
        "loss_low": min(lost),
        "loss_high": max(lost),
        "nobn_lars": top1(nobn_rows, lars),
        "nobn_momentum": top1(nobn_rows, momentum),
        "nobn_nesterov": top1(nobn_rows, nesterov),
        "ahead_low": min(ahead),
        "ahead_high": max(ahead),
        "nobn_lars_lost": nobn_lars_lost,
        "below": centre / first_number(chosen[0]["swept rate"])
        if len(chosen) == 1
        else f"{len(chosen)} chosen",
        "runs": float(wall.group(1)),
        "hours": float(wall.group(2)),
    }


def time_to_train(text, _):
    rows = [r for r in table(text, "model", "time to train") if "the paper" in r and r["the paper"]]
    alexnet = [r for r in rows if r["model"].startswith("AlexNet-BN")]
    resnet = [r for r in rows if r["model"].startswith("ResNet-50")]
    if len(alexnet) != 1 or len(resnet) != 1:
        raise LookupError(f"want one AlexNet-BN and one ResNet-50 prediction beside the paper's, got {rows}")
    figures = {}
    for prefix, r in (("a", alexnet[0]), ("r", resnet[0])):
        figures[f"{prefix}_epochs"] = first_number(r["model"].split(", ")[1])
        figures[f"{prefix}_sockets"] = first_number(r["sockets"])
        figures[f"{prefix}_cpu"] = r["CPU"]
        figures[f"{prefix}_time"] = first_number(r["time to train"])
        figures[f"{prefix}_paper"] = first_number(r["the paper"])
    figures["r_batch"] = first_number(resnet[0]["global batch"])
    return figures


def communication(text, _):
    at_128 = "n / t at 128 MiB (Gbit/s)"
    fits = table(text, "link", at_128)
    sizes = [r["size"] for r in table(text, "size")]
    fast = [float(r[at_128]) for r in fits if r["link"] in ("unshaped", "10gbit")]
    return {
        "smallest": sizes[0],
        "largest": sizes[-1],
        "one_gbit": [float(r[at_128]) for r in fits if r["link"] == "1gbit"],
        "fast_low": min(fast),
        "fast_high": max(fast),
    }


def allreduce_hosts(text, _):
    # 16 MiB on 4 and 8 ranks (4x1, 8x1, 4x2): Open MPI's own choice (`mpi`) against the project's settings
    # through the launch scripts (`launch_env`) and a bare horovodrun of the main program (`main`).
    rows = [r for r in table(text, "layout", "variant", "median / bound") if r["size"] == "16 MiB"]

    def ratios(*variants):
        return [float(r["median / bound"]) for r in rows if r["p"] in ("4", "8") and r["variant"] in variants]

    default, ours = ratios("mpi"), ratios("launch_env", "main")
    if len(default) != 3 or len(ours) != 6:
        raise LookupError(f"want 3 + 6 rows of 16 MiB at p = 4 and 8, got {len(default)} + {len(ours)}")
    return {"default_low": min(default), "default_high": max(default), "ours_low": min(ours),
            "ours_high": max(ours)}  # fmt: skip


def horovod_keras_allreduce(text, _):
    # 16 MiB on 4 hosts, a ported script after horovod_keras.init(), with the rules and without.
    rows = [r for r in table(text, "layout", "variant", "median / bound") if r["size"] == "16 MiB"]
    return {
        "rules": float(row(rows, variant="horovod_keras")["median / bound"]),
        "off": float(row(rows, variant="horovod_keras_off")["median / bound"]),
    }


# The README's words, with each figure a named group (whitespace in a pattern matches any run of it).
CLAIMS = [
    Claim("make train",
          r"Measured on this project's 2-core (?P<cpu>[\w ]+?): test top-1 (?P<top1>[\d.]+) "
          r"after (?P<wall>\d+) s of training",
          "fashion_mnist_lars.md", make_train),
    Claim("Horovod's polling on 2 cores",
          r"\(2 ranks x 1 thread on 2 cores: (?P<defaults>[\d.]+) of 1 rank x 2 "
          r"threads; with these settings (?P<tuned>[\d.]+);",
          "archive/scaling_threads.md", threads),
    Claim("silent host with the ssh keepalive",
          r"with `launch/env.sh`'s ssh keepalive the job ended in (?P<low>[\d.]+)-(?P<high>[\d.]+) s",
          "archive/faults.md", silent_host),
    Claim("elastic 2 -> 1 -> 2 repetitions",
          r"Tested 2 -> 1 -> 2 workers in `tests/test_elastic.py` and (?P<times>\d+) times in "
          r"`results/archive/faults.md`",
          "archive/faults.md", elastic),
    Claim("ResNet-50 throughput ratios",
          r"in section `(?P<section>[^`]+)`, ResNet-50 training: ours (?P<f32>[\d.]+)x plain Keras in "
          r"float32, (?P<bf16>[\d.]+)x with `mixed_bfloat16` \(against plain Keras in float32; "
          r"(?P<bf16_vs_bf16>[\d.]+)x against its (?P<faster>faster|slower) `mixed_bfloat16`\)",
          "models_throughput.md", models_throughput),
    Claim("LARS step cost",
          r"LARS's step on ResNet-50's (?P<tensors>\d+) tensors: (?P<ratio>[\d.]+)x Keras momentum SGD",
          "lars_step.md", lars_step),
    Claim("large-batch study",
          r"global batch (?P<low>[\d,]+)-(?P<high>[\d,]+), rates tuned on a validation split, "
          r"(?P<seeds>\d+) seeds: at 8,192 with batch norm LARS (?P<bn_lars>[\d.]+), momentum SGD "
          r"(?P<bn_momentum>[\d.]+), Nesterov (?P<bn_nesterov>[\d.]+) test top-1 \(every arm loses "
          r"(?P<loss_low>[\d.]+)-(?P<loss_high>[\d.]+) points\); without batch norm LARS "
          r"(?P<nobn_lars>[\d.]+), momentum SGD (?P<nobn_momentum>[\d.]+) \(its rate tuned (?P<below>\d+)x "
          r"below the linear scaling rule's\), Nesterov (?P<nobn_nesterov>[\d.]+) \(LARS holds "
          r"(?P<ahead_low>[\d.]+)-(?P<ahead_high>[\d.]+) of the points both momentum arms lose, and loses "
          r"(?P<nobn_lars_lost>[\d.]+) itself\).*?the first network's "
          r"(?P<runs>\d+) runs took "
          r"(?P<hours>[\d.]+) h here",
          "large_batch_study.md", large_batch_study),
    Claim("time to train",
          r"AlexNet-BN, (?P<a_epochs>\d+) epochs on (?P<a_sockets>[\d,]+) (?P<a_cpu>[\w ]+?) sockets: "
          r"(?P<a_time>[\d.]+) min \(the paper: (?P<a_paper>\d+) min\); "
          r"ResNet-50, (?P<r_epochs>\d+) epochs at batch (?P<r_batch>[\d,]+) on (?P<r_sockets>[\d,]+) "
          r"(?P<r_cpu>[\w ]+?) sockets: (?P<r_time>[\d.]+) min \(the paper: (?P<r_paper>\d+) min\)",
          "time_to_train.md", time_to_train),
    Claim("allreduce sweep",
          r"time against size, (?P<smallest>\d+ [KMG]iB)-(?P<largest>\d+ [KMG]iB), .*?"
          r"\(128 MiB reaches (?P<one_gbit>[\d.]+) of a 1 Gbit/s link; unshaped and 10 Gbit/s stop at "
          r"(?P<fast_low>\d+)-(?P<fast_high>\d+) Gbit/s",
          "communication.md", communication),
    Claim("allreduce past 2 hosts",
          r"Open MPI 4.1's own choice took (?P<default_low>[\d.]+)-(?P<default_high>[\d.]+)x the "
          r"bandwidth bound for 16 MiB on 4-8 emulated hosts; the ring takes "
          r"(?P<ours_low>[\d.]+)-(?P<ours_high>[\d.]+)x",
          "allreduce_hosts.md", allreduce_hosts),
    Claim("horovod_keras allreduce",
          r"16 MiB allreduce then took (?P<rules>[\d.]+)x the ring bound, against (?P<off>[\d.]+)x with the "
          r"rules off",
          "horovod_keras_allreduce.md", horovod_keras_allreduce),
]  # fmt: skip

# Phrases with numbers in the README's results table that are not results: configuration, names.
NOT_RESULTS = [
    "2-core",
    "global batch 4,096",
    "2 Horovod ranks",
    "2 ranks",
    "2 emulated hosts",
    "10 / 1 Gbit/s",
    "10 Gbit/s",
    "1 Gbit/s",
    "ResNet-50",
    "AlexNet-BN",
    "224x224",
    "mixed_bfloat16",
    "float32",
    "float16",
    "Fashion-MNIST",
    "Intel Xeon Platinum 8160",
    "Intel Xeon Phi 7250",
    "AVX-512 BF16",
]


# --------------------------------------------------------------------------------------------- checker


def agrees(readme_figure, value):
    if isinstance(value, list):
        return bool(value) and all(agrees(readme_figure, v) for v in value)
    if isinstance(value, str):
        return readme_figure == value
    figure = readme_figure.replace(",", "")
    decimals = len(figure.partition(".")[2])
    return round(value, decimals) == float(figure)


def shown(value):
    if isinstance(value, list):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


def check(readme, source_text):
    """Messages, one per README figure that its source does not give (empty: all agree).

    Args:
        readme: README.md's text.
        source_text: callable, a results file's name -> its text.
    """
    flat = re.sub(r"\s+", " ", readme)
    line_of = []  # line number of each character of `flat`
    line = 1
    for word in re.split(r"(\s+)", readme):
        if word and word.isspace():
            line_of.append(line)
            line += word.count("\n")
        else:
            line_of.extend([line] * len(word))
    messages = []
    for claim in CLAIMS:
        found = re.search(claim.readme.replace(" ", r"\s"), flat)
        if not found:
            messages.append(f"README.md no longer quotes {claim.name!r} ({claim.readme!r}): update CLAIMS")
            continue
        where = f"README.md line {line_of[found.start()]}"
        try:
            expected = claim.extract(source_text(claim.source), found.groupdict())
        except (LookupError, AttributeError, ValueError) as error:
            messages.append(f"{where} ({claim.name}): results/{claim.source} cannot be read for it: {error}")
            continue
        for group, figure in found.groupdict().items():
            if group not in expected:  # a group that only selects (the section's name) is read by extract
                continue
            if not agrees(figure, expected[group]):
                messages.append(
                    f"{where} ({claim.name}): the README says {group} = {figure}, "
                    f"results/{claim.source} gives {shown(expected[group])}"
                )
    return messages


def read_results(name):
    with open(os.path.join(RESULTS, name)) as f:
        return f.read()


def read_readme():
    """README.md, then docs/*.md: the figures follow wherever the text that quotes them moves."""
    from checks import readme

    texts = []
    for path in readme.documents():
        with open(os.path.join(REPO, path)) as f:
            texts.append(f.read())
    return "\n".join(texts)


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.unit
def test_readme_figures_match_their_results_files():
    assert check(read_readme(), read_results) == []


def remeasured(name, old, new):
    """The results files, with file `name` as if measured again: `old` replaced by `new` (once)."""

    def source_text(source):
        text = read_results(source)
        if source == name:
            assert text.count(old) == 1, f"{old!r} is not once in results/{name}"
            text = text.replace(old, new)
        return text

    return source_text


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, old, new, reported",
    [
        # ours in mixed_bfloat16 measured faster: 13.75 / 5.90 = 2.33x plain Keras in float32
        ("models_throughput.md", "| 12.75 (12.75) | 1.52x |", "| 13.75 (13.75) | 1.64x |",
         ["bf16 = 2.16, results/models_throughput.md gives 2.33",
          "bf16_vs_bf16 = 1.52, results/models_throughput.md gives 1.64"]),
        ("large_batch_study.md", "| 512 | **0.9330**",
         "| 128 | **0.9100** (0.9, 0.9), n=2 |\n| 512 | **0.9330**",
         ["low = 512, results/large_batch_study.md gives 128"]),
        ("archive/scaling_threads.md", "| 12.19 | 0.99 |", "| 11.19 | 0.91 |",
         ["tuned = 0.99, results/archive/scaling_threads.md gives 0.91"]),
        ("communication.md", "| 1,150 | 0.93 |", "| 1,150 | 0.91 |",
         ["one_gbit = 0.93, results/communication.md gives [0.91, 0.93]"]),
        ("archive/faults.md", "| 37.5 / 38.5 / 39.7 |", "| 36.1 / 38.5 / 39.7 |",
         ["low = 37.5, results/archive/faults.md gives 36.1"]),
        ("time_to_train.md", "| 5.4 min | 20 min |", "| 6.1 min | 20 min |",
         ["r_time = 5.4, results/time_to_train.md gives 6.1"]),
        ("allreduce_hosts.md", "| 8x1 | 8 | main | 16 MiB | 1.5012 | 1.3049 | 1.15 |",
         "| 8x1 | 8 | main | 16 MiB | 1.6312 | 1.3049 | 1.25 |",
         ["ours_high = 1.15, results/allreduce_hosts.md gives 1.25"]),
    ],
)  # fmt: skip
def test_a_result_measured_again_without_the_readme_following_is_reported(name, old, new, reported):
    messages = check(read_readme(), remeasured(name, old, new))
    assert len(messages) == len(reported), messages
    for message, expected in zip(messages, reported):
        assert re.match(r"README.md line \d+ \(", message) and expected in message, (message, expected)


@pytest.mark.unit
@pytest.mark.parametrize("figure", ["top1", "cpu"])
def test_make_train_run_again_without_the_readme_following_is_reported(figure):
    # make train rewrites its record on every run, on whatever CPU: the case starts from the record as it is.
    record = read_results("fashion_mnist_lars.md")
    if figure == "top1":
        top1 = search(r"\*\*Final test top-1 ([\d.]+)\*\*", record).group(1)
        other = f"{float(top1) - 0.0037:.4f}"
        old, new = f"**Final test top-1 {top1}**", f"**Final test top-1 {other}**"
        reported = f"top1 = {top1}, results/fashion_mnist_lars.md gives {other}"
    else:
        machine = search(r"^- Machine: (.*?),", record).group(1)
        other = "AMD EPYC" if short_cpu(machine) != "AMD EPYC" else "Intel(R) Xeon(R) Processor"
        old, new = f"- Machine: {machine},", f"- Machine: {other},"
        reported = f"cpu = {short_cpu(machine)}, results/fashion_mnist_lars.md gives {short_cpu(other)!r}"
    messages = check(read_readme(), remeasured("fashion_mnist_lars.md", old, new))
    assert len(messages) == 1 and re.match(r"README.md line \d+ \(", messages[0]), messages
    assert reported in messages[0], (messages[0], reported)


@pytest.mark.unit
def test_a_section_the_readme_names_that_the_file_no_longer_has_is_reported():
    heading = "AMD EPYC with AVX-512 BF16: AMD EPYC (identity not recorded)"
    new = "AMD EPYC with AVX-512 BF16: AMD EPYC (AuthenticAMD family 25 model 17 stepping 1, flags 0123abcd)"
    messages = check(read_readme(), remeasured("models_throughput.md", f"## {heading}", f"## {new}"))
    assert len(messages) == 1 and f"no section headed {heading!r}" in messages[0], messages


@pytest.mark.unit
def test_every_figure_of_a_claim_has_its_source_value():
    flat = re.sub(r"\s+", " ", read_readme())
    for claim in CLAIMS:
        groups = re.search(claim.readme.replace(" ", r"\s"), flat).groupdict()
        expected = claim.extract(read_results(claim.source), groups)
        assert set(groups) - {"section"} == set(expected), claim.name


@pytest.mark.unit
def test_a_claim_the_readme_dropped_is_reported():
    readme = read_readme().replace("with the rules off", "without the rules")
    assert check(readme, read_results) == [
        f"README.md no longer quotes {CLAIMS[-1].name!r} ({CLAIMS[-1].readme!r}): update CLAIMS"
    ]


@pytest.mark.unit
def test_every_number_of_the_results_table_is_checked():
    readme = read_readme()
    results_part = readme[readme.index("## Results") :]
    rows = [line for line in results_part.splitlines() if line.startswith("| `")]
    assert rows
    flat = re.sub(r"\s+", " ", readme)
    covered = [m.span(g) for c in CLAIMS for m in [re.search(c.readme.replace(" ", r"\s"), flat)] if m
               for g in m.groupdict()]  # fmt: skip
    figures = {n for a, b in covered for n in re.findall(r"\d[\d,.]*", flat[a:b])}
    unchecked = []
    for line in rows:
        text = re.sub(r"`[^`]*`", " ", line)  # file names, commands, flags
        for phrase in NOT_RESULTS:
            text = text.replace(phrase, " ")
        for number in re.findall(r"\d[\d,.]*", text):
            if number.rstrip(".,") not in figures:
                unchecked.append((number, line[:60]))
    assert unchecked == []
