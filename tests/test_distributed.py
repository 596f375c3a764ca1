"""The Horovod glue on 2 real ranks: DistributedOptimizer over every optimizer, rate and loss-scaler nesting,
accumulation, overlapped/grouped and float16 reduction, and the Horovod-named callbacks.

Two process groups run all cases (tests/support/hvd_worker.py): the optimizer matrix under Gloo, the rest
under MPI, so both of Horovod's controllers are exercised. Tolerances: "the same updates as one process on the
concatenated batch" holds to rtol 1e-5, atol 1e-6, because float32 means are taken in another order (one
mean of 8 rows against the mean of two means of 4); across ranks the weights are bit-identical.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support import REPO
from tests.support.horovodrun_checked_once import HOROVODRUN
from tests.support.hvd_worker import CLIPNORM, OPTIMIZERS, RATE_KINDS, STEPS, WRAPS, initial_weights
from tests.support.main_server import served

WORKER = os.path.join(REPO, "tests", "support", "hvd_worker.py")
RTOL, ATOL = 1e-5, 1e-6


def _run_group(tmp_path_factory, group, controller):
    out = tmp_path_factory.mktemp(group)
    cmd = [*HOROVODRUN, controller, "-np", "2", "-H", "localhost:2", sys.executable, WORKER, str(out), group]
    env = dict(os.environ, TMPDIR=str(out))
    cmd = served(cmd, env=env)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    ranks = []
    for rank in range(2):
        with np.load(out / f"{group}_rank{rank}.npz") as f:
            ranks.append({k: f[k] for k in f.files})
    return ranks


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return _run_group(tmp_path_factory, "matrix", "--gloo")


@pytest.fixture(scope="module")
def behaviour(tmp_path_factory):
    return _run_group(tmp_path_factory, "behaviour", "--mpi")


def _arrays(results, prefix):
    keys = sorted((k for k in results if k.startswith(prefix + "/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    return [results[k] for k in keys]


@pytest.mark.horovod
@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("rate_kind", RATE_KINDS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_rate_and_nesting(matrix, name, rate_kind, wrap):
    r0, r1 = matrix
    case = f"{name}/{rate_kind}/{wrap}"
    final0, final1 = _arrays(r0, f"{case}/final"), _arrays(r1, f"{case}/final")
    reference = _arrays(r0, f"{name}/{rate_kind}/reference")
    assert len(final0) == len(reference) == 4
    for w0, w1, want, start in zip(final0, final1, reference, initial_weights()):
        np.testing.assert_array_equal(w0, w1)
        np.testing.assert_allclose(w0, want, rtol=RTOL, atol=ATOL)
        assert np.abs(w0 - start).max() > 1e-4  # the run moved the weights (100 x ATOL)
    assert int(r0[f"{case}/iterations"]) == int(r1[f"{case}/iterations"]) == STEPS
    expected_types = {
        "bare": [
            "DistributedOptimizer",
            {"sgd": "SGD", "adam": "Adam", "lamb": "Lamb", "lars": "LARS"}[name],
        ],
        "lso_inside": ["DistributedLossScaleOptimizer", "LossScaleOptimizer"],
        "lso_chosen": ["DistributedLossScaleOptimizer", "LossScaleOptimizer"],
    }[wrap]
    assert list(r0[f"{case}/types"]) == expected_types
    assert str(r0[f"{case}/keras_type"]) == expected_types[0]
    # The whole optimizer state (counters, slots, rates, loss scale) is the same on both ranks and comes
    # back from a checkpoint and from a .keras file.
    state0, state1 = _arrays(r0, f"{case}/state"), _arrays(r1, f"{case}/state")
    assert len(state0) >= 6
    for restored in ("checkpoint_state", "keras_state"):
        got = _arrays(r0, f"{case}/{restored}")
        assert len(got) == len(state0), restored
        for a, b in zip(state0, got):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(state0, state1):
        np.testing.assert_array_equal(a, b)


@pytest.mark.horovod
def test_matrix_rates_and_clipping_take_effect(matrix):
    r0, _ = matrix
    # Each way of giving the rate changes the result (none is silently replaced by a constant).
    for name in OPTIMIZERS:
        float_run = _arrays(r0, f"{name}/float/bare/final")
        for kind in RATE_KINDS[1:]:
            other = _arrays(r0, f"{name}/{kind}/bare/final")
            assert max(np.abs(a - b).max() for a, b in zip(float_run, other)) > 1e-5, (name, kind)
    # SGD's global_clipnorm clipped (the first gradient is longer than it), and the 2-rank runs match the
    # one-process runs only if clipping saw the averaged gradient.
    assert float(r0["sgd/float/first_gradient_norm"]) > 2 * CLIPNORM


@pytest.mark.horovod
def test_loss_scaler_inside_averages_the_scaled_gradients(behaviour):
    # DistributedOptimizer(LossScaleOptimizer(SGD(1.0), initial_scale=4)), scaled gradients 8 and 0.
    for r in behaviour:
        np.testing.assert_array_equal(r["lso_inside/steps"], [[-1.0, 4.0, 1.0]])  # w, scale, iterations


@pytest.mark.horovod
def test_loss_scaler_chosen_under_mixed_float16_decides_on_overflow_together(behaviour):
    # DistributedOptimizer(SGD(1.0)) made under mixed_float16, initial scale 4: inf on rank 0, 8 on rank 1
    # -> both skip and halve the scale; then 8 and 0 at scale 2 -> mean 2 -> w = -2. No rank hangs.
    for r in behaviour:
        np.testing.assert_array_equal(r["lso_chosen/steps"], [[0.0, 2.0, 0.0], [-2.0, 2.0, 1.0]])


@pytest.mark.horovod
def test_loss_scaler_keras_adds_under_mixed_float16(behaviour):
    for r in behaviour:
        assert list(r["keras_built/types"]) == ["DistributedLossScaleOptimizer", "LossScaleOptimizer"]
        # kernel, scale: the overflow on rank 0 skips the step on both ranks; the next step applies.
        np.testing.assert_array_equal(r["keras_built/steps"], [[0.0, 2.0], [-2.0, 2.0]])


@pytest.mark.horovod
def test_a_loss_scaler_around_the_wrapper_is_refused_when_made(behaviour):
    for case in ("around_plain", "two_scalers"):
        for r in behaviour:
            assert "would check each rank's gradients alone" in str(r[f"{case}/error"]), case


@pytest.mark.horovod
@pytest.mark.parametrize("case", ["sgd_adopted", "lars_schedule_lso_inside", "adam_lso_chosen"])
def test_accumulation_averages_once_per_update(behaviour, case):
    r0, r1 = behaviour
    # 2 ranks x 2 micro-batches of 2 rows against one process on 8 rows per update.
    for w0, w1, want in zip(
        _arrays(r0, f"accumulation/{case}/final"),
        _arrays(r1, f"accumulation/{case}/final"),
        _arrays(r0, f"accumulation/{case}/reference"),
    ):
        np.testing.assert_array_equal(w0, w1)
        np.testing.assert_allclose(w0, want, rtol=RTOL, atol=ATOL)
    # iterations counts updates; the wrapper's own counter, micro-batches.
    assert list(r0[f"accumulation/{case}/counts"]) == [STEPS, 2 * STEPS]


@pytest.mark.horovod
def test_accumulating_micro_batches_do_not_communicate(behaviour):
    # The traced update's cond: 4 allreduces (one per tensor) in the update branch, none in the other.
    assert list(behaviour[0]["accumulation/allreduces_per_branch"]) == [4, 0]


@pytest.mark.horovod
def test_the_largest_count_of_any_rank_on_every_rank(behaviour):
    # Rank 0 holds 1, rank 1 holds 3 (the elastic loop's attempts, where rank 0 joined later).
    assert [int(r["counts/max"]) for r in behaviour] == [3, 3]


@pytest.mark.horovod
def test_overlapped_and_grouped_reduction(behaviour):
    r0, r1 = behaviour
    # 4 per-tensor allreduces (each waits for its own gradient only) against 1 grouped allreduce.
    assert list(r0["reduction/overlap/none/ops"]) == [4, 0, 0]
    assert list(r0["reduction/grouped/none/ops"]) == [0, 1, 0]
    for compression in ("none", "fp16"):
        overlap = _arrays(r0, f"reduction/overlap/{compression}/final")
        grouped = _arrays(r0, f"reduction/grouped/{compression}/final")
        for a, b, c in zip(overlap, grouped, _arrays(r1, f"reduction/overlap/{compression}/final")):
            np.testing.assert_array_equal(a, c)
            # Tolerance 0: with 2 ranks each value is the sum of two terms, which float addition gives
            # exactly in any order or fusion (with more ranks the order could move the last bit).
            np.testing.assert_array_equal(a, b)


@pytest.mark.horovod
def test_fp16_compression(behaviour):
    r0, r1 = behaviour
    # The allreduces take float16 tensors: 4 of them, or the 1 grouped one.
    assert list(r0["reduction/overlap/fp16/ops"]) == [4, 0, 4]
    assert list(r0["reduction/grouped/fp16/ops"]) == [0, 1, 1]
    compressed = _arrays(r0, "reduction/overlap/fp16/final")
    exact = _arrays(r0, "reduction/overlap/none/final")
    largest_error = 0.0
    for c, c1, e, start in zip(
        compressed, _arrays(r1, "reduction/overlap/fp16/final"), exact, initial_weights()
    ):
        np.testing.assert_array_equal(c, c1)
        # float16 keeps 11 significant bits: each rank's value and the sum are rounded by at most 2^-11
        # (4.9e-4) relative, so the weights differ by at most about 1e-3 of what training moved them.
        moved = np.abs(e - start).max()
        error = np.abs(c - e).max()
        assert error <= 2e-3 * moved, (error, moved)
        largest_error = max(largest_error, error)
    assert largest_error > 0  # the values did travel as float16


@pytest.mark.horovod
def test_broadcast_callback_at_start_and_on_resume(behaviour):
    r0, r1 = behaviour
    assert np.abs(r0["broadcast/initial"] - r1["broadcast/initial"]).max() > 0.01  # different seeds
    for stage in ("first_fit", "resumed"):
        a, b = _arrays(r0, f"broadcast/{stage}"), _arrays(r1, f"broadcast/{stage}")
        assert len(a) == len(b) >= 8  # 4 weights, then the optimizer's counters and momenta
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    # Rank 0 alone "restored" step 100 before the second fit of 3 updates.
    assert int(r0["broadcast/iterations"]) == int(r1["broadcast/iterations"]) == 100 + STEPS


@pytest.mark.horovod
def test_metric_average_callback_includes_keras_validation_metrics(behaviour):
    for r in behaviour:
        # val_loss 1.0 on rank 0 and 3.0 on rank 1: EarlyStopping sees 2.0 on both.
        assert float(r["metric_average/best"]) == 2.0
        np.testing.assert_array_equal(r["metric_average/val_loss"], [2.0, 2.0])
        np.testing.assert_array_equal(r["metric_average/loss"], [15.0, 15.0])  # 10 and 20
        assert float(r["metric_average/evaluate"]) == 2.0  # average_metrics(model.evaluate(...))


@pytest.mark.horovod
def test_learning_rate_warmup_callback_follows_horovods_formula(behaviour):
    size, initial_lr, warmup_epochs, updates_per_epoch = 2, 0.4, 2, 4
    want = [
        initial_lr / size * ((k + 1) / updates_per_epoch * (size - 1) / warmup_epochs + 1)
        for k in range(warmup_epochs * updates_per_epoch)
    ]
    want += [initial_lr, initial_lr, 0.1, 0.1]  # after warmup the user's own change (0.1) stays
    for r in behaviour:
        np.testing.assert_allclose(r["warmup/rates"], want, rtol=1e-6)
