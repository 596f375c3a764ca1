"""AlexNet (one tower, with local response normalisation) and AlexNet-BN, the network of You et al. 2018.

AlexNet: Krizhevsky, Sutskever, Hinton, NIPS 2012, laid out as Caffe's `bvlc_alexnet` but as one tower
(no grouped convolutions): 62,378,344 parameters with 1,000 classes. AlexNet-BN: the released LARS
solver's (Intel Caffe 1.0.7, `models/intel_optimized_models/multinode/alexnet_bn_64nodes/
train_val2.prototxt`): no LRN, a batch norm without scale/shift after pool1, pool2, conv3 and conv4, its
bias initialisers; one tower as well (the prototxt groups conv2, conv4 and conv5 in 2).
"""

import keras
import tensorflow as tf
from keras import layers

# Caffe's LRN across channels: b = a / (k + alpha / n * sum_{n neighbours} a^2) ^ beta with n = 5,
# alpha = 1e-4, beta = 0.75, k = 1 (bvlc_alexnet's norm1/norm2). Krizhevsky et al. wrote k = 2 and alpha
# without the 1 / n; the Caffe form is the one the paper's Caffe runs used.
LRN_SIZE = 5
LRN_ALPHA = 1e-4
LRN_BETA = 0.75
LRN_BIAS = 1.0

# BN without scale/shift, momentum 0.9 (moving = 0.9 * moving + 0.1 * batch), epsilon 1e-4: the released
# AlexNet-BN's BatchNorm layers (Intel Caffe 1.0.7, models/intel_optimized_models/multinode/
# alexnet_bn_64nodes/train_val2.prototxt: moving_average_fraction 0.9, eps 0.0001).
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-4

# Initialisers: Gaussian weights (std 0.01; 0.005 for fc6 and fc7) in both. Biases: bvlc_alexnet's
# (models/bvlc_alexnet/train_val.prototxt) for AlexNet: 0 for conv1, conv3 and fc8, 0.1 elsewhere; the
# released AlexNet-BN's (train_val2.prototxt above): 0.01 for every convolution and fc8, 0.1 for fc6, fc7.
CONV_SPECS = (  # name, filters, kernel, stride
    ("conv1", 96, 11, 4),
    ("conv2", 256, 5, 1),
    ("conv3", 384, 3, 1),
    ("conv4", 384, 3, 1),
    ("conv5", 256, 3, 1),
)
BIAS_INIT = {
    "alexnet": {"conv1": 0.0, "conv2": 0.1, "conv3": 0.0, "conv4": 0.1, "conv5": 0.1, "fc6": 0.1, "fc7": 0.1,
                "logits": 0.0},
    "alexnet_bn": {"conv1": 0.01, "conv2": 0.01, "conv3": 0.01, "conv4": 0.01, "conv5": 0.01, "fc6": 0.1,
                   "fc7": 0.1, "logits": 0.01},
}  # fmt: skip
FC_STD = {"fc6": 0.005, "fc7": 0.005, "logits": 0.01}
DROPOUT = 0.5


@keras.saving.register_keras_serializable(package="hvd_lars")
class LocalResponseNormalization(layers.Layer):
    """Caffe's across-channel LRN on channels-last (B, H, W, C) input; output has the input's shape and dtype.

    y[..., c] = x[..., c] / (bias + alpha / size * sum_{|c' - c| <= size // 2} x[..., c']^2) ^ beta,
    computed in float32 (also under `mixed_bfloat16`) by `tf.nn.local_response_normalization`.
    """

    def __init__(self, size=LRN_SIZE, alpha=LRN_ALPHA, beta=LRN_BETA, bias=LRN_BIAS, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(size, int) or size < 1 or size % 2 == 0:
            raise ValueError(f"LRN size must be an odd integer >= 1, got {size!r}.")
        self.size, self.alpha, self.beta, self.bias = size, alpha, beta, bias

    def call(self, inputs):
        y = tf.nn.local_response_normalization(
            tf.cast(inputs, tf.float32),
            depth_radius=self.size // 2,
            bias=self.bias,
            alpha=self.alpha / self.size,
            beta=self.beta,
        )
        return tf.cast(y, inputs.dtype)

    def get_config(self):
        return {
            **super().get_config(),
            "size": self.size,
            "alpha": self.alpha,
            "beta": self.beta,
            "bias": self.bias,
        }


def alexnet(num_classes=1000, input_shape=(227, 227, 3), batch_norm=False):
    """One-tower AlexNet with LRN after conv1 and conv2, or (`batch_norm`) AlexNet-BN of You et al. 2018:
    conv -> ReLU -> [max pool] -> BN (no scale/shift) after conv1-conv4, no LRN; then fc6 4096, fc7 4096
    (each with dropout 0.5) and the logits (fc8).

    Returns a `keras.Model` (named "alexnet" or "alexnet_bn") from float (B, H, W, C) images (227x227x3
    nominal) to float32 logits (B, num_classes). Raises ValueError for images smaller than 67x67.
    """
    name = "alexnet_bn" if batch_norm else "alexnet"
    # conv1 (11x11, stride 4, no padding) and three 3x3 stride-2 max pools: 227 -> 55 -> 27 -> 13 -> 6.
    size = min(input_shape[0], input_shape[1])
    for kernel, stride in ((11, 4), (3, 2), (3, 2), (3, 2)):
        size = (size - kernel) // stride + 1
    if size < 1:
        raise ValueError(
            f"{name} needs images of at least 67x67 pixels (227x227 nominal), got {tuple(input_shape)!r}."
        )
    inputs = keras.Input(shape=input_shape, name="images")
    x = inputs
    biases = BIAS_INIT[name]
    for conv_name, filters, kernel, stride in CONV_SPECS:
        x = layers.Conv2D(
            filters,
            kernel,
            strides=stride,
            padding="valid" if conv_name == "conv1" else "same",
            kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
            bias_initializer=keras.initializers.Constant(biases[conv_name]),
            name=conv_name,
        )(x)
        x = layers.ReLU(name=f"{conv_name}_relu")(x)
        if not batch_norm and conv_name in ("conv1", "conv2"):
            x = LocalResponseNormalization(name=f"{conv_name}_lrn")(x)
        if conv_name in ("conv1", "conv2", "conv5"):
            # Caffe rounds pooled sizes up, Keras "valid" down; they agree at 227x227 (55, 27, 13 are odd).
            x = layers.MaxPooling2D(3, strides=2, name=f"{conv_name}_pool")(x)
        if batch_norm and conv_name != "conv5":
            x = layers.BatchNormalization(
                momentum=BN_MOMENTUM, epsilon=BN_EPSILON, center=False, scale=False, name=f"{conv_name}_bn"
            )(x)
    x = layers.Flatten(name="flatten")(x)
    for fc_name in ("fc6", "fc7", "logits"):
        x = layers.Dense(
            num_classes if fc_name == "logits" else 4096,
            kernel_initializer=keras.initializers.RandomNormal(stddev=FC_STD[fc_name]),
            bias_initializer=keras.initializers.Constant(biases[fc_name]),
            # Logits in float32 whatever the precision policy: the cross-entropy is computed in float32.
            dtype="float32" if fc_name == "logits" else None,
            name=fc_name,
        )(x)
        if fc_name != "logits":
            x = layers.ReLU(name=f"{fc_name}_relu")(x)
            x = layers.Dropout(DROPOUT, name=f"{fc_name}_dropout")(x)
    return keras.Model(inputs, x, name=name)
