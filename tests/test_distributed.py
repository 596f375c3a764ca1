"""Two real Horovod processes: identical weights on both ranks, equal to one process on the global batch."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
WORKER = os.path.join(REPO, "tests", "hvd_worker.py")


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    subprocess.run([sys.executable, WORKER, str(out)], check=True, timeout=300)
    return _load(out / "rank0_of_1_acc1.npz")


@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_two_ranks_match_each_other_and_one_process(controller, tmp_path, single_process):
    cmd = [HOROVODRUN, controller, "-np", "2", "-H", "localhost:2", sys.executable, WORKER, str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    r0, r1 = _load(tmp_path / "rank0_of_2_acc1.npz"), _load(tmp_path / "rank1_of_2_acc1.npz")
    assert int(r0["iterations"]) == int(r1["iterations"]) == 4
    finals = sorted(k for k in r0 if k.startswith("final_"))
    assert len(finals) == 4  # conv kernel, conv bias, dense kernel, dense bias
    for k in finals:
        # Ranks started from different seeds; the broadcast made them equal, and averaged gradients keep
        # them bit-identical.
        np.testing.assert_array_equal(r0[k], r1[k])
        np.testing.assert_allclose(r0[k], single_process[k], rtol=1e-5, atol=1e-6)
        # The run moved the weights (the comparison above is not of two untouched copies).
        assert np.abs(r0[k] - r0[k.replace("final", "initial")]).max() > 1e-4
    np.testing.assert_array_equal(r0["initial_0"], single_process["initial_0"])


def test_accumulation_2_ranks_x_2_micro_batches_equals_4_micro_batches_in_one_process(
    tmp_path, single_process
):
    # Same 32 images per update: 2 ranks x 2 micro-batches of 8, 1 process x 4 micro-batches of 8, and
    # (the single_process fixture) 1 process x 1 batch of 32. The model has no batch norm: with it, each
    # micro-batch would normalise with its own statistics and the three runs would differ by design.
    subprocess.run([sys.executable, WORKER, str(tmp_path), "4"], check=True, timeout=300)
    cmd = [HOROVODRUN, "-np", "2", "-H", "localhost:2", sys.executable, WORKER, str(tmp_path), "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one = _load(tmp_path / "rank0_of_1_acc4.npz")
    r0, r1 = _load(tmp_path / "rank0_of_2_acc2.npz"), _load(tmp_path / "rank1_of_2_acc2.npz")
    # The optimizer counts updates, not micro-batches.
    assert int(one["iterations"]) == int(r0["iterations"]) == 4
    for k in (k for k in r0 if k.startswith("final_")):
        np.testing.assert_array_equal(r0[k], r1[k])
        np.testing.assert_allclose(r0[k], one[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(one[k], single_process[k], rtol=1e-5, atol=1e-6)


def test_averaging_copy_keeps_a_shared_learning_rate_variable_and_the_update_rule():
    import keras
    import tensorflow as tf

    from hvd_lars import LARS, distributed

    rate = keras.Variable(0.5)
    original = LARS(rate, weight_decay=1e-3, eta=0.01, momentum_correction=True)
    copy = distributed._averaging_copy(original)
    assert isinstance(copy, LARS) and type(copy).__name__ == "DistributedLARS"
    assert copy._learning_rate is rate  # a callback changing `rate` changes the copy's rate
    assert {k: v for k, v in copy.get_config().items() if k != "learning_rate"} == {
        k: v for k, v in original.get_config().items() if k != "learning_rate"
    }
    w = keras.Variable(np.array([3.0, 4.0], np.float32))
    copy.build([w])
    rate.assign(2.0)
    copy.apply([tf.constant([0.6, 0.8])], [w])
    # World size 1: the average is the gradient itself; the LARS step uses the new rate 2.0:
    # trust = 0.01 * 5 / (1 + 1e-3 * 5); w - 2 * trust * (g + 1e-3 * w).
    trust = 0.05 / 1.005
    np.testing.assert_allclose(w.numpy(), [3 - 2 * trust * 0.603, 4 - 2 * trust * 0.804], rtol=1e-5)
    with pytest.raises(ValueError, match="unbuilt optimizer"):
        distributed._averaging_copy(copy)
