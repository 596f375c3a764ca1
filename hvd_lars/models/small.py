"""Small convolutional networks for 28x28 / 32x32 images (the Fashion-MNIST demo and large-batch study).

`small_cnn`: four 3x3 convolutions (16-16-32-32 channels), each followed by batch normalisation and ReLU,
max-pooling after every second one, then dense 128 (batch norm, ReLU) and the logits: about 0.22M
parameters for 28x28x1 input. `small_cnn_nobn`: the same layers without the normalisation.
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
    return _small_cnn(num_classes, input_shape, channels, dense_units, batch_norm=True)


def small_cnn_nobn(num_classes=10, input_shape=(28, 28, 1), channels=(16, 16, 32, 32), dense_units=128):
    """`small_cnn` without batch normalisation: the same convolutions, pooling and dense layers, with the
    ReLU directly after each convolution and after the dense layer.

    Each convolution gets a bias (zero-initialised) in place of batch norm's shift beta; batch norm's scale
    gamma, its moving statistics and nothing else go. For 28x28x1 input that is 896 fewer numbers than
    `small_cnn` less the 96 convolution biases (0.217M parameters).

    Initialisation: He-normal kernels (variance 2 / fan_in; He et al. 2015, "Delving Deep into
    Rectifiers", eq. 10) for every layer followed by a ReLU. A ReLU zeroes half of a symmetric input, so a
    kernel of variance 2 / fan_in keeps the second moment of each layer's pre-activations equal to the
    previous layer's: without normalisation the signal neither shrinks nor grows through the 5 ReLU
    layers, and the first updates at batch 512 already see gradients of the scale of the later ones.
    Keras's default (Glorot uniform, variance 2 / (fan_in + fan_out) = 1 / fan_in here) halves that
    moment at every ReLU layer, a factor 32 at the logits. The logits layer keeps Glorot uniform (no ReLU
    follows it).

    Returns a `keras.Model` mapping float (B, H, W, C) images to float32 logits (B, num_classes).
    """
    return _small_cnn(num_classes, input_shape, channels, dense_units, batch_norm=False)


def _small_cnn(num_classes, input_shape, channels, dense_units, batch_norm):
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
