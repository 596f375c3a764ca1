"""The benchmarks' fits, ring bound, layouts and link rates by hand; the emulated cluster taken down."""

import subprocess
import sys

import pytest

from benchmarks import allreduce_hosts, common
from tests.support import REPO


@pytest.mark.unit
def test_the_fits_the_ring_bound_layouts_and_link_rates():
    # One constant c to times 1 and 2: minimise (c - 1)^2 + ((c - 2) / 2)^2, so c = 6/5 (unweighted: 1.5).
    x, residual = common.fit([[1.0], [1.0]], [1.0, 2.0])
    assert (*x, *residual) == pytest.approx((1.2, 0.2, 0.4), rel=1e-12)  # |1.2 - 1| / 1, |1.2 - 2| / 2
    # t = alpha + S / B at S = 0, 1, 2 taking 2, 3, 6 s. Rows over t: [1/2, 0], [1/3, 1/3], [1/6, 1/3], each
    # against 1. x 36: [[14, 6], [6, 8]] (alpha, 1/B) = [36, 24], so alpha = 144/76 = 36/19 and
    # 1/B = 120/76 = 30/19. Fitted 36/19, 66/19, 96/19 s: relative misses 1/19, 3/19, 3/19.
    assert common.alpha_beta([0, 1, 2], [2.0, 3.0, 6.0]) == pytest.approx(
        (36 / 19, 19 / 30, 3 / 19), rel=1e-12
    )
    # p = 4: 2(p - 1) = 6 ring steps of 1 ms, and 2(p - 1)/p = 1.5 x S at 25 MB/s.
    sizes = [1024, 2**20, 16 * 2**20]
    alpha, beta, worst = common.ring(4, sizes, [6e-3 + 1.5 * s / 25e6 for s in sizes])
    assert (alpha, beta) == pytest.approx((1e-3, 25e6), rel=1e-9) and worst < 1e-9
    # c_2 = 5 ms, c_4 = 13 ms, B = 2e7 B/s exactly: S = 1 MiB, 16 MiB at each p.
    ps, sizes = [2, 2, 4, 4], [2**20, 2**24, 2**20, 2**24]
    times = [{2: 5e-3, 4: 13e-3}[p] + 2 * (p - 1) / p * s / 2e7 for p, s in zip(ps, sizes)]
    latency, inverse_b, residual = common.ring_per_p(ps, sizes, times)
    assert latency == pytest.approx({2: 5e-3, 4: 13e-3}, rel=1e-9)
    assert 1 / inverse_b == pytest.approx(2e7, rel=1e-9) and max(residual) < 1e-9
    # 200 Mbit/s at 0.9 payload: 16 MiB over 4 ranks takes 1.5 x 16 MiB x 8 / 180e6 = 1.1185 s at best.
    assert allreduce_hosts.bound_s(16 * 2**20, 4, 200e6) == pytest.approx(1.1185, abs=1e-4)
    assert allreduce_hosts.parse_layout("4x2") == (4, 2)
    rates = [common.link_rate_bits(r) for r in ("200mbit", "1gbit", "2.5gbit", "64kbit")]
    assert rates == [200e6, 1e9, 2.5e9, 64e3]


@pytest.mark.unit
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: common.fit([[1.0, 0.0]], [1.0]), r"design of shape \(1, 2\) and 1 times"),
        (lambda: common.fit([[1.0], [1.0]], [1.0]), r"design of shape \(2, 1\) and 1 times"),
        (lambda: common.fit([[1.0], [1.0]], [1.0, 0.0]), r"times \[1.0, 0.0\]; every time must be positive"),
        (lambda: common.ring(4, [1024], [0.01]), r"ring: 1 size\(s\); 2 or more needed"),
        # Larger messages faster than smaller ones: a negative 1/B, refused naming p.
        (lambda: common.ring(2, [1e3, 1e6], [1.0, 0.5]), r"ring: p=2: fitted alpha=.* 1/beta=-"),
        (lambda: common.ring_per_p([2, 2, 4, 4], [1, 2] * 2, [1.0, 0.5] * 2), r"1/B = -.* at p = \[2, 4\]"),
        *[(lambda bad=bad: allreduce_hosts.parse_layout(bad), bad) for bad in ("4", "9x1", "1x1", "4xa")],
        *[(lambda bad=bad: common.link_rate_bits(bad), f"link rate {bad!r}: expected")
          for bad in ("200", "fastmbit", "1 tbit", "")],
    ],
)  # fmt: skip
def test_what_the_fits_and_parsers_refuse(call, message):
    with pytest.raises(ValueError, match=message):
        call()


EMULATED = """
import os, signal, sys
from benchmarks import common
common.EMULATED_CLUSTER = sys.argv[1]
with common.emulated_cluster(4, "200mbit") as env:
    assert env["NODES"] == "4" and env["LINK_RATE"] == "200mbit"
    os.kill(os.getpid(), signal.SIGTERM)
    print("not reached")
"""


@pytest.mark.horovod  # a subprocess (the tier of tests that start processes); no root, no Horovod ranks
def test_the_emulated_cluster_is_taken_down_when_the_benchmark_is_terminated(tmp_path):
    log, script = tmp_path / "verbs", tmp_path / "emulated_cluster.sh"
    script.write_text(f'#!/bin/sh\necho "$1 $NODES $LINK_RATE" >> {log}\n')
    script.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-c", EMULATED, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 128 + 15 and "not reached" not in result.stdout, result.stderr[-2000:]
    assert log.read_text().splitlines() == ["up 4 200mbit", "down 4 200mbit"]
