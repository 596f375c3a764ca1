"""ImageNet ResNets: ResNet-18 and -34 (basic blocks) and ResNet-50 v1.5 (bottleneck blocks).

He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition" (CVPR 2016), table 1, with the v1.5
change of the reference implementations (torchvision, the TensorFlow/MLPerf ResNet-50): in a down-sampling
bottleneck the stride sits on the 3x3 convolution, not on the first 1x1. Projection shortcuts (option B:
1x1 convolution + batch norm) wherever the shape changes, identity elsewhere. No convolution biases
(each convolution feeds a batch norm), so ResNet-50 with 1,000 classes has 25,557,032 trainable
parameters, the count of torchvision's and MLPerf's models.
"""

import keras
from keras import layers

from hvd_lars.models.batch_norm import batch_norm_layer

# Batch-norm momentum 0.9 (Keras convention: moving = 0.9 * moving + 0.1 * batch) and epsilon 1e-5: the
# TensorFlow TPU / MLPerf ResNet-50 reference (BATCH_NORM_DECAY 0.9, EPSILON 1e-5) and torchvision
# (momentum 0.1 in PyTorch's convention is the same rule). Keras's default 0.99 leaves the running
# statistics near their initial values after the few hundred steps of a large-batch run.
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5

# He et al. 2015 ("Delving Deep into Rectifiers", eq. 10): zero-mean normal, std sqrt(2 / fan_in), the
# initialisation the ResNet paper cites; the logits layer draws from N(0, 0.01^2) with zero bias, as in
# Goyal et al. 2017 (section 5.1) and the MLPerf reference.
CONV_INITIALIZER = keras.initializers.VarianceScaling(2.0, "fan_in", "untruncated_normal")
LOGITS_INITIALIZER = keras.initializers.RandomNormal(stddev=0.01)

# Blocks per stage (table 1 of He et al. 2016); stage widths 64-128-256-512 (x4 at a bottleneck's output).
STAGE_BLOCKS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3)}
STAGE_WIDTHS = (64, 128, 256, 512)


def conv(x, filters, kernel, stride, name):
    """Bias-free convolution. Strided ones pad (kernel - 1) // 2 on every side, as the TF/MLPerf reference
    does (`fixed_padding`), instead of Keras "same" (which pads only bottom/right for even inputs)."""
    if stride > 1:
        pad = (kernel - 1) // 2
        x = layers.ZeroPadding2D(pad, name=f"{name}_pad")(x) if pad else x
        padding = "valid"
    else:
        padding = "same"
    return layers.Conv2D(
        filters,
        kernel,
        strides=stride,
        padding=padding,
        use_bias=False,
        kernel_initializer=CONV_INITIALIZER,
        name=name,
    )(x)


def norm(x, name, zero_gamma=False, fused=True):
    """Batch norm (momentum 0.9, epsilon 1e-5); gamma starts at 0 when `zero_gamma`."""
    return batch_norm_layer(fused)(
        momentum=BN_MOMENTUM,
        epsilon=BN_EPSILON,
        gamma_initializer="zeros" if zero_gamma else "ones",
        name=name,
    )(x)


def basic_block(x, filters, stride, name, zero_init_residual, fused):
    """Two 3x3 convolutions; output `filters` channels, spatial size divided by `stride`."""
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = norm(conv(x, filters, 1, stride, f"{name}_proj"), f"{name}_proj_bn", fused=fused)
    y = conv(x, filters, 3, stride, f"{name}_conv1")
    y = layers.ReLU(name=f"{name}_relu1")(norm(y, f"{name}_bn1", fused=fused))
    y = conv(y, filters, 3, 1, f"{name}_conv2")
    y = norm(y, f"{name}_bn2", zero_gamma=zero_init_residual, fused=fused)
    return layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([y, shortcut]))


