"""Horovod 0.28.1's own TF2 Keras examples, which `hvd_lars.parallel.horovod_keras` stands in for, on 2 ranks
as Horovod ships them, run by tests/support/horovod_files.py: the MNIST example, the synthetic benchmark with
float16 compression, and the elastic MNIST example through 2 -> 1 -> 2 workers (its reset callback runs). The
MNIST examples' fits are capped at `EPOCHS` (elastic: `ELASTIC_EPOCHS`) epochs of `STEPS` steps (their 24
epochs of 500 / size steps take ~40 min on 2 cores)."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.support import HOROVODRUN, REPO, TWO_RANKS
from tests.support.horovod_files import HOROVOD_FILES
from tests.support.main_server import served

pytestmark = [
    pytest.mark.horovod,
    pytest.mark.skipif(
        not os.path.isdir(HOROVOD_FILES),
        reason=f"Horovod 0.28.1's own files are not at {HOROVOD_FILES} (or set HVD_LARS_HOROVOD_FILES)",
    ),
]
RUNNER = os.path.join(REPO, "tests", "support", "horovod_files.py")
ENV = dict(os.environ, PYTHONPATH=REPO)
STEPS = 4
EPOCHS = 4  # the MNIST example's warmup of 3 epochs, and one at the warmed-up rate
# Each membership change lands within about 2 epochs of its signal (steps are short, the driver polls every
# second): the elastic example's fits end well after both, however fast the machine.
ELASTIC_EPOCHS = 12


def _horovodrun(out, *args, timeout=900):
    cmd = [*TWO_RANKS, sys.executable, RUNNER, "example", str(out), *args]
    cmd = served(cmd, out, ENV)
    result = subprocess.run(cmd, cwd=out, env=ENV, capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def _ranks(out):
    """Both ranks' records, and how many weights they hold (bit for bit the same on both)."""
    ranks = [np.load(out / f"rank{r}.npz") for r in range(2)]
    weights = sorted(k for k in ranks[0].files if k.startswith("w"))
    for key in weights:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    return ranks, len(weights)


def test_horovods_mnist_example_trains_both_ranks_alike(tmp_path):
    path = os.path.join(HOROVOD_FILES, "examples", "tensorflow2", "tensorflow2_keras_mnist.py")
    code, output = _horovodrun(tmp_path, path, f"--steps-per-epoch={STEPS}", f"--epochs={EPOCHS}")
    assert code == 0, output[-6000:]
    ranks, weights = _ranks(tmp_path)
    assert weights == 8  # 2 convolutions and 2 dense layers, kernel and bias each
    for r in ranks:
        assert str(r["optimizer"]) == "DistributedOptimizer"
        assert int(r["iterations"]) == EPOCHS * STEPS  # one update per batch
        # The warmup over 3 epochs ends at Horovod's scaled rate 0.001 * size.
        assert float(r["learning_rate"]) == pytest.approx(0.002, rel=1e-6)
    assert "LearningRateWarmupCallback: warmup finished at rate 0.002" in output
    checkpoints = sorted(p.name for p in tmp_path.glob("checkpoint-*.h5"))
    assert checkpoints == sorted(f"checkpoint-{e}.h5" for e in range(1, EPOCHS + 1))  # rank 0's, every epoch
    for p in tmp_path.glob("checkpoint-*.h5"):
        p.unlink()  # files of 14 MB: checked by name, not kept
    top1 = float(ranks[0]["test_top1"])
    assert top1 >= 0.65, top1  # 0.749 when measured (16 updates of global batch 256; 0.852 with 96)
    assert "experimental_run_tf_function=False)` -> `compile(...)`': 1" in output  # a rename applied


