"""examples/: Horovod's TF2 Keras MNIST example and its elastic variant, ported as a user would
(issue 21), on 2 real ranks with Fashion-MNIST: identical weights on every rank at the end, test top-1
of at least 0.80 (what each reaches is in the assertion's comment), and the elastic one through a real
membership change, 2 -> 1 -> 2 workers, under horovodrun's elastic driver."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.support import REPO

pytestmark = pytest.mark.horovod

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
RUNNER = os.path.join(REPO, "tests", "support", "example_runner.py")
ENV = dict(os.environ, PYTHONPATH=REPO)


def _check(out):
    ranks = [np.load(out / f"rank{r}.npz") for r in range(2)]
    weights = sorted(k for k in ranks[0].files if k.startswith("w"))
    assert len(weights) == 8  # 2 convolutions and 2 dense layers, kernel and bias each
    for key in weights:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    assert int(ranks[0]["iterations"]) == int(ranks[1]["iterations"])
    return float(ranks[0]["test_top1"]), int(ranks[0]["iterations"])


def test_tensorflow2_keras_mnist_on_two_ranks(tmp_path):
    example = os.path.join(REPO, "examples", "tensorflow2_keras_mnist.py")
    # 2 epochs of 300 // 2 = 150 updates at a global batch of 256.
    cmd = [
        HOROVODRUN,
        "-np",
        "2",
        "-H",
        "localhost:2",
        sys.executable,
        RUNNER,
        str(tmp_path),
        example,
        "2",
        "300",
    ]
    result = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    top1, updates = _check(tmp_path)
    assert updates == 300  # 2 epochs x 150 updates
    assert top1 >= 0.80, top1  # 0.877 when measured (2 ranks, 2 shared cores, about 2.5 minutes)
    assert (tmp_path / "checkpoint-2.keras").exists()


class _Job:
    def __init__(self, tmp_path, *cmd):
        self.hosts = tmp_path / "hosts"
        self.hosts.write_text("localhost:2\n")
        discovery = tmp_path / "discover.sh"
        discovery.write_text(f"#!/bin/sh\ncat {self.hosts}\n")
        discovery.chmod(0o755)
        launcher = [HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2"]
        # Every host is localhost: Horovod's driver must then be told to use the loopback interface.
        launcher += ["--host-discovery-script", str(discovery), "--network-interface", "lo"]
        self.process = subprocess.Popen(
            launcher + list(cmd),
            cwd=tmp_path,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True).start()

    def wait_for(self, condition, what, timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline and self.process.poll() is None:
            if condition():
                return
            time.sleep(0.2)
        raise AssertionError(f"no {what} after {timeout} s:\n{''.join(self.lines)[-6000:]}")

    def count(self, text):
        return sum(text in line for line in self.lines)


def test_tensorflow2_keras_mnist_elastic_through_2_1_2_workers(tmp_path):
    example = os.path.join(REPO, "examples", "tensorflow2_keras_mnist_elastic.py")
    args = ["--epochs=3", "--steps-per-epoch=160"]
    job = _Job(tmp_path, sys.executable, RUNNER, str(tmp_path), example, *args)
    try:
        job.wait_for(lambda: (tmp_path / "checkpoint-1.keras").exists(), "checkpoint of epoch 1")
        job.hosts.write_text("localhost:1\n")
        job.wait_for(lambda: job.count("has been removed from elastic job"), "removal of the second worker")
        job.hosts.write_text("localhost:2\n")
        # The joining worker's runner announces itself as rank 1 of 2, the second time such a line comes.
        job.wait_for(
            lambda: job.count("example_runner: started as rank 1 of 2") >= 2, "the worker that joined"
        )
        returncode = job.process.wait(timeout=600)
    finally:
        if job.process.poll() is None:
            job.process.kill()
    out = "".join(job.lines)
    assert returncode == 0, out[-6000:]
    assert job.count("example_runner: started as rank 0 of 2") == 1  # rank 0 ran throughout
    top1, _ = _check(tmp_path)
    assert top1 >= 0.80, top1  # 0.875 when measured (243 updates; about 2.7 minutes on 2 shared cores)
