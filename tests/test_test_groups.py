"""How `make test` spreads the suite over pytest-xdist workers (tests/conftest.py): every file a group of
its own and every system test in one, system tests first. Two system tests on two workers at once would
bring up two emulated clusters with the same host names; one file split over workers would build its
module-scoped fixtures twice."""

import re
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.support import REPO

# Starts pytest itself (no Horovod): the tier for subprocesses.
pytestmark = pytest.mark.horovod

FILES = ["tests/test_schedules.py", "tests/test_flops.py"]


def test_each_file_runs_on_one_worker_under_loadgroup():
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-n", "2", "--dist", "loadgroup"]
    result = subprocess.run(cmd + FILES, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    workers = defaultdict(set)
    for worker, path, group in re.findall(
        r"^\[(gw\d+)\] .*PASSED (tests/\S+?\.py)::\S+@(\S+)", result.stdout, re.M
    ):
        assert group == path
        workers[path].add(worker)
    assert sorted(workers) == sorted(FILES), result.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)


def test_system_tests_are_collected_first_in_one_group():
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--collect-only",
        "-q",
        "-m",
        "system or unit",
    ]
    files = ["tests/test_flops.py", "tests/test_cluster.py"]
    result = subprocess.run(cmd + files, cwd=REPO, capture_output=True, text=True, timeout=600)
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    files = [i.split("::")[0] for i in ids]
    # test_flops.py is given first, yet test_cluster.py's system tests come before it.
    assert files[0] == "tests/test_cluster.py" and files[-1] == "tests/test_flops.py", ids
    assert files == sorted(files, key=lambda f: f != "tests/test_cluster.py"), ids
