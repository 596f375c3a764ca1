"""benchmarks/time_to_train.py: the model's arithmetic, with hand-computed values."""

import json

import pytest

from benchmarks import time_to_train as ttt

SOCKET = ttt.Socket("test", cores=10, ghz=2.0, flops_per_cycle=64, source="")  # 1,280 GFLOP/s
N = 300 * 2**20  # 300 MiB: 3 fused messages of at most 128 MiB


@pytest.mark.unit
@pytest.mark.parametrize(
    "function, args, expected",
    [
        (ttt.updates_per_epoch, (32768,), 40),  # the released AlexNet-BN solver: 4,000 updates in 100 epochs
        (ttt.updates_per_epoch, (100, 1000), 10),
        (ttt.time_to_train_s, (100, 32768, 0.165), 660.0),  # 11 minutes
        (ttt.ring_allreduce_s, (100e6, 2, 1e-3, 1e8), 1.001),  # alpha + 2 (1/2) n / B
        (ttt.ring_allreduce_s, (100e6, 4, 1e-3, 1e8, 1e-6), 1e-3 + 6e-6 + 1.5),  # 6 hops, 2 (3/4) n / B
        (ttt.ring_allreduce_s, (N, 2, 1e-3, 1e9, 1e-6), 3 * (1e-3 + 2e-6) + N / 1e9),  # each pays alpha, hops
        (ttt.ring_allreduce_s, (1e9, 1, 1.0, 1.0), 0.0),
        (ttt.step_time_s, (1.0, 1.0, 0.75), 1.5),  # backward 2/3 of compute hides 0.5 s of the allreduce
        (ttt.step_time_s, (1.0, 1.0), 2.0),
        (ttt.step_time_s, (1.0, 0.5, 1.0), 1.0),
        (ttt.overlap_from_measurement, (1.0 + 1.0 - 0.3 * 2 / 3, 1.0, 1.0), 0.3),
        (ttt.overlap_from_measurement, (0.9, 1.0, 1.0), 1.0),  # a step below compute: clipped
        (ttt.scaled_images_per_second, (10.0, 200.0, SOCKET), 64.0),  # 10 x 1280 / 200
    ],
)
def test_arithmetic(function, args, expected):
    assert function(*args) == pytest.approx(expected)


@pytest.mark.unit
def test_predict_and_what_is_refused():
    # 10 images/s here at 200 GFLOP/s -> 64 images/s per socket; 16 images per socket -> 0.25 s compute.
    p = ttt.predict(10.0, 200.0, 100e6, SOCKET, 4, 64, 1, (1e-3, 1e9, 0.0), overlap=0.0)
    assert p["per_socket_batch"] == 16 and p["compute_s"] == pytest.approx(0.25)
    assert p["allreduce_s"] == pytest.approx(1e-3 + 0.15) and p["step_s"] == pytest.approx(0.401)
    assert (p["efficiency"], p["time_to_train_s"]) == pytest.approx((0.25 / 0.401, 20019 * 0.401))  # 1 epoch
    with pytest.raises(ValueError, match="does not divide over 3 sockets"):
        ttt.predict(10.0, 200.0, 1, SOCKET, 3, 64, 1, (0, 1, 0), 0)
    with pytest.raises(ValueError, match="global batch 0"):
        ttt.updates_per_epoch(0)
    with pytest.raises(ValueError, match="ranks=0"):
        ttt.ring_allreduce_s(1, 0, 0, 1)


@pytest.mark.unit
def test_validation_calibrates_on_resnet50_at_1gbit():
    # A made-up emulated-cluster run whose grouped steps are exactly compute + allreduce.
    alpha, bandwidth, grads = 1e-3, 1e8, {"resnet50": 100e6, "alexnet_bn": 200e6}
    reduce = {m: ttt.ring_allreduce_s(n, 2, alpha, bandwidth) for m, n in grads.items()}
    c = {"resnet50": 1.5, "alexnet_bn": 1.2}
    modes = {m: {"grouped": [c[m] + reduce[m]], "overlap": [ttt.step_time_s(c[m], reduce[m], 0.4)]}
             for m in c}  # fmt: skip
    record = {"compute_both_cores_busy": {"models": {m: {"modes": {"compute": [c[m]]}} for m in c}},
              "ranks": {"world_size": 2, "models": {m: {"modes": modes[m]} for m in c}}}  # fmt: skip
    links = {"1gbit": (alpha, bandwidth)}
    rows, overlap = ttt.validate({"scaling": {"1gbit": record}, "links": links}, grads)
    assert overlap == pytest.approx(0.4) and len(rows) == 4 and all(abs(r["error"]) < 1e-12 for r in rows)
    assert [r["calibration"] for r in rows].count(True) == 1


LATENCY_S = {2: 5e-3, 4: 13e-3, 8: 30e-3}  # c_p: grows with p, as where ranks outnumber the cores


