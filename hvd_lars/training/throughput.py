"""Training throughput in the epoch logs: images of all ranks per second of training (`ImagesPerSecond`)."""

import time

import keras


class ImagesPerSecond(keras.callbacks.Callback):
    """Adds `images_per_second` (images of all ranks per second of training, evaluation excluded) and
    `epoch_time_s` to the epoch logs.

    Args:
        images_per_batch: images one training batch (micro-batch) covers over all ranks.
    """

    def __init__(self, images_per_batch):
        super().__init__()
        self.images_per_batch = images_per_batch
        self._start = None
        self._batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1

    def on_epoch_end(self, epoch, logs=None):
        elapsed = time.perf_counter() - self._start
        if logs is not None:
            logs["images_per_second"] = self.images_per_batch * self._batches / elapsed
            logs["epoch_time_s"] = elapsed
