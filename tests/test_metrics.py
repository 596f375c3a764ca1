"""Top-1 / top-5 by one rule (ties broken by class index) in the training logs and in ExactEvaluation."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_lars.metrics import TopKAccuracy, top_k_correct
from hvd_lars.training.config import TrainConfig
from hvd_lars.training.epoch_logs import ExactEvaluation
from hvd_lars.training.plan import loss_and_metrics


@pytest.mark.unit
def test_all_zero_logits_give_chance_top1_and_top5_in_training_and_evaluation():
    # 10 classes, every logit 0, labels 0..9 twice: ties broken by class index predict classes 0 (top-1) and
    # 0-4 (top-5), 2 and 10 of 20 correct, in training (one-hot targets of label smoothing) and test alike.
    images, labels = np.zeros((20, 4), np.float32), np.tile(np.arange(10, dtype=np.int32), 2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(10, kernel_initializer="zeros")])
    _, metrics = loss_and_metrics(TrainConfig(label_smoothing=0.1), num_classes=10)
    for metric in metrics:  # as a training step updates them
        metric.update_state(tf.one_hot(labels, 10), model(images))
    logs = {metric.name: float(metric.result()) for metric in metrics}
    evaluation = ExactEvaluation(tf.data.Dataset.from_tensor_slices((images, labels)).batch(7), 20)
    evaluation.set_model(model)
    evaluation.on_epoch_end(0, logs)
    chance = {"top1": 0.1, "top5": 0.5, "test_top1": 0.1, "test_top5": 0.5, "test_loss": np.log(10)}
    assert logs == pytest.approx(chance, rel=1e-6)


RNG = np.random.default_rng(0)
ADVERSARIAL = {
    # (labels, logits): ties at the k-th place, constant rows, -inf/inf, a NaN row.
    "ties": ([2, 1, 3, 0], [[1, 3, 3, 0], [1, 3, 3, 0], [5, 5, 5, 5], [0, 0, 0, 0]]),
    "constant": ([0, 4, 5, 9], [[-2.5] * 10] * 4),
    "infinities": ([1, 0, 2], [[np.inf, np.inf, 0], [-np.inf, 0, -np.inf], [0, 1, np.inf]]),
    "nan_row": ([0, 1], [[np.nan, 0, 0], [0, 5, 1]]),
    "single_class": ([0, 0, 0], [[0.0], [-3.0], [7.0]]),
    # 1.0 and 1.001: two float32 numbers, one bfloat16 number (8-bit significand).
    "near_tie": ([1, 1], [[1.0, 1.001, 0.5], [0.5, 1.001, 1.0]]),
    "near_tie_bfloat16": ([1, 1], tf.cast([[1.0, 1.001, 0.5], [0.5, 1.001, 1.0]], tf.bfloat16)),
    # About 3 tied classes per value.
    "tie_heavy": (RNG.integers(0, 10, size=500).astype(np.int32), RNG.integers(0, 3, size=(500, 10))),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_adversarial_inputs_match_the_stable_sort_and_so_does_the_keras_metric(case):
    labels, logits = ADVERSARIAL[case]
    logits = tf.constant(logits, logits.dtype if tf.is_tensor(logits) else tf.float32)
    values = logits.numpy().astype(np.float32)
    # NumPy: the label's position in a stable descending sort (ties keep the lower class index first).
    rank = np.argmax(np.argsort(-values, axis=1, kind="stable") == np.asarray(labels)[:, None], axis=1)
    finite = ~np.isnan(values).any(axis=1)
    for k in (1, 2, 5):
        want = (rank < k) & finite
        got = top_k_correct(tf.constant(labels), logits, k).numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"k={k}")
        # (B, 1) integer labels as Keras passes them; one-hot targets (of one class: read as a label).
        one_hot = [tf.one_hot(labels, values.shape[1])] if values.shape[1] > 1 else []
        for targets in [np.asarray(labels)[:, None], *one_hot]:
            metric = TopKAccuracy(k)
            metric.update_state(targets, logits)
            assert float(metric.result()) == pytest.approx(want.mean(), abs=1e-6), f"k={k}"
    # Top-1 is argmax's answer wherever the row has no NaN.
    top1 = top_k_correct(tf.constant(labels), logits, 1).numpy()
    np.testing.assert_array_equal(top1[finite], (np.argmax(values, 1) == labels)[finite])
    if case.startswith("near_tie"):  # by hand: 1.001 leads in float32; in bfloat16, the lower class
        assert top1.tolist() == ([False, True] if case.endswith("bfloat16") else [True, True])
    if case == "tie_heavy":  # in_top_k, which Keras's own top-k metrics use, counts every tie as inside
        assert tf.math.in_top_k(labels, values, 1).numpy().mean() > top1.mean() + 0.1


@pytest.mark.unit
def test_metric_config_round_trip_and_bad_k():
    again = TopKAccuracy.from_config(TopKAccuracy(5, name="top5").get_config())
    assert (again.k, again.name) == (5, "top5")
    with pytest.raises(ValueError, match="got 0"):
        TopKAccuracy(0)
    with pytest.raises(ValueError, match="got 0"):
        top_k_correct(tf.constant([0]), tf.constant([[1.0]]), 0)
