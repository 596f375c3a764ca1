"""LARS: layer-wise adaptive rate scaling for Keras 3 (You, Gitman, Ginsburg, arXiv 1708.03888, as
released with You et al., "ImageNet Training in Minutes", ICPP 2018, in Intel Caffe 1.0.7)."""

import numbers
import re
import warnings

import keras
from keras import ops

from hvd_lars import keras_internals
from hvd_lars.arguments import Range, above, at_least, check, refuse

# The trust ratio's denominator: "paper" (the released Caffe code, the MLPerf reference), "decayed_gradient"
# (apex LARC, PyTorch ports), "update" (LAMB-style, the norm of the new velocity).
TRUST_RATIO_MODES = ("paper", "decayed_gradient", "update")

# How the velocity follows a change of the rate: "none" (Intel Caffe's fused update, the paper's runs),
# "warmup" (its non-fused update: during warmup only), "always" (Goyal et al. 2017, eq. 10).
MOMENTUM_CORRECTIONS = ("none", "warmup", "always")


def mlperf_exclusions():
    """Regexes (for `re.search` on `variable.path`, e.g. `conv1_bn/gamma`, `fc8/bias`) of batch-norm
    parameters and biases: both exclusion arguments of `LARS` in the MLPerf ResNet-50 recipe (and the TF
    model garden's LARS recipe)."""
    return [r"(^|/)(gamma|beta|bias|moving_mean|moving_variance)$|batch_?norm"]


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

    `||.||` is the L2 norm of the whole tensor, `||g||` taken before weight decay. The rate is inside the
    velocity (Caffe-style). With `eta` 0.001, LARS peak rates are 10-30 where SGD's are 0.1-3.
    `trust_ratio_mode` selects the published variants:
      * `"paper"`: as above.
      * `"decayed_gradient"`: `trust = eta * ||w|| / (||g + beta * w|| + eps)`.
      * `"update"`: `u = m * u + (g + beta * w)`, `w = w - lr_t * eta * ||w|| / (||u|| + eps) * u`.
    A tensor whose `variable.path` matches a regex of `exclude_from_weight_decay` (or is named in Keras's
    `exclude_from_weight_decay()`) gets `beta = 0`; one that matches `exclude_from_layer_adaptation` gets
    `trust = 1`. Weight decay is applied here only, never by the Keras base class. `iterations` counts
    applied updates (with `gradient_accumulation_steps=k`, once per `k` calls of `apply`); schedules see it.

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
        momentum_correction: one of `MOMENTUM_CORRECTIONS`: the velocity is
            rescaled by `lr_t / lr_{t-1}` before the update never (`"none"`, the released solver's default
            build), only during warmup (`"warmup"`, its non-fused path; needs a schedule with an int
            `warmup_steps`) or always (`"always"`, Goyal et al. 2017, eq. 10).
        name: str, or None for Keras's automatic name ("lars", "lars_1", ...).
        **kwargs: passed to `keras.optimizers.Optimizer` (clipnorm, use_ema, ...).

    Raises:
        ValueError: a number out of the ranges above, an unknown mode or correction, a correction with
            `trust_ratio_mode="update"`, `"warmup"` without a schedule with `warmup_steps`, a bad regex.

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
            # A placeholder keeps the base class from making a rate variable of its own (untracking one
            # afterwards leaves a list tf.train.Checkpoint refuses to save).
            learning_rate = _rate_set_below
        elif isinstance(learning_rate, numbers.Real) and not isinstance(learning_rate, bool):
            learning_rate = float(check("learning_rate", learning_rate, at_least(0)))  # Keras: floats only
        # weight_decay is not passed on: the base class would apply a second, decoupled decay.
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if shared_rate is not None:
            # The caller's variable itself (a callback or another optimizer may change it).
            keras_internals.adopt_rate_variable(self, shared_rate)
        check("momentum", momentum, Range(0, 1))
        check("weight_decay", weight_decay, at_least(0))
        check("epsilon", epsilon, at_least(0))
        check("eta", eta, above(0))
        if trust_ratio_mode not in TRUST_RATIO_MODES:
            refuse("trust_ratio_mode", trust_ratio_mode, f"one of {TRUST_RATIO_MODES}")
        if momentum_correction not in MOMENTUM_CORRECTIONS:
            refuse("momentum_correction", momentum_correction, f"one of {MOMENTUM_CORRECTIONS}")
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
                refuse("with momentum_correction='warmup', learning_rate", learning_rate,
                       "a schedule with an int `warmup_steps` (any of hvd_lars.optim.schedules)")  # fmt: skip
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
        # TensorFlow's fused kernels (one-pass norm, fused momentum update); other backends: keras.ops.
        self._fused = keras.backend.backend() == "tensorflow"

    def build(self, variables):
        """Creates one velocity slot per variable and resolves the exclusions on `variable.path`."""
        if self.built:
            return
        super().build(variables)
        self.velocities = self.add_optimizer_variables(variables, "velocity")
        paths = [getattr(v, "path", v.name) for v in variables]
        # Decided here by index: update_step receives the backend variable, which has no .path.
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
            # Usually a pattern written for `variable.name` or Keras 2 names: the exclusion does nothing.
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
        if self.momentum_correction != "none":
            previous = self._previous_learning_rate
            if self._correction_steps is not None:
                # Intel Caffe's non-fused path: only while the update index is inside warmup.
                previous = ops.where(self.iterations < self._correction_steps, previous, 0.0)
            correct_momentum(self.velocities, previous, learning_rate)
        super()._backend_update_step(grads, trainable_variables, learning_rate)
        if self.momentum_correction != "none":
            self._previous_learning_rate.assign(ops.cast(learning_rate, "float32"))

    def update_step(self, gradient, variable, learning_rate):
        """One LARS update of `variable`; the slot holds `-v` (Keras SGD's sign), so `w += slot`."""
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
        if self.trust_ratio_mode == "update":
            u = momentum * slot - decayed  # the slot holds -u, in gradient units
            self.assign(slot, u)
            step = momentum * u - decayed if self.nesterov else u
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
            fused_momentum_step(variable, slot, scaled_lr, decayed, momentum, self.nesterov)
            return
        new_slot = momentum * slot - scaled_lr * decayed
        self.assign(slot, new_slot)
        self.assign_add(variable, momentum * new_slot - scaled_lr * decayed if self.nesterov else new_slot)

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
                "exclude_from_weight_decay": _sources(self.exclude_from_weight_decay_patterns),
                "exclude_from_layer_adaptation": _sources(self.exclude_from_layer_adaptation_patterns),
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


