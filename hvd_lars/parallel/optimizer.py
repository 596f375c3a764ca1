"""DistributedOptimizer: a Keras 3 optimizer that averages gradients over Horovod ranks before the
optimizer it holds applies them (held, as Keras's `LossScaleOptimizer` holds its `inner_optimizer`, so any
Keras 3 optimizer keeps whatever it was built with). The collectives are `hvd_lars.parallel.collectives`.
"""

import keras

from hvd_lars import keras_internals
from hvd_lars.arguments import above, check, refuse
from hvd_lars.optim.lars import fused_momentum_step
from hvd_lars.optim.wrapping import innermost_optimizer
from hvd_lars.parallel import collectives
from hvd_lars.parallel.accumulation import accumulate

LossScaleOptimizer = keras.optimizers.LossScaleOptimizer


@keras.saving.register_keras_serializable(package="hvd_lars")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Averages each update's gradients over all ranks, then lets `optimizer` apply them.

    Per update, on every rank: the gradients of `backward_passes_per_step` micro-batches are averaged
    locally (summed with `average_aggregated_gradients=False`, Horovod's default), averaged over ranks and
    handed to `optimizer.apply`, so clipping, weight decay, the update rule and `iterations` see the global
    mean gradient once per update; with world size 1 it is `optimizer`. For float16 loss scaling, wrap the
    scaler or make the wrapper under `mixed_float16` (a `DistributedLossScaleOptimizer`; docs/design.md,
    "Keras's private names, and loss scaling"). Compile with `jit_compile=False` (no Horovod XLA ops).
    On TensorFlow a held `keras.optimizers.SGD` with momentum applies its update in one fused kernel, as
    tf_keras's SGD does, where Keras 3's makes five passes over each variable (the same values, bit for bit).

    Example:

        optimizer = DistributedOptimizer(hvd_lars.LARS(learning_rate=0.1), backward_passes_per_step=2)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", jit_compile=False)

    Args:
        optimizer: any Keras 3 optimizer (not built if it has `gradient_accumulation_steps`).
        backward_passes_per_step: int >= 1; None: the held optimizer's `gradient_accumulation_steps`, or 1.
        compression: "none" or "fp16", or Horovod's `Compression.none` / `.fp16`.
        gradient_reduction: "overlap" or "grouped" (`collectives.allreduce_gradients`).
        name: str; default "distributed_<name of optimizer>".
        average_aggregated_gradients: bool, see above (True here, as Keras's accumulation).
        scale_local_gradients: True: gradients of `register_local_var`'s variables divided by world size.
        op: "average" or "sum", or Horovod's `Average` / `Sum`.
        gradient_predivide_factor: float > 0, Horovod's (ignored with op "sum").
        groups: None, an int k >= 1 (k grouped allreduces of consecutive variables), or lists of
            variables (or paths), each one grouped allreduce, in place of `gradient_reduction`.
        device_dense: "" or a TensorFlow device for the collectives.
        sparse_as_dense, device_sparse, process_set: Horovod's, accepted (sparse gradients are always made
            dense; only the global process set).

    Raises:
        ValueError: an argument out of the ranges above, `optimizer` not a Keras 3 optimizer or already
            distributed, an accumulating optimizer already built or whose accumulation contradicts
            `backward_passes_per_step`; `LossScaleOptimizer(DistributedOptimizer(opt))`.
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        optimizer = kwargs.get("optimizer", optimizer)
        # A loss scaler, or a plain optimizer under mixed_float16 (where compile would wrap the wrapper).
        scales = isinstance(optimizer, LossScaleOptimizer) or (
            not isinstance(optimizer, DistributedOptimizer)
            and isinstance(optimizer, keras.optimizers.Optimizer)
            and keras.config.dtype_policy().name == "mixed_float16"
        )
        if cls is DistributedOptimizer and scales:
            cls = DistributedLossScaleOptimizer
        return super().__new__(cls)

    def __init__(
        self,
        optimizer,
        backward_passes_per_step=None,
        compression="none",
        gradient_reduction="overlap",
        name=None,
        *,
        average_aggregated_gradients=True,
        scale_local_gradients=True,
        sparse_as_dense=False,
        process_set=None,
        op="average",
        gradient_predivide_factor=1.0,
        groups=None,
        device_dense="",
        device_sparse="",
    ):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            refuse("DistributedOptimizer's optimizer", optimizer, "a Keras 3 optimizer")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError(f"{optimizer.name!r} already averages over ranks; wrap the optimizer only once.")
        compression = collectives.compression_name(compression)
        op = collectives.op_name(op)
        if gradient_reduction not in collectives.GRADIENT_REDUCTIONS:
            refuse("gradient_reduction", gradient_reduction, f"one of {collectives.GRADIENT_REDUCTIONS}")
        check("gradient_predivide_factor", gradient_predivide_factor, above(0))
        for arg, value in (
            ("average_aggregated_gradients", average_aggregated_gradients),
            ("scale_local_gradients", scale_local_gradients),
            ("sparse_as_dense", sparse_as_dense),
        ):
            if not isinstance(value, bool):
                refuse(arg, value, "a bool")
        if groups is not None:
            whole = isinstance(groups, int) and not isinstance(groups, bool)
            if not (isinstance(groups, (list, tuple)) or (whole and groups >= 1)):
                refuse("groups", groups, "None, an int >= 1 or a list of lists of variables")
            if gradient_reduction != "overlap":
                refuse("with groups, gradient_reduction", gradient_reduction, "'overlap' (give one of them)")
        if not (process_set is None or getattr(process_set, "process_set_id", None) == 0):
            refuse("process_set", process_set, "the global process set (launch a subset of ranks as a job)")
        name = name or f"distributed_{optimizer.name}"
        if isinstance(self, LossScaleOptimizer) and not isinstance(optimizer, LossScaleOptimizer):
            optimizer = LossScaleOptimizer(optimizer)  # chosen under mixed_float16 (see the class)
        accumulating = innermost_optimizer(optimizer)
        own_steps = accumulating.gradient_accumulation_steps
        steps = (own_steps or 1) if backward_passes_per_step is None else backward_passes_per_step
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            refuse("backward_passes_per_step", steps, "an int >= 1")
        if own_steps and own_steps != steps:
            raise ValueError(
                f"backward_passes_per_step={steps} contradicts the optimizer's gradient_accumulation_steps="
                f"{own_steps}; give one of them."
            )
        if own_steps and accumulating.built:
            raise ValueError(
                f"{accumulating.name!r} is built with gradient_accumulation_steps={own_steps}; wrap it "
                "before it is built (its accumulators would go unused), or give backward_passes_per_step."
            )
        # A placeholder rate: the rate is the held optimizer's (see `learning_rate`); a float here would
        # make a second `learning_rate` variable in `variables`.
        keras.optimizers.Optimizer.__init__(self, learning_rate=_held_optimizers_rate, name=name)
        self.inner_optimizer = optimizer
        self.backward_passes_per_step = steps
        self.compression = compression
        self.gradient_reduction = gradient_reduction
        self.average_aggregated_gradients = average_aggregated_gradients
        self.scale_local_gradients = scale_local_gradients
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.groups = groups if groups is None or isinstance(groups, int) else _group_keys(groups)
        self.device_dense = device_dense
        self._local_keys = set()  # `_variable_key`s of variables whose gradients stay on their rank
        self._local_layers = []  # PartialDistributedOptimizer's layers, resolved at the first step
        if own_steps:
            accumulating.gradient_accumulation_steps = None  # taken over: ranks talk once per update
        on_tensorflow = keras.backend.backend() == "tensorflow"
        if on_tensorflow and type(accumulating) is keras.optimizers.SGD and accumulating.momentum:
            accumulating.update_step = lambda g, v, lr: _fused_sgd_step(accumulating, g, v, lr)

    def build(self, var_list):
        """Creates the gradient accumulators (when accumulating) and builds the held optimizer."""
        if self.built:
            return
        if self.backward_passes_per_step > 1:
            self._accumulated_gradients = [
                self.add_variable_from_reference(v, name="gradient_accumulator") for v in var_list
            ]
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    def apply(self, grads, trainable_variables=None):
        """Accumulates this micro-batch's gradients (a list, None for a variable without one); on the
        update's last micro-batch averages them over micro-batches and ranks and applies them with the
        held optimizer to `trainable_variables` (None: those it was built with)."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else None

        def update(gradients):
            self.inner_optimizer.apply(self._average(gradients, variables), variables)

        if self.backward_passes_per_step == 1:
            update(grads)
        else:
            indices = range(len(grads))
            if variables is not None:
                indices = [keras_internals.variable_index(self, v) for v in variables]
            accumulators = [self._accumulated_gradients[i] for i in indices]
            counter, steps = keras_internals.own_iterations(self), self.backward_passes_per_step
            accumulate(grads, accumulators, counter, steps, self.average_aggregated_gradients, update)
        keras_internals.own_iterations(self).assign_add(1)

    def _average(self, grads, variables=None):
        variables = keras_internals.built_variables(self) if variables is None else variables
        local = self._local_mask(variables)
        how = dict(
            reduction=self.gradient_reduction,
            compression=self.compression,
            op=self.op,
            predivide=self.gradient_predivide_factor,
            groups=self._group_positions(grads, variables),
            device=self.device_dense,
        )
        # Local variables' gradients stay out of the allreduce (None there keeps the positions).
        shared = collectives.allreduce_gradients(
            [None if is_local else g for g, is_local in zip(grads, local)], **how
        )
        scale = collectives.size() if self.scale_local_gradients else 1
        return [
            (g if scale == 1 or g is None else g / scale) if is_local else r
            for g, r, is_local in zip(grads, shared, local)
        ]

    def _group_positions(self, grads, variables):
        """Horovod's `groups` as lists of positions in `grads`, or None."""
        if self.groups is None:
            return None
        if isinstance(self.groups, int):
            # Horovod's split of the present gradients into k near-equal runs (its common.util.split_list).
            present = [i for i, g in enumerate(grads) if g is not None]
            d, r = divmod(len(present), self.groups)
            return [present[i * d + min(i, r) : (i + 1) * d + min(i + 1, r)] for i in range(self.groups)]
        where = {_variable_key(v): i for i, v in enumerate(variables)}
        return [[where[key] for key in group if key in where] for group in self.groups]

    def register_local_var(self, var):
        """Horovod's: keeps the gradient of `var` (a `keras.Variable` or a `tf.Variable`, else ValueError) on
        its rank, divided by the world size when `scale_local_gradients`. Call before the first step."""
        if not (isinstance(var, keras.Variable) or _is_tf_variable(var)):
            refuse("register_local_var's var", var, "a keras.Variable or a tf.Variable")
        self._local_keys.add(_variable_key(var))

    def _local_mask(self, variables):
        keys = set(self._local_keys)
        keys.update(_variable_key(v) for layer in self._local_layers for v in layer.trainable_weights)
        return [_variable_key(v) in keys for v in variables]

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    @property
    def variables(self):
        """This wrapper's own (micro-batch counter, accumulators), then the held optimizer's."""
        return keras_internals.own_variables(self) + self.inner_optimizer.variables

    learning_rate = property(
        lambda self: self.inner_optimizer.learning_rate,
        lambda self, rate: setattr(self.inner_optimizer, "learning_rate", rate),
    )
    iterations = property(lambda self: self.inner_optimizer.iterations, doc="Applied updates.")

    @property
    def loss_scale_factor(self):
        inner = self.__dict__.get("inner_optimizer")
        return None if inner is None else inner.loss_scale_factor

    def __setattr__(self, name, value):
        if name == "loss_scale_factor":
            # To the setter: Keras's tracking `__setattr__` skips assigning the value already read (None).
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        # None, after the base class's first one, is what a LossScaleOptimizer made around this wrapper
        # sets: that nesting would decide on overflow rank by rank (see the class), so it is refused.
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:
            if value is not None:
                raise ValueError("Give loss_scale_factor to the held optimizer, not to DistributedOptimizer.")
        elif value is None:
            raise ValueError(
                f"A LossScaleOptimizer around {self.name!r} would check each rank's gradients alone and "
                "leave the other ranks waiting at an overflow; make the wrapper scale the loss itself: "
                "DistributedOptimizer(LossScaleOptimizer(optimizer)), or DistributedOptimizer(optimizer) "
                "made after keras.mixed_precision.set_global_policy('mixed_float16')."
            )
        else:
            inner.loss_scale_factor = value

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_weights(self):
        """Values of `variables`, as `.h5` files save them."""
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights):
        """Assigns `weights` to `variables` in order, as Keras's `set_weights` (how `load_model` restores an
        `.h5` file); ValueError when unbuilt or on a shape that differs."""
        if not self.built:
            raise ValueError(f"{self.name!r} is not built; build it before set_weights.")
        for variable, value in zip(self.variables, weights):
            if tuple(variable.shape) != tuple(getattr(value, "shape", ())):
                raise ValueError(
                    f"{variable.path} has shape {tuple(variable.shape)}, set_weights got {value.shape}."
                )
            variable.assign(value)

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "backward_passes_per_step": self.backward_passes_per_step,
            "compression": self.compression,
            "gradient_reduction": self.gradient_reduction,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "scale_local_gradients": self.scale_local_gradients,
            "op": self.op,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "groups": self.groups,
            "device_dense": self.device_dense,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(optimizer, **config)


