"""results/ answers one question per file.

The rules, on the committed files:
- Every report in results/, at the top and in the question folders (a folder's README.md, an index,
  aside), names for each run it shows the command, the 40-hex git SHA, the date, the CPU's identity
  (vendor, family, model, as /proc/cpuinfo gives them) and the tf.matmul rate of that run; where the run did
  not record one of the last two, it says so in those words ("... not recorded for this run",
  benchmarks.common.NOT_RECORDED), so that no figure is filled in after the fact. A run's provenance is the
  paragraph (lines between blank lines, a table's rows left out) naming its SHA; a report names at least one.
- A SHA ending in "-dirty" (a tree with uncommitted changes: no commit holds the code that ran) is one of
  the runs made before this rule (LEGACY_DIRTY), and its line says that its exact source is not recorded.
  A new run is made from a committed tree.
- Every file under results/ (but run folders, results/runs/, and hidden scratch files) is reached by links
  from results/README.md: a Markdown link, a path in backticks (relative to the file that names it, to
  results/ or, starting with results/, to the repository) or a glob in backticks (`models_throughput/*.json`).
  Every top report is in the index itself, and every results file a report names in backticks exists (a
  file moved without its links following fails).
"""

import fnmatch
import os
import re

import pytest

from benchmarks import common
from tests.support import REPO

RESULTS = os.path.join(REPO, "results")
INDEX = os.path.join(RESULTS, "README.md")

SHA = re.compile(r"\b[0-9a-f]{40}\b(-dirty)?")
SHORT_SHA = re.compile(r"\b(?:git|SHA:?)\s+`?([0-9a-f]{7,39})\b")
COMMAND = re.compile(r"`(?:python|make|bash|\.venv/bin/python)\s[^`]*`")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d(?!\d)")
CPU = re.compile(r"\b(?:GenuineIntel|AuthenticAMD|HygonGenuine|CentaurHauls),? family \d+,? model \d+")
CPU_NOT_RECORDED = re.compile(r"\b(?:vendor|family|model|identity)\b[^.;\n]*" + common.NOT_RECORDED)
RATE = re.compile(r"tf\.matmul\b[^\n]*?\d+ GFLOP/s")
RATE_NOT_RECORDED = f"tf.matmul rate {common.NOT_RECORDED}"
DIRTY_NOT_RECORDED = re.compile(r"-dirty`?[^\n]*?exact source[^\n]*" + common.NOT_RECORDED)

# The runs of results/ made from trees with uncommitted changes before the rule above.
LEGACY_DIRTY = {
    "00a3027803146e70d96e61a09cefc035a9129dfb", "039ce0fdfef5ebc022b7df62e577a6da3ed10dd5",
    "153a9a6eb445ca96339dd8203be772788e0a098d", "172859d4d7bde91e0f719f27ba7e669f32c012cd",
    "2046711672f73288f2f3f55c44e71b5205399975", "2130bdd6b3903483c621878c083d5883518281f3",
    "29ad4862498def8ff1519df9aa943faff54be756", "372b6f5a5595828da7ba529634cfacf9de92afca",
    "41bb976e3aed0d2ca0852864e51dbf63d6e90f69", "4ab0dce02e3b1411f0fc00ada5b9dcf53eeafe7b",
    "5705f304caccb24719e99ac16c5e73a7a2a80c35", "6074ed5d6f8bcce7cbe9f41cb53c2f31772e110e",
    "6d2cf852420efdfdd370cdec595fb1a78a1eda3a", "7b54dff86b05058f86c9b44b2ecf98d5f1ec1cae",
    "7c655bc724f2d493b58511733acb9e0a45860b1c", "84f628b5c2055d958ff93dee3e5a2bfbd27002d4",
    "877be1e85fe3fcd605b251299a80e54155f070c0", "87d03f78091a4f29f79fb559fff6b80ac22d983b",
    "9efa55856e7977081fb025783b493ba872502d70", "b5ff2e7ead3aa389480cec13ad6f16516ff94819",
    "b8f7911c42f3592a61d963914803f5373a6d4948", "b8fc4b488d0ba0434740ec52807313869ff93202",
    "b9d5cfce9afe2aa42776f1d7ac217d4d998319ba", "bb6566eff9203051e6e9a9f8ea066316f638d2ea",
    "c54e3b89bde2369e8dca1596307c139776aab824", "c6088c25495030e1c560f2626621ec1de5ee7390",
    "cae0a5cce69096f2b6e69e4714decea8f58c8288", "cae32917b2520063f33d2344bec163a1918e2428",
    "d020f9258a6a529451e36737a51e98ccfe3db3f4", "d1ff9c32bc8b084b7aef850d807a0aafddae174c",
    "d74eab7abf5c7a5c21f13f9889d2156f03c62d70", "e489f4d031c6e30bda8eb5230ebf577aca582bde",
    "e4f1c4138abb2c619998b5008e23b4bcb6be80e7", "e55668a58f6d8aee7bd4590d948cf932baa9ad5b",
    "e9566124b9e9925994739fffccaab28c4e8ad3bd", "ee192778b4a594dd20d18cb37b5e4637b02e7112",
    "ff2e747ae6f0b7767df0b5ee240197b082eb9703",
}  # fmt: skip


