"""Elastic training across emulated hosts: a discovery script lists node1..node3 (one
worker each); node3 dies (every one of its processes killed, as a host that fails) and is left out of the
list, then boots again and is listed again. The job goes on with 2 workers, takes node3 back once its
cooldown has passed (launch/elastic.sh's COOLDOWN_S), keeps the plan's global batch and schedule, and ends
with rank 0's weights on every rank (tests/support/elastic_job.py, `host_removed_and_added`).

Needs root (launch/emulated_cluster.sh); without it the test fails with the reason, never skips. The
launcher runs on node1, as from a cluster's first node: Gloo's rendezvous address must be on the cluster
network. The run directory is outside /tmp, which each host has of its own.
"""

import json

import numpy as np
import pytest

from tests.support.elastic_job import HOSTS_TOTAL_STEPS, host_removed_and_added

NODES = 3


@pytest.mark.system
def test_a_host_removed_and_added_back_keeps_the_plan_and_ends_with_identical_weights(cluster, shared_dir):
    returncode, out, attempts = host_removed_and_added(cluster, shared_dir)
    assert returncode == 0, out[-6000:]
    assert "(global batch 96)" in out and out.count("(global batch 96)") == len(attempts)
    assert [(w, b) for w, _, b in attempts] == [(3, 32), (2, 48), (3, 32)], attempts
    updates = [u for _, u, _ in attempts]
    # Each attempt goes on from a commit (every 5 updates) after the last one's: the 2 workers from the
    # last commit before node3 died (after the checkpoint of update 10).
    assert updates[0] == 0 and 10 <= updates[1] < updates[2] < HOSTS_TOTAL_STEPS, updates
    assert updates[1] % 5 == updates[2] % 5 == 0, updates
    run_dir = shared_dir / "r"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2, 3, 4]
    assert summary["global_batch_size"] == 96 and summary["world_size"] == 3
    assert summary["hosts"] == ["node1", "node2", "node3"]
    # The plan's schedule throughout: the rate of the last update's step t = 119 in the polynomial decay of
    # WarmupPolynomialDecay: 2 x (1 - (t - 30) / 91) ** 2 (W = 30 warmup updates, D = 120 - 30 + 1).
    np.testing.assert_allclose(summary["epochs"][-1]["learning_rate"], 2 * (2 / 91) ** 2, rtol=1e-5)
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
    assert int(reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE")) == HOSTS_TOTAL_STEPS