def correct_momentum(velocities, old_rate, new_rate):
    """Goyal et al. 2017's momentum correction (eq. 10): multiplies each of `velocities` (variables whose
    velocity carries the rate, `v = m v - lr g`) by `new_rate / old_rate` before the update at `new_rate`;
    no change where `old_rate` is 0 (no update yet). Rates: floats or scalar tensors, traceable."""
    old, new = ops.cast(old_rate, "float32"), ops.cast(new_rate, "float32")
    ratio = ops.where(old > 0, new / ops.maximum(old, 1e-30), 1.0)
    for v in velocities:
        v.assign(v * ops.cast(ratio, v.dtype))


def _rate_set_below():
    raise AssertionError("LARS replaces this placeholder learning rate in __init__.")


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
            refuse(name, p, f"regular expressions ({e})")
    return compiled


def _sources(patterns):
    return [p.pattern for p in patterns] or None


def _matches(patterns, path):
    return any(p.search(path) for p in patterns)


def fused_momentum_step(variable, slot, learning_rate, gradient, momentum, nesterov):
    """Keras SGD's momentum update in TensorFlow's fused kernel, one pass over the four tensors (as
    tf_keras's SGD): slot = momentum * slot - learning_rate * gradient, then variable += slot (Nesterov:
    variable += momentum * slot - learning_rate * gradient). The same operations in the same order as Keras
    3's separate ones, so the same values bit for bit. TensorFlow backend only."""
    import tensorflow as tf

    handle = lambda v: (v.value if isinstance(v, keras.Variable) else v).handle
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=handle(variable),
        accum=handle(slot),
        lr=learning_rate,
        grad=gradient,
        momentum=momentum,
        use_locking=False,
        use_nesterov=nesterov,
    )
