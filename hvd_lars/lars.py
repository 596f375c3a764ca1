"""LARS: layer-wise adaptive rate scaling for Keras 3.

You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks" (arXiv 1708.03888), as used by
You, Zhang, Hsieh, Demmel, Keutzer, "ImageNet Training in Minutes" (ICPP 2018, arXiv 1709.05011) and
released in Intel Caffe 1.0.7.
"""

import re
import warnings

import keras
from keras import ops

# How the trust ratio's gradient norm is taken. "paper" is the released Caffe code and the TF/MLPerf
# reference (eta * ||w|| / (||g|| + beta * ||w|| + eps)); "decayed_gradient" takes the norm of the
# decayed gradient (eta * ||w|| / (||g + beta * w|| + eps)), as in NVIDIA's apex LARC and several
# PyTorch ports; "update" rescales the momentum-filtered update instead of the gradient (trust ratio of
# ||w|| to the norm of the new velocity), as in LAMB-style implementations with SGD momentum.
TRUST_RATIO_MODES = ("paper", "decayed_gradient", "update")

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

    For each trainable tensor `w` (every kernel and every bias is its own "layer", as in the released
    Caffe code) with averaged gradient `g`, learning rate `lr_t`, momentum `m`, weight decay `beta`,
    trust coefficient `eta` and epsilon `eps`, the default (`trust_ratio_mode="paper"`) update is:

    ```
    trust = eta * ||w|| / (||g|| + beta * ||w|| + eps)    (1.0 when ||w|| == 0 or ||g|| == 0)
    v     = m * v + lr_t * trust * (g + beta * w)
    w     = w - v               (nesterov: w = w - m * v - lr_t * trust * (g + beta * w))
    ```

    `||.||` is the Frobenius (L2) norm of the whole tensor and `||g||` is the norm of the raw gradient
    before weight decay is added. This is equation (6)-(7) of You et al. (arXiv 1708.03888) in the form of
    the released Intel Caffe solver and of the TF/MLPerf `LARSOptimizer`; the learning rate sits inside
    the velocity (Caffe-style momentum), so the velocity is in units of the weights.

    Conventions, with `trust_ratio_mode`:
      * `"paper"` (default): as above.
      * `"decayed_gradient"`: `trust = eta * ||w|| / (||g + beta * w|| + eps)`, the norm of the decayed
        gradient (NVIDIA apex `LARC`, several PyTorch ports).
      * `"update"`: the velocity is accumulated without trust ratio (`u = m * v + (g + beta * w)`) and
        the step is `lr_t * eta * ||w|| / (||u|| + eps) * u` (trust ratio on the final update, as
        LAMB-style code does; here `v` is kept in gradient units).

    Excluded tensors: a tensor whose `variable.path` matches a regex of `exclude_from_weight_decay` gets
    `beta = 0`; one that matches `exclude_from_layer_adaptation` gets `trust = 1` (plain momentum SGD).
    A tensor with a zero gradient still decays (`v = m * v + lr_t * beta * w` with trust 1): weight
    decay is part of the objective, as in the Caffe solver, which decays every parameter each step.
    Weight decay is applied here only; it is never handed to the Keras base class (which would decay a
    second time, decoupled from the trust ratio).

    Args:
        learning_rate: float, a `keras.optimizers.schedules.LearningRateSchedule` of the optimizer step
            (applied updates), or a callable of no arguments. The global rate before the trust ratio;
            a float rate can be changed later (`optimizer.learning_rate = x`, as callbacks do).
        momentum: float in [0, 1). 0.9 in the paper's solver.
        weight_decay: float >= 0, L2 coefficient beta (5e-4 for AlexNet-BN, 1e-4 for ResNet-50).
        eta: float > 0, trust coefficient (0.001 in the paper).
        epsilon: float >= 0 added to the trust ratio's denominator (0 in the paper; 1e-5 in some MLPerf
            submissions).
        nesterov: bool, Nesterov momentum.
        exclude_from_weight_decay: list of regexes (`re.search` on `variable.path`), or None.
        exclude_from_layer_adaptation: list of regexes, or None. None means no exclusions (the paper:
            every tensor is adapted); see `mlperf_exclusions()` for the MLPerf choice.
        trust_ratio_mode: one of `TRUST_RATIO_MODES`.
        momentum_correction: bool. When True, the velocity is rescaled by `lr_t / lr_{t-1}` before each
            update, as the Caffe solver does during warmup (Goyal et al. 2017, section 2.1). With a
            per-step linear warmup the ratio stays within a few percent of 1 after the first steps, so
            it is off by default; it matters when the rate jumps (step decay, the paper's drop at the
            end of warmup).
        name, **kwargs: passed to `keras.optimizers.Optimizer` (clipnorm, use_ema, ...).

    Raises:
        ValueError: negative `eta`, `momentum` outside [0, 1), negative `weight_decay` or `epsilon`,
            an unknown `trust_ratio_mode`, or an exclusion pattern that is not a valid regex.
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
        momentum_correction=False,
        name="lars",
        **kwargs,
    ):
        # weight_decay is not passed on: the base class would apply a second, decoupled decay.
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        _check_range("momentum", momentum, 0.0, 1.0, "in [0, 1)")
        _check_range("weight_decay", weight_decay, 0.0, None, ">= 0")
        _check_range("epsilon", epsilon, 0.0, None, ">= 0")
        if not isinstance(eta, (int, float)) or not eta > 0:
            raise ValueError(f"eta (trust coefficient) must be a number > 0, got {eta!r}.")
        if trust_ratio_mode not in TRUST_RATIO_MODES:
            raise ValueError(
                f"trust_ratio_mode must be one of {TRUST_RATIO_MODES}, got {trust_ratio_mode!r}."
            )
        self.momentum = float(momentum)
        self.lars_weight_decay = float(weight_decay)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.nesterov = bool(nesterov)
        self.trust_ratio_mode = trust_ratio_mode
        self.momentum_correction = bool(momentum_correction)
        self.exclude_from_weight_decay_patterns = _compile_patterns(
            "exclude_from_weight_decay", exclude_from_weight_decay
        )
        self.exclude_from_layer_adaptation_patterns = _compile_patterns(
            "exclude_from_layer_adaptation", exclude_from_layer_adaptation
        )

    def build(self, variables):
        """Creates one velocity slot per variable and resolves the exclusions on `variable.path`."""
        if self.built:
            return
        super().build(variables)
        self.velocities = self.add_optimizer_variables(variables, "velocity")
        paths = [getattr(v, "path", v.name) for v in variables]
        # Per-variable Python constants: update_step receives the backend tf.Variable, which has no
        # .path, so the choice is made here and looked up by index.
        self._decay_mask = [not _matches(self.exclude_from_weight_decay_patterns, p) for p in paths]
        self._adapt_mask = [not _matches(self.exclude_from_layer_adaptation_patterns, p) for p in paths]
        for arg, patterns in (
            ("exclude_from_weight_decay", self.exclude_from_weight_decay_patterns),
            ("exclude_from_layer_adaptation", self.exclude_from_layer_adaptation_patterns),
        ):
            for pattern in patterns:
                if not any(pattern.search(p) for p in paths):
                    warnings.warn(
                        f"LARS {arg} pattern {pattern.pattern!r} matches no variable path "
                        f"(paths look like {paths[:3]}).",
                        stacklevel=2,
                    )
        if self.momentum_correction:
            self._previous_learning_rate = self.add_variable(
                shape=(), dtype="float32", initializer="zeros", name="previous_learning_rate"
            )

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        super()._backend_update_step(grads, trainable_variables, learning_rate)
        if self.momentum_correction:
            self._previous_learning_rate.assign(ops.cast(learning_rate, "float32"))

    def update_step(self, gradient, variable, learning_rate):
        """Applies one LARS update to `variable` (any rank, float32 or float16/bfloat16)."""
        dtype = variable.dtype
        index = self._get_variable_index(variable)
        lr = ops.cast(learning_rate, dtype)
        g = ops.cast(gradient, dtype)
        w = variable
        v = self.velocities[index]
        m = ops.cast(self.momentum, dtype)
        beta = self.lars_weight_decay if self._decay_mask[index] else 0.0
        adapt = self._adapt_mask[index]

        if self.momentum_correction:
            previous = ops.cast(self._previous_learning_rate, dtype)
            ratio = ops.where(previous > 0, lr / ops.maximum(previous, 1e-30), ops.ones_like(lr))
            self.assign(v, v * ratio)

        decayed = g + beta * w if beta else g
        if self.trust_ratio_mode == "update":
            u = m * v + decayed
            trust = self._trust_ratio(w, u, 0.0) if adapt else 1.0
            self.assign(v, u)
            step = lr * trust * (m * u + decayed if self.nesterov else u)
            self.assign_sub(w, step)
            return

        if not adapt:
            trust = 1.0
        elif self.trust_ratio_mode == "paper":
            trust = self._trust_ratio(w, g, beta)
        else:  # decayed_gradient
            trust = self._trust_ratio(w, decayed, 0.0)
        scaled = lr * trust * decayed
        new_v = m * v + scaled
        self.assign(v, new_v)
        self.assign_sub(w, m * new_v + scaled if self.nesterov else new_v)

    def _trust_ratio(self, w, g, beta):
        """eta * ||w|| / (||g|| + beta * ||w|| + eps); 1 where ||w|| or ||g|| is zero (scalar tensor)."""
        w_norm = ops.sqrt(ops.sum(ops.square(w)))
        g_norm = ops.sqrt(ops.sum(ops.square(g)))
        denominator = g_norm + beta * w_norm + self.epsilon
        ok = ops.logical_and(w_norm > 0, g_norm > 0)
        safe = ops.where(ok, denominator, ops.ones_like(denominator))
        return ops.where(ok, self.eta * w_norm / safe, ops.ones_like(w_norm))

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
        schedule = self._learning_rate
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            return schedule(self.iterations)
        return super()._get_current_learning_rate()


def _check_range(name, value, low, high, accepted):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
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
