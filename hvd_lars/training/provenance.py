"""Where a result came from: git commit, date, machine and software versions (for summary.json)."""

import datetime
import os
import platform
import subprocess


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


def machine():
    """A one-line description of this machine: CPU model, logical cores, memory, OS."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = ""
    try:
        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    return f"{cpu}, {os.cpu_count()} logical cores{memory}, {platform.system()} {platform.release()}"


# CPU flags that decide training speed here (/proc/cpuinfo): AVX-512, native bfloat16, AMX tiles.
CPU_FLAGS = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8")


def cpu():
    """This machine's CPU for benchmark records: dict with `model` (/proc/cpuinfo's model name), `flags`
    (those of CPU_FLAGS it has) and `family`, a short name for one table section per kind of CPU (e.g.
    "AMD EPYC with AVX-512 BF16", "Intel Xeon with AMX")."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and "model name" not in flags:
                    model = line.split(":", 1)[1].strip()
                    flags.add("model name")
                if line.startswith("flags"):
                    flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [f for f in CPU_FLAGS if f in flags]
    family = "AMD EPYC" if "EPYC" in model else ("Intel Xeon" if "Xeon" in model else model)
    if "amx_bf16" in have:
        family += " with AMX"
    elif "avx512_bf16" in have:
        family += " with AVX-512 BF16"
    return {"model": model, "flags": have, "family": family}


def record():
    """Dict with git_sha, date (UTC, ISO 8601), machine, python, tensorflow, keras, horovod versions."""
    import keras
    import tensorflow as tf

    try:
        import horovod

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
