"""tests/support/main_server.py: a start forked from the server is what the same command run as a new
interpreter is (argv, working directory, environment, sys.path, stdin, stdout and stderr, exit status,
the signal that ended it, an uncaught exception), a start that overruns its timeout is killed, and what the
server cannot serve (another checkout ahead on the path, a launcher) runs as a subprocess."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support import HOROVODRUN, REPO, TWO_RANKS, main_server

pytestmark = pytest.mark.horovod
SCRIPT = os.path.join(REPO, "tests", "support", "interpreter_report.py")


def _both(args, cwd, env):
    served = main_server.shared().run(args, cwd=cwd, env=env)
    new = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    return served, new


@pytest.mark.parametrize(
    "ending, returncode",
    [(("exit", "3"), 3), (("exit", "0"), 0), (("signal", "KILL"), -9), (("signal", "TERM"), -15)],
)
def test_a_served_start_sees_and_ends_as_a_new_interpreter(tmp_path, ending, returncode):
    env = dict(os.environ, HVD_LARS_PROBE="probe value", PYTHONPATH=str(tmp_path), TMPDIR=str(tmp_path))
    served, new = _both([SCRIPT, *ending], tmp_path, env)
    assert served.returncode == new.returncode == returncode
    ours, theirs = json.loads(served.stdout), json.loads(new.stdout)
    assert ours.pop("pid") not in (os.getpid(), main_server.shared().process.pid, theirs.pop("pid"))
    assert ours == theirs and ours["tmp"] == str(tmp_path)
    assert ours["argv"] == [SCRIPT, *ending] and ours["cwd"] == str(tmp_path)
    assert ours["path"][:2] == [os.path.dirname(SCRIPT), str(tmp_path)]
    assert ours["probe"] == "probe value" and ours["name"] == "__main__" and not ours["flags_parsed"]
    assert served.stderr.splitlines()[-1:] == ["to stderr"]


def test_an_uncaught_exception_is_a_traceback_and_status_1(tmp_path):
    served, new = _both([SCRIPT, "raise", "the message"], tmp_path, dict(os.environ))
    assert served.returncode == new.returncode == 1
    assert served.stderr.splitlines()[-1] == new.stderr.splitlines()[-1] == "RuntimeError: the message"


def test_the_main_program_refuses_a_bad_flag_as_a_new_interpreter_does(tmp_path):
    args = ["-m", "hvd_lars.main", "--flagfile=flags/smoke.flags", f"--workdir={tmp_path}"]
    served, new = _both([*args, "--global_batch_size=-3"], REPO, dict(os.environ))
    line = "hvd_lars: error: --global_batch_size must be a whole number >= 0, got -3."
    assert served.returncode == new.returncode == 2
    assert [x for x in served.stderr.splitlines() if x.startswith("hvd_lars:")] == [line]
    assert [x for x in new.stderr.splitlines() if x.startswith("hvd_lars:")] == [line]


def test_a_start_past_its_timeout_is_killed(tmp_path):
    never = tmp_path / "never"
    with pytest.raises(subprocess.TimeoutExpired):
        main_server.shared().run([SCRIPT, "wait", str(never)], cwd=tmp_path, timeout=1)
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


PROBE = """
import sys
import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum)
print(f"rank {hvd.rank()} of {hvd.size()}: sum {float(total[0])}", flush=True)
hvd.allreduce(tf.constant([0.0]))  # rank 1 fails the job only once both ranks have printed
sys.exit(int(sys.argv[1]) if hvd.rank() == 1 else 0)
"""


# Open MPI as horovodrun starts it (its mpirun command line, without its build check), and Gloo.
@pytest.mark.parametrize(
    "launcher", [TWO_RANKS, [HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2"]], ids=["mpi", "gloo"]
)
def test_served_ranks_run_a_horovod_job(tmp_path, launcher):
    # A script of tests/support's folder, as the ranks' scripts are (written for the test, removed after).
    probe = os.path.join(REPO, "tests", "support", f"served_probe_{os.getpid()}.py")
    with open(probe, "w") as f:
        f.write(PROBE)
    try:
        cmd = [*launcher, sys.executable, probe]
        launched = main_server.served([*cmd, "3"], cwd=tmp_path)
        assert launched[: len(cmd) - 2] == cmd[:-2] and "--client" in launched
        result = subprocess.run(launched, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        for rank in (0, 1):
            assert f"rank {rank} of 2: sum 3.0" in result.stdout, result.stderr[-3000:]
        # A rank's exit status is the job's: rank 1's 3 fails it (the launcher names the failed rank). A
        # served job's status 0: tests/test_main.py's and tests/test_launcher_watch.py's served jobs.
        assert result.returncode != 0
    finally:
        os.remove(probe)


SENT = ("SIGTERM", "SIGUSR1", "SIGINT")


@pytest.fixture
def client_waiting(tmp_path):
    """Starts a rank's client (as a launcher starts it: the signals sent here not ignored, whatever
    pytest-xdist's worker or nohup ignores) whose served process waits for a file never made; returns the
    client's Popen and the served process's report, once the process has begun. The client is killed after
    the test."""
    clients = []

    def start():
        command = main_server.shared().rank_command([SCRIPT, "wait", str(tmp_path / "never")])
        client = subprocess.Popen(
            command,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: [signal.signal(getattr(signal, n), signal.SIG_DFL) for n in SENT],
        )
        clients.append(client)
        return client, json.loads(client.stdout.readline())

    yield start
    for client in clients:
        client.kill()
        client.wait()


@pytest.mark.parametrize("name", SENT)
def test_a_signal_to_a_rank_client_reaches_its_process_and_ends_the_client_alike(client_waiting, name):
    client, report = client_waiting()
    assert report["pid"] != client.pid and name not in report["ignored"]
    client.send_signal(getattr(signal, name))
    # SIGINT: Python's KeyboardInterrupt, whose interpreter then ends itself by SIGINT as Python does.
    assert client.wait(timeout=60) == -getattr(signal, name)


def test_a_killed_rank_client_takes_its_process_along(client_waiting):
    client, report = client_waiting()
    pid = report["pid"]
    client.kill()
    assert client.wait(timeout=60) == -9
    deadline = time.monotonic() + 60  # the process ends on the client's end: an event, polled
    while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z"


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_the_server_ends_with_the_process_that_started_it(tmp_path):
    # A process that starts a server and exits at once, without stopping it (as pytest-xdist's workers
    # end, atexit handlers unrun): the server's pid is its one line.
    code = (
        "import os, sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "from tests.support import main_server\n"
        "print(main_server.MainServer().process.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    owner = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    pid = int(owner.stdout.split()[-1])
    deadline = time.monotonic() + 60  # the server's end is the event: polled
    while _state(pid) not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(pid) in ("gone", "Z")
