"""The emulated cluster of launch/emulated_cluster.sh, seen from the tests: bring it up and down, run
commands on its hosts over ssh, read their link counters, and kill a host.

Each host nodeK is a set of namespaces (network, UTS, mount with a private /tmp) with its own sshd; every
process that runs "on" nodeK is in nodeK's network namespace, which is how `kill` finds them all.
"""

import contextlib
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support import REPO

SCRIPT = os.path.join(REPO, "launch", "emulated_cluster.sh")
SUBNET = "198.18.0.0/24"
CONTROLLER_ADDRESS = "198.18.0.1"  # the bridge: this machine as seen from the hosts
SHARED_BASE = "/var/tmp/hvd_lars_tests"  # seen by every host, unlike /tmp


def shared_folder(name):
    """A fresh folder under SHARED_BASE."""
    os.makedirs(SHARED_BASE, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name[:40]}-", dir=SHARED_BASE))


@contextlib.contextmanager
def cluster_up(nodes):
    """An `EmulatedCluster` of `nodes` hosts, up for the block and down after it (an emptied SHARED_BASE
    removed too). Fails, never skips, without root."""
    require_root()
    cluster = EmulatedCluster(nodes=nodes)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()
        if os.path.isdir(SHARED_BASE) and not os.listdir(SHARED_BASE):
            os.rmdir(SHARED_BASE)


def require_root():
    assert os.geteuid() == 0, (
        "the emulated-cluster tests need root: launch/emulated_cluster.sh creates network, UTS and mount "
        f"namespaces, a bridge and one sshd per host (running as uid {os.geteuid()}); run the tests as root, "
        "as CI does on its fresh Debian 12 machine"
    )


class Host:
    """One emulated host: its name (= `hostname` there), address, and the host-side end of its link."""

    def __init__(self, index):
        self.name = f"node{index}"
        self.address = f"198.18.0.{10 + index}"
        self.veth = f"hvdlars-n{index}"

    def run(self, command, timeout=120, check=True):
        """Runs a shell command line on this host over ssh (its login shell's minimal environment)."""
        result = subprocess.run(
            ["ssh", "-o", "BatchMode=yes", self.name, command],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"ssh {self.name} {command!r}: exit {result.returncode}\n{result.stderr[-2000:]}"
            )
        return result

    def link_bytes(self):
        """(bytes the host sent, bytes it received) on its link, from the host-side veth's counters."""
        stats = Path(f"/sys/class/net/{self.veth}/statistics")
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def pids(self):
        """Every process running on this host (in its network namespace)."""
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def set_link(self, up):
        """The link goes silent (down: no packet in or out, no reset; the processes run on) or comes back."""
        subprocess.run(["ip", "link", "set", self.veth, "up" if up else "down"], check=True, timeout=30)

    def processes_running(self, text):
        """PIDs of this host's processes whose command line contains `text`."""
        found = []
        for pid in self.pids():
            with contextlib.suppress(OSError):  # ended meanwhile
                if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                    found.append(pid)
        return found

    def kill(self, timeout=20):
        """The host dies: SIGKILL to every one of its processes (sshd, slurmd, ranks) until none is left."""
        deadline = time.time() + timeout
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.time() > deadline:
                raise RuntimeError(f"{self.name}: processes {pids} survive SIGKILL")
            time.sleep(0.05)


class EmulatedCluster:
    """`launch/emulated_cluster.sh` with `nodes` hosts (unshaped links); `up()` also revives dead hosts."""

    def __init__(self, nodes=2):
        self.hosts = [Host(k) for k in range(1, nodes + 1)]
        self.env = dict(os.environ, NODES=str(nodes), LINK_RATE="")

    def _script(self, verb):
        result = subprocess.run([SCRIPT, verb], env=self.env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"emulated_cluster.sh {verb}: {result.stdout}{result.stderr}"

    def up(self):
        self._script("up")

    def down(self):
        self._script("down")

    def host_list(self, slots):
        """horovodrun's -H list, e.g. "node1:2,node2:2"."""
        return ",".join(f"{h.name}:{slots}" for h in self.hosts)


def shell_command(argv, cwd=REPO, env=None):
    """A command line for `Host.run`: cd to `cwd`, set `env` (name -> value), run `argv`."""
    assignments = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return f"cd {shlex.quote(cwd)} && {'env ' + assignments if assignments else ''}{shlex.join(argv)}"


def wait_for_checkpoint(workdir, alive, timeout=300):
    """Waits for the smoke run's first complete checkpoint under `workdir` (named in the manager's
    `checkpoint` file); returns its step. Fails when `alive()` turns false first, or after `timeout` s."""
    state = Path(workdir) / "smoke" / "checkpoints" / "checkpoint"
    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if m := re.search(r'^model_checkpoint_path: "ckpt-([1-9]\d*)"', state.read_text(), re.M):
                return int(m.group(1))
        assert alive(), "the job ended before writing a checkpoint"
        time.sleep(0.2)
    raise TimeoutError(f"no checkpoint in {timeout} s")
