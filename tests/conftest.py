"""Test tiers and the environment every test runs in.

Every test carries exactly one tier marker (README, "Tests"):
  unit     no subprocess (a unit test that starts one fails: see `_no_subprocesses`); `pytest -m unit`
           is the quick subset of the edit-test loop;
  horovod  real Horovod ranks or other subprocesses of the main program, on this machine;
  system   root: emulated hosts (launch/emulated_cluster.sh) or a real Slurm.
"""

import logging
import os
import platform
import shutil
import subprocess
import sys

import pytest

# Quiet TensorFlow's C++ logs; allow Open MPI to run as root (CI containers).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

TIERS = ("unit", "horovod", "system")

# Python's platform module runs `uname -p` the first time anything asks for the processor (h5py does,
# when TensorFlow first imports its Keras 2 modules inside a unit test); asked once here, it is cached.
platform.processor()


def pytest_configure(config):
    for tier, what in zip(
        TIERS, ("no subprocess", "real Horovod ranks or subprocesses", "root: hosts, Slurm")
    ):
        config.addinivalue_line("markers", f"{tier}: {what}")
    config.addinivalue_line("markers", "xdist_group(name): the pytest-xdist group (loadgroup) of a test")


# `make test` runs the suite on one pytest-xdist worker per core (`--dist loadgroup`): most tests start one
# process (a main program, a script) that uses one core, or wait on a scheduler, ssh or a file, so a
# second worker's test fills the idle core. The groups: every system test in one (emulated hosts and the
# one Slurm are machine-wide: one such test at a time, run first, as they take longest), every other file
# in its own (its module-scoped fixtures are built once). Without xdist the order is the same.
SYSTEM_GROUP = "system"


def pytest_itemcollected(item):
    # Marked while collecting: xdist reads the group in its own pytest_collection_modifyitems.
    group = SYSTEM_GROUP if item.get_closest_marker("system") else item.nodeid.split("::")[0]
    item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid} has tier markers {tiers}; give exactly one of {TIERS}.")
    items.sort(key=lambda item: item.get_closest_marker("system") is None)


@pytest.fixture(autouse=True)
def _no_subprocesses(request, monkeypatch):
    # A unit test that starts a process is mislabelled: it fails here instead of slowing the quick tier.
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} is marked unit but starts a process: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.fixture(autouse=True)
def _run_lines_to_caplog():
    # hvd_lars.main.configure_logging (called in-process by a test of the main program) gives the run's
    # logger handlers of its own; each test starts from Python's default, which pytest's caplog sees.
    logger = logging.getLogger("hvd_lars")
    logger.handlers.clear()
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


@pytest.fixture(autouse=True)
def _no_file_failure_noted_before():
    # hvd_lars.training.faults keeps one note per process until the ranks' next vote: a note left
    # by one in-process test (a write it made fail on purpose) must not be the next test's failure.
    module = sys.modules.get("hvd_lars.training.faults")
    if module is not None:
        module._noted = None


@pytest.fixture(autouse=True)
def _float32_policy_after():
    # The training loop, run in-process, sets Keras's global dtype policy (mixed_bfloat16 under
    # --precision=auto on a CPU with bfloat16): each later test builds its models in float32 again.
    yield
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(autouse=True)
def _no_horovod_in_process():
    # Horovod in a test process leaves Open MPI's variables, and its later horovodrun fails (status 1).
    yield
    horovod = sys.modules.get("horovod.tensorflow")
    assert horovod is None or not horovod.is_initialized(), "Horovod started in-process: start ranks instead"


@pytest.fixture(scope="module")
def cluster(request):
    """The emulated hosts of a system test module (launch/emulated_cluster.sh): its NODES, else 2."""
    from tests.support.emulated_cluster import cluster_up

    with cluster_up(getattr(request.module, "NODES", 2)) as c:
        yield c


@pytest.fixture
def shared_dir(request):
    """A fresh folder every emulated host sees (outside /tmp, which each host has of its own)."""
    from tests.support.emulated_cluster import shared_folder

    path = shared_folder(request.node.name)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm(cluster):
    """A Slurm controller and one slurmd per emulated host of the module's cluster."""
    from tests.support.emulated_cluster import CONTROLLER_ADDRESS, shared_folder
    from tests.support.slurm_cluster import SlurmCluster

    workdir = shared_folder("slurm")
    s = SlurmCluster(workdir, hosts=cluster.hosts, controller_address=CONTROLLER_ADDRESS)
    try:
        yield s.start()
    finally:
        s.stop()
        shutil.rmtree(workdir, ignore_errors=True)
