"""benchmarks/peer.py's `main` as `python -m benchmarks.peer` runs it, with tiny arguments and its report in
tmp_path: the peer (tf_keras + Horovod's own Keras layer) and hvd_lars's fused run, one process each, one
step of 2 images at 32x32; the report's row and provenance. The tf.matmul rate is a stand-in here:
test_benchmarks_smoke.py's record_run test measures it."""

import json
import re

import pytest

from benchmarks import common, peer


@pytest.mark.horovod  # a Horovod process per side
def test_peer_benchmark_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "matmul_rate", lambda: {"float32": 123.4, "bfloat16": 5.6, "size": 4096})
    args = ["--layouts=1", "--dtypes=float32", "--models=fused", "--image_size=32", "--batch_size=2",
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
    assert set(runs) == {"peer", "fused"}
    assert runs["peer"]["keras"].startswith("2.") and runs["fused"]["keras"].startswith("3.")
    assert all(r["ranks"] == 1 and r["weights_identical"] and r["images"] == 2 for r in runs.values())
