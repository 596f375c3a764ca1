"""Top-1 / top-5 accuracy by one exact rule, shared by the training logs and the evaluation.

A prediction is top-k correct when the true class is among the first k classes of the logits sorted in
decreasing order, ties broken by class index (the order of `argmax` and `tf.math.top_k`), so top-1 agrees
with `argmax(logits) == label` and tied logits never make several classes correct at once (Keras's top-k
metrics, built on `tf.math.in_top_k`, count every class tied with the k-th as inside: equal logits score
top-1 = 1.0). A row holding a NaN logit counts as wrong. Written in `keras.ops`: it runs on every Keras 3
backend.
"""

import keras
from keras import ops


def top_k_correct(labels, logits, k):
    """bool (B,): whether each label (int (B,), in [0, C)) is among the top `k` (int >= 1; above C: C)
    of `logits` (float (B, C), compared as given, so bfloat16 ties stay ties), ties broken by class index:
    rank(label) = #{c : logit[c] > logit[label]} + #{c < label : logit[c] == logit[label]}, correct when
    rank(label) < k and the row has no NaN. Raises ValueError for `k` < 1."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}.")
    logits = ops.cast(logits, "float32")  # exact for bfloat16/float16: ties are kept
    labels = ops.cast(ops.reshape(labels, (-1, 1)), "int32")
    own = ops.take_along_axis(logits, labels, axis=1)
    classes = ops.arange(ops.shape(logits)[1], dtype="int32")[None, :]
    ahead = ops.logical_or(logits > own, ops.logical_and(logits == own, classes < labels))
    rank = ops.sum(ops.cast(ahead, "int32"), axis=1)
    finite = ops.logical_not(ops.any(ops.isnan(logits), axis=1))
    return ops.logical_and(rank < k, finite)


def _labels_from_targets(y_true, y_pred):
    # One-hot or smoothed targets (label smoothing maps labels to one-hot): the class is their argmax.
    if len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] == y_pred.shape[-1] != 1:
        return ops.cast(ops.argmax(y_true, axis=-1), "int32")
    return ops.cast(ops.reshape(y_true, (-1,)), "int32")


@keras.saving.register_keras_serializable(package="hvd_lars")
class TopKAccuracy(keras.metrics.MeanMetricWrapper):
    """Fraction of examples whose label is among the top `k` logits (`top_k_correct`), for `compile`.

    Takes integer labels (B,) or (B, 1), or one-hot / smoothed targets (B, C) (their argmax is the
    class), and logits (B, C) in any float dtype.

    Args:
        k: int >= 1 (1 for top-1, 5 for top-5; give min(5, classes) for fewer than 5 classes).
        name: the key in the logs ("top1", "top5").
    """

    def __init__(self, k=1, name=None, dtype=None):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}.")
        self.k = k

        def correct(y_true, y_pred):
            return ops.cast(top_k_correct(_labels_from_targets(y_true, y_pred), y_pred, k), "float32")

        super().__init__(fn=correct, name=name or f"top{k}", dtype=dtype)

    def get_config(self):
        return {"k": self.k, "name": self.name, "dtype": self.dtype}
