"""TensorFlow's start-up notices are left out, all else kept; ranks report progress within epochs."""

import os
import subprocess
import sys

import pytest

from hvd_lars import quiet_tensorflow
from tests.support import REPO, TWO_RANKS

# What `import tensorflow` wrote on a 2-core Xeon without a GPU (TF 2.21), two lines of others among them.
PREFIX = "0000 00:00:1796527360.932197   22180 "
STARTUP = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    f"I{PREFIX}port.cc:153] oneDNN custom operations are on. You may see slightly different numerical "
    "results due to floating-point round-off errors from different computation orders. To turn them off, "
    "set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    f"I{PREFIX}cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.",
    "a line of someone else",
    f"I{PREFIX}cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU "
    "instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other operations, "
    "rebuild TensorFlow with the appropriate compiler flags.",
    f"W{PREFIX}other.cc:1] a warning of TensorFlow's",
    f"E{PREFIX}cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: "
    "UNKNOWN ERROR (303)",
]
STARTUP = "".join(line + "\n" for line in STARTUP).encode()
KEPT = f"a line of someone else\nW{PREFIX}other.cc:1] a warning of TensorFlow's\n".encode()
CUINIT = STARTUP.splitlines(keepends=True)[-1]
LOUD = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as a user's environment


@pytest.mark.unit
def test_the_startup_notices_are_left_out_and_the_rest_kept():
    assert quiet_tensorflow.kept(STARTUP, driver=False) == KEPT
    # With NVIDIA's driver loaded, a failed cuInit is news: kept.
    assert quiet_tensorflow.kept(STARTUP, driver=True) == KEPT + CUINIT
    assert quiet_tensorflow.kept(b"no line end") == b"no line end"


@pytest.mark.horovod
def test_the_filter_of_a_launchers_standard_error_keeps_all_but_the_notices():
    # As `make train` runs it on horovodrun's standard error, by path: a Ctrl-C is left to the launcher.
    script = os.path.join(REPO, "hvd_lars", "quiet_tensorflow.py")
    result = subprocess.run([sys.executable, script], input=STARTUP, capture_output=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, b"")
    assert result.stderr == (KEPT + CUINIT if quiet_tensorflow._driver() else KEPT)


@pytest.mark.horovod
def test_what_an_import_that_aborts_wrote_is_printed(tmp_path):
    # A TensorFlow whose import writes the notices and a fatal line, then aborts (as a protobuf clash does).
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(
        f"import os\nos.write(2, {STARTUP!r} + b'F0000 fatal.cc:1] a fatal line\\n')\nos.abort()\n"
    )
    env = dict(LOUD, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    # The main program imports TensorFlow through the filter once its flags are checked.
    command = [sys.executable, "-m", "hvd_lars.main", "--flagfile=flags/smoke.flags"]
    result = subprocess.run(command, capture_output=True, env=env, cwd=REPO, timeout=60)
    assert result.returncode == -6  # SIGABRT
    assert result.stderr.startswith(KEPT) and b"F0000 fatal.cc:1] a fatal line\n" in result.stderr


@pytest.mark.horovod
def test_two_ranks_start_quiet_and_report_progress_within_epochs(tmp_path):
    command = [*TWO_RANKS, sys.executable, "-m", "hvd_lars.main"]
    command += ["--flagfile=flags/smoke.flags", f"--workdir={tmp_path}", "--progress_every_s=0"]
    result = subprocess.run(command, capture_output=True, text=True, env=LOUD, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    for notice in ("oneDNN", "cuInit", "absl::InitializeLog", "cuda drivers", "cpu_feature_guard"):
        assert notice not in out, out
    # 3 updates an epoch, a line after each but the last, whose epoch line follows: 2 per epoch, rank 0's.
    progress = [line for line in result.stdout.splitlines() if " images/s - loss: " in line]
    assert [line.split(" - ")[0] for line in progress] == ["[1,0]<stdout>:1/3", "[1,0]<stdout>:2/3"] * 2
    assert "\r" not in result.stdout and "\b" not in result.stdout
    # Each line written whole: the launcher tags what each write brings, so a split line shows two tags.
    assert [line for line in result.stdout.splitlines() if line.count("<stdout>:") > 1] == []