def results_files():
    """Every file under results/ a reader is meant to find: not the run folders, not hidden scratch."""
    found = []
    for folder, dirs, files in os.walk(RESULTS):
        dirs[:] = [d for d in dirs if not d.startswith(".") and os.path.join(folder, d) != f"{RESULTS}/runs"]
        found += [os.path.join(folder, f) for f in files if not f.startswith(".")]
    return sorted(os.path.relpath(f, RESULTS) for f in found)


def top_reports():
    return sorted(n for n in os.listdir(RESULTS) if n.endswith(".md") and n != "README.md")


def reports():
    return [f for f in results_files() if f.endswith(".md") and os.path.basename(f) != "README.md"]


def provenance_problems(text):
    """What a report's text lacks of the rules above, as messages ([] if nothing)."""
    problems = []
    for line in text.splitlines():
        for short in SHORT_SHA.findall(line):
            problems.append(f"git SHA {short!r} is not the full 40 hex digits ({line.strip()[:90]!r})")
    # A table's rows are a run's details; the paragraph that names its SHA is its provenance.
    paragraphs = [
        "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("|"))
        for block in re.split(r"\n[ \t]*\n", text)
    ]
    blocks = [b for b in paragraphs if SHA.search(b) or SHORT_SHA.search(b)]
    if not blocks:
        problems.append("no paragraph names a run's 40-hex git SHA")
    for block in blocks:
        first = block.strip().splitlines()[0][:90]
        lacks = [
            name
            for name, found in (
                ("command in backticks", COMMAND.search(block)),
                ("date", DATE.search(block)),
                ("CPU vendor, family and model", CPU.search(block) or CPU_NOT_RECORDED.search(block)),
                ("tf.matmul rate", RATE.search(block) or RATE_NOT_RECORDED in block),
            )
            if not found
        ]
        if lacks:
            problems.append(f"the run of {first!r} lacks: {', '.join(lacks)} (named, or said to be "
                            f"{common.NOT_RECORDED})")  # fmt: skip
    for line in text.splitlines():
        for sha in re.findall(r"\b([0-9a-f]{40})-dirty", line):
            if sha not in LEGACY_DIRTY:
                problems.append(f"{sha}-dirty: a run of a tree with uncommitted changes; commit, run again")
            elif not DIRTY_NOT_RECORDED.search(line):
                problems.append(
                    f"{sha}-dirty: the line does not say the exact source is {common.NOT_RECORDED}"
                )
    return problems


@pytest.mark.unit
@pytest.mark.parametrize("name", reports())
def test_every_report_names_each_runs_command_sha_date_cpu_and_matmul_rate(name):
    with open(os.path.join(RESULTS, name)) as f:
        assert provenance_problems(f.read()) == []


GOOD = """# A result

- Command (from the repository root): `python -m benchmarks.x`
- Git SHA: `0123456789abcdef0123456789abcdef01234567`; date (UTC): 2026-12-03T10:00:00+00:00
- Machine: AMD EPYC, 2 logical cores; CPU: AuthenticAMD family 26 model 2 stepping 1; CPU flags: avx512f;
  tf.matmul 4096^2: 404 GFLOP/s float32, 726 bfloat16

| a | b |
"""


