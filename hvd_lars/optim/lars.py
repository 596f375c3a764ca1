"""LARS: layer-wise adaptive rate scaling for Keras 3.

You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks" (arXiv 1708.03888), as used by
You, Zhang, Hsieh, Demmel, Keutzer, "ImageNet Training in Minutes" (ICPP 2018, arXiv 1709.05011) and
released in Intel Caffe 1.0.7.
"""

import numbers
import re
import warnings

import keras
from keras import ops

from hvd_lars import keras_internals

# How the trust ratio's gradient norm is taken. "paper" is the released Caffe code and the TF/MLPerf
# reference (eta * ||w|| / (||g|| + beta * ||w|| + eps)); "decayed_gradient" takes the norm of the
# decayed gradient (eta * ||w|| / (||g + beta * w|| + eps)), as in NVIDIA's apex LARC and several
# PyTorch ports; "update" rescales the momentum-filtered update instead of the gradient (trust ratio of
# ||w|| to the norm of the new velocity), as in LAMB-style implementations with SGD momentum.
TRUST_RATIO_MODES = ("paper", "decayed_gradient", "update")

# How the velocity (which holds the learning rate) follows a change of the rate; see LARS's docstring.
# "none": Intel Caffe 1.0.7's fused SGD update, which the paper's runs used; "warmup": Intel Caffe's
# non-fused update (lr_t / lr_{t-1} during warmup only); "always": Goyal et al. 2017, eq. 10.
MOMENTUM_CORRECTIONS = ("none", "warmup", "always")

# Batch-norm parameters and biases: left out of weight decay and layer adaptation by the MLPerf ResNet-50
# reference (and the TF model garden LARS recipe). Matched against Keras 3 `variable.path`.
MLPERF_EXCLUSIONS = (r"(^|/)(gamma|beta|bias|moving_mean|moving_variance)$|batch_?norm",)


def mlperf_exclusions():
    """Regexes excluding batch-norm parameters and biases, for both exclusion arguments of `LARS`.

    Returns:
        A list of regex strings matched with `re.search` against Keras 3 `variable.path` (for example
        `conv1_bn/gamma`, `fc8/bias`). Pass it as `exclude_from_weight_decay` and
        `exclude_from_layer_adaptation` to reproduce the MLPerf ResNet-50 LARS recipe.
    """
    return list(MLPERF_EXCLUSIONS)


