"""Elastic training across emulated hosts (issue 20, item 4): a discovery script lists node1..node3 (one
worker each); node3 dies (every one of its processes killed, as a host that fails) and is left out of the
list, then boots again and is listed again. The job goes on with 2 workers, takes node3 back once its
cooldown has passed (launch/elastic.sh's COOLDOWN_S), keeps the plan's global batch and schedule, and ends
with rank 0's weights on every rank.

Needs root (launch/emulated_cluster.sh); without it the test fails with the reason, never skips. The
launcher runs on node1, as from a cluster's first node: Gloo's rendezvous address must be on the cluster
network. The run directory is outside /tmp, which each host has of its own.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.support.elastic_job import ElasticJob
from tests.support.emulated_cluster import EmulatedCluster, require_root

SHARED_BASE = "/var/tmp/hvd_lars_tests"
ALL_HOSTS = "node1:1\nnode2:1\nnode3:1"
# 9,600 Fashion-MNIST images at global batch 96 (3 x 32, 2 x 48): 100 updates per epoch, 4 epochs.
STEPS_PER_EPOCH, EPOCHS = 100, 4
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS
FLAGS = [
    "--max_train_examples=9600", "--max_eval_examples=500", "--global_batch_size=96",
    f"--epochs={EPOCHS}", "--warmup_epochs=1", "--peak_learning_rate=2", "--checkpoint_every_steps=50",
    "--elastic_commit_every_steps=5", "--run_name=r", "--verbose=2", "--intra_op_threads=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def cluster():
    require_root()
    c = EmulatedCluster(nodes=3)
    try:
        c.up()
        yield c
    finally:
        c.down()


@pytest.fixture
def shared_dir(request):
    os.makedirs(SHARED_BASE, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{request.node.name[:40]}-", dir=SHARED_BASE))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _attempts(out):
    """(workers, update, per-rank batch) of each attempt, from rank 0's 'elastic attempt' lines."""
    found = []
    for line in out.splitlines():
        if "elastic attempt " in line:
            text = line.split("elastic attempt ")[1]
            workers = int(text.split(": ")[1].split(" worker(s)")[0])
            update = int(text.split("from update ")[1].split(",")[0])
            per_rank = int(text.split(", ")[1].split(" images per rank")[0])
            assert "(global batch 96)" in text, line
            found.append((workers, update, per_rank))
    return found


@pytest.mark.system
def test_a_host_removed_and_added_back_keeps_the_plan_and_ends_with_identical_weights(cluster, shared_dir):
    node3 = cluster.hosts[2]
    job = ElasticJob(
        shared_dir,
        ALL_HOSTS,
        2,
        3,
        flagfile="flags/fashion_mnist_lars.flags",
        base_flags=FLAGS,
        on_host=cluster.hosts[0],
        # node3 is taken back 2-3 s after its failure (Horovod 0.28.1: the first cooldown is 2-3 x MIN).
        env={"COOLDOWN_S": "1 5"},
    )
    try:
        job.wait_for("elastic attempt 1: 3 worker(s) from update 0, 32 images per rank", timeout=240)
        job.wait_for_file(shared_dir / "r" / "checkpoints" / "ckpt-50.index", timeout=240)
        job.set_hosts("node1:1\nnode2:1")
        node3.kill()  # the host dies: its rank, its sshd
        job.wait_for("elastic attempt 2: 2 worker(s) from update ", timeout=240)
        cluster.up()  # node3 boots again (its sshd), and is listed again
        job.set_hosts(ALL_HOSTS)
        job.wait_for("elastic attempt 3: 3 worker(s) from update ", timeout=240)
        returncode = job.finish(timeout=400)
    finally:
        if job.process.poll() is None:
            job.process.kill()
    out = job.output()
    assert returncode == 0, out[-6000:]
    attempts = _attempts(out)
    assert [(w, b) for w, _, b in attempts] == [(3, 32), (2, 48), (3, 32)], attempts
    updates = [u for _, u, _ in attempts]
    # Each attempt goes on from a commit (every 5 updates) after the last one's.
    assert updates[0] == 0 and 50 <= updates[1] < updates[2] < TOTAL_STEPS, updates
    assert updates[1] % 5 == updates[2] % 5 == 0, updates
    run_dir = shared_dir / "r"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2, 3, 4]
    assert summary["global_batch_size"] == 96 and summary["world_size"] == 3
    assert summary["hosts"] == ["node1", "node2", "node3"]
    # The plan's schedule throughout: the polynomial decay ends at update 400 (rate near 0).
    assert summary["epochs"][-1]["learning_rate"] < 1e-3
    assert summary["final_test_top1"] > 0.6
    # Every rank of the last attempt (node3's came back with nothing but the broadcast) holds rank 0's
    # weights, bit for bit.
    ranks = [np.load(run_dir / "rank_weights" / f"rank{r}.npz") for r in range(3)]
    trainable = sorted(k for k in ranks[0].files if k.startswith("t"))
    assert trainable
    for r in (1, 2):
        for key in trainable:
            np.testing.assert_array_equal(ranks[0][key], ranks[r][key], err_msg=f"rank {r}, {key}")
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(run_dir / "checkpoints"))
    assert int(reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE")) == TOTAL_STEPS
