"""benchmarks/time_to_train.py: the model's arithmetic, with hand-computed values."""

import json

import pytest

from benchmarks import time_to_train as ttt


@pytest.mark.unit
def test_updates_per_epoch_and_time_to_train():
    assert ttt.updates_per_epoch(32768) == 40  # the released AlexNet-BN solver: 4,000 updates in 100 epochs
    assert ttt.updates_per_epoch(8192) == 157 and ttt.updates_per_epoch(100, images=1000) == 10
    assert ttt.time_to_train_s(100, 32768, 0.165) == pytest.approx(660.0)  # 11 minutes
    with pytest.raises(ValueError, match="global batch 0"):
        ttt.updates_per_epoch(0)


@pytest.mark.unit
def test_ring_allreduce():
    # 2 ranks: alpha + 2 (1/2) n / B.
    assert ttt.ring_allreduce_s(100e6, 2, 1e-3, 1e8) == pytest.approx(1.001)
    # 4 ranks, 1 us per hop: alpha + 6 hops + 2 (3/4) n / B.
    assert ttt.ring_allreduce_s(100e6, 4, 1e-3, 1e8, 1e-6) == pytest.approx(1e-3 + 6e-6 + 1.5)
    # 300 MiB in messages of at most 128 MiB: 3 messages, each paying alpha and the hops.
    n = 300 * 2**20
    assert ttt.ring_allreduce_s(n, 2, 1e-3, 1e9, 1e-6) == pytest.approx(3 * (1e-3 + 2e-6) + n / 1e9)
    assert ttt.ring_allreduce_s(1e9, 1, 1.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="ranks=0"):
        ttt.ring_allreduce_s(1, 0, 0, 1)


@pytest.mark.unit
def test_step_time_and_overlap():
    # Backward is 2/3 of compute; overlap 0.75 hides 0.5 s of a 1 s allreduce behind 1 s of compute.
    assert ttt.step_time_s(1.0, 1.0, 0.75) == pytest.approx(1.5)
    assert ttt.step_time_s(1.0, 1.0) == 2.0 and ttt.step_time_s(1.0, 0.5, 1.0) == 1.0
    assert ttt.overlap_from_measurement(ttt.step_time_s(1.0, 1.0, 0.3), 1.0, 1.0) == pytest.approx(0.3)
    assert ttt.overlap_from_measurement(0.9, 1.0, 1.0) == 1.0  # all hidden and a step below compute: clipped


@pytest.mark.unit
def test_peaks_and_scaling():
    assert ttt.SOCKETS["xeon_platinum_8160"].peak_gflops == pytest.approx(24 * 2.1 * 64)  # 3,225.6
    assert ttt.SOCKETS["xeon_phi_7250"].peak_gflops == pytest.approx(68 * 1.4 * 64)  # 6,092.8
    socket = ttt.Socket("test", cores=10, ghz=2.0, flops_per_cycle=64, source="")
    assert ttt.scaled_images_per_second(10.0, 200.0, socket) == pytest.approx(64.0)  # 10 x 1280 / 200


@pytest.mark.unit
def test_predict():
    socket = ttt.Socket("test", cores=10, ghz=2.0, flops_per_cycle=64, source="")  # 1,280 GFLOP/s
    # 10 images/s here at 200 GFLOP/s -> 64 images/s per socket; 16 images per socket -> 0.25 s compute.
    p = ttt.predict(10.0, 200.0, 100e6, socket, 4, 64, 1, (1e-3, 1e9, 0.0), overlap=0.0)
    assert p["per_socket_batch"] == 16 and p["compute_s"] == pytest.approx(0.25)
    assert p["allreduce_s"] == pytest.approx(1e-3 + 0.15)
    assert p["step_s"] == pytest.approx(0.401) and p["efficiency"] == pytest.approx(0.25 / 0.401)
    assert p["time_to_train_s"] == pytest.approx(ttt.updates_per_epoch(64) * 0.401)
    with pytest.raises(ValueError, match="does not divide over 3 sockets"):
        ttt.predict(10.0, 200.0, 1, socket, 3, 64, 1, (0, 1, 0), 0)


