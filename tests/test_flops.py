"""hvd_lars.models.flops: multiply-adds from a model's layers, against hand counts (against published ones:
ResNet-50's and AlexNet's, in tests/test_models.py beside their parameter counts, on the same models)."""

import keras
import pytest

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
