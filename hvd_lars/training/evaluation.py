"""The evaluation of the training application: every evaluation image counted once over all ranks, with
the ranks' batch-norm statistics averaged first (`ExactEvaluation`, `moving_statistics`).

Order matters: `hvd_lars.parallel.callbacks.MetricAverageCallback` and
`hvd_lars.training.epoch_logs.ImagesPerSecond` precede `ExactEvaluation`, and all of them precede the
loggers (metrics.csv, TensorBoard, the progress bar), which then see rank-averaged values
(`hvd_lars.training.train.callbacks_in_order`).
"""

import keras
import numpy as np
import tensorflow as tf

from hvd_lars.metrics import top_k_correct
from hvd_lars.parallel import collectives
from hvd_lars.training import faults


def moving_statistics(model):
    """The model's non-trainable float variables (batch-norm moving mean and variance), without the
    dropout seed states, which stay per rank."""
    return [
        v
        for v in model.non_trainable_variables
        if "seed_generator" not in v.path and v.dtype.startswith("float")
    ]


class ExactEvaluation(keras.callbacks.Callback):
    """Evaluates every `every_epochs` epochs (and at the last) on each rank's shard; sums exact counts.

    Adds `<prefix>_loss` (mean softmax cross-entropy), `<prefix>_top1` and `<prefix>_top5` (fractions)
    computed from correct-prediction counts summed over ranks, so every evaluation image counts exactly
    once. A prediction is correct by `hvd_lars.metrics.top_k_correct` (ties broken by class index, as
    argmax does), the rule of the training metrics. `prefix` is "test" for the test set and "val" for a
    validation split (Keras's TensorBoard callback writes `val_*` to its `validation/` folder, as the
    same tags).

    Raises:
        RuntimeError: the ranks together evaluated a number of images other than `num_examples`.
    """

    def __init__(self, dataset, num_examples, every_epochs=1, last_epoch=None, prefix="test"):
        super().__init__()
        self.dataset = dataset
        self.num_examples = num_examples
        self.every_epochs = every_epochs
        self.last_epoch = last_epoch
        self.prefix = prefix
        self._step = None

    def _counts(self):
        if self._step is None:

            @tf.function(reduce_retracing=True)
            def step(images, labels):
                logits = tf.cast(self.model(images, training=False), tf.float32)
                labels = tf.cast(labels, tf.int32)
                loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
                # The training metrics' rule (hvd_lars.metrics): ties broken by class index.
                top1 = top_k_correct(labels, logits, 1)
                top5 = top_k_correct(labels, logits, min(5, logits.shape[-1]))
                return tf.stack(
                    [
                        tf.reduce_sum(loss),
                        tf.reduce_sum(tf.cast(top1, tf.float32)),
                        tf.reduce_sum(tf.cast(top5, tf.float32)),
                        tf.cast(tf.size(labels), tf.float32),
                    ]
                )

            self._step = step
        total = np.zeros(4, dtype=np.float64)
        for images, labels in self.dataset:
            total += self._step(images, labels).numpy()
            faults.heartbeat()
        return total

    def on_epoch_end(self, epoch, logs=None):
        last = self.last_epoch is not None and epoch + 1 == self.last_epoch
        if not (last or (epoch + 1) % self.every_epochs == 0):
            return
        # One model for every rank: each rank's batch-norm moving statistics follow its own batches.
        collectives.average_variables(moving_statistics(self.model))
        # With the counts, whether a rank failed to read an evaluation file (file_failures).
        counts = [*self._counts(), faults.vote()]
        loss, top1, top5, count, failed = collectives.allreduce_sum(counts, name="hvd_lars.eval_counts")
        if failed:
            faults.raise_noted()
        if int(count) != self.num_examples:
            raise RuntimeError(
                f"evaluated {int(count)} {self.prefix} images across ranks, expected {self.num_examples}."
            )
        if logs is not None:
            logs[f"{self.prefix}_loss"] = loss / count
            logs[f"{self.prefix}_top1"] = top1 / count
            logs[f"{self.prefix}_top5"] = top5 / count