def test_horovods_synthetic_benchmark_with_fp16_compression(tmp_path):
    path = os.path.join(HOROVOD_FILES, "examples", "tensorflow2", "tensorflow2_keras_synthetic_benchmark.py")
    # The script's own options: a small keras.applications model, on CPUs, with hvd.Compression.fp16.
    # Two iterations of one batch: the script measures the second (the first is its warmup).
    args = ["--model", "MobileNetV3Small", "--batch-size", "4", "--num-iters", "2"]
    args += ["--num-batches-per-iter", "1", "--fp16-allreduce", "--no-cuda"]
    code, output = _horovodrun(tmp_path, path, *args)
    assert code == 0, output[-6000:]
    ranks, weights = _ranks(tmp_path)
    assert weights == 142  # MobileNetV3Small's trainable variables
    for r in ranks:
        assert str(r["compression"]) == "fp16"
        assert int(r["iterations"]) == 2  # 2 iterations of 1 batch
    assert "Number of CPUs: 2" in output
    assert "Total img/sec on 2 CPU(s):" in output


def test_horovods_elastic_example_through_2_1_2_workers(tmp_path):
    path = os.path.join(HOROVOD_FILES, "examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py")
    hosts, discovery = tmp_path / "hosts", tmp_path / "discover.sh"
    hosts.write_text("localhost:2\n")
    discovery.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discovery.chmod(0o755)
    # The elastic driver, 1 to 2 slots on the hosts `hosts` lists: all localhost, hence the loopback device.
    # Its workers are forked from the server (a new interpreter's imports can outlast Gloo's 30 s rendezvous
    # on a loaded machine).
    cmd = [HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", discovery]
    cmd += ["--network-interface", "lo", sys.executable, RUNNER, "example", tmp_path, path]
    cmd += [f"--steps-per-epoch={STEPS}", f"--epochs={ELASTIC_EPOCHS}"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    job = subprocess.Popen(served(cmd, tmp_path, ENV), cwd=tmp_path, env=ENV, **pipes)
    lines = []
    threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True).start()

    def pids_as(rank_of_size):  # the processes that started a fit as `rank_of_size` ("rank 1 of 2")
        fits = [line for line in list(lines) if "horovod_files: pid" in line and f"on {rank_of_size}" in line]
        return {line.split(" pid ")[1].split()[0] for line in fits}

    def wait_for(condition, what):
        deadline = time.time() + 600
        while not condition():
            assert time.time() < deadline and job.poll() is None, f"no {what}:\n{''.join(lines)[-6000:]}"
            time.sleep(0.2)

    try:
        wait_for(lambda: (tmp_path / "checkpoint-1.h5").exists(), "checkpoint of epoch 1")
        first = pids_as("rank 1 of 2")
        hosts.write_text("localhost:1\n")
        removed = lambda: any("has been removed from elastic job" in line for line in list(lines))  # noqa: E731
        wait_for(removed, "removal of the second worker")
        hosts.write_text("localhost:2\n")
        wait_for(lambda: pids_as("rank 1 of 2") - first, "a worker that joined as rank 1 of 2")
        returncode = job.wait(timeout=900)
    finally:
        if job.poll() is None:
            job.kill()
    out = "".join(lines)
    assert returncode == 0, out[-6000:]
    ranks, _ = _ranks(tmp_path)
    assert len(pids_as("rank 0 of 2")) == 1  # rank 0 ran throughout
    fits = [tuple(f) for f in ranks[0]["fits"]]
    # Rank 0: the script's first one-step fit, then after each of the 2 membership changes its reset
    # callback's one-step fit (the callback ran: it also set the rate to 0.001 * size).
    assert fits.count((1, 1)) == 3, fits
    assert float(ranks[0]["learning_rate"]) == pytest.approx(0.002, rel=1e-6)
    assert int(ranks[0]["size"]) == 2
    top1 = float(ranks[0]["test_top1"])
    assert top1 >= 0.65, top1  # 0.837 when measured (55 updates)
    assert "`optimizer.lr` -> `optimizer.learning_rate`" in out  # tf.keras.backend.set_value(...lr, ...)
