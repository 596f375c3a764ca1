"""tests/support/main_server.py: a start forked from the server is what the same command run as a new
interpreter is (argv, working directory, environment, sys.path, stdin, stdout and stderr, exit status,
the signal that ended it, an uncaught exception), a start that overruns its timeout is killed, a rank's
client passes signals on and takes its process along, and what the server cannot serve (another checkout
ahead on the path) runs as a subprocess. Served jobs of 2 ranks, their exit status included:
tests/test_distributed.py, tests/test_resume.py, tests/test_elastic.py (Gloo)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import REPO, main_server

pytestmark = pytest.mark.horovod
SCRIPT = os.path.join(REPO, "tests", "support", "interpreter_report.py")


@pytest.mark.parametrize(
    "ending, returncode", [(("exit", "3"), 3), (("signal", "TERM"), -15), (("raise", "the message"), 1)]
)
def test_a_served_start_sees_and_ends_as_a_new_interpreter(tmp_path, ending, returncode):
    env = dict(os.environ, HVD_LARS_PROBE="probe value", PYTHONPATH=str(tmp_path), TMPDIR=str(tmp_path))
    served = main_server.shared().run([SCRIPT, *ending], cwd=tmp_path, env=env)
    new = subprocess.run([sys.executable, SCRIPT, *ending], cwd=tmp_path, env=env, capture_output=True,
                         text=True, stdin=subprocess.DEVNULL)  # fmt: skip
    assert served.returncode == new.returncode == returncode
    ours, theirs = json.loads(served.stdout), json.loads(new.stdout)
    assert ours.pop("pid") not in (os.getpid(), main_server.shared().process.pid, theirs.pop("pid"))
    assert ours == theirs and ours["tmp"] == str(tmp_path)
    assert ours["argv"] == [SCRIPT, *ending] and ours["cwd"] == str(tmp_path)
    assert ours["path"][:2] == [os.path.dirname(SCRIPT), str(tmp_path)]
    assert ours["probe"] == "probe value" and ours["name"] == "__main__" and not ours["flags_parsed"]
    # "to stderr", or the traceback's last line: "RuntimeError: the message".
    assert served.stderr.splitlines()[-1] == new.stderr.splitlines()[-1]
    assert "to stderr" in served.stderr.splitlines()


def test_a_start_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        main_server.shared().run([SCRIPT, "wait", str(tmp_path / "never")], cwd=tmp_path, timeout=1)
    # The server is free again: the next start runs.
    assert main_server.shared().run([SCRIPT, "exit", "4"], cwd=tmp_path).returncode == 4


@pytest.mark.parametrize("where", ["PYTHONPATH", "cwd"])
def test_another_checkout_ahead_on_the_path_runs_as_a_subprocess(tmp_path, where):
    (tmp_path / "hvd_lars").mkdir()
    (tmp_path / "hvd_lars" / "__init__.py").write_text("")
    (tmp_path / "hvd_lars" / "main.py").write_text("import sys; print('the other checkout'); sys.exit(5)\n")
    # A new interpreter finds the other checkout: first on PYTHONPATH (run from a folder without one), or
    # in the working directory of `python -m`.
    (tmp_path / "elsewhere").mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path)) if where == "PYTHONPATH" else dict(os.environ)
    cwd = tmp_path if where == "cwd" else tmp_path / "elsewhere"
    result = main_server.run_main([sys.executable, "-m", "hvd_lars.main"], cwd=cwd, env=env)
    assert result.returncode == 5 and result.stdout == "the other checkout\n"


SENT = ("SIGTERM", "SIGUSR1", "SIGINT")


def _waiting_client(folder):
    """A rank's client as a launcher starts it (the signals sent here not ignored, whatever pytest-xdist's
    worker or nohup ignores), its served process waiting for a file never made; (the client's Popen, the
    served process's report) once the process has begun."""
    command = main_server.shared().rank_command([SCRIPT, "wait", str(folder / "never")])
    default = lambda: [signal.signal(getattr(signal, n), signal.SIG_DFL) for n in SENT]  # noqa: E731
    client = subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, text=True, preexec_fn=default)
    try:
        return client, json.loads(client.stdout.readline())
    except Exception:
        client.kill()
        raise


def _gone(pid, within_s=60):
    """Whether process `pid` has ended (or is a zombie) within `within_s` seconds: the event, polled."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("name", [*SENT, "SIGKILL"])
def test_a_signal_to_a_rank_client_reaches_its_process_and_ends_the_client_alike(tmp_path, name):
    client, report = _waiting_client(tmp_path)
    try:
        assert report["pid"] != client.pid and name not in report["ignored"]
        client.send_signal(getattr(signal, name))
        # SIGINT: Python's KeyboardInterrupt, whose interpreter then ends itself by SIGINT as Python does.
        # SIGKILL, which the client cannot pass on: its process ends with it.
        assert client.wait(timeout=60) == -getattr(signal, name)
        assert _gone(report["pid"])
    finally:
        client.kill()
        client.wait()


def test_the_server_ends_with_the_process_that_started_it():
    # A process that starts a server and exits at once, without stopping it (as pytest-xdist's workers
    # end, atexit handlers unrun): the server's pid is its one line.
    code = (
        f"import os, sys; sys.path.insert(0, {REPO!r})\n"
        "from tests.support import main_server\n"
        "print(main_server.MainServer().process.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    owner = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert _gone(int(owner.stdout.split()[-1]))
