"""TensorFlow imported without its C++ start-up notices.

`import tensorflow` (2.21, the CPU wheel) writes these from C++ straight to file descriptor 2, before Python
runs again; TF_CPP_MIN_LOG_LEVEL leaves the first three even at 3. On a machine without NVIDIA's driver the
first look for GPUs adds an error-level line that says only that there is no driver:

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 ... port.cc:153] oneDNN custom operations are on. You may see slightly different numerical ...
    I0000 ... cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
    I0000 ... cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU ...
    To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow ...
    E0000 ... cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: ... (303)

(the first three twice: two of TensorFlow's libraries log them). `load` imports TensorFlow with descriptor 2
led through a filter that writes every other line; oneDNN, CUDA and TensorFlow's log levels stay as
TensorFlow sets them, so a run computes what it computes after a plain `import tensorflow`. Exporting
TF_CPP_MIN_LOG_LEVEL=0 (TensorFlow's "log everything") shows them.
"""

import os
import re
import sys

_NOTICE = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    rb"|I\d{4} [\d:.]+ +\d+ (port|cudart_stub|cpu_feature_guard)\.cc:\d+\] "
    rb"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler flags\.$"
)
_NO_DRIVER = re.compile(rb"E\d{4} [\d:.]+ +\d+ cuda_platform\.cc:\d+\] failed call to cuInit: ")
# Where NVIDIA's kernel driver shows itself, also inside a container given GPUs.
_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl")


def nvidia_driver():
    """True when NVIDIA's kernel driver is loaded here (a GPU machine)."""
    return any(os.path.exists(p) for p in _DRIVER_PATHS)


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
    `environ` (default `os.environ`) has TF_CPP_MIN_LOG_LEVEL=0.

    What TensorFlow writes meanwhile goes through a pipe to a forked filter process, which writes the rest
    to descriptor 2 as it comes, so a message of an import that aborts the process is still printed."""
    environ = os.environ if environ is None else environ
    if "tensorflow" in sys.modules or environ.get("TF_CPP_MIN_LOG_LEVEL") == "0":
        import tensorflow

        return tensorflow
    try:
        saved = os.dup(2)
    except OSError:
        import tensorflow

        return tensorflow
    driver = nvidia_driver()
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
    """The forked filter: every line of the pipe but the notices to descriptor 2, until the pipe closes."""
    try:
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                _write(kept(line, driver))
    finally:
        os._exit(0)


def _flush():
    if sys.stderr is not None:
        sys.stderr.flush()


def _write(data):
    while data:
        data = data[os.write(2, data) :]
