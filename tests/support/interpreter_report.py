"""What a start of Python sees of itself, for tests/test_main_server.py: prints one JSON line (argv, working
directory, sys.path, the environment variable HVD_LARS_PROBE, whether absl's flags were parsed before, the
modules __main__ and __spec__ of this run), then, by its first argument: `exit N` exits with status N,
`signal NAME` sends itself that signal, `raise` raises, `wait FILE` waits until FILE exists."""

import json
import os
import signal
import sys
import time

from absl import flags

IGNORABLE = ("SIGINT", "SIGTERM", "SIGHUP")

print(
    json.dumps(
        {
            "argv": sys.argv,
            "pid": os.getpid(),
            "tmp": __import__("tempfile").gettempdir(),
            "cwd": os.getcwd(),
            "path": sys.path,
            "probe": os.environ.get("HVD_LARS_PROBE"),
            "flags_parsed": flags.FLAGS.is_parsed(),
            "name": __name__,
            "stdin": sys.stdin.read(),
            "ignored": [n for n in IGNORABLE if signal.getsignal(getattr(signal, n)) == signal.SIG_IGN],
        }
    ),
    flush=True,
)
print("to stderr", file=sys.stderr)
what, value = sys.argv[1], sys.argv[2]
if what == "exit":
    sys.exit(int(value))
if what == "signal":
    os.kill(os.getpid(), getattr(signal, f"SIG{value}"))
if what == "raise":
    raise RuntimeError(value)
if what == "wait":
    while not os.path.exists(value):
        time.sleep(0.05)
