"""horovodrun for the tests whose subject is the job it starts, not the launcher: Horovod's own launcher
(`horovod.runner.launch.run_commandline`, what .venv/bin/horovodrun calls) with one thing changed, its build
check made once per installed Horovod instead of at every start.

At each start, horovodrun asks whether its extension was built with MPI (or Gloo) by importing
horovod.tensorflow, and with it TensorFlow, in a forked process: about 7 s of CPU per job on this repository's
2-core machines, more than the ranks of a short job spend training. Here the first start runs that check
(Horovod's own `mpi_built` and `gloo_built`) and writes its answers to `CACHE`, keyed by the extension
library's path, size and modification time; later starts read them, and a rebuilt Horovod is checked again.
Everything else (the host list, MPI's or Gloo's launch, the environment the ranks get, elastic mode) is the
launcher's own code. The tests of the launcher as a user runs it (the README's commands, launch/*.sh, the
cluster and Slurm tests, test_setup's user) start the real horovodrun.

Usage: `python tests/support/horovodrun_checked_once.py` with horovodrun's arguments (`HOROVODRUN` below).
"""

import glob
import json
import os
import sys
import tempfile

HOROVODRUN = [sys.executable, os.path.abspath(__file__)]
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "hvd_lars", "horovod_built.json")


def extension_key():
    """The installed extension library's path, size and modification time (None: no extension)."""
    import horovod

    folder = os.path.join(os.path.dirname(horovod.__file__), "tensorflow")
    libraries = sorted(glob.glob(os.path.join(folder, "mpi_lib*.so")))
    if not libraries:
        return None
    stat = os.stat(libraries[0])
    return f"{libraries[0]}:{stat.st_size}:{stat.st_mtime_ns}"


def built_answers(cache=CACHE):
    """{"mpi": ..., "gloo": ...}: Horovod's answers to "built with MPI / with Gloo", from `cache` when it
    holds this extension's, otherwise from Horovod's check (then written to `cache`)."""
    from horovod.common import util

    key = extension_key()
    try:
        with open(cache) as f:
            cached = json.load(f)
        if key is not None and cached.get("key") == key:
            return {"mpi": cached["mpi"], "gloo": cached["gloo"]}
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    answers = {"mpi": util.mpi_built(), "gloo": util.gloo_built()}
    if key is not None and answers["mpi"] is not None:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=os.path.dirname(cache), prefix=".horovod_built.")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, **answers}, f)
        os.replace(partial, cache)  # whole or absent, when two first starts race
    return answers


def main():
    answers = built_answers()
    from horovod.runner import launch

    # The launcher's only calls of the check (horovod/runner/launch.py imports the two names).
    launch.mpi_built = lambda verbose=False: answers["mpi"]
    launch.gloo_built = lambda verbose=False: answers["gloo"]
    sys.argv[0] = "horovodrun"
    return launch.run_commandline()


if __name__ == "__main__":
    sys.exit(main())
