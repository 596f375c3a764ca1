"""Workers the tests launch as real Horovod ranks, and helpers the tests and benchmarks share."""

import os
import sys

# The checkout these files belong to.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Two ranks on this machine as horovodrun starts them over MPI (its mpirun command line), for the tests whose
# subject is the job rather than the launcher: without horovodrun's build check, which imports TensorFlow
# in a process of its own at every start (about 7 s of CPU on these 2-core machines).
TWO_RANKS = "mpirun --tag-output -np 2 -H localhost:2 --bind-to none --map-by slot".split()
# horovodrun itself, where the subject is the launcher or Gloo.
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def python_shim(folder, script):
    """Writes `folder`/python, an interpreter for launch scripts (given to them as $PYTHON) that runs
    `script` (a path under tests/support, with the same arguments) where they run `-m hvd_lars.main`, and
    anything else unchanged; returns its path (str)."""
    path = os.path.join(str(folder), "python")
    with open(path, "w") as f:
        f.write(
            "#!/bin/sh\n"
            '[ "$1" = -m ] && [ "$2" = hvd_lars.main ] && shift 2 && '
            f'exec {sys.executable} {os.path.join(REPO, script)} "$@"\n'
            f'exec {sys.executable} "$@"\n'
        )
    os.chmod(path, 0o755)
    return path
