"""CIFAR-style ResNets (depth 6n + 2) for 32x32 (or 28x28) images; `resnet20` is n = 3.

He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition" (CVPR 2016), section 4.2: a 3x3
convolution with 16 filters, three stages of n basic blocks with 16, 32 and 64 filters on feature maps of
32, 16 and 8 pixels, global average pooling and the logits. Shortcuts are option A (parameter-free:
subsample by 2 and append zero channels), so ResNet-20 has 0.27M parameters (269,722 with 10 classes),
the figure of the paper's table 6.
"""

import keras
from keras import layers

from hvd_lars.models.batch_norm import batch_norm_layer
from hvd_lars.models.resnet import BN_EPSILON, BN_MOMENTUM, conv

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


def _norm(x, name, zero_gamma, fused):
    return batch_norm_layer(fused)(
        momentum=BN_MOMENTUM,
        epsilon=BN_EPSILON,
        gamma_initializer="zeros" if zero_gamma else "ones",
        name=name,
    )(x)


def cifar_resnet(
    depth, num_classes=10, input_shape=(32, 32, 3), zero_init_residual=False, fused_batch_norm=True
):
    """Builds the CIFAR ResNet of `depth` = 6n + 2 layers (20, 32, 44, 56, 110, ...).

    Initialisers: convolutions N(0, 2 / fan_in) (He et al. 2015, as the paper); logits N(0, 0.01^2).
    Batch norm momentum 0.9, epsilon 1e-5 (as `hvd_lars.models.resnet`). `zero_init_residual` starts the
    second batch-norm scale of every block at 0 (off by default: the paper initialises gamma to 1).

    Returns a `keras.Model` from float (B, H, W, C) images to float32 logits (B, num_classes).
    Raises ValueError when `depth` is not 6n + 2 with n >= 1.
    """
    if not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
        raise ValueError(f"CIFAR ResNet depth must be 6n + 2 with n >= 1 (20, 32, 56, ...), got {depth!r}.")
    blocks = (depth - 2) // 6
    inputs = keras.Input(shape=input_shape, name="images")
    x = conv(inputs, STAGE_WIDTHS[0], 3, 1, "conv1")
    x = layers.ReLU(name="conv1_relu")(_norm(x, "conv1_bn", False, fused_batch_norm))
    for stage, width in enumerate(STAGE_WIDTHS):
        for i in range(blocks):
            name = f"stage{stage + 1}_block{i + 1}"
            stride = 2 if i == 0 and stage > 0 else 1
            shortcut = x
            if stride != 1 or x.shape[-1] != width:
                shortcut = ZeroPadShortcut(width, stride, name=f"{name}_shortcut")(x)
            y = conv(x, width, 3, stride, f"{name}_conv1")
            y = layers.ReLU(name=f"{name}_relu1")(_norm(y, f"{name}_bn1", False, fused_batch_norm))
            y = conv(y, width, 3, 1, f"{name}_conv2")
            y = _norm(y, f"{name}_bn2", zero_init_residual, fused_batch_norm)
            x = layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([y, shortcut]))
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    # Logits in float32 whatever the precision policy, so the softmax cross-entropy is computed in float32.
    outputs = layers.Dense(
        num_classes,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
        dtype="float32",
        name="logits",
    )(x)
    return keras.Model(inputs, outputs, name=f"cifar_resnet{depth}")


def resnet20(num_classes=10, input_shape=(32, 32, 3), **kwargs):
    """CIFAR ResNet-20 (n = 3): 269,722 trainable parameters with 10 classes and 3 input channels."""
    return cifar_resnet(20, num_classes, input_shape, **kwargs)
