"""CIFAR-style ResNets (depth 6n + 2) for 32x32 (or 28x28) images; `resnet20` is n = 3.

He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition" (CVPR 2016), section 4.2: a 3x3
convolution with 16 filters, three stages of n basic blocks with 16, 32 and 64 filters, global average
pooling and the logits. Shortcuts are option A (subsample by 2 and append zero channels), so ResNet-20
has 269,722 parameters with 10 classes (0.27M, the paper's table 6).
"""

import keras
from keras import layers

from hvd_lars.models.resnet import conv, logits, norm, stages

STAGE_WIDTHS = (16, 32, 64)


@keras.saving.register_keras_serializable(package="hvd_lars")
class ZeroPadShortcut(layers.Layer):
    """Option-A shortcut: (B, H, W, C) -> (B, ceil(H / stride), ceil(W / stride), filters), taking every
    `stride`-th pixel and appending `filters - C` zero channels. No parameters."""

    def __init__(self, filters, stride, **kwargs):
        super().__init__(**kwargs)
        self.filters, self.stride = filters, stride

    def call(self, inputs):
        x = inputs[:, :: self.stride, :: self.stride, :]
        extra = self.filters - x.shape[-1]
        return keras.ops.pad(x, [[0, 0], [0, 0], [0, 0], [0, extra]]) if extra > 0 else x

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "stride": self.stride}


def _zero_pad(x, filters, stride, name, fused):
    return ZeroPadShortcut(filters, stride, name=f"{name}_shortcut")(x)


def cifar_resnet(
    depth, num_classes=10, input_shape=(32, 32, 3), zero_init_residual=False, fused_batch_norm=True
):
    """Builds the CIFAR ResNet of `depth` = 6n + 2 layers (20, 32, 44, 56, 110, ...), initialised and
    normalised as `hvd_lars.models.resnet`; `zero_init_residual` is off by default (the paper's gamma 1).

    Returns a `keras.Model` from float (B, H, W, C) images to float32 logits (B, num_classes).
    Raises ValueError when `depth` is not 6n + 2 with n >= 1.
    """
    if not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
        raise ValueError(f"CIFAR ResNet depth must be 6n + 2 with n >= 1 (20, 32, 56, ...), got {depth!r}.")
    inputs = keras.Input(shape=input_shape, name="images")
    x = conv(inputs, STAGE_WIDTHS[0], 3, 1, "conv1")
    x = layers.ReLU(name="conv1_relu")(norm(x, "conv1_bn", fused=fused_batch_norm))
    x = stages(
        x,
        [(depth - 2) // 6] * 3,
        STAGE_WIDTHS,
        zero_init_residual=zero_init_residual,
        fused=fused_batch_norm,
        shortcut=_zero_pad,
    )
    return keras.Model(inputs, logits(x, num_classes), name=f"cifar_resnet{depth}")
