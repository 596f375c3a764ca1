"""Two real Horovod ranks whose batch norms see different data: the moving statistics are averaged over
the ranks before each checkpoint and each evaluation (hvd_lars.parallel.collectives.average_variables)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.support import REPO
from tests.support.horovodrun_checked_once import HOROVODRUN
from tests.support.main_server import served

WORKER = os.path.join(REPO, "tests", "support", "bn_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("bn")
    cmd = [*HOROVODRUN, "-np", "2", "-H", "localhost:2", sys.executable, WORKER, str(out)]
    result = subprocess.run(served(cmd), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loaded = []
    for r in range(2):
        with np.load(out / f"rank{r}.npz") as f:
            loaded.append({k: f[k] for k in f.files})
    return out, loaded


@pytest.mark.horovod
def test_checkpoint_holds_the_mean_of_the_ranks_statistics(ranks):
    out, (r0, r1) = ranks
    # Epoch 1: each rank's statistics follow its own data (rank 1's mean is about 3 higher) ...
    assert np.abs(r0["1_before"] - r1["1_before"]).min() > 0.3
    np.testing.assert_array_equal(r0["1_mid"], r0["1_before"])  # no evaluation in epoch 1
    # ... and the checkpoint callback replaced them on both ranks by their mean.
    np.testing.assert_array_equal(r0["1_after"], r1["1_after"])
    np.testing.assert_allclose(r0["1_after"], (r0["1_before"] + r1["1_before"]) / 2, rtol=1e-6)
    # The saved checkpoint (rank 0 writes it) holds the averaged values of the last save (epoch 2).
    reader = tf.train.load_checkpoint(str(out / "checkpoints"))
    saved = {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map() if "moving_" in n}
    assert len(saved) == 2
    mean = next(v for n, v in saved.items() if "moving_mean" in n)
    variance = next(v for n, v in saved.items() if "moving_variance" in n)
    np.testing.assert_array_equal(np.stack([mean, variance]), r0["2_after"])


@pytest.mark.horovod
def test_evaluation_uses_the_mean_of_the_ranks_statistics(ranks):
    _, (r0, r1) = ranks
    # Epoch 2 started from equal statistics, then each rank updated them from its own batches again.
    assert np.abs(r0["2_before"] - r1["2_before"]).min() > 0.1
    np.testing.assert_array_equal(r0["2_mid"], r1["2_mid"])
    np.testing.assert_allclose(r0["2_mid"], (r0["2_before"] + r1["2_before"]) / 2, rtol=1e-6)
