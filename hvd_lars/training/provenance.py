"""Where a result came from: git commit, date, machine and software versions (for summary.json)."""

import datetime
import os
import platform
import subprocess

import keras
import tensorflow as tf


def git_sha(path=None):
    """The commit of the repository holding `path` (default: this package), with "-dirty" when the work
    tree has uncommitted changes; "unknown" outside a git checkout."""
    path = path or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def cpuinfo(path="/proc/cpuinfo"):
    """The first processor's fields of /proc/cpuinfo as {name: value} ("model name", "vendor_id",
    "cpu family", "model", "stepping", "flags", ...); {} where the file cannot be read."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the end of the first processor's block
                    continue
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def machine():
    """A one-line description of this machine: CPU model, logical cores, memory, OS."""
    cpu = cpuinfo().get("model name") or platform.processor() or platform.machine()
    memory = ""
    try:
        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    return f"{cpu}, {os.cpu_count()} logical cores{memory}, {platform.system()} {platform.release()}"


def record():
    """Dict with git_sha, date (UTC, ISO 8601), machine, python, tensorflow, keras, horovod versions."""
    try:
        import horovod  # optional: a single-process run works without it

        horovod_version = horovod.__version__
    except ImportError:
        horovod_version = None
    return {
        "git_sha": git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "horovod": horovod_version,
    }
