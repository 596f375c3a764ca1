"""A real single-node Slurm (Debian's slurm-wlm + munge) started on free local ports for the launch tests.

`SlurmCluster(workdir)` writes a slurm.conf for this machine, makes sure munged runs, starts slurmctld and
slurmd, and waits until the node is idle; `stop()` shuts both down. Commands run with `env` (SLURM_CONF set).
"""

import os
import shutil
import socket
import subprocess
import time

DAEMONS = ("slurmctld", "slurmd", "munged")


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
    def __init__(self, workdir):
        self.dir = str(workdir)
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def _write_conf(self):
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        cpus = os.cpu_count() or 2
        memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
        d = self.dir
        lines = [
            "ClusterName=hvdlarstest",
            f"SlurmctldHost={self.host}",
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
            "SchedulerType=sched/builtin",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd.log",
            f"NodeName={self.host} CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 "
            f"RealMemory={memory_mb} State=UNKNOWN",
            f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def start(self, timeout=60):
        self._write_conf()
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            # munged refuses to run as root; the Debian package made a munge user and key.
            os.makedirs("/run/munge", exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", _daemon("munged")], check=True)
        subprocess.run([_daemon("slurmctld"), "-f", self.conf], check=True, env=self.env)
        subprocess.run([_daemon("slurmd"), "-f", self.conf], check=True, env=self.env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.run(["sinfo", "-h", "-o", "%T"], check=False).stdout.strip()
            if state.startswith("idle"):
                return self
            time.sleep(1)
        raise RuntimeError(f"Slurm node not idle after {timeout} s (sinfo: {state!r}); logs in {self.dir}")

    def run(self, cmd, check=True, **kw):
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, **kw)

    def job_state(self, job_id):
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED, ...), from scontrol."""
        out = self.run(["scontrol", "show", "job", str(job_id)], check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait(self, job_id, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {self.job_state(job_id)} after {timeout} s")

    def stop(self):
        self.run(["scontrol", "shutdown"], check=False)
        for name in ("slurmctld", "slurmd"):
            pid_file = os.path.join(self.dir, f"{name}.pid")
            for _ in range(30):
                if not os.path.exists(pid_file):
                    break
                time.sleep(0.5)