@keras.saving.register_keras_serializable(package="hvd_lars")
class LARS(keras.optimizers.Optimizer):
    """Momentum SGD with a layer-wise trust ratio (LARS).

    For each trainable tensor `w` (every kernel and every bias is its own "layer") with averaged gradient
    `g`, learning rate `lr_t`, momentum `m`, weight decay `beta`, trust coefficient `eta`, epsilon `eps`:

    ```
    trust = eta * ||w|| / (||g|| + beta * ||w|| + eps)    (1.0 when ||w|| == 0 or ||g|| == 0)
    v     = m * v + lr_t * trust * (g + beta * w)
    w     = w - v               (nesterov: w = w - m * v - lr_t * trust * (g + beta * w))
    ```

    `||.||` is the L2 norm of the whole tensor; `||g||` is taken before weight decay is added. The rate is
    inside the velocity (Caffe-style), so `v` is in units of the weights; all coefficients are
    dimensionless. With `eta` 0.001 the trust ratio is typically 1e-4 to 1e-2, so LARS peak rates are 10-30
    where SGD's are 0.1-3. `trust_ratio_mode` selects the published variants:
      * `"paper"`: as above.
      * `"decayed_gradient"`: `trust = eta * ||w|| / (||g + beta * w|| + eps)`.
      * `"update"`: `u = m * u + (g + beta * w)`, `w = w - lr_t * eta * ||w|| / (||u|| + eps) * u`.
    A tensor whose `variable.path` matches a regex of `exclude_from_weight_decay` (or is named in Keras's
    `exclude_from_weight_decay()`) gets `beta = 0`; one that matches `exclude_from_layer_adaptation` gets
    `trust = 1`. A zero gradient still decays with trust 1 in `"paper"` mode, as the released solver does.
    Weight decay is applied here only, never by the Keras base class. `iterations` counts applied
    updates (with `gradient_accumulation_steps=k`, once per `k` calls of `apply`); schedules see it.

    Args:
        learning_rate: float >= 0, a `keras.Variable`, a `LearningRateSchedule` of the update count, or a
            callable of no arguments: the global rate before the trust ratio.
        momentum: float in [0, 1) (0.9 in the paper's solver).
        weight_decay: float >= 0, the L2 coefficient beta (5e-4 for AlexNet-BN, 1e-4 for ResNet-50).
        eta: float > 0, trust coefficient (0.001 in the paper).
        epsilon: float >= 0 added to the trust ratio's denominator (0 in the paper; 1e-5 in some MLPerf
            submissions).
        nesterov: bool, Nesterov momentum (not in the paper).
        exclude_from_weight_decay: regexes (`re.search` on `variable.path`), one regex, or None.
        exclude_from_layer_adaptation: as above; None adapts every tensor (the paper);
            `mlperf_exclusions()` leaves batch-norm parameters and biases out of both.
        trust_ratio_mode: one of `TRUST_RATIO_MODES`.
        momentum_correction: one of `MOMENTUM_CORRECTIONS` (False: "none", True: "always"): the velocity is
            rescaled by `lr_t / lr_{t-1}` before the update never (`"none"`, the released solver's default
            build), only during warmup (`"warmup"`, its non-fused path; needs a schedule with an int
            `warmup_steps`) or always (`"always"`, Goyal et al. 2017, eq. 10).
        name: str, or None for Keras's automatic name ("lars", then "lars_1", ... in one program), which
            prefixes the paths of the optimizer's variables (`lars/iteration`, `lars_1/iteration`).
        **kwargs: passed to `keras.optimizers.Optimizer` (clipnorm, use_ema, ...).

    Raises:
        ValueError: a negative float `learning_rate`, `eta` <= 0, `momentum` outside [0, 1), negative
            `weight_decay` or `epsilon`, a non-number for any of them, an unknown `trust_ratio_mode` or
            `momentum_correction`, a correction with `trust_ratio_mode="update"`, `"warmup"` without a
            schedule that has `warmup_steps`, or an invalid regex; the message quotes the value received.

    Example:
        >>> optimizer = LARS(WarmupPolynomialDecay(20.0, total_steps=1000, warmup_steps=100),
        ...                  weight_decay=5e-4, exclude_from_layer_adaptation=mlperf_exclusions())

    Source: You, Gitman, Ginsburg, arXiv 1708.03888, eqs. (6)-(7), in the form of the solver released with
    You et al., ICPP 2018 (Intel Caffe 1.0.7); docs/fidelity.md gives the places in that code.
    """

    def __init__(
        self,
        learning_rate=0.01,
        momentum=0.9,
        weight_decay=0.0,
        eta=0.001,
        epsilon=0.0,
        nesterov=False,
        exclude_from_weight_decay=None,
        exclude_from_layer_adaptation=None,
        trust_ratio_mode="paper",
        momentum_correction="none",
        name=None,
        **kwargs,
    ):
        shared_rate = learning_rate if isinstance(learning_rate, keras.Variable) else None
        if shared_rate is not None:
            # The base class would make a rate variable of its own; a placeholder callable keeps it from
            # doing so (untracking one afterwards edits the tracked variable list in place, which
            # tf.train.Checkpoint refuses to save).
            learning_rate = _rate_set_below
        elif isinstance(learning_rate, numbers.Real) and not isinstance(learning_rate, bool):
            _check_range("learning_rate", learning_rate, 0.0, None, ">= 0")
            learning_rate = float(learning_rate)  # the Keras base class accepts Python floats only
        # weight_decay is not passed on: the base class would apply a second, decoupled decay.
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if shared_rate is not None:
            # The caller's variable itself (a callback or another optimizer may change it).
            keras_internals.adopt_rate_variable(self, shared_rate)
        _check_range("momentum", momentum, 0.0, 1.0, "in [0, 1)")
        _check_range("weight_decay", weight_decay, 0.0, None, ">= 0")
        _check_range("epsilon", epsilon, 0.0, None, ">= 0")
        if not isinstance(eta, numbers.Real) or isinstance(eta, bool) or not eta > 0:
            raise ValueError(f"eta (trust coefficient) must be a number > 0, got {eta!r}.")
        if trust_ratio_mode not in TRUST_RATIO_MODES:
            raise ValueError(
                f"trust_ratio_mode must be one of {TRUST_RATIO_MODES}, got {trust_ratio_mode!r}."
            )
        momentum_correction = _correction_name(momentum_correction)
        if momentum_correction != "none" and trust_ratio_mode == "update":
            # There the velocity is in gradient units: rescaling it by lr_t / lr_{t-1} corrects nothing.
            raise ValueError(
                f"momentum_correction={momentum_correction!r} does not apply to trust_ratio_mode='update' "
                "(its velocity holds no learning rate); use 'paper' or 'decayed_gradient', or "
                "momentum_correction='none'."
            )
        self._correction_steps = None  # updates during which the "warmup" correction applies
        if momentum_correction == "warmup":
            steps = getattr(keras_internals.rate_object(self), "warmup_steps", None)
            if not isinstance(steps, numbers.Integral) or isinstance(steps, bool):
                raise ValueError(
                    "momentum_correction='warmup' corrects during the schedule's warmup, so learning_rate "
                    "must be a schedule with an int `warmup_steps` (any hvd_lars.optim.schedules "
                    "schedule); got "
                    f"{learning_rate!r}."
                )
            self._correction_steps = int(steps)
        self.momentum = float(momentum)
        self.lars_weight_decay = float(weight_decay)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.nesterov = bool(nesterov)
        self.trust_ratio_mode = trust_ratio_mode
        self.momentum_correction = momentum_correction
        self.exclude_from_weight_decay_patterns = _compile_patterns(
            "exclude_from_weight_decay", exclude_from_weight_decay
        )
        self.exclude_from_layer_adaptation_patterns = _compile_patterns(
            "exclude_from_layer_adaptation", exclude_from_layer_adaptation
        )
        # TensorFlow's fused kernels (one-pass L2 norm, fused momentum update) make the step cost about
        # what Keras SGD's does; other backends use the portable keras.ops path (same results).
        self._fused = keras.backend.backend() == "tensorflow"

    def build(self, variables):
        """Creates one velocity slot per variable and resolves the exclusions on `variable.path`."""
        if self.built:
            return
        super().build(variables)
        self.velocities = self.add_optimizer_variables(variables, "velocity")
        paths = [getattr(v, "path", v.name) for v in variables]
        # Per-variable Python constants: update_step receives the backend tf.Variable, which has no
        # .path, so the choice is made here and looked up by index.
        # Keras's own exclude_from_weight_decay(var_list=..., var_names=...) counts too.
        self._decay_mask = [
            not _matches(self.exclude_from_weight_decay_patterns, p)
            and keras_internals.uses_weight_decay(self, v)
            for p, v in zip(paths, variables)
        ]
        self._adapt_mask = [not _matches(self.exclude_from_layer_adaptation_patterns, p) for p in paths]
        unmatched = [
            f"{arg}={pattern.pattern!r}"
            for arg, patterns in (
                ("exclude_from_weight_decay", self.exclude_from_weight_decay_patterns),
                ("exclude_from_layer_adaptation", self.exclude_from_layer_adaptation_patterns),
            )
            for pattern in patterns
            if not any(pattern.search(p) for p in paths)
        ]
        if unmatched:
            # Once per optimizer (build runs once): a pattern matching nothing is almost always a pattern
            # written for `variable.name` or for Keras 2 names, which silently disables the exclusion.
            warnings.warn(
                f"LARS exclusion pattern(s) {', '.join(unmatched)} match no variable path of the "
                f"{len(paths)} variables (paths look like {paths[:3]}).",
                stacklevel=2,
            )
        if self.momentum_correction != "none":
            self._previous_learning_rate = self.add_variable(
                shape=(), dtype="float32", initializer="zeros", name="previous_learning_rate"
            )

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        super()._backend_update_step(grads, trainable_variables, learning_rate)
        if self.momentum_correction != "none":
            self._previous_learning_rate.assign(ops.cast(learning_rate, "float32"))

    def update_step(self, gradient, variable, learning_rate):
        """Applies one LARS update to `variable` (any rank, float32 or float16/bfloat16).

        The velocity slot holds the negated velocity `-v` (the sign convention of Keras SGD and of
        TensorFlow's fused momentum kernel), so that the step is `w += slot`.
        """
        dtype = variable.dtype
        index = keras_internals.variable_index(self, variable)
        slot = self.velocities[index]
        lr = ops.cast(learning_rate, dtype)
        g = ops.cast(gradient, dtype)
        w = ops.convert_to_tensor(variable)
        beta = self.lars_weight_decay if self._decay_mask[index] else 0.0
        adapt = self._adapt_mask[index]
        decayed = g + ops.cast(beta, dtype) * w if beta else g

        momentum = ops.cast(self.momentum, dtype)
        if self.momentum_correction != "none":
            previous = ops.cast(self._previous_learning_rate, dtype)
            ratio = ops.where(previous > 0, lr / ops.maximum(previous, 1e-30), ops.ones_like(lr))
            if self._correction_steps is not None:
                # Intel Caffe's non-fused path: only while the update index is inside warmup.
                warm = self.iterations < self._correction_steps
                ratio = ops.where(warm, ratio, ops.ones_like(ratio))
            if self.nesterov and self._fused and self.trust_ratio_mode != "update":
                self.assign(slot, slot * ratio)  # the fused kernel's look-ahead must use plain m
            else:
                momentum = momentum * ratio  # m * (ratio * v): folded, saves a pass over the slot

        if self.trust_ratio_mode == "update":
            u = momentum * slot - decayed  # the slot holds -u, in gradient units
            self.assign(slot, u)
            step = ops.cast(self.momentum, dtype) * u - decayed if self.nesterov else u
            trust = self._trust_ratio(self._norm(w), self._norm(u), 0.0) if adapt else 1.0
            self.assign_add(variable, ops.cast(lr * ops.cast(trust, dtype), dtype) * step)
            return

        if not adapt:
            scaled_lr = lr
        elif self.trust_ratio_mode == "paper":
            scaled_lr = lr * ops.cast(self._trust_ratio(self._norm(w), self._norm(g), beta), dtype)
        else:  # decayed_gradient
            scaled_lr = lr * ops.cast(self._trust_ratio(self._norm(w), self._norm(decayed), 0.0), dtype)
        if self._fused:
            _apply_keras_momentum(variable, slot, scaled_lr, decayed, momentum, self.nesterov)
            return
        new_slot = momentum * slot - scaled_lr * decayed
        self.assign(slot, new_slot)
        self.assign_add(
            variable,
            ops.cast(self.momentum, dtype) * new_slot - scaled_lr * decayed if self.nesterov else new_slot,
        )

    def _norm(self, x):
        """Frobenius norm of a whole tensor, as a float32 scalar (float32 also for bfloat16 tensors)."""
        x = ops.cast(x, "float32")
        if self._fused:
            import tensorflow as tf

            # l2_loss = sum(x**2) / 2 in one pass, where square-then-sum makes a full-size temporary.
            return ops.sqrt(2.0 * tf.nn.l2_loss(x))
        return ops.sqrt(ops.sum(ops.square(x)))

    def _trust_ratio(self, w_norm, d_norm, beta):
        """eta * ||w|| / (d_norm + beta * ||w|| + eps); 1 where ||w|| or d_norm is zero (float32 scalar)."""
        denominator = d_norm + beta * w_norm if beta else d_norm
        if self.epsilon:
            denominator = denominator + self.epsilon
        # Where either norm is zero the division may give inf or NaN, but only in the discarded branch.
        ok = ops.minimum(w_norm, d_norm) > 0
        return ops.where(ok, self.eta * w_norm / denominator, 1.0)

    def get_config(self):
        config = super().get_config()
        config.pop("weight_decay", None)
        config.update(
            {
                "momentum": self.momentum,
                "weight_decay": self.lars_weight_decay,
                "eta": self.eta,
                "epsilon": self.epsilon,
                "nesterov": self.nesterov,
                "exclude_from_weight_decay": [p.pattern for p in self.exclude_from_weight_decay_patterns]
                or None,
                "exclude_from_layer_adaptation": [
                    p.pattern for p in self.exclude_from_layer_adaptation_patterns
                ]
                or None,
                "trust_ratio_mode": self.trust_ratio_mode,
                "momentum_correction": self.momentum_correction,
            }
        )
        return config

    def _get_current_learning_rate(self):
        # Keras evaluates schedules at the micro-batch counter; with gradient accumulation the rate must
        # follow applied updates (`self.iterations`), as the paper's schedule counts iterations.
        schedule = keras_internals.rate_object(self)
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            return schedule(self.iterations)
        return super()._get_current_learning_rate()


