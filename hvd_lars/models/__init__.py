"""Model registry: `MODELS` maps a `--model` name to `f(num_classes, input_shape, **options) -> keras.Model`.

Every model is channels-last and returns float32 logits (B, num_classes), also under `mixed_bfloat16`.
"""

import functools

from hvd_lars.models.alexnet import alexnet
from hvd_lars.models.cifar_resnet import cifar_resnet
from hvd_lars.models.resnet import resnet
from hvd_lars.models.small import small_cnn

MODELS = {
    "alexnet": alexnet,
    "alexnet_bn": functools.partial(alexnet, batch_norm=True),
    "resnet18": functools.partial(resnet, 18),
    "resnet34": functools.partial(resnet, 34),
    "resnet50": functools.partial(resnet, 50),
    "resnet20": functools.partial(cifar_resnet, 20),
    "small_cnn": small_cnn,
    "small_cnn_nobn": functools.partial(small_cnn, batch_norm=False),
}


def get_model(name, num_classes=1000, input_shape=None, **options):
    """Builds model `name` (a key of `MODELS`) with float32 logits of shape (B, num_classes).

    `input_shape`: (H, W, C) of the input images; None takes the model's nominal shape (227x227x3 for the
    AlexNets, 224x224x3 for the ImageNet ResNets, 32x32x3 for `resnet20`, 28x28x1 for the small CNNs).
    `**options`: the model's own keyword arguments (e.g. `zero_init_residual`, `fused_batch_norm`).

    Raises:
        ValueError: unknown name, listing the valid ones; an input shape the model cannot take.
    """
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.")
    if input_shape is not None:
        options["input_shape"] = tuple(input_shape)
    return MODELS[name](num_classes=num_classes, **options)