def _hosts_record(bandwidth, ps=(2, 4, 8), scale=None):
    """An allreduce_hosts.json whose `main` allreduces at 1 rank per host follow t = c_p + 2 (p - 1)/p x S / B
    exactly from 1 MiB on (`scale`: {(p, size): factor} spoils some), 1 KiB and 16 KiB taking c_p - 0.1 ms
    and c_p + 0.1 ms, beside rows the fit must leave out: another variant, and 2 ranks per host."""
    results = [{"layout": "4x2", "p": 8, "variant": "main", "size": 2**20, "median_s": 99.0},
               {"layout": "8x1", "p": 8, "variant": "mpi", "size": 2**20, "median_s": 99.0}]  # fmt: skip
    small = {2**10: -1e-4, 2**14: 1e-4}
    for p in ps:
        for size in (*small, 2**20, 2**24, 2**26):
            t = LATENCY_S[p] + small.get(size, 2 * (p - 1) / p * size / bandwidth)
            t *= (scale or {}).get((p, size), 1.0)
            results.append({"layout": f"{p}x1", "p": p, "variant": "main", "size": size, "median_s": t})
    return {"command": "test", "link_rate": "200mbit", "results": results}


@pytest.mark.unit
def test_hosts_fit_takes_alpha_at_the_smallest_p_and_b_from_every_p_alone_and_together():
    # 200 Mbit/s = 25e6 B/s; B = 20e6 B/s is 0.8 of it.
    fit = ttt.hosts_fit(_hosts_record(20e6))
    assert fit["alpha_s"] == pytest.approx(5e-3)  # the median of 4.9 and 5.1 ms at p = 2
    assert (fit["bandwidth"], fit["share"], fit["link_bits"]) == pytest.approx((20e6, 0.8, 200e6), rel=1e-9)
    assert sorted(fit["per_p"]) == [2, 4, 8]  # the 4x2 layout and the mpi variant are left out
    for p, f in fit["per_p"].items():
        assert f["n"] == 3 and f["worst"] < 1e-9 and f["share"] == pytest.approx(0.8, rel=1e-9)
        assert f["small_s"] == pytest.approx(LATENCY_S[p])
    alpha, bandwidth, latency, share = ttt.target_link({"hosts": fit})
    # B: 0.8 of Omni-Path's 100 Gbit/s.
    assert (alpha, share, latency, bandwidth) == pytest.approx((5e-3, 0.8, 1e-6, 0.8 * 100e9 / 8))
    # p = 4's 16 MiB allreduce 10% slow: p = 4's own B drops, p = 2's and 8's stay; the joint B lies between.
    fit = ttt.hosts_fit(_hosts_record(20e6, scale={(4, 2**24): 1.1}))
    four = fit["per_p"][4]
    assert four["share"] < fit["share"] < 0.8 and four["share"] < 0.79
    for f in (fit["per_p"][2], fit["per_p"][8]):
        assert f["share"] == pytest.approx(0.8, rel=1e-9) and f["worst"] < four["worst"]


@pytest.mark.unit
def test_measurements_of_one_named_cpu_and_an_allreduce_record_of_one_p(tmp_path, monkeypatch):
    for folder in ("models_throughput", "communication", "allreduce_hosts"):
        (tmp_path / folder).mkdir()
    (tmp_path / "communication" / "communication.json").write_text("{}")
    monkeypatch.setattr(ttt, "RESULTS", str(tmp_path))

    def record(name, key, rate):
        runs = [{"kind": "matmul", "gflops": {"float32": 200.0}}, {"kind": "ours", "precision": "float32",
                "images_per_second": rate, "train_gflop_per_image": 24.6}]  # fmt: skip
        cpu = {"model": "AMD EPYC", "family": "AMD EPYC with AVX-512 BF16", "key": key}
        (tmp_path / "models_throughput" / f"{name}.json").write_text(json.dumps(
            {"model": "resnet50", "cpu": cpu, "runs": runs}))  # fmt: skip

    rate = lambda cpu=None: ttt.load_measurements(cpu)["throughput"]["resnet50"]["images_per_second"]  # noqa: E731
    record("a", "AuthenticAMD family 25 model 17 stepping 1, flags 1a2b", 10.0)
    assert rate() == 10.0
    # Two EPYCs of different speed: one must be named, and only its records are used.
    record("b", "AuthenticAMD family 25 model 1 stepping 1, flags 3c4d", 20.0)
    assert rate("model 1 ") == 20.0 and rate("model 17") == 10.0
    for cpu, message in ((None, r"records of 2 CPUs .*name one with --cpu"),
                         ("Xeon", r"no throughput record of a CPU matching --cpu='Xeon'")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ttt.load_measurements(cpu)
    # An allreduce record of one p gives no fit; the rest of the model still loads.
    hosts = tmp_path / "allreduce_hosts" / "allreduce_hosts.json"
    hosts.write_text(json.dumps(_hosts_record(2e7, ps=(8,))))
    measurements = ttt.load_measurements("model 17")
    assert measurements["hosts"] is None
    with pytest.raises(ValueError, match=r"allreduce_hosts.json gives no fit: .*at p = \[8\]; 2 or more p"):
        ttt.target_link(measurements)
    hosts.write_text(json.dumps(_hosts_record(2e7)))
    assert ttt.load_measurements("model 17")["hosts"]["share"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="no results/allreduce_hosts/allreduce_hosts.json"):
        ttt.target_link({"hosts": None, "links": {}})