@pytest.mark.unit
@pytest.mark.parametrize(
    "old, new, problem",
    [
        ("tf.matmul 4096^2: 404 GFLOP/s float32, 726 bfloat16", "", "lacks: tf.matmul rate"),
        ("CPU: AuthenticAMD family 26 model 2 stepping 1; ", "", "lacks: CPU vendor, family and model"),
        ("`python -m benchmarks.x`", "python -m benchmarks.x", "lacks: command in backticks"),
        ("2026-12-03T10:00:00+00:00", "today", "lacks: date"),
        ("0123456789abcdef0123456789abcdef01234567", "0123456789ab", "'0123456789ab' is not the full 40"),
        ("01234567`", "01234567-dirty`", "01234567-dirty: a run of a tree with uncommitted changes"),
        ("- Git SHA", "Results\n\n- Git SHA", "lacks: command in backticks"),
        ("`0123456789abcdef0123456789abcdef01234567`", "abc", "no paragraph names a run's 40-hex git SHA"),
    ],
)
def test_a_report_missing_a_piece_of_a_runs_provenance_is_refused(old, new, problem):
    assert provenance_problems(GOOD) == []
    problems = provenance_problems(GOOD.replace(old, new, 1))
    assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.unit
def test_what_a_run_did_not_record_is_said_in_words():
    text = GOOD.replace("CPU: AuthenticAMD family 26 model 2 stepping 1", f"CPU vendor, family and model "
                        f"{common.NOT_RECORDED}").replace("tf.matmul 4096^2: 404 GFLOP/s float32, 726 "
                        "bfloat16", f"tf.matmul rate {common.NOT_RECORDED}")  # fmt: skip
    assert provenance_problems(text) == []
    legacy = "d1ff9c32bc8b084b7aef850d807a0aafddae174c"
    dirty = text.replace("0123456789abcdef0123456789abcdef01234567`", f"{legacy}-dirty`")
    assert provenance_problems(dirty) == [f"{legacy}-dirty: the line does not say the exact source is "
                                          f"{common.NOT_RECORDED}"]  # fmt: skip
    said = dirty.replace("-dirty`", f"-dirty` ({common.DIRTY})")
    assert provenance_problems(said) == []


# ------------------------------------------------------------------------------------------------ links

BACKTICKED = re.compile(r"`([^`\s]+)`")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE = re.compile(r"(?<![\w/`])(results/[\w.*/-]+\w)")


def links(path, files):
    """The files of `files` (paths relative to results/) that the Markdown file `path` names."""
    with open(path) as f:
        text = f.read()
    here = os.path.relpath(os.path.dirname(path), RESULTS)
    named = set()
    for target in MARKDOWN_LINK.findall(text) + BACKTICKED.findall(text) + BARE.findall(text):
        target = target.split("#")[0].rstrip(".,;:")
        if target.startswith("results/"):
            candidates = [target[len("results/") :]]
        else:
            candidates = [os.path.normpath(os.path.join(here, target)), os.path.normpath(target)]
        for candidate in candidates:
            named.update(fnmatch.filter(files, candidate) if "*" in candidate else {candidate} & set(files))
    return named


def reached_from_index():
    files = results_files()
    reached, todo = {"README.md"}, ["README.md"]
    while todo:
        name = todo.pop()
        for found in links(os.path.join(RESULTS, name), files) - reached:
            reached.add(found)
            if found.endswith(".md"):
                todo.append(found)
    return files, reached


@pytest.mark.unit
def test_every_file_of_results_is_reached_from_its_index():
    files, reached = reached_from_index()
    assert sorted(set(files) - reached) == []


@pytest.mark.unit
def test_every_report_at_the_top_is_in_the_index():
    # The index names each question's report itself, not only through another report.
    assert sorted(set(top_reports()) - links(INDEX, results_files())) == []


NAMED_FILE = re.compile(r"`((?:results/)?[\w.*/-]+\.(?:md|json|png))`")
# Paths of the repository outside results/ that reports name in backticks.
NOT_RESULTS = ("hvd_lars/", "benchmarks/", "tests/", "flags/", "launch/", "install/", "docs/", "examples/")


@pytest.mark.unit
def test_every_results_file_a_report_names_exists():
    files = results_files()
    missing = []
    for name in (f for f in files if f.endswith(".md")):
        with open(os.path.join(RESULTS, name)) as f:
            text = f.read()
        here = os.path.dirname(name)
        # `_2ms.md` after a name is a suffix of that name, not a path.
        for ref in (r for r in NAMED_FILE.findall(text) if not r.startswith((*NOT_RESULTS, "_"))):
            if ref.startswith("results/"):
                candidates = [ref[len("results/") :]]
            else:
                candidates = [os.path.normpath(os.path.join(here, ref)), os.path.normpath(ref)]
            if not any(fnmatch.filter(files, c) if "*" in c else c in files for c in candidates):
                missing.append(f"{name}: `{ref}`")
    assert missing == []
