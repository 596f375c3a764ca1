"""ImageNet ResNets: ResNet-18 and -34 (basic blocks) and ResNet-50 v1.5 (bottleneck blocks).

He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition" (CVPR 2016), table 1, with the v1.5
change of torchvision and the TensorFlow/MLPerf reference (the stride of a down-sampling bottleneck on its
3x3 convolution). Projection shortcuts (1x1 convolution + batch norm) where the shape changes; no
convolution biases. Trainable parameters with 1,000 classes: ResNet-18 11,689,512, ResNet-34 21,797,672,
ResNet-50 25,557,032 (torchvision's and MLPerf's counts).
"""

import keras
from keras import layers

from hvd_lars.models.batch_norm import FusedBatchNormalization

# Momentum 0.9 (moving = 0.9 * moving + 0.1 * batch) and epsilon 1e-5: the TensorFlow/MLPerf ResNet-50
# reference and torchvision (docs/design.md, "Batch-norm momentum").
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5

# He et al. 2015 ("Delving Deep into Rectifiers", eq. 10): N(0, 2 / fan_in); logits N(0, 0.01^2) with zero
# bias (Goyal et al. 2017, section 5.1; MLPerf).
CONV_INITIALIZER = keras.initializers.VarianceScaling(2.0, "fan_in", "untruncated_normal")
LOGITS_INITIALIZER = keras.initializers.RandomNormal(stddev=0.01)

# Blocks per stage (He et al. 2016, table 1); widths 64-128-256-512 (x4 at a bottleneck's output).
STAGE_BLOCKS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3)}
STAGE_WIDTHS = (64, 128, 256, 512)


def conv(x, filters, kernel, stride, name):
    """Bias-free convolution. Strided ones pad (kernel - 1) // 2 on every side, as the TF/MLPerf reference
    does (`fixed_padding`), instead of Keras "same" (which pads only bottom/right for even inputs)."""
    padding = "same"
    if stride > 1:
        pad = (kernel - 1) // 2
        x = layers.ZeroPadding2D(pad, name=f"{name}_pad")(x) if pad else x
        padding = "valid"
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
    """Batch norm (momentum 0.9, epsilon 1e-5; `FusedBatchNormalization` if `fused`); gamma starts at 0
    when `zero_gamma`."""
    return (FusedBatchNormalization if fused else layers.BatchNormalization)(
        momentum=BN_MOMENTUM,
        epsilon=BN_EPSILON,
        gamma_initializer="zeros" if zero_gamma else "ones",
        name=name,
    )(x)


def _projection(x, filters, stride, name, fused):
    return norm(conv(x, filters, 1, stride, f"{name}_proj"), f"{name}_proj_bn", fused=fused)


def block(x, filters, stride, name, zero_init_residual, fused, bottleneck=False, shortcut=_projection):
    """A basic block (two 3x3 convolutions, `filters` channels out) or a v1.5 bottleneck (1x1, 3x3 with
    the stride, 1x1 to 4 * `filters`); spatial size divided by `stride`. `shortcut(x, channels, stride,
    name, fused)` makes the shortcut where the shape changes (identity elsewhere); the block's last
    gamma starts at 0 when `zero_init_residual`."""
    out = 4 * filters if bottleneck else filters
    changes = stride != 1 or x.shape[-1] != out
    shortcut = shortcut(x, out, stride, name, fused) if changes else x
    # (channels, kernel, stride) of each convolution.
    convs = [(filters, 1, 1), (filters, 3, stride), (out, 1, 1)]
    convs = convs if bottleneck else [(filters, 3, stride), (out, 3, 1)]
    y = x
    for i, (width, kernel, s) in enumerate(convs, start=1):
        last = i == len(convs)
        y = conv(y, width, kernel, s, f"{name}_conv{i}")
        y = norm(y, f"{name}_bn{i}", zero_gamma=last and zero_init_residual, fused=fused)
        y = y if last else layers.ReLU(name=f"{name}_relu{i}")(y)
    return layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([y, shortcut]))


def stages(x, stage_blocks, widths, **block_options):
    """The residual stages: `stage_blocks[k]` blocks of width `widths[k]`; the first block of every stage
    but the first down-samples by 2."""
    for stage, (blocks, width) in enumerate(zip(stage_blocks, widths)):
        for i in range(blocks):
            stride = 2 if i == 0 and stage > 0 else 1
            x = block(x, width, stride, f"stage{stage + 1}_block{i + 1}", **block_options)
    return x


def logits(x, num_classes):
    """Global average pooling, then the logits layer, in float32 whatever the precision policy (so the
    softmax cross-entropy is computed in float32)."""
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    return layers.Dense(num_classes, kernel_initializer=LOGITS_INITIALIZER, dtype="float32", name="logits")(x)


def resnet(
    depth, num_classes=1000, input_shape=(224, 224, 3), zero_init_residual=True, fused_batch_norm=True
):
    """Builds ResNet-`depth` (18, 34 or 50) for channels-last images.

    `zero_init_residual` starts the last batch-norm gamma of every residual block at 0 (Goyal et al. 2017,
    section 5.1; MLPerf; False: gamma 1, as He et al. 2016); `fused_batch_norm` uses
    `FusedBatchNormalization`. Returns a `keras.Model` from float (B, H, W, C) images to float32 logits
    (B, num_classes). Raises ValueError for a depth not in `STAGE_BLOCKS`.
    """
    if depth not in STAGE_BLOCKS:
        raise ValueError(f"ResNet depth must be one of {sorted(STAGE_BLOCKS)}, got {depth!r}.")
    inputs = keras.Input(shape=input_shape, name="images")
    x = conv(inputs, 64, 7, 2, "conv1")
    x = layers.ReLU(name="conv1_relu")(norm(x, "conv1_bn", fused=fused_batch_norm))
    x = layers.MaxPooling2D(3, strides=2, padding="same", name="pool1")(x)
    x = stages(
        x,
        STAGE_BLOCKS[depth],
        STAGE_WIDTHS,
        zero_init_residual=zero_init_residual,
        fused=fused_batch_norm,
        bottleneck=depth >= 50,
    )
    return keras.Model(inputs, logits(x, num_classes), name=f"resnet{depth}")
