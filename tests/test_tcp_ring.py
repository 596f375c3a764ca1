"""benchmarks/tcp_ring.py: its arithmetic by hand, and a real ring of 3 worker processes over this machine's
loopback (no emulated cluster), each receive checked to come from the rank before it."""

import socket

import pytest

from benchmarks import tcp_ring


@pytest.mark.unit
def test_bound_and_patterns_by_hand():
    # 16 MiB over 8 hosts at 200 Mbit/s: 2 x 7/8 x 16 MiB = 29,360,128 B = 234,881,024 bit at 180 Mbit/s.
    assert tcp_ring.bound_s(16 * 2**20, 8, 200e6) == pytest.approx(234_881_024 / 180e6, rel=1e-12)
    # The stream sends the ring's whole traffic at once; the steps send S/p, 2(p - 1) times.
    assert tcp_ring.chunks(16 * 2**20, 8, "stream") == (14 * 2**21, 1)
    assert tcp_ring.chunks(16 * 2**20, 8, "steps") == (2**21, 14)
    assert tcp_ring.chunks(1000, 4, "steps") == (250, 6)
    with pytest.raises(ValueError, match="pattern 'tree': expected one of stream, steps"):
        tcp_ring.chunks(1000, 4, "tree")
    with pytest.raises(ValueError, match="p = 1: a ring needs 2 hosts or more"):
        tcp_ring.chunks(1000, 1, "stream")
    assert tcp_ring.cluster_addresses(2) == ["198.18.0.11:29517", "198.18.0.12:29517"]


@pytest.mark.unit
def test_a_repeat_takes_its_slowest_host():
    outputs = [
        {"rank": 0, "results": [{"size": 8 * 2**20, "pattern": "stream", "times_s": [1.0, 2.0, 3.0]}]},
        {"rank": 1, "results": [{"size": 8 * 2**20, "pattern": "stream", "times_s": [1.5, 1.0, 2.5]}]},
    ]
    (row,) = tcp_ring.combine(2, outputs, 100e6)
    assert row["times_s"] == [1.5, 2.0, 3.0] and row["median_s"] == 2.0
    bound = 8 * 2**20 * 8 / 90e6  # p = 2: 2(p - 1)/p = 1
    assert row["bound_s"] == pytest.approx(bound) and row["ratio"] == pytest.approx(2.0 / bound)


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.horovod
def test_three_workers_ring_over_loopback():
    addresses = [f"127.0.0.1:{port}" for port in _free_ports(3)]
    outputs = tcp_ring.run_ring(3, [3000, 2**20], ["stream", "steps"], 2, 60, addresses=addresses)
    assert [o["rank"] for o in outputs] == [0, 1, 2]
    for o in outputs:
        assert [(r["size"], r["pattern"]) for r in o["results"]] == [
            (3000, "stream"), (3000, "steps"), (2**20, "stream"), (2**20, "steps"),
        ]  # fmt: skip
        assert all(len(r["times_s"]) == 2 and min(r["times_s"]) > 0 for r in o["results"])
    rows = tcp_ring.combine(3, outputs, 1e9)
    assert [r["bound_s"] for r in rows[:2]] == [pytest.approx(2 * 2 / 3 * 3000 * 8 / 0.9e9)] * 2
