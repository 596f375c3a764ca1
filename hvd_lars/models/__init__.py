"""Model registry: `MODELS` maps a `--model` name to `f(num_classes, input_shape, **options) -> keras.Model`.

Every model is channels-last and returns float32 logits (B, num_classes), also under `mixed_bfloat16`.
"""

import hvd_lars

hvd_lars.require(__name__, ("tensorflow",))  # one line where TensorFlow cannot run

from hvd_lars.models.alexnet import alexnet, alexnet_bn
from hvd_lars.models.cifar_resnet import resnet20
from hvd_lars.models.resnet import resnet18, resnet34, resnet50
from hvd_lars.models.small import small_cnn, small_cnn_nobn

MODELS = {
    "alexnet": alexnet,
    "alexnet_bn": alexnet_bn,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet20": resnet20,
    "small_cnn": small_cnn,
    "small_cnn_nobn": small_cnn_nobn,
}


def get_model(name, num_classes=1000, input_shape=None, **options):
    """Builds model `name` with float32 logits of shape (B, num_classes).

    Args:
        name: a key of `MODELS`.
        num_classes: width of the logits.
        input_shape: (H, W, C) of the input images; None takes the model's nominal shape (227x227x3 for
            the AlexNets, 224x224x3 for the ImageNet ResNets, 32x32x3 for `resnet20`, 28x28x1 for
            `small_cnn` and `small_cnn_nobn`).
        **options: model-specific keyword arguments (e.g. `zero_init_residual`, `fused_batch_norm` for
            the ResNets).

    Raises:
        ValueError: unknown name, listing the valid ones; an input shape the model cannot take.
    """
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.")
    if input_shape is not None:
        options["input_shape"] = tuple(input_shape)
    return MODELS[name](num_classes=num_classes, **options)
