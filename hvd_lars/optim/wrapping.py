"""Looking through optimizer wrappers (LossScaleOptimizer, DistributedOptimizer) and reading their scalars."""

import keras

from hvd_lars import keras_internals


def innermost_optimizer(optimizer):
    """The optimizer at the bottom of a chain of wrappers (LossScaleOptimizer, DistributedOptimizer): the
    one that holds the learning rate and the update rule."""
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def held_rate(optimizer):
    """What the innermost optimizer of `optimizer` holds as its rate: a `keras.Variable` when it was given
    a float (a callback can set it), else its schedule or callable (`keras_internals.rate_object`)."""
    return keras_internals.rate_object(innermost_optimizer(optimizer))


def to_float(value):
    """A Python float from a scalar Keras variable, tensor or number."""
    # Variables through .numpy(): NumPy 2 warns when np.array() converts a Keras variable.
    if isinstance(value, keras.Variable):
        value = value.numpy()
    return float(keras.ops.convert_to_numpy(value))
