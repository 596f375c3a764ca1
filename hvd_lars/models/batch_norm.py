"""Batch normalisation on TensorFlow's fused kernel (one pass forward, one backward) for NHWC images.

Keras 3's `BatchNormalization` computes moments and the normalisation as separate element-wise ops, each a
full pass over the activation tensor, after upcasting bfloat16 inputs to float32. On a CPU these passes are
memory-bound and cost a large share of a ResNet-50 training step. `FusedBatchNormalization` keeps the
Keras layer (same variables, arguments, checkpoints and config) and runs the 4-D channels-last case on
`FusedBatchNormV3` (oneDNN's kernel when TensorFlow's oneDNN optimisations are on), which reads bfloat16
directly. Anything else (masks, renorm, other ranks or axes) falls back to the Keras computation.
"""

import keras
import tensorflow as tf

from hvd_lars.keras_internals import flatten_layers


@keras.saving.register_keras_serializable(package="hvd_lars")
class FusedBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` computed by `tf.raw_ops.FusedBatchNormV3` for (B, H, W, C) inputs.

    Training: y = gamma * (x - mean_B) / sqrt(var_B + epsilon) + beta over the batch and spatial axes
    (Ioffe & Szegedy 2015, algorithm 1), with the moving averages updated as Keras does,
    `moving = momentum * moving + (1 - momentum) * batch_statistic`. One difference from Keras: the batch
    variance that enters the moving variance carries Bessel's correction n / (n - 1), n = B * H * W, as in
    Caffe's BatchNorm layer and TensorFlow 1's fused layer (Keras 3 uses the biased variance). The
    normalisation itself uses the biased batch variance in both.
    Inference: y = gamma * (x - moving_mean) / sqrt(moving_variance + epsilon) + beta.

    Input and output dtype: the layer's compute dtype (float32, or bfloat16 under `mixed_bfloat16`);
    statistics, gamma and beta stay float32.

    `bessel_correction=False` keeps Keras's biased batch variance in the moving variance, so the layer
    computes what Keras's does (`fuse_batch_norm` sets it).
    """

    def __init__(self, *args, bessel_correction=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.bessel_correction = bessel_correction

    def get_config(self):
        return {**super().get_config(), "bessel_correction": self.bessel_correction}

    def _fusable(self, inputs, mask):
        return (
            mask is None
            and not getattr(self, "renorm", False)  # Keras 3.14 added renorm; 3.12-3.13 have none
            and not self.synchronized
            and len(inputs.shape) == 4
            and self.axis in (-1, 3)
            and inputs.dtype in (tf.float32, tf.bfloat16, tf.float16)
        )

    def call(self, inputs, training=None, mask=None):
        if not self._fusable(inputs, mask):
            return super().call(inputs, training=training, mask=mask)
        x = tf.cast(inputs, self.compute_dtype)
        channels = x.shape[-1]
        scale = tf.cast(self.gamma, tf.float32) if self.scale else tf.ones((channels,), tf.float32)
        offset = tf.cast(self.beta, tf.float32) if self.center else tf.zeros((channels,), tf.float32)
        if training and self.trainable:
            empty = tf.constant([], tf.float32)
            y, mean, variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
                x=x,
                scale=scale,
                offset=offset,
                mean=empty,
                variance=empty,
                epsilon=self.epsilon,
                data_format="NHWC",
                is_training=True,
            )
            if not self.bessel_correction:
                n = tf.cast(tf.size(x) // channels, tf.float32)
                variance = variance * (n - 1.0) / n
            decay = 1.0 - self.momentum
            self.moving_mean.assign_sub((self.moving_mean - mean) * decay)
            self.moving_variance.assign_sub((self.moving_variance - variance) * decay)
            return y
        y, _, _, _, _, _ = tf.raw_ops.FusedBatchNormV3(
            x=x,
            scale=scale,
            offset=offset,
            mean=tf.cast(self.moving_mean, tf.float32),
            variance=tf.cast(self.moving_variance, tf.float32),
            epsilon=self.epsilon,
            data_format="NHWC",
            is_training=False,
        )
        return y


def batch_norm_layer(fused):
    """The batch-norm class to build with: `FusedBatchNormalization` if `fused`, else Keras's own."""
    return FusedBatchNormalization if fused else keras.layers.BatchNormalization


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
