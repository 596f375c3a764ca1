"""Small convolutional network for 28x28 / 32x32 images (the Fashion-MNIST demo).

Four 3x3 convolutions (16-16-32-32 channels), each followed by batch normalisation and ReLU, max-pooling
after every second one, then dense 128 and the logits: about 0.22M parameters for 28x28x1 input.
"""

import keras
from keras import layers

# Batch-norm momentum 0.9 as in the released AlexNet-BN prototxt: with only ~15 updates per epoch at
# batch 4K, Keras's default 0.99 leaves the running statistics near their initial values
# (0.99 ** 70 ~ 0.5) and evaluation collapses (docs/design.md, "Batch-norm momentum").
BN_MOMENTUM = 0.9


def small_cnn(num_classes=10, input_shape=(28, 28, 1), channels=(16, 16, 32, 32), dense_units=128):
    """The demo CNN. Channels-last; He-normal kernels (He et al. 2015) for the ReLU layers.

    Returns a `keras.Model` mapping float (B, H, W, C) images to float32 logits (B, num_classes).
    """
    inputs = keras.Input(shape=input_shape, name="images")
    x = inputs
    for i, filters in enumerate(channels):
        x = layers.Conv2D(
            filters, 3, padding="same", use_bias=False, kernel_initializer="he_normal", name=f"conv{i + 1}"
        )(x)
        x = layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"conv{i + 1}_bn")(x)
        x = layers.ReLU(name=f"conv{i + 1}_relu")(x)
        if i % 2 == 1:
            x = layers.MaxPooling2D(2, name=f"pool{i // 2 + 1}")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(dense_units, kernel_initializer="he_normal", name="fc1")(x)
    x = layers.BatchNormalization(momentum=BN_MOMENTUM, name="fc1_bn")(x)
    x = layers.ReLU(name="fc1_relu")(x)
    # Logits in float32 whatever the precision policy, so the softmax cross-entropy is computed in float32.
    outputs = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="small_cnn")
