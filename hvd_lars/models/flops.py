"""Arithmetic of a model, counted from its own layers: multiply-adds per image, and FLOPs of a training step.

Published counts of image classifiers ("ResNet-50: 4.1 G", "AlexNet: 0.72 G") are multiply-adds of the
forward pass over the convolutions and fully connected layers, one image at the nominal size; batch norm,
activations, pooling and residual additions (a few percent of the arithmetic, all memory-bound) are left
out. `forward_multiply_adds` counts the same way, so its totals compare with those figures:

    multiply-adds of a layer = prod(kernel shape) x prod(output positions)

(a Conv2D kernel (kh, kw, C_in / groups, C_out) applied at every output pixel; a Dense kernel (C_in, C_out)
once per example; a DepthwiseConv2D kernel (kh, kw, C, multiplier) at every output pixel).

A FLOP is one multiplication or one addition, so a multiply-add is 2 FLOPs, and a training step costs about
3 forward passes: the forward pass, then for every layer the gradient with respect to its input and the
gradient with respect to its weights, each as many multiply-adds as the forward pass (Goyal et al. 2017 and
MLPerf count training the same way). `training_flops_per_image` = 3 x 2 x multiply-adds; it ignores that the
first layer needs no input gradient (for ResNet-50, conv1 is 2.9% of the forward pass).
"""

import math

import keras

# Layers whose arithmetic is counted; any other layer holding a kernel is refused, so nothing is missed.
_COUNTED = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.DepthwiseConv2D,
    keras.layers.Dense,
)


def _leaf_layers(model):
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            yield from _leaf_layers(layer)
        else:
            yield layer


def forward_multiply_adds(model):
    """Multiply-adds of one forward pass of one image, per counted layer.

    Args:
        model: a built functional or Sequential `keras.Model` (input shape known).

    Returns:
        dict {layer name: multiply-adds (int)} over the convolutions and dense layers, in layer order.

    Raises:
        ValueError: a layer with a kernel of a kind not counted here (e.g. Conv2DTranspose,
            SeparableConv2D, EinsumDense), naming it.
    """
    counts = {}
    for layer in _leaf_layers(model):
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
    """FLOPs of one training step per image: 3 passes (forward, input gradients, weight gradients) x 2
    FLOPs per multiply-add x `forward_multiply_adds` (module docstring). A float.

    Raises:
        ValueError: as `forward_multiply_adds`.
    """
    return 3.0 * 2.0 * sum(forward_multiply_adds(model).values())
