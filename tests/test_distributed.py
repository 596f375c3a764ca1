"""The Horovod glue on 2 real ranks: DistributedOptimizer over every optimizer, rate and loss-scaler nesting,
accumulation, overlapped/grouped and float16 reduction, and the Horovod-named callbacks. Each case is a
function of tests/support/hvd_worker.py; one job runs them all (Gloo: tests/test_horovod_examples.py's elastic
example and tests/test_launcher_watch.py). "The updates of one process on the whole batch" hold to rtol 1e-5,
atol 1e-6 (float32 means taken in another order); across ranks the weights are bit-identical.
"""

import os

import numpy as np
import pytest

from tests.support import hvd_worker as w
from tests.support.data_fixtures import make_image_folder

pytestmark = pytest.mark.horovod
RTOL, ATOL = 1e-5, 1e-6
OPTIMIZERS = (w.sgd, w.adam, w.lamb, w.lars)
RATES = (w.float_rate, w.variable_rate, w.schedule_rate, w.callable_rate)
WRAPS = (w.bare, w.lso_inside, w.lso_chosen)
# Every pair of an optimizer, a way of giving the rate and a nesting in at least one 2-rank case (16 of the
# 48 combinations: the nesting of optimizer i and rate j is (i + j) mod 3), each against one process.
CASES = [
    (make, rate, WRAPS[(i + j) % 3]) for i, make in enumerate(OPTIMIZERS) for j, rate in enumerate(RATES)
]
ACCUMULATING = (w.sgd_adopted, w.lars_schedule_lso_inside, w.adam_lso_chosen)


