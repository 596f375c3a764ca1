"""benchmarks/common.py: the one least-squares fit on relative residuals, and its three forms, against
values worked out by hand (the normal equations of the rows divided by their times)."""

import pytest

from benchmarks import common


@pytest.mark.unit
def test_the_fit_weighs_each_residual_by_its_time():
    # One constant c to times 1 and 2: minimise (c - 1)^2 + ((c - 2) / 2)^2, so 2(c - 1) + (c - 2)/2 = 0,
    # c = 6/5. An unweighted fit would give the mean, 1.5.
    x, residual = common.fit([[1.0], [1.0]], [1.0, 2.0])
    assert x.tolist() == pytest.approx([1.2], rel=1e-12)
    assert residual.tolist() == pytest.approx([0.2, 0.4], rel=1e-12)  # |1.2 - 1| / 1, |1.2 - 2| / 2


@pytest.mark.unit
def test_alpha_beta_by_the_normal_equations():
    # t = alpha + S / B at S = 0, 1, 2 taking 2, 3, 6 s. Rows over t: [1/2, 0], [1/3, 1/3], [1/6, 1/3], each
    # against 1. x 36: [[14, 6], [6, 8]] (alpha, 1/B) = [36, 24], so alpha = 144/76 = 36/19 and
    # 1/B = 120/76 = 30/19. Fitted 36/19, 66/19, 96/19 s: relative misses 1/19, 3/19, 3/19.
    alpha, bandwidth, worst = common.alpha_beta([0, 1, 2], [2.0, 3.0, 6.0])
    assert alpha == pytest.approx(36 / 19, rel=1e-12)
    assert bandwidth == pytest.approx(19 / 30, rel=1e-12)
    assert worst == pytest.approx(3 / 19, rel=1e-12)


@pytest.mark.unit
def test_ring_recovers_its_terms_and_refuses_what_it_cannot_fit():
    # p = 2: 2 ring steps of 1 ms and 1 x S at 1e6 B/s: 1 KB takes 2 ms + 1 ms, 1 MB 2 ms + 1 s.
    alpha, bandwidth, worst = common.ring(2, [1e3, 1e6], [3e-3, 1.002])
    assert (alpha, bandwidth) == pytest.approx((1e-3, 1e6), rel=1e-9) and worst < 1e-12
    with pytest.raises(ValueError, match=r"ring: 1 size\(s\); 2 or more needed"):
        common.ring(2, [1e3], [3e-3])
    # Larger messages faster than smaller ones: a negative 1/B, refused naming p.
    with pytest.raises(ValueError, match=r"ring: p=2: fitted alpha=.* 1/beta=-"):
        common.ring(2, [1e3, 1e6], [1.0, 0.5])


@pytest.mark.unit
def test_ring_per_p_gives_each_p_its_latency_and_all_one_bandwidth():
    # c_2 = 5 ms, c_4 = 13 ms, B = 2e7 B/s exactly: S = 1 MiB, 16 MiB at each p.
    ps, sizes = [2, 2, 4, 4], [2**20, 2**24, 2**20, 2**24]
    times = [{2: 5e-3, 4: 13e-3}[p] + 2 * (p - 1) / p * s / 2e7 for p, s in zip(ps, sizes)]
    assert times[3] == pytest.approx(0.013 + 1.5 * 16777216 / 2e7)  # 1.271291 s
    latency, inverse_b, residual = common.ring_per_p(ps, sizes, times)
    assert latency == pytest.approx({2: 5e-3, 4: 13e-3}, rel=1e-9)
    assert 1 / inverse_b == pytest.approx(2e7, rel=1e-9) and max(residual) < 1e-9
    with pytest.raises(ValueError, match=r"ring_per_p: fitted 1/B = -.* at p = \[2, 4\]"):
        common.ring_per_p(ps, sizes, [1.0, 0.5, 1.0, 0.5])


@pytest.mark.unit
@pytest.mark.parametrize(
    "design, times, message",
    [
        ([[1.0, 0.0]], [1.0], r"design of shape \(1, 2\) and 1 times"),
        ([[1.0], [1.0]], [1.0], r"design of shape \(2, 1\) and 1 times"),
        ([[1.0], [1.0]], [1.0, 0.0], r"times \[1.0, 0.0\]; every time must be positive"),
    ],
)
def test_the_fit_refuses_what_it_cannot_weigh(design, times, message):
    with pytest.raises(ValueError, match=message):
        common.fit(design, times)
