"""hvd_lars.models.flops: multiply-adds from a model's layers, against hand counts and published ones."""

import keras
import pytest

from hvd_lars.models import get_model
from hvd_lars.models.flops import forward_multiply_adds, training_flops_per_image

pytestmark = pytest.mark.unit


def test_multiply_adds_of_hand_counted_layers_and_refusals():
    inputs = keras.Input((10, 10, 4))
    x = keras.layers.Conv2D(6, 3, padding="same", groups=2, name="grouped")(inputs)  # 10x10x6, kernel 3x3x2
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, name="depthwise")(x)  # 8x8x12, kernel 3x3
    x = keras.layers.Dense(5, name="dense")(keras.layers.GlobalAveragePooling2D()(x))
    counts = forward_multiply_adds(keras.Model(inputs, x))
    assert counts == {"grouped": 100 * 6 * 9 * 2, "depthwise": 64 * 12 * 9, "dense": 12 * 5}
    assert training_flops_per_image(keras.Model(inputs, x)) == 6.0 * (10800 + 6912 + 60)
    model = keras.Model(inputs, keras.layers.Conv2DTranspose(4, 3, name="up")(inputs))
    with pytest.raises(ValueError, match="'up' \\(Conv2DTranspose\\)"):
        forward_multiply_adds(model)


def test_resnet50_v1_5_multiply_adds_against_published_counts():
    # torchvision's ResNet-50 (v1.5): "GFLOPS 4.09" (multiply-adds) at 224x224 in its model table.
    ours = sum(forward_multiply_adds(get_model("resnet50")).values())
    assert ours == pytest.approx(4.09e9, rel=0.005)
    # He et al. 2016, table 1: ResNet-50 (v1, stride on the first 1x1) "3.8 x 10^9 FLOPs" (multiply-adds).
    v1 = sum(forward_multiply_adds(keras.applications.ResNet50(weights=None)).values())
    assert v1 == pytest.approx(3.8e9, rel=0.02) and v1 < ours


def test_alexnet_multiply_adds_against_published_counts():
    # Caffe's two-tower bvlc_alexnet (conv2, conv4, conv5 grouped in 2). Sze et al., "Efficient Processing of
    # Deep Neural Networks", Proc. IEEE 2017, table III: 666M multiply-adds in the convolutions, 58.6M in fc.
    x = inputs = keras.Input((227, 227, 3))
    for filters, kernel, strides, groups, pool in [
        (96, 11, 4, 1, True), (256, 5, 1, 2, True), (384, 3, 1, 1, False), (384, 3, 1, 2, False),
        (256, 3, 1, 2, True),
    ]:  # fmt: skip
        padding = "valid" if kernel == 11 else "same"
        x = keras.layers.Conv2D(filters, kernel, strides=strides, padding=padding, groups=groups)(x)
        x = keras.layers.MaxPooling2D(3, 2)(x) if pool else x
    x = keras.layers.Flatten()(x)
    for units in (4096, 4096, 1000):
        x = keras.layers.Dense(units)(x)
    counts = list(forward_multiply_adds(keras.Model(inputs, x)).values())
    assert sum(counts[:5]) == pytest.approx(666e6, rel=0.005)
    assert sum(counts[5:]) == pytest.approx(58.6e6, rel=0.005)
    # hvd_lars's AlexNet-BN is one tower: conv2, conv4 and conv5 see all input channels, twice the work.
    grouped = dict(zip(["conv1", "conv2", "conv3", "conv4", "conv5", "fc6", "fc7", "logits"], counts))
    want = {k: v * (2 if k in ("conv2", "conv4", "conv5") else 1) for k, v in grouped.items()}
    assert forward_multiply_adds(get_model("alexnet_bn")) == want
