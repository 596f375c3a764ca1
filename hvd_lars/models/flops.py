"""Arithmetic of a model, counted from its own layers: multiply-adds per image, and FLOPs of a training step.

Counted as published counts of image classifiers are ("ResNet-50: 4.1 G"): multiply-adds of the forward
pass over convolutions and dense layers, one image (batch norm, activations, pooling and additions left
out); a layer's are prod(kernel shape) x prod(output positions). A training step is about 3 forward
passes (forward, input gradients, weight gradients; Goyal et al. 2017 and MLPerf count the same way) of
2 FLOPs per multiply-add.
"""

import math

import keras

from hvd_lars import keras_internals

# Layers whose arithmetic is counted; any other layer holding a kernel is refused, so nothing is missed.
_COUNTED = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.DepthwiseConv2D,
    keras.layers.Dense,
)


def forward_multiply_adds(model):
    """{layer name: multiply-adds (int)} of one forward pass of one image over the convolutions and dense
    layers of a built `keras.Model`, in layer order. Raises ValueError naming a layer with a kernel of a
    kind not counted here (e.g. Conv2DTranspose, SeparableConv2D, EinsumDense)."""
    counts = {}
    for layer in keras_internals.flatten_layers(model):
        if isinstance(layer, keras.Model):
            continue
        if isinstance(layer, keras.layers.Conv2DTranspose) or not isinstance(layer, _COUNTED):
            if any(hasattr(layer, k) for k in ("kernel", "depthwise_kernel", "pointwise_kernel")):
                raise ValueError(
                    f"forward_multiply_adds: layer {layer.name!r} ({type(layer).__name__}) has a kernel "
                    f"but is not counted; counted kinds: {', '.join(c.__name__ for c in _COUNTED)}."
                )
            continue
        kernel = layer.kernel  # DepthwiseConv2D's too: (kh, kw, C, multiplier)
        positions = math.prod(int(d) for d in layer.output.shape[1:-1])
        counts[layer.name] = math.prod(int(d) for d in kernel.shape) * positions
    return counts


def training_flops_per_image(model):
    """FLOPs of one training step per image (a float): 3 x 2 x `forward_multiply_adds` (which it raises)."""
    return 3.0 * 2.0 * sum(forward_multiply_adds(model).values())
