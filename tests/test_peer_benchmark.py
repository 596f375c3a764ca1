"""benchmarks/peer.py: `main` with tiny arguments, report in tmp_path (the peer, tf_keras + Horovod's Keras
layer, and hvd_lars's fused and own runs, one process each, one step of 2 images at 32x32; the report's
rows and provenance; the tf.matmul rate a stand-in: test_benchmarks_smoke.py measures it); the profile's
op times."""

import json
import re

import pytest

from benchmarks import common, peer


@pytest.mark.horovod  # a Horovod process per side
def test_peer_benchmark_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "matmul_rate", lambda: {"float32": 123.4, "bfloat16": 5.6, "size": 4096})
    args = ["--layouts=1", "--dtypes=float32", "--models=fused,own", "--image_size=32", "--batch_size=2",
            "--warmup=1", "--steps=1", "--repetitions=1", f"--out={tmp_path / 'peer.md'}"]  # fmt: skip
    peer.main(args)
    text = (tmp_path / "peer.md").read_text()
    assert "- Command (from the repository root): `python -m benchmarks.peer --layouts=1" in text
    cpu = common.cpu()
    assert f"CPU: {cpu['vendor']} family {cpu['family']} model {cpu['model_number']} stepping " in text
    assert "tf.matmul 4096^2: 123 GFLOP/s float32, 6 bfloat16" in text  # this run's rate
    row = re.search(r"\| 1 process \| float32 \| `applications\.ResNet50`, `fuse_batch_norm` \| ([\d.]+) \| "
                    r"([\d.]+) \| \*\*([\d.]+)\*\* \|", text)  # fmt: skip
    assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0, text
    runs = {r["name"]: r for r in json.loads((tmp_path / "peer.json").read_text())["runs"]}
    assert set(runs) == {"peer", "fused", "peer_own", "own"}
    assert [runs[n]["keras"][:2] for n in ("peer", "peer_own", "fused", "own")] == ["2.", "2.", "3.", "3."]
    # The own row's peer is the same network in Keras 2: ResNet-50 v1.5's 25,557,032 parameters on both sides.
    assert runs["peer_own"]["trainable_parameters"] == runs["own"]["trainable_parameters"] == 25_557_032
    own = re.search(r"\| 1 process \| float32 \| project's `get_model\('resnet50'\)` \| ([\d.]+) \|", text)
    assert own and float(own.group(1)) == round(runs["peer_own"]["images_per_cpu_s"], 3), text
    assert all(r["ranks"] == 1 and r["weights_identical"] and r["images"] == 2 for r in runs.values())


@pytest.mark.unit
def test_profile_op_times_by_layer_kind_for_both_naming_schemes(tmp_path):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()  # events "<op name>:<op type>"; Keras's *_bn, *_bn_1; the project's *_bnN
    plane = space.planes.add(name="/host:CPU")
    for i, name in enumerate(["a_bn/F:FusedBatchNormV3", "a_bn_1/M:Mul", "b_bn2_1/F:FusedBatchNormV3",
                              "conv1/C:Conv2D", "conv1_bnx/R:Relu", "Executor::Run:Run"]):  # fmt: skip
        plane.event_metadata[i].name = name
        plane.lines.add().events.add(metadata_id=i, duration_ps=2**i * 10**9)  # op i: 2^i ms
    (tmp_path / "x.xplane.pb").write_bytes(space.SerializeToString())
    times = peer.op_times(str(tmp_path))
    assert times["by_layer"] == {"batch norm": 1 + 2 + 4, "convolution": 8, "other": 16}
    assert times["by_type"]["FusedBatchNormV3"] == 1 + 4 and "Run" not in times["by_type"]
