"""An elastic job for the tests: launch/elastic.sh in the background with a host discovery script that prints
a file the caller rewrites, and its output collected line by line. The worker program is
tests/support/rank_weights_main.py (the main program, then each rank's final weights saved), on this machine
forked from tests/support/main_server.py's server (the subject is the job, not an interpreter's start)."""

import os
import re
import shlex
import subprocess
import sys
import threading
import time

from tests.support import HOROVODRUN, REPO, python_shim
from tests.support.emulated_cluster import shell_command
from tests.support.main_server import shared

# 200 updates per epoch at global batch 64 (12,800 Fashion-MNIST images), 3 epochs.
FLAGS = [
    "--max_train_examples=12800", "--max_eval_examples=500",
    "--global_batch_size=64", "--epochs=3", "--warmup_epochs=1", "--peak_learning_rate=2",
    "--checkpoint_every_steps=100", "--elastic_commit_every_steps=5", "--run_name=r", "--verbose=2",
]  # fmt: skip


class ElasticJob:
    def __init__(
        self,
        tmp_path,
        hosts,
        min_np,
        max_np,
        *flags,
        flagfile="flags/fashion_mnist_lars.flags",
        base_flags=FLAGS,
        on_host=None,
        env=None,
    ):
        """`on_host`: an emulated host (tests.support.emulated_cluster.Host) to launch from over ssh, as from
        a cluster's first node; `tmp_path` must then be a folder every host sees (not under /tmp). `env`:
        more environment variables for the launcher."""
        self.hosts = tmp_path / "hosts"
        self.hosts.write_text(hosts + "\n")
        discovery = tmp_path / "discover.sh"
        discovery.write_text(f"#!/bin/sh\ncat {self.hosts}\n")
        discovery.chmod(0o755)
        worker = os.path.join(REPO, "tests", "support", "rank_weights_main.py")
        launcher_env = dict(PYTHON=python_shim(tmp_path, worker), RANKS_PER_SOCKET="2", PYTHONPATH=REPO)
        launcher_env.update(env or {}, HOROVODRUN=HOROVODRUN)
        if on_host is None:  # the shim's worker start made a client of the server
            shim = tmp_path / "python"
            client = shlex.join(shared().rank_command([worker]))
            shim.write_text(shim.read_text().replace(f"exec {sys.executable} {worker}", f"exec {client}"))
        cmd = ["launch/elastic.sh", str(discovery), str(min_np), str(max_np), flagfile, *base_flags]
        cmd += [f"--workdir={tmp_path}", *flags]
        if on_host is not None:
            launcher_env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
            cmd = ["ssh", "-o", "BatchMode=yes", on_host.name, shell_command(cmd, env=launcher_env)]
            launcher_env = {}
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        self.process = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, **launcher_env), **pipes)
        self.lines = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def set_hosts(self, hosts):
        self.hosts.write_text(hosts + "\n")

    def wait_for(self, text, timeout=180):
        self._wait(lambda: any(text in line for line in self.lines), f"line with {text!r}", timeout)

    def _wait(self, happened, what, timeout):
        deadline = time.time() + timeout
        while not happened():
            if self.process.poll() is not None or time.time() > deadline:
                self.process.kill()
                raise AssertionError(f"no {what} after {timeout} s; output:\n{self.output()[-6000:]}")
            time.sleep(0.2)

    def finish(self, timeout=300):
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        self._reader.join(10)
        return self.process.returncode

    def output(self):
        return "".join(self.lines)


# Across emulated hosts (tests/test_elastic_hosts.py): 2,880
# Fashion-MNIST images at global batch 96 (3 x 32, 2 x 48): 30 updates per epoch, 4 epochs.
HOSTS_TOTAL_STEPS = 120
HOSTS_FLAGS = [
    "--max_train_examples=2880", "--max_eval_examples=500", "--global_batch_size=96", "--epochs=4",
    "--warmup_epochs=1", "--peak_learning_rate=2", "--checkpoint_every_steps=10",
    "--elastic_commit_every_steps=5", "--run_name=r", "--verbose=2", "--intra_op_threads=1",
]  # fmt: skip


def host_removed_and_added(cluster, shared_dir):
    """node1..node3 listed, 1 worker each, launched from node1; after the checkpoint of update 10 node3
    dies (every one of its processes killed) and is dropped from the list; once the 2 workers go on
    without it, node3 boots again and is listed again (taken back after its cooldown, COOLDOWN_S="1 5").

    `shared_dir` must be seen by every host (not under /tmp). Returns (exit status, output, [(workers,
    update, per-rank batch) of each attempt])."""
    node3 = cluster.hosts[2]
    # Horovod 0.28.1 takes a failed host back 2-3 x MIN s after its first failure.
    hosts, cooldown = "node1:1\nnode2:1\nnode3:1", {"COOLDOWN_S": "1 5"}
    job = ElasticJob(shared_dir, hosts, 2, 3, base_flags=HOSTS_FLAGS, on_host=cluster.hosts[0], env=cooldown)
    try:
        job.wait_for("elastic attempt 1: 3 worker(s) from update 0, 32 images per rank", timeout=240)
        checkpoint = shared_dir / "r" / "checkpoints" / "ckpt-10.index"
        job._wait(checkpoint.exists, checkpoint, timeout=240)
        job.set_hosts("node1:1\nnode2:1")
        node3.kill()  # the host dies: its rank, its sshd
        job.wait_for("elastic attempt 2: 2 worker(s) from update ", timeout=240)
        cluster.up()  # node3 boots again (its sshd), and is listed again
        job.set_hosts("node1:1\nnode2:1\nnode3:1")
        job.wait_for("elastic attempt 3: 3 worker(s) from update ", timeout=240)
        returncode = job.finish(timeout=400)
    finally:
        if job.process.poll() is None:
            job.process.kill()
    out = job.output()
    attempt = r"elastic attempt \d+: (\d+) worker\(s\) from update (\d+), (\d+) images per rank"
    return returncode, out, [tuple(map(int, a)) for a in re.findall(attempt, out)]