@pytest.mark.unit
def test_validation_calibrates_on_resnet50_at_1gbit():
    # A made-up emulated-cluster run whose grouped steps are exactly compute + allreduce.
    alpha, bandwidth, grads = 1e-3, 1e8, {"resnet50": 100e6, "alexnet_bn": 200e6}
    reduce = {m: ttt.ring_allreduce_s(n, 2, alpha, bandwidth) for m, n in grads.items()}
    compute = {"resnet50": 1.5, "alexnet_bn": 1.2}
    record = {
        "compute_both_cores_busy": {"models": {m: {"modes": {"compute": [c]}} for m, c in compute.items()}},
        "ranks": {
            "world_size": 2,
            "models": {
                m: {"modes": {"grouped": [compute[m] + reduce[m]],
                              "overlap": [ttt.step_time_s(compute[m], reduce[m], 0.4)]}}
                for m in compute
            },
        },
    }  # fmt: skip
    rows, overlap = ttt.validate(
        {"scaling": {"1gbit": record}, "links": {"1gbit": (alpha, bandwidth)}}, grads
    )
    assert overlap == pytest.approx(0.4)
    assert len(rows) == 4 and all(abs(r["error"]) < 1e-12 for r in rows)
    assert [r["calibration"] for r in rows].count(True) == 1


@pytest.mark.unit
def test_throughput_records_of_one_named_cpu_are_used(tmp_path, monkeypatch):
    (tmp_path / "models_throughput").mkdir()
    (tmp_path / "communication").mkdir()
    (tmp_path / "communication" / "communication.json").write_text("{}")

    def record(name, key, rate):
        runs = [{"kind": "matmul", "gflops": {"float32": 200.0}}, {"kind": "ours", "precision": "float32",
                "images_per_second": rate, "train_gflop_per_image": 24.6}]  # fmt: skip
        cpu = {"model": "AMD EPYC", "family": "AMD EPYC with AVX-512 BF16", "key": key}
        (tmp_path / "models_throughput" / f"{name}.json").write_text(
            json.dumps({"model": "resnet50", "cpu": cpu, "runs": runs})
        )

    monkeypatch.setattr(ttt, "RESULTS", str(tmp_path))
    record("a", "AuthenticAMD family 25 model 17 stepping 1, flags 1a2b", 10.0)
    assert ttt.load_measurements()["throughput"]["resnet50"]["images_per_second"] == 10.0
    # Two EPYCs of different speed: one must be named, and only its records are used.
    record("b", "AuthenticAMD family 25 model 1 stepping 1, flags 3c4d", 20.0)
    with pytest.raises(ValueError, match=r"records of 2 CPUs .*name one with --cpu"):
        ttt.load_measurements()
    assert ttt.load_measurements("model 1 ")["throughput"]["resnet50"]["images_per_second"] == 20.0
    assert ttt.load_measurements("model 17")["throughput"]["resnet50"]["images_per_second"] == 10.0
    with pytest.raises(ValueError, match=r"no throughput record of a CPU matching --cpu='Xeon'"):
        ttt.load_measurements("Xeon")


LATENCY_S = {2: 5e-3, 4: 13e-3, 8: 30e-3}  # c_p: grows with p, as where ranks outnumber the cores


def _hosts_record(bandwidth, ps=(2, 4, 8), link_rate="200mbit", scale=None):
    """An allreduce_hosts.json whose `main` allreduces at 1 rank per host follow t = c_p + 2 (p - 1)/p x S / B
    exactly from 1 MiB on (`scale`: {(p, size): factor} spoils some), 1 KiB and 16 KiB taking c_p - 0.1 ms
    and c_p + 0.1 ms, beside rows the fit must leave out: another variant, and 2 ranks per host."""
    results = []
    for p in ps:
        for size in (2**10, 2**14):
            results.append({"layout": f"{p}x1", "p": p, "variant": "main", "size": size,
                            "median_s": LATENCY_S[p] + (1e-4 if size > 2**10 else -1e-4)})  # fmt: skip
        for size in (2**20, 2**24, 2**26):
            t = LATENCY_S[p] + 2 * (p - 1) / p * size / bandwidth
            t *= (scale or {}).get((p, size), 1.0)
            results.append({"layout": f"{p}x1", "p": p, "variant": "main", "size": size, "median_s": t})
    results += [
        {"layout": "4x2", "p": 8, "variant": "main", "size": 2**20, "median_s": 99.0},
        {"layout": "8x1", "p": 8, "variant": "mpi", "size": 2**20, "median_s": 99.0},
    ]
    return {"command": "test", "link_rate": link_rate, "results": results}


