"""Looking through optimizer wrappers (LossScaleOptimizer, DistributedOptimizer) and reading their scalars."""

import keras


def innermost_optimizer(optimizer):
    """The optimizer at the bottom of a chain of wrappers (LossScaleOptimizer, DistributedOptimizer): the
    one that holds the learning rate and the update rule."""
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def to_float(value):
    """A Python float from a scalar Keras variable, tensor or number."""
    # Variables through .numpy(): NumPy 2 warns when np.array() converts a Keras variable.
    if isinstance(value, keras.Variable):
        value = value.numpy()
    return float(keras.ops.convert_to_numpy(value))
