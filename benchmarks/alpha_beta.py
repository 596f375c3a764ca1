"""The alpha-beta model of an allreduce's time, fitted by least squares on relative residuals.

An allreduce of S bytes takes t = latency + bytes moved / bandwidth (Hockney's model; the ring allreduce of
Patarasuk and Yuan, J. Parallel Distrib. Comput. 69(2), 2009, moves 2(p - 1)/p x S per rank in 2(p - 1)
steps). Every fit here minimises sum_i ((design_i . x - t_i) / t_i)^2: each residual relative to its
time, so that a 1 KiB allreduce of milliseconds weighs as much as a 64 MiB one of seconds (`fit`). The
three forms the benchmarks use are thin designs over it:

    alpha_beta(sizes, times)          t = alpha + S / B                    (communication.py, 2 hosts)
    ring(p, sizes, times)             t = 2(p - 1) alpha + 2(p - 1)/p S / B   (allreduce_hosts.py, one p)
    ring_per_p(ps, sizes, times)      t = c_p + 2(p - 1)/p S / B, one c_p per p, one B for all
                                                                           (time_to_train.py's eq. 4)

Sizes are in bytes, times in seconds, bandwidths in bytes/s.
"""

import numpy as np


def fit(design, times):
    """The x minimising sum_i ((design_i . x - t_i) / t_i)^2 (numpy.linalg.lstsq on the rows divided by
    their times), and each point's |design_i . x - t_i| / t_i.

    Args:
        design: (n, k) array-like, one row per measurement.
        times: n measured times (s), all positive.
    Returns:
        (x: (k,) float array, relative residuals: (n,) float array).
    Raises:
        ValueError: fewer rows than unknowns, a shape mismatch, or a time that is not positive.
    """
    design, t = np.asarray(design, float), np.asarray(times, float)
    if design.ndim != 2 or design.shape[0] != t.shape[0] or design.shape[0] < design.shape[1]:
        raise ValueError(
            f"fit: design of shape {design.shape} and {t.shape[0]} times; one row per time and at least "
            f"as many rows as unknowns needed"
        )
    if not np.all(t > 0):
        raise ValueError(f"fit: times {t.tolist()}; every time must be positive (they weigh the residuals)")
    x, *_ = np.linalg.lstsq(design / t[:, None], np.ones_like(t), rcond=None)
    return x, np.abs(design @ x - t) / t


def alpha_beta(sizes, times):
    """t = alpha + S / B fitted to allreduces of `sizes` bytes that took `times` s (`fit`).

    Returns:
        (alpha s, B bytes/s, the largest relative residual).
    """
    sizes = np.asarray(sizes, float)
    (alpha, inverse_b), residual = fit(np.stack([np.ones_like(sizes), sizes], axis=1), times)
    return float(alpha), float(1 / inverse_b), float(np.max(residual))


def ring(p, sizes, times):
    """t = 2(p - 1) alpha + 2(p - 1)/p x S / B fitted to one p's allreduces (`fit`).

    Returns:
        (alpha s per ring step, B bytes/s, the largest relative residual).
    Raises:
        ValueError: fewer than 2 sizes, or a fitted alpha or 1/B that is not positive.
    """
    if len(sizes) < 2:
        raise ValueError(f"ring: {len(sizes)} size(s); 2 or more needed")
    steps = 2.0 * (p - 1)
    design = np.stack([np.full(len(sizes), steps), steps / p * np.asarray(sizes, float)], 1)
    (alpha, inverse_beta), residual = fit(design, times)
    if alpha <= 0 or inverse_beta <= 0:
        raise ValueError(f"ring: p={p}: fitted alpha={alpha:.3g} s, 1/beta={inverse_beta:.3g} s/B")
    return float(alpha), float(1.0 / inverse_beta), float(np.max(residual))


def ring_per_p(ps, sizes, times):
    """t = c_p + 2(p - 1)/p x S / B fitted to allreduces at several p at once: a latency c_p for each p,
    one B for all (`fit`).

    Args:
        ps, sizes, times: one entry per allreduce (ranks, bytes, s).
    Returns:
        ({p: c_p s}, 1/B s per byte, relative residuals as a float array in the order given).
    Raises:
        ValueError: a fitted 1/B that is not positive, naming the p.
    """
    p = np.asarray(ps, float)
    distinct = sorted(set(p.tolist()))
    latency_columns = [(p == q).astype(float) for q in distinct]
    design = np.stack(latency_columns + [2 * (p - 1) / p * np.asarray(sizes, float)], 1)
    x, residual = fit(design, times)
    if x[-1] <= 0:
        raise ValueError(f"ring_per_p: fitted 1/B = {x[-1]:.3g} s/B at p = {[int(q) for q in distinct]}")
    return {int(q): float(c) for q, c in zip(distinct, x[:-1])}, float(x[-1]), residual
