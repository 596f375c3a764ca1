"""NumPy reference of LARS, written from the update rule of the released solver (float64), and the one
problem the tests run it and LARS on."""

import keras
import numpy as np

# One problem holds every case at once: ranks 0 to 5, a zero-initialised tensor, a tensor whose gradient
# is always zero, and tensors excluded from weight decay, from layer adaptation, or from both.
PATHS_AND_SHAPES = [("a/scalar", ()), ("a/zero_init", (7,)), ("b/kernel", (5, 3)),
                    ("c/kernel_zero_grad", (3, 3, 2, 4)), ("c/bias", (4,)), ("d_bn/gamma", (4,)),
                    ("d_bn/beta", (4,)), ("e/kernel", (2, 3, 2, 2, 3))]  # fmt: skip
PATHS = [path for path, _ in PATHS_AND_SHAPES]
ZERO_INIT, ZERO_GRAD = 1, 3
DECAY_MASK = [True, True, True, True, False, True, False, True]
ADAPT_MASK = [True, True, True, True, True, False, False, True]
EXCLUSIONS = dict(exclude_from_weight_decay=[r"bias$", r"beta$"],
                  exclude_from_layer_adaptation=[r"gamma$", r"beta$"])  # fmt: skip


def problem(seed=0, steps=6):
    """(float32 weights, one list of gradients per step) of `PATHS_AND_SHAPES`."""
    rng = np.random.default_rng(seed)
    shapes = [s for _, s in PATHS_AND_SHAPES]
    weights = [rng.normal(size=s).astype(np.float32) for s in shapes]
    weights[ZERO_INIT][:] = 0.0
    grads = [[rng.normal(scale=0.1, size=s).astype(np.float32) for s in shapes] for _ in range(steps)]
    for g in grads:
        g[ZERO_GRAD][...] = 0.0
    return weights, grads


def keras_variables(weights, paths=None):
    """float32 Keras variables holding `weights`, at `paths` ("scope/name"; default "t{i}/w")."""
    out = []
    for path, w in zip(paths or [f"t{i}/w" for i in range(len(weights))], weights):
        scope, name = path.rsplit("/", 1)
        with keras.name_scope(scope):
            out.append(keras.Variable(w, dtype="float32", name=name))
    return out


def reference(weights, steps, lrs, exclusions=False, correction=False, weight_decay=0.0, **kw):
    """Weights after `lars_step` over each step's gradients at rate `lrs[t]`; `exclusions`: the masks of
    `EXCLUSIONS` on `PATHS`; `correction`: the velocity rescaled by lr_t / lr_{t-1} first."""
    ws = [np.asarray(w, np.float64) for w in weights]
    vs = [np.zeros_like(w) for w in ws]
    for t, grads in enumerate(steps):
        scale = lrs[t] / lrs[t - 1] if correction and t > 0 else 1.0
        for i, g in enumerate(grads):
            adapt, beta = (
                (ADAPT_MASK[i], weight_decay * DECAY_MASK[i]) if exclusions else (True, weight_decay)
            )
            ws[i], vs[i] = lars_step(
                ws[i], vs[i], g, lrs[t], adapt=adapt, beta=beta, velocity_scale=scale, **kw
            )
    return ws


def trust_ratio(eta, w_norm, g_norm, beta, epsilon):
    return 1.0 if w_norm == 0 or g_norm == 0 else eta * w_norm / (g_norm + beta * w_norm + epsilon)


def lars_step(w, v, g, lr, *, momentum=0.9, beta=0.0, eta=0.001, epsilon=0.0, nesterov=False, adapt=True,
              mode="paper", velocity_scale=1.0):  # fmt: skip
    """One update; returns new (w, v). `beta` is this tensor's weight decay (0 if excluded); `v` the velocity
    as Intel Caffe's sgd_solver.cpp writes it (`w -= v`; gradient units in mode "update"), so only weights are
    compared; `velocity_scale` the momentum correction lr_t / lr_{t-1} applied to `v` first."""
    w, v, g = (np.asarray(a, dtype=np.float64) for a in (w, v, g))
    v = v * velocity_scale
    decayed = g + beta * w
    if mode == "update":
        u = momentum * v + decayed
        t = trust_ratio(eta, np.linalg.norm(w), np.linalg.norm(u), 0.0, epsilon) if adapt else 1.0
        step = lr * t * (momentum * u + decayed if nesterov else u)
        return w - step, u
    if not adapt:
        t = 1.0
    elif mode == "paper":
        t = trust_ratio(eta, np.linalg.norm(w), np.linalg.norm(g), beta, epsilon)
    else:
        t = trust_ratio(eta, np.linalg.norm(w), np.linalg.norm(decayed), 0.0, epsilon)
    scaled = lr * t * decayed
    v = momentum * v + scaled
    return w - (momentum * v + scaled if nesterov else v), v
