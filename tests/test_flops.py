"""hvd_lars.models.flops: multiply-adds from a model's layers, against hand counts and published ones."""

import keras
import pytest

from hvd_lars.models import get_model
from hvd_lars.models.flops import forward_multiply_adds, training_flops_per_image


@pytest.mark.unit
def test_hand_counted_layers():
    inputs = keras.Input((10, 10, 4))
    x = keras.layers.Conv2D(6, 3, padding="same", groups=2, name="grouped")(inputs)  # 10x10x6, kernel 3x3x2
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, name="depthwise")(x)  # 8x8x12, kernel 3x3
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(5, name="dense")(x)
    counts = forward_multiply_adds(keras.Model(inputs, x))
    assert counts == {"grouped": 100 * 6 * 9 * 2, "depthwise": 64 * 12 * 9, "dense": 12 * 5}
    assert training_flops_per_image(keras.Model(inputs, x)) == 6.0 * (10800 + 6912 + 60)


@pytest.mark.unit
def test_resnet50_v1_5_against_published_counts():
    # torchvision's ResNet-50 (v1.5, stride on the 3x3): 4.09 G multiply-adds at 224x224 ("GFLOPS 4.09" in
    # its model table, pytorch.org/vision/stable/models/generated/torchvision.models.resnet50.html).
    ours = sum(forward_multiply_adds(get_model("resnet50")).values())
    assert ours == pytest.approx(4.09e9, rel=0.005)
    # He et al. 2016, table 1: ResNet-50 (v1, stride on the first 1x1) "3.8 x 10^9 FLOPs" (multiply-adds).
    v1 = sum(forward_multiply_adds(keras.applications.ResNet50(weights=None)).values())
    assert v1 == pytest.approx(3.8e9, rel=0.02) and v1 < ours


def _two_tower_alexnet():
    # Krizhevsky et al. 2012 as Caffe's bvlc_alexnet: conv2, conv4, conv5 grouped in 2 (227x227 input).
    inputs = keras.Input((227, 227, 3))
    x = keras.layers.Conv2D(96, 11, strides=4)(inputs)
    x = keras.layers.MaxPooling2D(3, 2)(x)
    x = keras.layers.Conv2D(256, 5, padding="same", groups=2)(x)
    x = keras.layers.MaxPooling2D(3, 2)(x)
    x = keras.layers.Conv2D(384, 3, padding="same")(x)
    x = keras.layers.Conv2D(384, 3, padding="same", groups=2)(x)
    x = keras.layers.Conv2D(256, 3, padding="same", groups=2)(x)
    x = keras.layers.Flatten()(keras.layers.MaxPooling2D(3, 2)(x))
    for units in (4096, 4096, 1000):
        x = keras.layers.Dense(units)(x)
    return keras.Model(inputs, x)


@pytest.mark.unit
def test_alexnet_against_published_counts():
    # Sze, Chen, Yang, Emer, "Efficient Processing of Deep Neural Networks: A Tutorial and Survey", Proc.
    # IEEE 105(12), 2017, table III: AlexNet 666M multiply-adds in its convolutions, 58.6M in its fully
    # connected layers, 724M in all.
    counts = list(forward_multiply_adds(_two_tower_alexnet()).values())
    assert sum(counts[:5]) == pytest.approx(666e6, rel=0.005)
    assert sum(counts[5:]) == pytest.approx(58.6e6, rel=0.005)
    # hvd_lars's AlexNet-BN is one tower: conv2, conv4 and conv5 see all input channels, twice the work.
    ours = forward_multiply_adds(get_model("alexnet_bn"))
    grouped = dict(zip(["conv1", "conv2", "conv3", "conv4", "conv5", "fc6", "fc7", "logits"], counts))
    assert ours == {k: v * (2 if k in ("conv2", "conv4", "conv5") else 1) for k, v in grouped.items()}


@pytest.mark.unit
def test_uncounted_kernels_are_refused():
    inputs = keras.Input((8, 8, 3))
    model = keras.Model(inputs, keras.layers.Conv2DTranspose(4, 3, name="up")(inputs))
    with pytest.raises(ValueError, match="'up' \\(Conv2DTranspose\\)"):
        forward_multiply_adds(model)
