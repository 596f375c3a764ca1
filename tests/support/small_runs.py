"""A short run of the main program on a test data set, for the data tests."""

import json
import os
import subprocess
import sys

from tests.support import REPO


def train_small_cnn(dataset, data_dir, workdir, run_name, global_batch, epochs, *extra):
    """Runs `python -m hvd_lars.main` briefly (small_cnn on 32x32 images, no warmup, LR 0.1) on a test
    data set; asserts it succeeded and returns its summary.json as a dict."""
    cmd = [sys.executable, "-m", "hvd_lars.main", f"--dataset={dataset}", f"--data_dir={data_dir}"]
    cmd += [
        "--model=small_cnn",
        "--image_size=32",
        f"--global_batch_size={global_batch}",
        f"--epochs={epochs}",
    ]
    cmd += ["--warmup_epochs=0", "--peak_learning_rate=0.1", f"--run_name={run_name}", f"--workdir={workdir}"]
    cmd += ["--verbose=0", *extra]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(workdir, run_name, "summary.json")) as f:
        return json.load(f)