@keras.saving.register_keras_serializable(package="hvd_lars")
class DistributedLossScaleOptimizer(DistributedOptimizer, LossScaleOptimizer):
    """What `DistributedOptimizer(LossScaleOptimizer(opt))` returns: averages the scaled gradients over
    ranks, then the held `LossScaleOptimizer` (and its state) checks them alike on every rank, unscales and
    applies. Being a `LossScaleOptimizer`, `model.compile` does not wrap it again under `mixed_float16`."""

    dynamic_scale = property(lambda self: self.inner_optimizer.dynamic_scale)
    step_counter = property(lambda self: self.inner_optimizer.step_counter)
    initial_scale = property(lambda self: self.inner_optimizer.initial_scale)
    dynamic_growth_steps = property(lambda self: self.inner_optimizer.dynamic_growth_steps)

    def check_finite(self, grads):
        return self.inner_optimizer.check_finite(grads)


def _fused_sgd_step(sgd, gradient, variable, learning_rate):
    """`keras.optimizers.SGD.update_step` with momentum, in TensorFlow's fused kernel (the same values)."""
    dtype = variable.dtype
    slot = sgd.momentums[keras_internals.variable_index(sgd, variable)]
    cast = lambda x: keras.ops.cast(x, dtype)
    fused_momentum_step(variable, slot, cast(learning_rate), cast(gradient), cast(sgd.momentum), sgd.nesterov)


def _is_tf_variable(value):
    import tensorflow as tf

    return isinstance(value, tf.Variable)


def _variable_key(variable):
    """What names a variable across calls: a Keras variable's (or a given) path, a tf.Variable's ref()."""
    if isinstance(variable, str):
        return variable
    if isinstance(variable, keras.Variable):
        return variable.path
    return variable.ref()


def _group_keys(groups):
    """Horovod's list of lists of variables as lists of `_variable_key`s; ValueError for other entries."""
    for group in groups:
        if not isinstance(group, (list, tuple)):
            refuse("an entry of groups", group, "a list of variables")
        for v in group:
            if not (isinstance(v, (str, keras.Variable)) or _is_tf_variable(v)):
                refuse("a member of groups", v, "a variable or its path")
    return [[_variable_key(v) for v in group] for group in groups]


def _held_optimizers_rate():
    raise AssertionError("DistributedOptimizer's rate is its held optimizer's.")
