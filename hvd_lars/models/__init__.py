"""Model registry: `MODELS` maps a `--model` name to `f(num_classes, input_shape) -> keras.Model`."""

from hvd_lars.models.small import small_cnn

MODELS = {"small_cnn": small_cnn}


def get_model(name, num_classes=1000, input_shape=(224, 224, 3)):
    """Builds model `name` with float32 logits of shape (B, num_classes).

    Raises:
        ValueError: unknown name, listing the valid ones.
    """
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.")
    return MODELS[name](num_classes=num_classes, input_shape=tuple(input_shape))
