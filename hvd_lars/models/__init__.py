"""Model registry: `MODELS` maps a `--model` name to `f(num_classes, input_shape, **options) -> keras.Model`.

Every model is channels-last and returns float32 logits (B, num_classes), also under `mixed_bfloat16`.
"""

import functools

import hvd_lars

hvd_lars.require(__name__)  # one line where TensorFlow cannot run

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
    """Builds model `name` (a key of `MODELS`) with float32 logits of shape (B, num_classes), for images
    of `input_shape` (H, W, C; None: the model's nominal shape), with the model's own `**options` (e.g.
    `zero_init_residual`). Raises ValueError for an unknown name (listing the valid ones) or an input
    shape the model cannot take."""
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.")
    if input_shape is not None:
        options["input_shape"] = tuple(input_shape)
    return MODELS[name](num_classes=num_classes, **options)
