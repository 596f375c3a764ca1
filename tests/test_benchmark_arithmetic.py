"""The arithmetic of the cluster benchmarks: the ring bound, the fit per p, the layouts, link rates."""

import pytest


@pytest.mark.unit
def test_allreduce_fit_recovers_the_ring_terms_and_layouts_are_checked():
    from benchmarks import allreduce_hosts, common

    # p = 4: 2(p - 1) = 6 ring steps of 1 ms, and 2(p - 1)/p = 1.5 x S at 25 MB/s.
    sizes = [1024, 2**20, 16 * 2**20]
    times = [6e-3 + 1.5 * s / 25e6 for s in sizes]
    assert times[2] == pytest.approx(1.01263, abs=1e-5)  # 0.006 + 1.5 x 16,777,216 / 25e6
    alpha, beta, worst = common.ring(4, sizes, times)
    assert alpha == pytest.approx(1e-3, rel=1e-9) and beta == pytest.approx(25e6, rel=1e-9)
    assert worst < 1e-9
    # 200 Mbit/s at 0.9 payload: 16 MiB over 4 ranks takes 1.5 x 16 MiB x 8 / 180e6 = 1.1185 s at best.
    assert allreduce_hosts.bound_s(16 * 2**20, 4, 200e6) == pytest.approx(1.1185, abs=1e-4)
    assert allreduce_hosts.parse_layout("4x2") == (4, 2)
    for bad in ("4", "9x1", "1x1", "4xa"):
        with pytest.raises(ValueError, match=bad):
            allreduce_hosts.parse_layout(bad)
    with pytest.raises(ValueError, match="2 or more"):
        common.ring(4, [1024], [0.01])


@pytest.mark.unit
def test_link_rates_are_read_as_tc_writes_them():
    from benchmarks import common

    assert common.link_rate_bits("200mbit") == 200e6
    assert common.link_rate_bits("1gbit") == 1e9
    assert common.link_rate_bits("2.5gbit") == 2.5e9
    assert common.link_rate_bits("64kbit") == 64e3
    for bad in ("200", "fastmbit", "1 tbit", ""):
        with pytest.raises(ValueError, match=f"link rate {bad!r}: expected"):
            common.link_rate_bits(bad)


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
    import subprocess
    import sys

    from tests.support import REPO

    log = tmp_path / "verbs"
    script = tmp_path / "emulated_cluster.sh"
    script.write_text(f'#!/bin/sh\necho "$1 $NODES $LINK_RATE" >> {log}\n')
    script.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-c", EMULATED, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 128 + 15 and "not reached" not in result.stdout, result.stderr[-2000:]
    assert log.read_text().splitlines() == ["up 4 200mbit", "down 4 200mbit"]