@pytest.mark.unit
def test_hosts_fit_takes_alpha_at_the_smallest_p_and_one_b_from_every_p():
    # 200 Mbit/s = 25e6 B/s; B = 20e6 B/s is 0.8 of it.
    fit = ttt.hosts_fit(_hosts_record(20e6))
    assert fit["alpha_s"] == pytest.approx(5e-3)  # the median of 4.9 and 5.1 ms at p = 2
    assert fit["bandwidth"] == pytest.approx(20e6, rel=1e-9) and fit["share"] == pytest.approx(0.8, rel=1e-9)
    assert fit["link_bits"] == 200e6
    assert sorted(fit["per_p"]) == [2, 4, 8]  # the 4x2 layout and the mpi variant are left out
    for p, f in fit["per_p"].items():
        assert f["n"] == 3 and f["worst"] < 1e-9 and f["share"] == pytest.approx(0.8, rel=1e-9)
        assert f["small_s"] == pytest.approx(LATENCY_S[p])


@pytest.mark.unit
def test_hosts_fit_keeps_each_p_alone_apart_from_the_others():
    # p = 4's 16 MiB allreduce 10% slow: p = 4's own B drops, p = 2's and 8's stay; the joint B lies
    # between, and misses p = 4 most.
    fit = ttt.hosts_fit(_hosts_record(20e6, scale={(4, 2**24): 1.1}))
    four = fit["per_p"][4]
    assert four["share"] < 0.79
    for p in (2, 8):
        assert fit["per_p"][p]["share"] == pytest.approx(0.8, rel=1e-9)
        assert fit["per_p"][p]["worst"] < four["worst"]
    assert four["share"] < fit["share"] < 0.8


@pytest.mark.unit
def test_target_link_from_hosts():
    alpha, bandwidth, latency, share = ttt.target_link({"hosts": ttt.hosts_fit(_hosts_record(20e6))})
    assert (alpha, share, latency) == pytest.approx((5e-3, 0.8, 1e-6))
    assert bandwidth == pytest.approx(0.8 * 100e9 / 8)  # 0.8 of Omni-Path's 100 Gbit/s
    with pytest.raises(ValueError, match="no results/allreduce_hosts/allreduce_hosts.json"):
        ttt.target_link({"hosts": None, "links": {}})


@pytest.mark.unit
def test_an_allreduce_record_with_one_p_leaves_the_rest_of_the_model_working(tmp_path, monkeypatch):
    for folder in ("models_throughput", "communication", "allreduce_hosts"):
        (tmp_path / folder).mkdir()
    (tmp_path / "communication" / "communication.json").write_text("{}")
    (tmp_path / "allreduce_hosts" / "allreduce_hosts.json").write_text(
        json.dumps(_hosts_record(2e7, ps=(8,)))
    )
    monkeypatch.setattr(ttt, "RESULTS", str(tmp_path))
    measurements = ttt.load_measurements()
    assert measurements["hosts"] is None
    with pytest.raises(ValueError, match=r"allreduce_hosts.json gives no fit: .*at p = \[8\]; 2 or more p"):
        ttt.target_link(measurements)
    (tmp_path / "allreduce_hosts" / "allreduce_hosts.json").write_text(json.dumps(_hosts_record(2e7)))
    assert ttt.load_measurements()["hosts"]["share"] == pytest.approx(0.8)
