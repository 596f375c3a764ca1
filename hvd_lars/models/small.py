"""Small convolutional networks for 28x28 / 32x32 images (the Fashion-MNIST demo and large-batch study).

`small_cnn`: four 3x3 convolutions (16-16-32-32 channels), each followed by batch normalisation and ReLU,
max-pooling after every second one, then dense 128 (batch norm, ReLU) and the logits: about 0.22M
parameters for 28x28x1 input. `small_cnn_nobn`: the same without the normalisation, each convolution
with a (zero-initialised) bias in place of batch norm's shift.
"""

import keras
from keras import layers

# Batch-norm momentum 0.9 as in the released AlexNet-BN prototxt (docs/design.md, "Batch-norm momentum").
BN_MOMENTUM = 0.9


def small_cnn(
    num_classes=10, input_shape=(28, 28, 1), channels=(16, 16, 32, 32), dense_units=128, batch_norm=True
):
    """The demo CNN, channels-last, with (`batch_norm`) or without batch normalisation. He-normal kernels
    (variance 2 / fan_in, He et al. 2015, eq. 10) for every layer a ReLU follows, Glorot for the logits.

    Returns a `keras.Model` mapping float (B, H, W, C) images to float32 logits (B, num_classes).
    """
    inputs = keras.Input(shape=input_shape, name="images")
    x = inputs
    for i, filters in enumerate(channels):
        name = f"conv{i + 1}"
        # With batch norm a convolution's bias would be cancelled by the mean subtraction (beta shifts).
        x = layers.Conv2D(
            filters, 3, padding="same", use_bias=not batch_norm, kernel_initializer="he_normal", name=name
        )(x)
        if batch_norm:
            x = layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"{name}_bn")(x)
        x = layers.ReLU(name=f"{name}_relu")(x)
        if i % 2 == 1:
            x = layers.MaxPooling2D(2, name=f"pool{i // 2 + 1}")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(dense_units, kernel_initializer="he_normal", name="fc1")(x)
    if batch_norm:
        x = layers.BatchNormalization(momentum=BN_MOMENTUM, name="fc1_bn")(x)
    x = layers.ReLU(name="fc1_relu")(x)
    # Logits in float32 whatever the precision policy, so the softmax cross-entropy is computed in float32.
    outputs = layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name="small_cnn" if batch_norm else "small_cnn_nobn")
