"""tests/support/main_server.py: a start forked from the server is what the same command run as a new
interpreter is (argv, working directory, environment, sys.path, stdin, stdout and stderr, exit status,
the signal that ended it, an uncaught exception), a start that overruns its timeout is killed, and what the
server cannot serve (another checkout ahead on the path, a launcher) runs as a subprocess."""

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO, main_server

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
    env = dict(os.environ, HVD_LARS_PROBE="probe value", PYTHONPATH=str(tmp_path))
    served, new = _both([SCRIPT, *ending], tmp_path, env)
    assert served.returncode == new.returncode == returncode
    ours, theirs = json.loads(served.stdout), json.loads(new.stdout)
    assert ours == theirs
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
