"""Batch normalisation on TensorFlow's fused kernel (one pass forward, one backward) for NHWC images:
Keras 3's `BatchNormalization` makes separate memory-bound passes (after upcasting bfloat16) on a CPU."""

import keras
import tensorflow as tf

from hvd_lars.keras_internals import flatten_layers


@keras.saving.register_keras_serializable(package="hvd_lars")
class FusedBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` computed by `tf.raw_ops.FusedBatchNormV3` for (B, H, W, C) inputs
    (same variables, arguments and config); anything else (masks, renorm, synchronized, other ranks or axes)
    falls back to Keras.

    Training: y = gamma * (x - mean_B) / sqrt(var_B + epsilon) + beta (Ioffe & Szegedy 2015, algorithm 1),
    `moving = momentum * moving + (1 - momentum) * batch_statistic`. With `bessel_correction` (the default,
    the project's models) the batch variance entering the moving variance carries n / (n - 1), n = B * H * W,
    as Caffe's and TensorFlow 1's fused layers do; without it (`fuse_batch_norm`), Keras 3's biased variance.
    Inference: the moving statistics. Input and output in the layer's compute dtype; statistics, gamma and
    beta float32.
    """

    def __init__(self, *args, bessel_correction=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.bessel_correction = bessel_correction

    def get_config(self):
        return {**super().get_config(), "bessel_correction": self.bessel_correction}

    def call(self, inputs, training=None, mask=None):
        fusable = (
            mask is None
            and not getattr(self, "renorm", False)  # Keras 3.14 added renorm; 3.12-3.13 have none
            and not self.synchronized
            and len(inputs.shape) == 4
            and self.axis in (-1, 3)
            and inputs.dtype in (tf.float32, tf.bfloat16, tf.float16)
        )
        if not fusable:
            return super().call(inputs, training=training, mask=mask)
        x = tf.cast(inputs, self.compute_dtype)
        channels = x.shape[-1]
        training = bool(training and self.trainable)
        empty = tf.constant([], tf.float32)
        y, mean, variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
            x=x,
            scale=tf.cast(self.gamma, tf.float32) if self.scale else tf.ones((channels,), tf.float32),
            offset=tf.cast(self.beta, tf.float32) if self.center else tf.zeros((channels,), tf.float32),
            mean=empty if training else tf.cast(self.moving_mean, tf.float32),
            variance=empty if training else tf.cast(self.moving_variance, tf.float32),
            epsilon=self.epsilon,
            data_format="NHWC",
            is_training=training,
        )
        if training:
            if not self.bessel_correction:
                n = tf.cast(tf.size(x) // channels, tf.float32)
                variance = variance * (n - 1.0) / n
            decay = 1.0 - self.momentum
            self.moving_mean.assign_sub((self.moving_mean - mean) * decay)
            self.moving_variance.assign_sub((self.moving_variance - variance) * decay)
        return y


def fuse_batch_norm(model):
    """Runs every `keras.layers.BatchNormalization` of `model` (nested ones included) on the fused kernel.

    In place: each such layer becomes a `FusedBatchNormalization` with the same variables, configuration
    and Keras's own moving-statistics rule, so training and inference compute what Keras's layer does
    (within float rounding), faster on a CPU. Call it on a built model before `compile`, e.g.
    `model = hvd_lars.fuse_batch_norm(keras.applications.ResNet50(weights=None))`. A `.keras` file of the
    result loads where `hvd_lars` is imported; plain Keras does not know the class (`custom_objects=
    {"FusedBatchNormalization": hvd_lars.FusedBatchNormalization}` lets it load).

    Returns:
        `model`, the same object.
    """
    for layer in flatten_layers(model):
        if type(layer) is keras.layers.BatchNormalization:
            layer.__class__ = FusedBatchNormalization
            layer.bessel_correction = False
    return model