# 13 classes of one training image each (one is left over with 2 ranks) and 9 evaluation images (ranks get 4
# and 5) with labels 0, 0, 1, 2, 3, 5, 7, 9, 12.
EVAL_COUNTS = [2, 1, 1, 1, 0, 1, 0, 1, 0, 1, 0, 0, 1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_folders")
    make_image_folder(str(root / "data"), [1] * 13, EVAL_COUNTS, odd={})
    make_image_folder(str(root / "bad"), [1, 1], [1, 1], odd={})
    (root / "bad" / "train" / "n00000001" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, folders):
    calls = [
        (w.first_gradient_norm,),
        *[(w.one_process, make, rate) for make in OPTIMIZERS for rate in RATES],
        *[(w.two_ranks, *case) for case in CASES],
        (w.loss_scaler_inside,),
        (w.loss_scaler_chosen,),
        *[(f, optimizer) for optimizer in ACCUMULATING for f in (w.accumulation, w.accumulation_reference)],
        (w.allreduces_per_accumulation_branch,),
        *[(w.gradient_reduction, r, c) for r in ("overlap", "grouped") for c in ("none", "fp16")],
        (w.metric_average,),
        (w.warmup_rates,),
        (w.batch_norm_statistics,),
        (w.image_folder_ranks, str(folders / "data"), str(folders)),
    ]
    return w.run(tmp_path_factory.mktemp("ranks"), calls)[0]


@pytest.mark.parametrize("make, rate, wrap", CASES, ids=lambda f: f.__name__)
def test_every_optimizer_rate_and_nesting(ranks, make, rate, wrap):
    r0, r1 = ranks(w.two_ranks, make, rate, wrap)
    [reference] = ranks(w.one_process, make, rate)
    assert len(r0["final"]) == len(reference["final"]) == 4
    for w0, w1, want, start in zip(r0["final"], r1["final"], reference["final"], w.initial_weights()):
        np.testing.assert_array_equal(w0, w1)
        np.testing.assert_allclose(w0, want, rtol=RTOL, atol=ATOL)
        assert np.abs(w0 - start).max() > 1e-4  # the run moved the weights (100 x ATOL)
    assert r0["iterations"] == r1["iterations"] == w.STEPS
    # The rate took effect (not silently a constant): other than the float rate's reference.
    [float_run] = ranks(w.one_process, make, w.float_rate)
    moved = max(np.abs(a - b).max() for a, b in zip(float_run["final"], reference["final"]))
    assert rate is w.float_rate or moved > 1e-5
    # SGD's global_clipnorm clipped (the first gradient is longer than it): the ranks match the reference
    # only if clipping saw the averaged gradient.
    assert make is not w.sgd or ranks(w.first_gradient_norm)[0] > 2 * w.CLIPNORM
    want = ["DistributedLossScaleOptimizer", "LossScaleOptimizer"]
    want = ["DistributedOptimizer", reference["type"]] if wrap is w.bare else want
    assert r0["types"] == want and r0["keras_type"] == want[0]
    # The whole optimizer state (counters, slots, rates, loss scale) is the same on both ranks and comes
    # back from a checkpoint and from a .keras file.
    assert len(r0["state"]) >= 6
    for other in (r1["state"], r0["checkpoint_state"], r0["keras_state"]):
        np.testing.assert_equal(other, r0["state"])


def test_loss_scalers_average_the_scaled_gradients_and_decide_together(ranks):
    # [w, scale, iterations]: scaled gradients 8 and 0 at scale 4, the mean 4 unscales to 1: w = -1.
    for got in ranks(w.loss_scaler_inside):
        np.testing.assert_array_equal(got, [[-1.0, 4.0, 1.0]])
    # inf and 8: both ranks skip and halve the scale; then 8 and 0 at scale 2: mean 2, w = -2. No hang.
    for got in ranks(w.loss_scaler_chosen):
        np.testing.assert_array_equal(got, [[0.0, 2.0, 0.0], [-2.0, 2.0, 1.0]])


@pytest.mark.parametrize("accumulating", ACCUMULATING, ids=lambda f: f.__name__)
def test_accumulation_averages_once_per_update(ranks, accumulating):
    r0, r1 = ranks(w.accumulation, accumulating)
    [reference] = ranks(w.accumulation_reference, accumulating)
    # 2 ranks x 2 micro-batches of 2 rows against one process on 8 rows per update.
    assert len(r0["final"]) == len(reference) == 4
    for w0, w1, want in zip(r0["final"], r1["final"], reference):
        np.testing.assert_array_equal(w0, w1)
        np.testing.assert_allclose(w0, want, rtol=RTOL, atol=ATOL)
    # iterations counts updates; the wrapper's own counter, micro-batches.
    assert r0["counts"] == [w.STEPS, 2 * w.STEPS]


def test_reduction_ops_overlapped_grouped_fp16_and_none_while_accumulating(ranks):
    # Accumulating, the traced cond: 4 allreduces (one per tensor) in the update branch, 0 in the other.
    assert ranks(w.allreduces_per_accumulation_branch)[0] == [4, 0]
    cases = [(r, c) for r in ("overlap", "grouped") for c in ("none", "fp16")]
    results = {case: ranks(w.gradient_reduction, *case) for case in cases}
    # [per-tensor allreduces (each waits for its own gradient only), grouped allreduces, ops on float16].
    ops = {case: r[0]["ops"] for case, r in results.items()}
    assert ops == {("overlap", "none"): [4, 0, 0], ("grouped", "none"): [0, 1, 0],
                   ("overlap", "fp16"): [4, 0, 4], ("grouped", "fp16"): [0, 1, 1]}  # fmt: skip
    for compression in ("none", "fp16"):
        (overlap0, overlap1), (grouped0, _) = results["overlap", compression], results["grouped", compression]
        assert len(overlap0["final"]) == 4
        # With 2 ranks each value is the sum of two terms, exact in any order or fusion: tolerance 0.
        np.testing.assert_equal([overlap1["final"], grouped0["final"]], [overlap0["final"]] * 2)
    compressed0, exact = results["overlap", "fp16"][0]["final"], results["overlap", "none"][0]["final"]
    errors = []
    for c, e, start in zip(compressed0, exact, w.initial_weights()):
        # float16 keeps 11 significant bits: each rank's value and the sum are rounded by at most 2^-11
        # relative, so the weights differ by at most about 1e-3 of what training moved them.
        errors.append(np.abs(c - e).max())
        assert errors[-1] <= 2e-3 * np.abs(e - start).max(), errors
    assert max(errors) > 0  # the values did travel as float16


def test_metric_average_callback_includes_keras_validation_metrics(ranks):
    # val_loss 1 on rank 0 and 3 on rank 1: EarlyStopping's best, the history and average_metrics(evaluate())
    # see 2 on both; loss 10 and 20: 15.
    want = {"best": 2.0, "evaluate": 2.0, "val_loss": [2.0, 2.0], "loss": [15.0, 15.0]}
    for r in ranks(w.metric_average):
        assert {key: r[key] for key in want} == want


def test_learning_rate_warmup_callback_follows_horovods_formula(ranks):
    # initial_lr / size * ((k + 1) / updates_per_epoch * (size - 1) / warmup_epochs + 1) before update k
    want = [0.4 / 2 * ((k + 1) / 4 * (2 - 1) / 2 + 1) for k in range(2 * 4)]
    want += [0.4, 0.4, 0.1, 0.1]  # after warmup the user's own change (0.1) stays
    for rates in ranks(w.warmup_rates):
        np.testing.assert_allclose(rates, want, rtol=1e-6)


def test_checkpoint_and_evaluation_use_the_mean_of_the_ranks_batch_norm_statistics(ranks):
    r0, r1 = ranks(w.batch_norm_statistics)
    # Epoch 1: each rank's statistics follow its own data; no evaluation; the checkpoint averages them.
    assert np.abs(r0["1_before"] - r1["1_before"]).min() > 0.3
    np.testing.assert_array_equal(r0["1_mid"], r0["1_before"])
    np.testing.assert_array_equal(r0["1_after"], r1["1_after"])
    np.testing.assert_allclose(r0["1_after"], (r0["1_before"] + r1["1_before"]) / 2, rtol=1e-6)
    # Epoch 2 starts equal, then the ranks drift apart again; the evaluation averages first.
    assert np.abs(r0["2_before"] - r1["2_before"]).min() > 0.1
    np.testing.assert_array_equal(r0["2_mid"], r1["2_mid"])
    np.testing.assert_allclose(r0["2_mid"], (r0["2_before"] + r1["2_before"]) / 2, rtol=1e-6)
    # The checkpoint rank 0 wrote last (epoch 2) holds the averaged values.
    np.testing.assert_array_equal(r0["saved"], r0["2_after"])


def test_image_folder_shards_training_counts_evaluation_once_and_lists_once(ranks, folders):
    r0, r1 = ranks(w.image_folder_ranks, str(folders / "data"), str(folders))
    assert r0["steps_per_epoch"] == r1["steps_per_epoch"] == 3  # 13 // 2 images, batch 2
    for epoch in range(2):
        shards = [sorted(r["train"][6 * epoch : 6 * (epoch + 1)].tolist()) for r in (r0, r1)]
        assert shards == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]  # disjoint; image 12 left out
    assert r0["eval"].tolist() == [0, 0, 1, 2] and r1["eval"].tolist() == [3, 5, 7, 9, 12]
    assert r0["num_eval_examples"] == 9
    for r in (r0, r1):  # the all-zero classifier's exact scores over all 9 images, on both ranks
        assert (r["top1"], r["top5"]) == (2 / 9, 5 / 9)  # labels 0, 0 | 0, 0, 1, 2, 3
    # Rank 0 listed train/ and validation/ once, its resume used the index, rank 1 never listed; the
    # refused folder was listed by rank 0 alone, and both ranks raised its error.
    assert [r0["first_listings"], r0["listings"], r1["listings"]] == [
        ["train", "validation"], ["train", "validation", "train"], []]  # fmt: skip
    for r in (r0, r1):
        assert "files that are not images this pipeline reads" in r["refusal"]
        assert f"{folders}/bad/train/n00000001/notes.txt" in r["refusal"]
    assert sorted(os.listdir(folders / "image_folder_index")) == ["train.index.npz", "validation.index.npz"]
