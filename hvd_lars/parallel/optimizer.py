"""DistributedOptimizer: a Keras 3 optimizer that averages gradients over Horovod ranks before the
optimizer it holds applies them.

The Keras 3 replacement for `horovod.tensorflow.keras.DistributedOptimizer`, which does not support Keras 3
(Horovod issue 4290). It holds the user's optimizer and delegates to it, as Keras's `LossScaleOptimizer`
holds its `inner_optimizer`, so every Keras 3 optimizer works with everything it was built with (a float
rate, a rate variable, a schedule, a callable, clipping, EMA, weight decay, an unregistered class). The
collectives themselves are in `hvd_lars.parallel.collectives`.
"""

import keras

from hvd_lars import keras_internals
from hvd_lars.optim.wrapping import innermost_optimizer
from hvd_lars.parallel import collectives
from hvd_lars.parallel.accumulation import GradientAccumulation

LossScaleOptimizer = keras.optimizers.LossScaleOptimizer


@keras.saving.register_keras_serializable(package="hvd_lars")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Averages each update's gradients over all ranks, then lets `optimizer` apply them.

    The Keras 3 counterpart of `horovod.tensorflow.keras.DistributedOptimizer`. Per update, on every rank:
    the gradients of the rank's `backward_passes_per_step` micro-batches are averaged locally, averaged over
    ranks in one round of allreduces and handed to `optimizer.apply`, so clipping, weight decay, the update
    rule and `iterations` see the global mean gradient once per update. With world size 1 it behaves exactly
    as `optimizer`. The held optimizer's own `gradient_accumulation_steps` is taken over as
    `backward_passes_per_step`, so its `iterations` and schedule count updates. For float16 loss scaling,
    wrap the scaler (`DistributedOptimizer(LossScaleOptimizer(opt))`) or make the wrapper under the
    `mixed_float16` policy: either gives a `DistributedLossScaleOptimizer`; the other nesting is refused.
    Why: docs/design.md, "Keras's private names, and loss scaling" and "Gradient accumulation".

    Example:

        optimizer = DistributedOptimizer(hvd_lars.LARS(learning_rate=0.1), backward_passes_per_step=2)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", jit_compile=False)

    Args:
        optimizer: any Keras 3 optimizer, built or not (not built if it has `gradient_accumulation_steps`),
            a `LossScaleOptimizer` included.
        backward_passes_per_step: int >= 1, micro-batches per update; None: the held optimizer's
            `gradient_accumulation_steps`, or 1.
        compression: "none" or "fp16" (float16 on the wire, divided by the world size before the sum;
            see `hvd_lars.parallel.collectives.allreduce_gradients`), or Horovod's `Compression.none` /
            `Compression.fp16`.
        gradient_reduction: "overlap" (one allreduce per gradient, started as backprop produces it;
            Horovod fuses what is ready) or "grouped" (one grouped allreduce after the last gradient).
        name: str; default "distributed_<name of optimizer>".
        average_aggregated_gradients: True (default here): an update's micro-batch gradients are averaged,
            as Keras's `gradient_accumulation_steps` does; False: summed (Horovod's default).
        scale_local_gradients: True (Horovod's default): gradients of local variables (`register_local_var`,
            `PartialDistributedOptimizer`) are divided by the world size; False leaves them as computed.
            Local variables are not averaged over ranks; register them before the first step.
        sparse_as_dense: accepted and ignored: sparse gradients are always made dense before the allreduce.
        process_set: None or Horovod's global process set; any other set is refused.
        op: "average" or "sum", or Horovod's `Average` / `Sum`.
        gradient_predivide_factor: float > 0 (1.0): gradients times 1 / f before the sum, f / world size
            after it (Horovod's split of the mean); ignored with op "sum", as Horovod does.
        groups: None, an int k >= 1 (k grouped allreduces of consecutive variables), or a list of lists of
            variables (or their paths), each one grouped allreduce: Horovod's `groups`, in place of
            `gradient_reduction`.
        device_dense: "" or a TensorFlow device for the collectives (Horovod's argument).
        device_sparse: accepted and ignored (sparse gradients are made dense).

    Raises:
        ValueError: `optimizer` is not a Keras 3 optimizer or is already distributed; a
            `backward_passes_per_step` that is not an int >= 1 or contradicts the optimizer's
            `gradient_accumulation_steps`; an accumulating optimizer that is already built; an unknown
            `compression`, `op`, `gradient_reduction` or `groups`, or both `groups` and
            `gradient_reduction="grouped"`; another process set. Each message quotes the value received.
            `LossScaleOptimizer(DistributedOptimizer(opt))` raises ValueError where the scaler is made.

    Compile models with `jit_compile=False` (Horovod's XLA ops are not built here); on CPU-only machines
    Keras's "auto" already chooses that.
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        optimizer = kwargs.get("optimizer", optimizer)
        if cls is DistributedOptimizer and _scales_the_loss(optimizer):
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
            raise ValueError(
                f"DistributedOptimizer needs a Keras 3 optimizer (keras.optimizers.Optimizer), got "
                f"{optimizer!r}."
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError(f"{optimizer.name!r} already averages over ranks; wrap the optimizer only once.")
        compression = collectives.compression_name(compression)
        op = collectives.op_name(op)
        _check_arguments(
            gradient_reduction, groups, gradient_predivide_factor, device_dense, device_sparse,
            average_aggregated_gradients=average_aggregated_gradients,
            scale_local_gradients=scale_local_gradients, sparse_as_dense=sparse_as_dense,
        )  # fmt: skip
        _check_process_set(process_set)
        name = name or f"distributed_{optimizer.name}"
        if isinstance(self, LossScaleOptimizer) and not isinstance(optimizer, LossScaleOptimizer):
            optimizer = LossScaleOptimizer(optimizer)  # chosen under mixed_float16 (see the class)
        accumulating = innermost_optimizer(optimizer)
        own_steps = accumulating.gradient_accumulation_steps
        steps = _accumulation_steps(backward_passes_per_step, own_steps)
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
        self._accumulation = GradientAccumulation(steps, average_aggregated_gradients)
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

    def build(self, var_list):
        """Creates the gradient accumulators (when accumulating) and builds the held optimizer."""
        if self.built:
            return
        if self.backward_passes_per_step > 1:
            self._accumulated_gradients = self._accumulation.create(self, var_list)
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    def apply(self, grads, trainable_variables=None):
        """Accumulates this micro-batch's gradients; on the update's last micro-batch averages them over
        micro-batches and ranks and applies them with the held optimizer.

        Args:
            grads: list of gradients, one per trainable variable, each of its variable's shape (float16,
                bfloat16, float32 or float64; `tf.IndexedSlices` are made dense), or None for a variable
                without a gradient.
            trainable_variables: the variables, or None for those the optimizer was built with.
        """
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
            self._accumulation.apply(grads, accumulators, keras_internals.own_iterations(self), update)
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
        if not any(local):
            return collectives.allreduce_gradients(grads, **how)
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
        """Keeps `var`'s gradient on its rank (Horovod's `register_local_var`): not averaged over ranks,
        divided by the world size when `scale_local_gradients`. Call before the first step.

        Args:
            var: a `keras.Variable` (a trainable weight of the model) or a `tf.Variable` (one that the
                optimizer is applied to as it is, e.g. through `apply_gradients`).

        Raises:
            ValueError: `var` is neither.
        """
        if not (isinstance(var, keras.Variable) or _is_tf_variable(var)):
            raise ValueError(f"register_local_var needs a keras.Variable or a tf.Variable, got {var!r}.")
        self._local_keys.add(_variable_key(var))

    def _local_mask(self, variables):
        if not (self._local_keys or self._local_layers):
            return [False] * len(variables)
        keys = set(self._local_keys)
        keys.update(_variable_key(v) for layer in self._local_layers for v in layer.trainable_weights)
        return [_variable_key(v) in keys for v in variables]

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    @property
    def variables(self):
        """This wrapper's own (micro-batch counter, accumulators), then the held optimizer's."""
        return keras_internals.own_variables(self) + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        """Applied updates: the held optimizer's counter."""
        return self.inner_optimizer.iterations

    @property
    def loss_scale_factor(self):
        inner = self.__dict__.get("inner_optimizer")
        return None if inner is None else inner.loss_scale_factor

    def __setattr__(self, name, value):
        if name == "loss_scale_factor":
            # Straight to the property's setter: Keras's tracking `__setattr__` skips an assignment of the
            # value the attribute already reads (None, the held optimizer's), which must be seen here.
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        # The base class sets None here before the held optimizer exists. Afterwards None is what a
        # LossScaleOptimizer made around this wrapper sets (to turn the held optimizer's static scaling
        # off): that nesting would decide on overflow rank by rank (see the class), so it is refused.
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
        """Values of `variables` (this wrapper's, then the held optimizer's), as `.h5` files save them."""
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights):
        """Assigns `weights` (as `get_weights` returns them) to `variables`, the held optimizer's included,
        in order, as Keras's `Optimizer.set_weights` pairs them (`zip`: the shorter list decides). This is
        how `keras.models.load_model` restores an `.h5` file's optimizer state: the update counters and
        the rate always; the slots only where the loader built the optimizer with its variables (Keras's
        `.h5` loader builds it with the model's own variables, none for a Sequential, so a Keras Adam
        gets its counter back and fresh slots, and so does this wrapper). `.keras` files keep everything.

        Raises:
            ValueError: unbuilt, or an array whose shape differs from its variable's.
        """
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
            "groups": self.groups
            if self.groups is None or isinstance(self.groups, int)
            else [list(group) for group in self.groups],
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
    ranks, then the held `LossScaleOptimizer` checks them (the same decision on every rank), unscales and
    applies. Being itself a `LossScaleOptimizer`, it is not wrapped again by `model.compile` under
    `mixed_float16`. The loss scale state (`dynamic_scale`, `step_counter`, `initial_scale`,
    `dynamic_growth_steps`) is the held optimizer's.
    """

    @property
    def dynamic_scale(self):
        return self.inner_optimizer.dynamic_scale

    @property
    def step_counter(self):
        return self.inner_optimizer.step_counter

    @property
    def initial_scale(self):
        return self.inner_optimizer.initial_scale

    @property
    def dynamic_growth_steps(self):
        return self.inner_optimizer.dynamic_growth_steps

    def check_finite(self, grads):
        return self.inner_optimizer.check_finite(grads)


def PartialDistributedOptimizer(optimizer, local_layers=None, scale_local_gradients=True, **kwargs):
    """Horovod's `PartialDistributedOptimizer`: a `DistributedOptimizer` whose `local_layers` keep their
    gradients on each rank (see `DistributedOptimizer.register_local_var`); their trainable weights are
    looked up at the first step, so the layers may be unbuilt here.

    Args:
        optimizer: a Keras 3 optimizer; `kwargs`: as for `DistributedOptimizer`.
        local_layers: a `keras.layers.Layer` or a list of them; None: none (a plain DistributedOptimizer).
        scale_local_gradients: as for `DistributedOptimizer`.

    Raises:
        ValueError: an entry of `local_layers` that is not a Keras layer.
    """
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    bad = [layer for layer in local_layers if not isinstance(layer, keras.layers.Layer)]
    if bad:
        raise ValueError(f"local_layers must be Keras layers, got {bad[0]!r}.")
    distributed = DistributedOptimizer(optimizer, scale_local_gradients=scale_local_gradients, **kwargs)
    distributed._local_layers = list(local_layers)
    return distributed


def _check_arguments(gradient_reduction, groups, predivide, device_dense, device_sparse, **flags):
    """Raises ValueError, quoting the value, for any argument of DistributedOptimizer out of range."""
    if gradient_reduction not in collectives.GRADIENT_REDUCTIONS:
        raise ValueError(
            f"gradient_reduction={gradient_reduction!r}; valid: {', '.join(collectives.GRADIENT_REDUCTIONS)}."
        )
    if groups is not None:
        kind = isinstance(groups, (int, list, tuple)) and not isinstance(groups, bool)
        if not kind or (isinstance(groups, int) and groups < 1):
            raise ValueError(
                f"groups must be None, an int >= 1 or a list of lists of variables, got {groups!r}."
            )
        if gradient_reduction != "overlap":
            raise ValueError(
                f"groups={groups!r} and gradient_reduction={gradient_reduction!r}: groups say how the "
                "gradients are grouped; give one of them."
            )
        if not isinstance(groups, int):
            _group_keys(groups)  # raises on entries that are not variables or paths
    if isinstance(predivide, bool) or not isinstance(predivide, (int, float)) or not predivide > 0:
        raise ValueError(f"gradient_predivide_factor must be a number > 0, got {predivide!r}.")
    for arg, value in (("device_dense", device_dense), ("device_sparse", device_sparse)):
        if not isinstance(value, str):
            raise ValueError(f"{arg} must be a device string ('' for TensorFlow's placement), got {value!r}.")
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{flag} must be a bool, got {value!r}.")


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
    """Horovod's list of lists of variables as lists of `_variable_key`s (paths for Keras variables).

    Raises:
        ValueError: an entry that is not a list, or a member that is not a variable or a path.
    """
    keys = []
    for group in groups:
        if not isinstance(group, (list, tuple)):
            raise ValueError(f"groups must be a list of lists of variables; an entry is {group!r}.")
        bad = [v for v in group if not (isinstance(v, (str, keras.Variable)) or _is_tf_variable(v))]
        if bad:
            raise ValueError(f"groups hold variables (or their paths); got {bad[0]!r}.")
        keys.append([_variable_key(v) for v in group])
    return keys


def _check_process_set(process_set):
    """Accepts None and Horovod's global process set (id 0: every rank); refuses any other."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return
    raise ValueError(
        f"process_set={process_set!r}: only the global process set (every rank) is supported here; "
        "to average over a subset of ranks, launch that subset as a job of its own."
    )


def _held_optimizers_rate():
    raise AssertionError("DistributedOptimizer's rate is its held optimizer's.")


def _accumulation_steps(backward_passes_per_step, own_steps):
    steps = backward_passes_per_step
    if steps is None:
        return own_steps or 1
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {steps!r}.")
    if own_steps and own_steps != steps:
        raise ValueError(
            f"backward_passes_per_step={steps} contradicts the optimizer's gradient_accumulation_steps="
            f"{own_steps}; give one of them."
        )
    return steps


def _scales_the_loss(optimizer):
    """Whether `DistributedOptimizer(optimizer)` is a `DistributedLossScaleOptimizer`: `optimizer` is a
    loss scaler, or a plain optimizer given while Keras's dtype policy is `mixed_float16` (where
    `model.compile` would otherwise put a loss scaler around the wrapper)."""
    if isinstance(optimizer, LossScaleOptimizer):
        return True
    return (
        isinstance(optimizer, keras.optimizers.Optimizer)
        and not isinstance(optimizer, DistributedOptimizer)
        and keras.config.dtype_policy().name == "mixed_float16"
    )
