"""tests/support/horovodrun_checked_once.py, the horovodrun most job tests start: Horovod's build check made
once per installed extension, its answers the ones Horovod's own check gives, and the launcher otherwise
Horovod's (`--check-build` prints the same table as .venv/bin/horovodrun)."""

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.horovodrun_checked_once import HOROVODRUN

# Subprocesses: Horovod's check forks a process that imports TensorFlow, which a test worker must not do.
pytestmark = pytest.mark.horovod

# In a fresh interpreter: the first call checks and writes the cache; an entry for this extension is read
# back (here one with MPI flipped, which only the cache can answer); another extension's is checked again.
SEQUENCE = """
import json, sys
from tests.support import horovodrun_checked_once as shim
cache = sys.argv[1]
answers = [shim.built_answers(cache)]
saved = json.load(open(cache))
json.dump({**saved, "mpi": not saved["mpi"]}, open(cache, "w"))
answers.append(shim.built_answers(cache))
json.dump({**saved, "key": saved["key"] + ":rebuilt", "mpi": not saved["mpi"]}, open(cache, "w"))
answers.append(shim.built_answers(cache))
print(json.dumps({"answers": answers, "saved": saved, "rewritten": json.load(open(cache)),
                  "key": shim.extension_key()}))
"""


def test_the_build_check_runs_once_per_extension(tmp_path):
    cache = tmp_path / "cache" / "horovod_built.json"
    cmd = [sys.executable, "-c", SEQUENCE, str(cache)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    # install/setup.sh builds Horovod with MPI and with Gloo (HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1).
    built = {"mpi": True, "gloo": True}
    library, size, mtime_ns = seen["key"].rsplit(":", 2)
    assert os.path.basename(os.path.dirname(library)) == "tensorflow", library
    assert os.path.basename(library).startswith("mpi_lib") and library.endswith(".so"), library
    assert (int(size), int(mtime_ns)) == (os.stat(library).st_size, os.stat(library).st_mtime_ns)
    assert seen["saved"] == {"key": seen["key"], **built}
    assert seen["answers"] == [built, {"mpi": False, "gloo": True}, built]
    assert seen["rewritten"] == seen["saved"]


def test_check_build_prints_what_horovodrun_prints():
    real = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    theirs = subprocess.run([real, "--check-build"], capture_output=True, text=True, timeout=300)
    ours = subprocess.run([*HOROVODRUN, "--check-build"], capture_output=True, text=True, timeout=300)
    assert theirs.returncode == ours.returncode == 0, theirs.stderr[-2000:] + ours.stderr[-2000:]
    assert ours.stdout == theirs.stdout
    assert "[X] MPI" in ours.stdout and "[X] Gloo" in ours.stdout, ours.stdout
