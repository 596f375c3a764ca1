"""`python -m hvd_lars.main` (or a script of tests/support that wraps it) for the tests that start the main
program many times, alone or as the ranks of a Horovod job: each start is a process forked from a server
that has imported TensorFlow, Keras, Horovod and the package once, instead of a new interpreter that imports
them again (about 5 s of CPU a start on this repository's 2-core machines). One server per test process
(`shared`), started on first use; it ends with that process.

The forked process is what the same command run as a new interpreter would be from there on (its pid,
working directory, environment, argv, sys.path, seeds, signal dispositions, standard streams; the module or
script run as __main__ through runpy; its exit as theirs: threads joined, atexit handlers run, the exit
status or the signal reported), except that it does not import again: the server runs hvd_lars/main.py's
import statements (never hvd_lars.main itself: its absl flags are defined by the run, once) and nothing else
(no TensorFlow op, no Horovod init). Environment variables read at import (TF_CPP_MIN_LOG_LEVEL) are the
server's, which it takes from the test process.

- `run_main(cmd, cwd, env, timeout)`: as `subprocess.run(cmd, ..., capture_output=True, text=True)`, the
  start (or, under a launcher, each rank) served where it is such a start of this checkout; any other (a
  launcher's own process, `python -c`, another checkout ahead on the path) runs as a subprocess.
- `served(cmd)`: a launcher's command (horovodrun, mpirun) with its ranks' command made a small client
  (`MainServer.rank_command`) that hands the server its streams, environment and working directory, passes
  on the signals it receives and ends as its process ends.
"""

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(REPO, "tests", "support")
# The signals a rank's client passes on to its process (SIGKILL and SIGSTOP cannot be caught).
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGCONT")

# Imported by the server beside hvd_lars/main.py's own import statements (which import them too).
PRELOADED = ("tensorflow", "keras", "horovod.tensorflow", "hvd_lars.training.train")


class MainServer:
    """One server process; `run` forks a start of the main program from it, `rank_command` is the command
    a launcher runs for each rank to have the server fork that rank's process."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="hvd_lars_main_server.")
        self.address = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", self.address],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            self.process.kill()
            raise RuntimeError(f"the main program's server did not start: {ready!r}")

    def rank_command(self, args):
        """`python *args` for a launcher's command line (horovodrun, mpirun): a small client that has the
        server fork the process, hands it its standard streams, environment and working directory, passes
        on the signals it receives and ends as the process ends."""
        return [sys.executable, os.path.abspath(__file__), "--client", self.address, *map(os.fspath, args)]

    def run(self, args, cwd=REPO, env=None, timeout=300):
        """Runs `python *args` (args: ["-m", "hvd_lars.main", ...] or [script, ...]) in `cwd` with `env`
        (default os.environ); returns a subprocess.CompletedProcess with text stdout and stderr, or raises
        subprocess.TimeoutExpired after `timeout` seconds (the start killed)."""
        if self.process.poll() is not None:
            raise RuntimeError(f"the main program's server ended (status {self.process.returncode})")
        args = list(map(os.fspath, args))
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            with open(os.devnull) as stdin:
                connection, pid = _request(self.address, args, cwd, env, (stdin, out, err))
            with connection:
                connection.settimeout(timeout)
                try:
                    status = _reply(connection)
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)
                    connection.settimeout(None)
                    _reply(connection)  # the server has reaped it
                    raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess([sys.executable, *args], status, out.read(), err.read())

    def close(self):
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _request(address, args, cwd, env, streams):
    """Asks the server at `address` to fork `python *args` with `streams` (stdin, stdout, stderr: files or
    descriptors) as its own; returns the connection, on which the exit status arrives, and the pid."""
    # The signals this process ignores, which a new interpreter started from it would ignore too (exec keeps
    # SIG_IGN, and Python then leaves SIGINT ignored); every other one the served process takes as a new
    # interpreter does.
    ignored = [name for name in FORWARDED if signal.getsignal(getattr(signal, name)) == signal.SIG_IGN]
    request = {"args": args, "cwd": os.fspath(cwd), "env": dict(os.environ if env is None else env)}
    body = json.dumps({**request, "ignored": ignored}).encode()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(address)
    fds = [s if isinstance(s, int) else s.fileno() for s in streams]
    socket.send_fds(connection, [len(body).to_bytes(8, "big") + body], fds)
    return connection, _reply(connection, "pid")


def _reply(connection, key="returncode"):
    line = b""
    while not line.endswith(b"\n"):
        chunk = connection.recv(1)
        if not chunk:
            raise RuntimeError("the main program's server closed the connection")
        line += chunk
    return json.loads(line)[key]


_SHARED = []
_INSTALLED = []  # the server's sys.path after its script's folder, less its PYTHONPATH


def shared():
    """This process's server, started on first use and stopped at exit."""
    if not _SHARED:
        _SHARED.append(MainServer())
        atexit.register(_SHARED[0].close)
    return _SHARED[0]


