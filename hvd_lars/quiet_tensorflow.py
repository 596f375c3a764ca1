"""TensorFlow imported without its C++ start-up notices.

`import tensorflow` (2.21, the CPU wheel) writes these from C++ straight to file descriptor 2, and
TF_CPP_MIN_LOG_LEVEL leaves most of them even at 3: "All log messages before absl::InitializeLog()",
oneDNN's, "Could not find cuda drivers", the CPU feature guard's two lines and, without NVIDIA's driver,
an error-level "failed call to cuInit". `load` imports TensorFlow with descriptor 2 led through a filter
that writes every other line; TensorFlow's settings stay as it sets them. TF_CPP_MIN_LOG_LEVEL=0 shows all.
"""

import os
import re
import signal
import sys

_NOTICE = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    rb"|I\d{4} [\d:.]+ +\d+ (port|cudart_stub|cpu_feature_guard)\.cc:\d+\] "
    rb"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler flags\.$"
)
_NO_DRIVER = re.compile(rb"E\d{4} [\d:.]+ +\d+ cuda_platform\.cc:\d+\] failed call to cuInit: ")
# Where NVIDIA's kernel driver shows itself, also inside a container given GPUs.
_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl")


def kept(text, driver=True):
    """The lines of `text` (bytes written to descriptor 2) that are not TensorFlow's start-up notices;
    without a `driver`, the failed cuInit is one of them."""
    lines = text.splitlines(keepends=True)
    return b"".join(
        line
        for line in lines
        if not _NOTICE.match(line.rstrip(b"\r\n")) and (driver or not _NO_DRIVER.match(line))
    )


def load(environ=None):
    """Imports TensorFlow (and, without NVIDIA's driver, lists its devices) with its start-up notices left
    out; returns the module. A plain import where TensorFlow is imported already, descriptor 2 is closed or
    `environ` (default `os.environ`) has TF_CPP_MIN_LOG_LEVEL=0. Descriptor 2 goes through a pipe to a
    forked filter meanwhile, so a message of an import that aborts the process is still printed."""
    environ = os.environ if environ is None else environ
    if "tensorflow" in sys.modules or environ.get("TF_CPP_MIN_LOG_LEVEL") == "0":
        import tensorflow

        return tensorflow
    try:
        saved = os.dup(2)
    except OSError:
        import tensorflow

        return tensorflow
    driver = _driver()
    _flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        _filter(read_end, write_end, driver)
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        import tensorflow

        if not driver:
            tensorflow.config.list_physical_devices()  # the failed cuInit, now rather than later
    finally:
        _flush()
        os.dup2(saved, 2)  # the pipe's last writer gone: the filter writes what is left and ends
        os.close(saved)
        os.waitpid(pid, 0)
    return tensorflow


def _filter(read_end, write_end, driver):
    """The filter: every line read from `read_end` but the notices to descriptor 2, until it closes."""
    try:
        if write_end is not None:
            os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                data = kept(line, driver)
                while data:
                    data = data[os.write(2, data) :]
    finally:
        os._exit(0)


def _driver():
    return any(os.path.exists(p) for p in _DRIVER_PATHS)


def _flush():
    if sys.stderr is not None:
        sys.stderr.flush()


def main():
    """`python hvd_lars/quiet_tensorflow.py` (by path, importing nothing of the package): standard input to
    standard error without the notices, until every writer closes it. `make train` leads horovodrun's and
    record_run's standard error through it (their imports of TensorFlow: horovodrun's build check). Stop
    signals are left to the command whose output it filters."""
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    _filter(0, None, _driver())


if __name__ == "__main__":
    main()