def _rate_set_below():
    raise AssertionError("LARS replaces this placeholder learning rate in __init__.")


def _apply_keras_momentum(variable, slot, learning_rate, gradient, momentum, nesterov):
    """TensorFlow's fused kernel: slot = momentum * slot - lr * grad; variable += slot (Nesterov:
    variable += momentum * slot - lr * grad), one pass over the four tensors."""
    import tensorflow as tf

    def handle(v):
        return (v.value if isinstance(v, keras.Variable) else v).handle

    tf.raw_ops.ResourceApplyKerasMomentum(
        var=handle(variable),
        accum=handle(slot),
        lr=learning_rate,
        grad=gradient,
        momentum=momentum,
        use_locking=False,
        use_nesterov=nesterov,
    )


def _correction_name(value):
    """`MOMENTUM_CORRECTIONS` name of `value` (False -> "none", True -> "always"); ValueError otherwise."""
    if isinstance(value, bool):
        return "always" if value else "none"
    if value not in MOMENTUM_CORRECTIONS:
        raise ValueError(
            f"momentum_correction must be one of {MOMENTUM_CORRECTIONS} (or a bool), got {value!r}."
        )
    return value


def _check_range(name, value, low, high, accepted):
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and value >= low and (high is None or value < high)
    if not ok:
        raise ValueError(f"{name} must be a number {accepted}, got {value!r}.")


def _compile_patterns(name, patterns):
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [patterns]
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except (re.error, TypeError) as e:
            raise ValueError(f"{name}: {p!r} is not a valid regular expression ({e}).") from e
    return compiled


def _matches(patterns, path):
    return any(p.search(path) for p in patterns)
