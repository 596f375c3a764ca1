"""NumPy reference of LARS, written from the update rule of the released solver (float64), for the tests."""

import numpy as np


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