def run_main(cmd, cwd=REPO, env=None, timeout=300):
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` for a start of
    the main program (or a script of tests/support) alone or under a launcher: `[sys.executable, "-m",
    "hvd_lars.main", ...]` forked from this process's server, a launcher's command with its ranks served
    (`served`); any other command (`python -c`, another checkout ahead on the path) as that subprocess.run."""
    cmd = list(map(os.fspath, cmd))
    if (
        len(cmd) > 1
        and cmd[0] == sys.executable
        and _served(cmd[1:], cwd, os.environ if env is None else env)
    ):
        return shared().run(cmd[1:], cwd=cwd, env=env, timeout=timeout)
    launched = served(cmd, cwd, env)
    return subprocess.run(launched, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def served(cmd, cwd=REPO, env=None):
    """A launcher's command (horovodrun, mpirun) whose ranks run `sys.executable *args`, with the ranks'
    command made `rank_command(args)` of this process's server where `run_main` would serve `args`;
    otherwise `cmd` as it is."""
    cmd = list(map(os.fspath, cmd))
    environment = os.environ if env is None else env
    for i, word in enumerate(cmd[1:], 1):
        if word == sys.executable and len(cmd) > i + 1:
            if _served(cmd[i + 1 :], cwd, environment):
                return [*cmd[:i], *shared().rank_command(cmd[i + 1 :])]
            break
    return cmd


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


def _receive(connection):
    """A request: its dict and the three descriptors sent with it."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    if len(data) < 8 or len(fds) != 3:
        raise RuntimeError(f"a request of {len(data)} bytes with {len(fds)} descriptors")
    size = int.from_bytes(data[:8], "big")
    body = data[8:]
    while len(body) < size:
        chunk = connection.recv(size - len(body))
        if not chunk:
            raise RuntimeError("a request cut short")
        body += chunk
    return {**json.loads(body), "fds": fds}


def _serve(address):
    """Answers requests until terminated or until the process that started it ends, each by a forked child,
    any number at once (a job's ranks wait for each other); returns, in a forked child, the request it is to
    run, and None in the server once it is to end."""
    import ast
    import importlib
    import importlib.util
    import select

    ours = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _INSTALLED[:] = [p for p in sys.path[1:] if os.path.abspath(p) not in ours]
    importlib.import_module("hvd_lars.quiet_tensorflow").load()  # as the main program imports TensorFlow
    for name in PRELOADED:
        importlib.import_module(name)
    # hvd_lars/main.py's module-level imports, run as it runs them (a `from package import module` too).
    main_file = importlib.util.find_spec("hvd_lars.main").origin  # found, not imported
    with open(main_file) as f:
        tree = ast.parse(f.read())
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), main_file, "exec"), {})
    assert "hvd_lars.main" not in sys.modules
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    owner = os.getppid()
    print("ready", flush=True)
    running = {}  # pid: the connection its status goes to
    while True:
        if os.getppid() != owner:
            return None  # the test process that started it has ended: so does the server
        if select.select([listener], [], [], 0.05)[0]:
            connection, _ = listener.accept()
            request = _receive(connection)
            creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            request["client"] = int.from_bytes(creds[:4], sys.byteorder)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in [connection, *running.values()]:
                    other.close()
                return request
            for fd in request["fds"]:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            running[pid] = connection
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = running.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(json.dumps({"returncode": _returncode(status)}).encode() + b"\n")
                except OSError:
                    pass  # its client has gone (a test's timeout, a killed rank)
                connection.close()


def _become(request):
    """The forked child turns into `python *args` as the request describes it."""
    import random
    import select
    import threading

    import numpy as np

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name in FORWARDED:
        number = getattr(signal, name)
        if name in request["ignored"]:
            signal.signal(number, signal.SIG_IGN)
        else:
            signal.signal(number, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
    for fd, received in enumerate(request["fds"]):
        os.dup2(received, fd)
        os.close(received)
    # Ends with its client: a rank's client killed (SIGKILL cannot be passed on) takes its process along.
    client = os.pidfd_open(request["client"])

    def end_with_client():
        select.select([client], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=end_with_client, name="main_server.end_with_client", daemon=True).start()
    tempfile.tempdir = None  # found again from this environment's TMPDIR
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


def _client(address, args):
    """A rank's process as the launcher sees it: the served process's status is this one's."""
    connection, pid = _request(address, args, os.getcwd(), None, (0, 1, 2))

    def forward(number, frame):
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass  # it has ended; its status is on its way

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    returncode = _reply(connection)
    if returncode < 0:
        if -returncode != signal.SIGKILL:  # whose disposition cannot be set
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode


def main():
    if sys.argv[1] == "--client":
        sys.exit(_client(sys.argv[2], sys.argv[3:]))
    request = _serve(sys.argv[2])
    if request is None:
        return
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
