"""examples/keras_horovod_lars.py, a user's own Keras 3 script with hvd_lars's Horovod pieces, on 2 ranks:
identical weights, the warmup rate at known steps, metrics averaged over the ranks."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support import REPO, TWO_RANKS

EXAMPLE = os.path.join(REPO, "examples", "keras_horovod_lars.py")


@pytest.mark.horovod
def test_example_on_two_ranks(tmp_path):
    command = [*TWO_RANKS, sys.executable, EXAMPLE, f"--out={tmp_path}"]
    env = dict(os.environ, PYTHONPATH=REPO)
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    r0, r1 = (np.load(tmp_path / f"rank{r}.npz") for r in range(2))
    # From each rank's own random weights, bit-identical after the broadcast and 48 averaged updates.
    assert r0["weights"].size == 16 * 64 + 64 + 64 * 4 + 4
    np.testing.assert_array_equal(r0["weights"], r1["weights"])
    # 0.5 per 256 images at global batch 128 is 0.25; warmup over the 16 updates of epoch 1 from 0, then decay
    # with power 2 over D = 48 - 16 + 1 = 33 updates (WarmupPolynomialDecay); rates[t]: the rate of update t.
    assert int(r0["steps_per_epoch"]) == 16 and float(r0["peak_learning_rate"]) == 0.25
    rates = r0["rates"]
    assert len(rates) == 48
    expected = [0.0, 0.0625, 0.125, 0.234375, 0.25, 0.25 * (17 / 33) ** 2, 0.25 * (2 / 33) ** 2]
    np.testing.assert_allclose(rates[[0, 4, 8, 15, 16, 32, 47]], expected, rtol=1e-6)
    np.testing.assert_array_equal(rates, r1["rates"])
    # Every rank's History holds the same numbers: the means of the ranks' own values on their shards.
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_array_equal(r0[f"history_{key}"], r1[f"history_{key}"])
    own = [float(r["own_val_loss"]) for r in (r0, r1)]
    assert own[0] != own[1]
    assert r0["history_val_loss"][-1] == pytest.approx(np.mean(own), rel=1e-5)
    accuracy = np.mean([float(r["own_val_accuracy"]) for r in (r0, r1)])
    assert r0["history_val_accuracy"][-1] == pytest.approx(accuracy, rel=1e-6)
    assert r0["history_val_accuracy"][-1] > 0.7  # 4 Gaussian classes: far above chance (0.25)
