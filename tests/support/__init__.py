"""Workers the tests launch as real Horovod ranks, and helpers the tests and benchmarks share."""

import os

# The checkout these files belong to.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python_shim(folder, script):
    """Writes `folder`/python, an interpreter for launch scripts (given to them as $PYTHON) that runs
    `script` (a path under tests/support, with the same arguments) where they run `-m hvd_lars.main`, and
    anything else unchanged; returns its path (str)."""
    import sys

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
