"""`python -m hvd_lars.main` (or a script under tests/support that wraps it) for the tests that start the main
program many times on one rank: each start is a process forked from one that has imported TensorFlow, Keras,
Horovod and the package once, instead of a new interpreter that imports them again (about 5 s of CPU a
start on this repository's 2-core machines, more than the short runs the tests make spend training).

The forked process is what `python -m hvd_lars.main ARGS` would be from there on: its own pid, working
directory, environment, argv, stdin from /dev/null, stdout and stderr to files; the module (or script) runs
as __main__ through runpy, as `python -m` and `python script.py` run it, and the interpreter exits as theirs
does (its threads joined, atexit handlers run, the exit status or the signal that ended it reported). What
it does not do again is import: the server imports what hvd_lars.main imports, never hvd_lars.main itself
(its absl flags are defined by the run, once). Nothing has run in the server but imports when it forks: no
TensorFlow op, no Horovod init, no thread of TensorFlow's started. Environment variables read at import (by
TensorFlow: TF_CPP_MIN_LOG_LEVEL) are the server's, which it takes from the test process.

`run_main` sends a command here only when it is such a start of this checkout; any other (a launcher such as
horovodrun, mpirun or srun first, `python -c`, another checkout ahead on the path) runs as a subprocess.
Both answer as `subprocess.run(..., capture_output=True, text=True)` does.

Usage: `run_main([sys.executable, "-m", "hvd_lars.main", *flags], cwd=..., env=..., timeout=...)`, through
`shared()`, the one server of this process (started on first use, stopped when the process exits).
"""

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(REPO, "tests", "support")

# What hvd_lars.main imports (and, by them, TensorFlow, Keras, Horovod's TensorFlow layer), short of
# hvd_lars.main itself.
PRELOADED = (
    "tensorflow",
    "keras",
    "horovod.tensorflow",
    "hvd_lars.data",
    "hvd_lars.data.imagenet_preparation",
    "hvd_lars.parallel.collectives",
    "hvd_lars.training.elastic_loop",
    "hvd_lars.training.threads",
    "hvd_lars.training.train",
    "hvd_lars.training.checkpoints",
    "hvd_lars.training.config",
    "hvd_lars.training.faults",
    "hvd_lars.training.settings",
)


class MainServer:
    """One server process; `run` forks a start of the main program from it (one at a time)."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="hvd_lars_main_server.")
        self.address = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self.address],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            self.process.kill()
            raise RuntimeError(f"the main program's server did not start: {ready!r}")

    def run(self, args, cwd=REPO, env=None, timeout=300):
        """Runs `python *args` (args: ["-m", "hvd_lars.main", ...] or [script, ...]) in `cwd` with `env`
        (default os.environ); returns a subprocess.CompletedProcess with text stdout and stderr, or raises
        subprocess.TimeoutExpired after `timeout` seconds (the start killed)."""
        if self.process.poll() is not None:
            raise RuntimeError(f"the main program's server ended (status {self.process.returncode})")
        out = tempfile.TemporaryDirectory(dir=self.folder)
        with out, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            request = {
                "args": list(map(str, args)),
                "cwd": os.fspath(cwd),
                "env": dict(os.environ if env is None else env),
                "stdout": os.path.join(out.name, "stdout"),
                "stderr": os.path.join(out.name, "stderr"),
            }
            connection.connect(self.address)
            replies = connection.makefile("r")
            connection.sendall(json.dumps(request).encode() + b"\n")
            pid = json.loads(replies.readline())["pid"]
            connection.settimeout(timeout)
            try:
                status = json.loads(replies.readline())["returncode"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                connection.settimeout(None)
                connection.makefile("r").readline()  # the server has reaped it (a timed-out file is spent)
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None
            with open(request["stdout"]) as f, open(request["stderr"]) as g:
                return subprocess.CompletedProcess([sys.executable, *args], status, f.read(), g.read())

    def close(self):
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        for name in os.listdir(self.folder):
            os.remove(os.path.join(self.folder, name))
        os.rmdir(self.folder)


_SHARED = []
_INSTALLED = []  # the server's sys.path after its script's folder, less its PYTHONPATH


def shared():
    """This process's server, started on first use and stopped at exit."""
    if not _SHARED:
        _SHARED.append(MainServer())
        atexit.register(_SHARED[0].close)
    return _SHARED[0]


def run_main(cmd, cwd=REPO, env=None, timeout=300):
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`, where a
    command `[sys.executable, "-m", "hvd_lars.main", ...]` or `[sys.executable, <a script in tests/support>,
    ...]` is forked from this process's server; any other (a launcher first, another interpreter) runs as
    that subprocess.run."""
    cmd = list(map(os.fspath, cmd))
    if (
        len(cmd) > 1
        and cmd[0] == sys.executable
        and _served(cmd[1:], cwd, os.environ if env is None else env)
    ):
        return shared().run(cmd[1:], cwd=cwd, env=env, timeout=timeout)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _served(args, cwd, env):
    """Whether `python *args` in `cwd` with `env` is a start the server's imports serve: the main program or
    a script of tests/support, with no folder ahead on its path that holds another hvd_lars."""
    if args[0] == "-m":
        first = cwd
        if args[1:2] != ["hvd_lars.main"]:
            return False
    else:
        script = os.path.abspath(os.path.join(cwd, args[0]))
        first = os.path.dirname(script)
        if first != SUPPORT or not script.endswith(".py"):
            return False
    ahead = [first, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return all(os.path.abspath(p) == REPO or not os.path.isdir(os.path.join(p, "hvd_lars")) for p in ahead)


def _returncode(status):
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _serve(address):
    """Answers requests until terminated; returns (in a forked child only) the request it is to run."""
    import importlib

    ours = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _INSTALLED[:] = [p for p in sys.path[1:] if os.path.abspath(p) not in ours]
    for name in PRELOADED:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen()
    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        request = json.loads(connection.makefile("r").readline())
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            connection.close()
            return request
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        try:
            connection.sendall(json.dumps({"returncode": _returncode(status)}).encode() + b"\n")
        except OSError:
            pass  # the test gave up on it (its timeout)
        connection.close()


def _become(request):
    """The forked child turns into `python *args` as the request describes it."""
    import random

    import numpy as np

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    # A new interpreter's seeds (Python's own `random` reseeds itself in a forked child).
    random.seed()
    np.random.seed()
    # sys.path as a new interpreter's: the script's folder (or, with -m, the working directory), then the
    # request's PYTHONPATH, then the installation's (the server was started without a PYTHONPATH of its own
    # in front: see `_serve`).
    args = request["args"]
    first = os.getcwd() if args[0] == "-m" else os.path.dirname(os.path.abspath(args[0]))
    extra = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_INSTALLED]
    return args


def main():
    request = _serve(sys.argv[1])
    args = _become(request)
    import runpy

    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy sets argv[0] to the module's file
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
