"""benchmarks/peer.py as results/README.md gives it (`python -m benchmarks.peer`), with tiny arguments and its
report in tmp_path: the peer (tf_keras + Horovod's own Keras layer) and hvd_lars's fused run, one process
each, one step of 2 images at 32x32; the report's row and provenance."""

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import common
from tests.support import REPO


@pytest.mark.horovod  # a Horovod process per side
def test_peer_benchmark_one_process(tmp_path):
    out = tmp_path / "peer.md"
    args = ["--layouts=1", "--dtypes=float32", "--models=fused", "--image_size=32", "--batch_size=2",
            "--warmup=1", "--steps=1", "--repetitions=1", f"--out={out}"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "benchmarks.peer", *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    assert "- Command (from the repository root): `python -m benchmarks.peer --layouts=1" in text
    cpu = common.cpu()
    assert f"CPU: {cpu['vendor']} family {cpu['family']} model {cpu['model_number']} stepping " in text
    assert re.search(r"tf\.matmul 4096\^2: \d+ GFLOP/s float32", text)
    row = re.search(r"\| 1 process \| float32 \| `applications\.ResNet50`, `fuse_batch_norm` \| ([\d.]+) \| "
                    r"([\d.]+) \| \*\*([\d.]+)\*\* \|", text)  # fmt: skip
    assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0, text
    runs = {r["name"]: r for r in json.loads((tmp_path / "peer.json").read_text())["runs"]}
    assert set(runs) == {"peer", "fused"}
    assert runs["peer"]["keras"].startswith("2.") and runs["fused"]["keras"].startswith("3.")
    assert all(r["ranks"] == 1 and r["weights_identical"] and r["images"] == 2 for r in runs.values())