def bottleneck_block(x, filters, stride, name, zero_init_residual, fused):
    """1x1 (`filters`) -> 3x3 (`filters`, stride `stride`: v1.5) -> 1x1 (4 * `filters`) channels."""
    shortcut = x
    if stride != 1 or x.shape[-1] != 4 * filters:
        shortcut = norm(conv(x, 4 * filters, 1, stride, f"{name}_proj"), f"{name}_proj_bn", fused=fused)
    y = conv(x, filters, 1, 1, f"{name}_conv1")
    y = layers.ReLU(name=f"{name}_relu1")(norm(y, f"{name}_bn1", fused=fused))
    y = conv(y, filters, 3, stride, f"{name}_conv2")
    y = layers.ReLU(name=f"{name}_relu2")(norm(y, f"{name}_bn2", fused=fused))
    y = conv(y, 4 * filters, 1, 1, f"{name}_conv3")
    y = norm(y, f"{name}_bn3", zero_gamma=zero_init_residual, fused=fused)
    return layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([y, shortcut]))


def resnet(
    depth, num_classes=1000, input_shape=(224, 224, 3), zero_init_residual=True, fused_batch_norm=True
):
    """Builds ResNet-`depth` (18, 34 or 50) for channels-last images.

    Args:
        depth: 18 or 34 (basic blocks) or 50 (bottleneck blocks, v1.5).
        num_classes: width of the logits.
        input_shape: (H, W, C) of the float input images; 224x224x3 for ImageNet.
        zero_init_residual: start the last batch-norm scale (gamma) of every residual block at 0, so each
            block begins as the identity (Goyal et al. 2017, section 5.1; the MLPerf reference does the
            same). False gives gamma = 1 everywhere, as in He et al. 2016.
        fused_batch_norm: use `FusedBatchNormalization` (same variables, faster on CPU) instead of
            `keras.layers.BatchNormalization`.

    Returns:
        A `keras.Model` from float (B, H, W, C) images to float32 logits (B, num_classes), whatever the
        dtype policy.

    Raises:
        ValueError: `depth` not in `STAGE_BLOCKS`.
    """
    if depth not in STAGE_BLOCKS:
        raise ValueError(f"ResNet depth must be one of {sorted(STAGE_BLOCKS)}, got {depth!r}.")
    block = bottleneck_block if depth >= 50 else basic_block
    inputs = keras.Input(shape=input_shape, name="images")
    x = conv(inputs, 64, 7, 2, "conv1")
    x = layers.ReLU(name="conv1_relu")(norm(x, "conv1_bn", fused=fused_batch_norm))
    x = layers.MaxPooling2D(3, strides=2, padding="same", name="pool1")(x)
    for stage, (blocks, width) in enumerate(zip(STAGE_BLOCKS[depth], STAGE_WIDTHS)):
        for i in range(blocks):
            # Stage 1 follows the stride-2 max pool, so only stages 2-4 down-sample (first block).
            stride = 2 if i == 0 and stage > 0 else 1
            x = block(
                x, width, stride, f"stage{stage + 1}_block{i + 1}", zero_init_residual, fused_batch_norm
            )
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    # Logits in float32 whatever the precision policy, so the softmax cross-entropy is computed in float32.
    outputs = layers.Dense(
        num_classes, kernel_initializer=LOGITS_INITIALIZER, dtype="float32", name="logits"
    )(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}")


def resnet18(num_classes=1000, input_shape=(224, 224, 3), **kwargs):
    """ResNet-18: basic blocks 2-2-2-2, 11,689,512 trainable parameters with 1,000 classes."""
    return resnet(18, num_classes, input_shape, **kwargs)


def resnet34(num_classes=1000, input_shape=(224, 224, 3), **kwargs):
    """ResNet-34: basic blocks 3-4-6-3, 21,797,672 trainable parameters with 1,000 classes."""
    return resnet(34, num_classes, input_shape, **kwargs)


def resnet50(num_classes=1000, input_shape=(224, 224, 3), **kwargs):
    """ResNet-50 v1.5: bottleneck blocks 3-4-6-3, 25,557,032 trainable parameters with 1,000 classes."""
    return resnet(50, num_classes, input_shape, **kwargs)
