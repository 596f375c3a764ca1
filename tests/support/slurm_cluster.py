"""A real Slurm (Debian's slurm-wlm + munge) on free ports for the launch tests: on this machine alone
(`SlurmCluster(workdir)`), or with one slurmd per emulated host (`hosts=cluster.hosts`), started over ssh so
that it lives in that host's namespaces and takes its name; `workdir` must then be outside /tmp, which each
host has of its own. `start()` waits until every node is idle; `stop()` shuts the daemons down.
"""

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged")

# A node whose slurmd stops answering is declared DOWN after this many seconds (Slurm's default is 300),
# which fails the jobs on it (host-failure tests); slurmd pings every SlurmdTimeout / 3.
SLURMD_TIMEOUT_S = 10
# Seconds from SIGTERM to SIGKILL when Slurm ends a step (Slurm's default 30 s): the ranks left on the live
# node of a failed one, blocked on the dead peer, cannot stop on SIGTERM, and the requeued job waits for them.
KILL_WAIT_S = 5
NODE_SPOOL = "/tmp/hvd_lars_slurmd"  # on an emulated node: in that node's private /tmp


def slurm_available():
    return all(shutil.which(d) or os.path.exists(f"/usr/sbin/{d}") for d in DAEMONS) and bool(
        shutil.which("sbatch")
    )


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, workdir, hosts=None, controller_address=None):
        self.dir = str(workdir)
        self.controller = socket.gethostname().split(".")[0]
        self.controller_address = controller_address
        self.hosts = hosts
        self.node_names = [h.name for h in hosts] if hosts else [self.controller]
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def _write_conf(self):
        os.makedirs(os.path.join(self.dir, "state"), exist_ok=True)
        if not self.hosts:
            os.makedirs(os.path.join(self.dir, "spool", self.controller), exist_ok=True)
        cpus = os.cpu_count() or 2
        memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
        d = self.dir
        controller = self.controller + (f"({self.controller_address})" if self.controller_address else "")
        lines = [
            "ClusterName=hvdlarstest",
            f"SlurmctldHost={controller}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
            f"KillWait={KILL_WAIT_S}",
            "SchedulerType=sched/builtin",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={d}/state",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            # One spool, pid and log file per node (%n: the node's name): emulated nodes share this folder.
            # An emulated node keeps its spool in its own /tmp, node-local as on a real node, and emptied
            # when the host boots again (a dead step's PMIx socket left there would block the requeued job).
            f"SlurmdSpoolDir={NODE_SPOOL if self.hosts else d + '/spool/%n'}",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmdLogFile={d}/slurmd-%n.log",
        ]
        for i, name in enumerate(self.node_names):
            address = f" NodeAddr={self.hosts[i].address}" if self.hosts else ""
            lines.append(
                f"NodeName={name}{address} CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 "
                f"RealMemory={memory_mb} State=UNKNOWN"
            )
        nodes = ",".join(self.node_names)
        lines.append(
            f"PartitionName=test Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
        )
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def start(self, timeout=60):
        assert slurm_available(), (
            "Slurm is not installed: `make test` installs slurm-wlm and munge (install/test_services.sh)"
        )
        self._write_conf()
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            # munged refuses to run as root; the Debian package made a munge user and key.
            os.makedirs("/run/munge", exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", _daemon("munged")], check=True)
        subprocess.run([_daemon("slurmctld"), "-f", self.conf], check=True, env=self.env)
        for name in self.node_names:
            self.start_slurmd(name)
        return self.wait_idle(timeout)

    def start_slurmd(self, name):
        """Starts the slurmd of node `name`: on this machine, or on the emulated host over ssh."""
        if not self.hosts:
            subprocess.run([_daemon("slurmd"), "-f", self.conf], check=True, env=self.env, timeout=60)
            return
        host = next(h for h in self.hosts if h.name == name)
        host.run(f"mkdir -p {NODE_SPOOL} && {_daemon('slurmd')} -f {self.conf}", timeout=60)

    def wait_idle(self, timeout=60):
        """Waits until every node is idle; returns self."""
        deadline = time.time() + timeout
        states = []
        while time.time() < deadline:
            states = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split("\n")
            states = [s for s in states if s.strip()]
            if len(states) == len(self.node_names) and all(s.split()[1].startswith("idle") for s in states):
                return self
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not idle after {timeout} s (sinfo: {states!r}); logs in {self.dir}")

    def run(self, cmd, check=True, **kw):
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, **kw)

    def job_state(self, job_id):
        return self.job_field(job_id, "JobState") or "UNKNOWN"

    def job_field(self, job_id, key):
        """One field of `scontrol show job` (e.g. "Restarts", "JobState"), or None."""
        out = self.run(["scontrol", "show", "job", str(job_id)], check=False).stdout
        return next((f.split("=", 1)[1] for f in out.split() if f.startswith(f"{key}=")), None)

    def wait(self, job_id, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} still {self.job_state(job_id)} after {timeout} s")

    def start_requeued_now(self, job_id, timeout=120):
        """Starts a requeued job now, which Slurm holds back (Reason=BeginTime) as a real pre-emption would,
        once it is pending and its last attempt is gone: no slurmstepd of it left (the requeued step 0 would
        find its PMIx socket in use), every node idle, and the clock past that second (Slurm refuses a job
        started in the second its credential was revoked in)."""
        self.wait(job_id, ("PENDING",), timeout)
        deadline = time.time() + timeout
        while _slurmstepd_pids(job_id):
            if time.time() > deadline:
                raise TimeoutError(f"job {job_id}'s slurmstepd still running after {timeout} s")
            time.sleep(0.2)
        self.wait_idle(timeout)
        second = int(time.time())
        while int(time.time()) <= second:
            time.sleep(0.05)
        result = self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
        if result.returncode != 0:
            shown = self.run(["scontrol", "show", "job", str(job_id)], check=False).stdout
            raise RuntimeError(f"job {job_id} could not be released: {result.stderr.strip()}\n{shown}")

    def stop(self, timeout=30):
        """Shuts the daemons down and waits until their processes are gone."""
        self.run(["scontrol", "shutdown"], check=False)
        deadline = time.time() + timeout
        # slurmctld asks each slurmd to stop, but may exit before an emulated node's slurmd hears it: once
        # slurmctld is gone, a slurmd still running is stopped directly.
        controller = os.path.join(self.dir, "slurmctld.pid")
        while time.time() < deadline and _alive(controller):
            time.sleep(0.1)
        for pid_file in glob.glob(os.path.join(self.dir, "slurmd*.pid")):
            if _alive(pid_file):
                with open(pid_file) as f:
                    os.kill(int(f.read().strip()), signal.SIGTERM)
        while time.time() < deadline and any(
            _alive(p) for p in glob.glob(os.path.join(self.dir, "slurm*.pid"))
        ):
            time.sleep(0.5)


def _slurmstepd_pids(job_id):
    """PIDs of job `job_id`'s slurmstepd processes, each named "slurmstepd: [<job>.<step>]" (the emulated
    hosts share this machine's process table)."""
    pids = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{entry}/cmdline").read_bytes().startswith(f"slurmstepd: [{job_id}.".encode()):
                pids.append(int(entry))
    return pids


def _alive(pid_file):
    """True while the daemon of `pid_file` runs (a zombie, which has no command line, counts as gone)."""
    try:
        with open(pid_file) as f, open(f"/proc/{int(f.read().strip())}/cmdline", "rb") as cmdline:
            return bool(cmdline.read())
    except (OSError, ValueError):
        return False
