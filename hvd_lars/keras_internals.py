"""Every private Keras 3 name hvd_lars reads or calls, behind one door: one function for each thing Keras
offers no public way to do, with what it relies on. Nothing else in the package touches a private Keras
name (tests/test_keras_internals.py holds that inventory), except the hooks a subclass overrides where it
is (`OVERRIDDEN_HOOKS`), which it may call through `super()`.

Checked against Keras 3.12.4, 3.13.2, 3.14.1 and 3.15.1 with TensorFlow 2.21
(`install/check_keras_versions.sh`, results/keras_versions.md), the range setup.cfg declares.
"""

# Optimizer methods Keras calls by name, which `hvd_lars.optim.lars.LARS` overrides.
OVERRIDDEN_HOOKS = {
    # `Optimizer.apply` calls `_backend_update_step(grads, variables, learning_rate)` once per applied
    # update, with the rate of that update; LARS records the rate for its momentum correction.
    "_backend_update_step": "keras.optimizers.Optimizer",
    # `Optimizer.apply` reads the update's rate through `_get_current_learning_rate()`; LARS evaluates a
    # schedule at its applied-update count rather than Keras's micro-batch count.
    "_get_current_learning_rate": "keras.optimizers.Optimizer",
}

# The private names the functions below use, with the class that defines them (the inventory test checks
# each is still there in the installed Keras).
PRIVATE_NAMES = {
    "_iterations": "keras.optimizers.Optimizer",
    "_trainable_variables": "keras.optimizers.Optimizer",
    "_variables": "keras.optimizers.Optimizer",
    "_get_variable_index": "keras.optimizers.Optimizer",
    "_use_weight_decay": "keras.optimizers.Optimizer",
    "_learning_rate": "keras.optimizers.Optimizer",
    "_tracker": "keras.optimizers.Optimizer",
    "_track_variable": "keras.optimizers.Optimizer",
    "_flatten_layers": "keras.Model",
    "_symbolic_build": "keras.Model",
    "_copy_trackable_to_cpu": "keras.Variable",
}


def own_iterations(optimizer):
    """The update counter `optimizer` keeps itself (an assignable `keras.Variable`): where a wrapper
    redefines the public `iterations` as its held optimizer's, the wrapper's own count. Relies on:
    `BaseOptimizer.__init__` creating `self._iterations`, the variable `iterations` returns."""
    return optimizer._iterations


def built_variables(optimizer):
    """The trainable variables `optimizer` was built with, in the order of its slots. Relies on:
    `BaseOptimizer.build` storing `var_list` as `self._trainable_variables`."""
    return optimizer._trainable_variables


def own_variables(optimizer):
    """The variables `optimizer` created itself (counter, rate, slots), without a held optimizer's. Relies
    on: `BaseOptimizer` tracking what `add_variable` makes in `self._variables`."""
    return optimizer._variables


def variable_index(optimizer, variable):
    """The slot index of `variable` (a Keras variable or the backend variable it wraps) in `optimizer`.
    Relies on: `BaseOptimizer._get_variable_index`, keyed by the variable's `_var_key`."""
    return optimizer._get_variable_index(variable)


def uses_weight_decay(optimizer, variable):
    """Whether Keras's own `exclude_from_weight_decay(var_list=..., var_names=...)` leaves `variable` in.
    Relies on: `BaseOptimizer._use_weight_decay(variable)`."""
    return optimizer._use_weight_decay(variable)


def rate_object(optimizer):
    """What `optimizer` was given as its rate: a `LearningRateSchedule`, a callable or the rate variable
    (the public `learning_rate` evaluates a schedule). Relies on: `BaseOptimizer.__init__` storing it as
    `self._learning_rate`."""
    return optimizer._learning_rate


def adopt_rate_variable(optimizer, variable):
    """Makes `variable` (a `keras.Variable`) `optimizer`'s rate, tracked once where a float rate's own
    variable would be, so the optimizer saves and loads like one built with a float; call from `__init__`,
    after the base class's. Relies on: `self._learning_rate` and the `_tracker` store "variables"
    (`_track_variable` appends to it; skipped where tracking was off when the variable was made)."""
    optimizer._learning_rate = variable
    if not optimizer._tracker.is_in_store("variables", variable):
        optimizer._track_variable(variable)


def flatten_layers(model):
    """`model` and every layer nested in it, once each (`model.layers` lists the top level only). Relies
    on: `Layer._flatten_layers(include_self=True, recursive=True)`."""
    return model._flatten_layers()


def symbolic_build(model, element_spec):
    """Builds `model`'s layers and compiled metrics from the shapes of a batch (`element_spec`), as `fit`
    does in its first step, so its variables exist before any step runs. Relies on:
    `Trainer._symbolic_build(data_batch=...)`."""
    model._symbolic_build(data_batch=element_spec)


def repair_async_checkpoint_copy():
    """Lets TensorFlow's asynchronous checkpoints save Keras 3 variables more than once per process.

    TF's async writer copies each variable to the host through its `_copy_trackable_to_cpu`, inside a
    `tf.function` from the second save on, where Keras 3.15's `Variable` making a new `tf.Variable` on
    every call raises "tf.function only supports singleton tf.Variables created on the first call". Here
    the Keras variable maps to the host copy of the `tf.Variable` it wraps (the same serialized tensor).
    Idempotent; only this one method is replaced.

    Relies on: `keras.src.backend.tensorflow.core.Variable` (what `keras.Variable` is under TensorFlow),
    its `value` (the wrapped `tf.Variable`) and TF's `Trackable._copy_trackable_to_cpu(object_map)`.
    """
    from keras.src.backend.tensorflow import core

    if getattr(core.Variable._copy_trackable_to_cpu, "_hvd_lars_repaired", False):
        return

    def _copy_trackable_to_cpu(self, object_map):
        self.value._copy_trackable_to_cpu(object_map)
        object_map[self] = object_map[self.value]

    _copy_trackable_to_cpu._hvd_lars_repaired = True
    core.Variable._copy_trackable_to_cpu = _copy_trackable_to_cpu
