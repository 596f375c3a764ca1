"""install/setup.sh as a user without root on a cluster would run it.

An unprivileged user made here runs the set-up in its own git clone of this checkout, with a PATH of
symlinks to the system's programs that leaves out dpkg, apt and sudo (a RHEL-like login node). It gets an
environment that trains 2 ranks under Open MPI; with MPICH's programs first on PATH (`module load mpich`)
the Horovod built against MPICH, whose 2 ranks under Hydra's mpiexec end bit-identical to Open MPI's.
With a needed tool hidden it gets one message naming it, exit status 1 and no environment.

Shared with the user, so nothing is built or downloaded twice: the Horovod wheels (root's cache copied
into SHARED/wheels, and a wheel the user builds copied back) and a wheelhouse of requirements.txt.
Needs root, Debian's mpich and libmpich-dev (install/test_services.sh) and Fashion-MNIST.
"""

import glob
import gzip
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support import REPO
from tests.support.small_runs import final_tensors

pytestmark = pytest.mark.system

USER = "hvdlarsuser"
SHARED = "/var/cache/hvd_lars"  # readable by every user, unlike /root
ROOT_WHEELS = os.path.expanduser("~/.cache/hvd_lars/wheels")
HIDDEN = ("dpkg", "dpkg-query", "apt", "apt-get", "apt-cache", "sudo")
# Debian's MPICH as a cluster's MPICH module puts it on PATH: its own names, first.
MPICH_PROGRAMS = {
    "mpicc": "mpicc.mpich", "mpicxx": "mpicxx.mpich", "mpic++": "mpicxx.mpich", "mpifort": "mpifort.mpich",
    "mpirun": "mpirun.mpich", "mpiexec": "mpiexec.mpich", "mpichversion": "mpichversion",
    "hydra_pmi_proxy": "hydra_pmi_proxy", "hydra_nameserver": "hydra_nameserver",
    "hydra_persist": "hydra_persist",
}  # fmt: skip
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"

if os.geteuid() != 0:
    pytest.skip("needs root (it makes a user)", allow_module_level=True)
if not os.path.exists("/usr/bin/mpiexec.mpich") or not os.path.exists("/usr/include/x86_64-linux-gnu/mpich"):
    pytest.skip("needs Debian's mpich and libmpich-dev (install/test_services.sh)", allow_module_level=True)


def _as_user(cmd, env, timeout, cwd):
    """Runs `cmd` (a list) as USER with exactly `env`; returns the CompletedProcess and the seconds taken."""
    started = time.time()
    result = subprocess.run(
        ["runuser", "-u", USER, "--", "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()), *cmd],
        capture_output=True, text=True, timeout=timeout, cwd=cwd,
    )  # fmt: skip
    return result, time.time() - started


def _path_farm(folder, leave_out=()):
    """A folder of symlinks to the programs of /usr/local/bin, /usr/bin, /bin but HIDDEN and `leave_out`."""
    os.makedirs(folder)
    for source in ("/usr/local/bin", "/usr/bin", "/bin"):
        for name in sorted(os.listdir(source)):
            link = os.path.join(folder, name)
            if name not in HIDDEN and name not in leave_out and not os.path.lexists(link):
                os.symlink(os.path.join(source, name), link)
    return folder


def _chown_tree(path, uid, gid):
    for base, dirs, files in os.walk(path):
        for name in [base, *(os.path.join(base, n) for n in dirs + files)]:
            os.lchown(name, uid, gid)


@pytest.fixture(scope="module")
def cluster_user(tmp_path_factory):
    """The user, its scratch clone, PATH farms, the shared caches; yields a dict of them."""
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", USER], check=True)
    account = pwd.getpwnam(USER)
    home = account.pw_dir
    work = os.path.join(home, "hvd_lars_test")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    scratch = os.path.join(work, "hvd_lars")
    head = subprocess.check_output(["git", "-C", REPO, "rev-parse", "HEAD"], text=True).strip()
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", REPO, scratch], check=True)
    subprocess.run(["git", "-C", scratch, "checkout", "--quiet", head], check=True)
    # The data as a user downloads it, uncompressed, in a folder of the user's.
    data = os.path.join(work, "fashion-mnist")
    os.makedirs(data)
    for name in glob.glob(os.path.join(FASHION_MNIST, "*-ubyte.gz")):
        with gzip.open(name, "rb") as f, open(os.path.join(data, os.path.basename(name)[:-3]), "wb") as out:
            shutil.copyfileobj(f, out)
    farms = os.path.join(work, "path")
    plain = _path_farm(os.path.join(farms, "plain"))
    no_launcher = _path_farm(os.path.join(farms, "no_launcher"), leave_out=("mpirun", "mpiexec"))
    no_compilers = _path_farm(
        os.path.join(farms, "no_compilers"), leave_out=("c++", "g++", "g++-12", "mpicxx", "mpic++", "mpiCC")
    )
    mpich = os.path.join(farms, "mpich_module")
    os.makedirs(mpich)
    for name, target in MPICH_PROGRAMS.items():
        os.symlink(os.path.join("/usr/bin", target), os.path.join(mpich, name))
    _chown_tree(work, account.pw_uid, account.pw_gid)

    # Wheels: root's cache into the shared one (the user's), and a wheelhouse of the requirements.
    wheels = os.path.join(SHARED, "wheels")
    wheelhouse = os.path.join(SHARED, "wheelhouse")
    for folder in (wheels, wheelhouse):
        os.makedirs(folder, exist_ok=True)
    if os.path.isdir(ROOT_WHEELS):
        shutil.copytree(ROOT_WHEELS, wheels, dirs_exist_ok=True)
    _chown_tree(wheels, account.pw_uid, account.pw_gid)
    started = time.time()
    download = [sys.executable, "-m", "pip", "download", "-q", "-d", wheelhouse,
                "-r", os.path.join(REPO, "requirements.txt"), "pip", "wheel", "setuptools",
                "cloudpickle", "psutil", "pyyaml", "packaging"]  # fmt: skip
    # From the wheelhouse alone when it already satisfies every requirement (5 CPU s here, against 17 s
    # of resolving against the index); from the index otherwise.
    offline = [*download, "--no-index", "--find-links", wheelhouse]
    if subprocess.run(offline, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(download, check=True, capture_output=True, timeout=1800)
    if not glob.glob(os.path.join(wheelhouse, "horovod-0.28.1.tar.gz")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "horovod==0.28.1", "-d", wheelhouse],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
    print(f"[test_setup] wheelhouse {wheelhouse} ready in {time.time() - started:.0f} s")
    env = {
        "HOME": home, "USER": USER, "LOGNAME": USER, "LANG": "C.UTF-8", "SHELL": "/bin/bash",
        "PYTHON": "/usr/bin/python3", "HVD_LARS_WHEEL_CACHE": wheels, "FASHION_MNIST_DIR": data,
        "PIP_FIND_LINKS": wheelhouse, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
        # No bytecode compiled at install (pip's --no-compile) for the thousands of modules of the
        # requirements: the imports that follow compile what they use.
        "PIP_COMPILE": "0",
    }  # fmt: skip
    yield {
        "scratch": scratch, "work": work, "data": data, "env": env, "plain": plain,
        "no_launcher": no_launcher, "no_compilers": no_compilers, "mpich": mpich, "wheels": wheels,
        "venv": os.path.join(scratch, ".venv"),
    }  # fmt: skip
    # A wheel the user built (MPICH's, on a fresh machine) goes back into root's cache for the next run.
    for wheel in glob.glob(os.path.join(wheels, "*", "*", "horovod-*.whl")):
        target = os.path.join(ROOT_WHEELS, os.path.relpath(wheel, wheels))
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(wheel, target)


def _setup(user, path, **extra_env):
    return _as_user(
        ["bash", "install/setup.sh"], dict(user["env"], PATH=path, **extra_env), 3600, user["scratch"]
    )


def _horovod_build(user):
    """The MPI the environment's Horovod was built for, as install/setup.sh records it."""
    return open(os.path.join(user["venv"], ".hvd_lars_horovod")).read()


def _mpi_libs(user):
    return glob.glob(
        os.path.join(user["venv"], "lib", "python3*", "site-packages", "horovod", "tensorflow", "mpi_lib*.so")
    )


def test_hidden_launcher_stops_with_one_message_and_installs_nothing(cluster_user):
    result, _ = _setup(cluster_user, cluster_user["no_launcher"])
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert len(lines) == 1 and lines[0].startswith(
        "  - an MPI launcher (mpirun or mpiexec): `module load openmpi`"
    )
    assert "conda install -c conda-forge openmpi-mpicxx" in lines[0]
    assert "Nothing was installed." in result.stderr
    assert "sudo" not in result.stderr.replace("or with sudo there", "")  # never tried
    assert result.stdout == "" and not os.path.exists(cluster_user["venv"])


def test_hidden_compilers_are_named_when_horovod_must_be_built(cluster_user):
    # An empty wheel cache: Horovod would have to be compiled, so the compilers are needed.
    empty = os.path.join(cluster_user["work"], "empty_cache")
    os.makedirs(empty, exist_ok=True)
    shutil.chown(empty, USER)
    result, _ = _setup(cluster_user, cluster_user["no_compilers"], HVD_LARS_WHEEL_CACHE=empty)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert [line.split(" (")[0] for line in lines] == [
        "  - a C++17 compiler",
        "  - an MPI C++ compiler wrapper",
    ]
    assert "`module load gcc`" in lines[0] and "gxx_linux-64" in lines[0]
    assert not os.path.exists(cluster_user["venv"]) and os.listdir(empty) == []


def _train(user, path, workdir, mpi):
    # The launcher takes the Python of the repository's .venv (launch/env.sh), not the set-up's PYTHON.
    env = {k: v for k, v in user["env"].items() if k != "PYTHON"}
    env.update(PATH=path)  # placement: launch/mpirun.sh's own from the machine, under Hydra too
    command = ["launch/mpirun.sh", "localhost", "2", "flags/smoke.flags", f"--workdir={workdir}"]
    result, seconds = _as_user(command, env, 600, user["scratch"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(open(os.path.join(workdir, "smoke", "summary.json")).read())
    assert summary["world_size"] == 2 and summary["local_size"] == 2
    cores = sorted(os.sched_getaffinity(0))[:2]
    assert summary["threads"]["cores_per_rank"] == [[c] for c in cores]  # bound, one core each
    print(f"[test_setup] 2-rank smoke run under {mpi}: {seconds:.0f} s")


@pytest.fixture(scope="module")
def openmpi_run(cluster_user):
    """The user's set-up with the system's Open MPI, then a 2-rank smoke run; returns its workdir."""
    result, seconds = _setup(cluster_user, cluster_user["plain"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(f"[test_setup] user's set-up with Open MPI: {seconds:.0f} s")
    assert "[setup] MPI: openmpi " in result.stdout and "[apt]" not in result.stdout
    assert _horovod_build(cluster_user).startswith("openmpi-")
    workdir = os.path.join(cluster_user["work"], "run_openmpi")
    _train(cluster_user, cluster_user["plain"], workdir, "Open MPI's mpirun")
    return workdir


def test_user_without_root_sets_up_and_trains_2_ranks(cluster_user, openmpi_run):
    # Trained 2 ranks (openmpi_run); in the user's own environment: owned by it, Horovod in it.
    assert os.stat(cluster_user["venv"]).st_uid == pwd.getpwnam(USER).pw_uid and _mpi_libs(cluster_user)
    # Again (nothing to install); from a clone sharing the environment (VENV=), Horovod lost; here again.
    scratch, other = cluster_user["scratch"], os.path.join(cluster_user["work"], "other_checkout")
    _as_user(["git", "clone", "--quiet", scratch, other], cluster_user["env"], 60, "/")
    python = f"{cluster_user['venv']}/bin/python"
    where = [python, "-c", "import importlib.util as u; print(u.find_spec('hvd_lars').origin)"]
    env = dict(cluster_user["env"], PATH=cluster_user["plain"], VENV=cluster_user["venv"])
    for checkout, installed in ((scratch, []), (other, ["Horovod", "hvd_lars"]), (scratch, ["hvd_lars"])):
        for lib in _mpi_libs(cluster_user) if checkout == other else ():
            os.remove(lib)
        result, seconds = _as_user(["bash", "install/setup.sh"], env, 600, checkout)
        assert result.returncode == 0 and (installed or seconds < 120), result.stdout + result.stderr[-2000:]
        assert re.findall(r"^\[setup\] installing (\w+)", result.stdout, re.M) == installed, result.stdout
        assert _as_user(where, cluster_user["env"], 60, "/")[0].stdout == f"{checkout}/hvd_lars/__init__.py\n"


def test_mpich_build_runs_2_ranks_under_mpiexec_bit_identical_to_open_mpi(cluster_user, openmpi_run):
    # Debian's alternatives still pick Open MPI for mpirun and mpicc with MPICH installed beside it.
    for group, want in (("mpirun", "/usr/bin/mpirun.openmpi"), ("mpi", "/usr/bin/mpicc.openmpi")):
        query = subprocess.run(["update-alternatives", "--query", group], capture_output=True, text=True)
        assert f"Value: {want}" in query.stdout, query.stdout
    path = cluster_user["mpich"] + ":" + cluster_user["plain"]
    result, seconds = _setup(cluster_user, path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(f"[test_setup] user's set-up switched to MPICH: {seconds:.0f} s")
    assert "[setup] MPI: mpich 4.0.2" in result.stdout
    assert f"installing Horovod from {cluster_user['wheels']}/mpich-4.0.2/tf-" in result.stdout
    assert _horovod_build(cluster_user).startswith("mpich-4.0.2 ")
    (mpi_lib,) = _mpi_libs(cluster_user)
    linked = subprocess.run(["ldd", mpi_lib], capture_output=True, text=True).stdout
    assert "libmpich.so" in linked and "libmpi.so.40" not in linked, linked
    workdir = os.path.join(cluster_user["work"], "run_mpich")
    _train(cluster_user, path, workdir, "MPICH's mpiexec")
    want, got = final_tensors(f"{openmpi_run}/smoke", 6), final_tensors(f"{workdir}/smoke", 6)
    assert sorted(got) == sorted(want) and int(got["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 6
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # Trained: the first convolution's kernel moved between steps 3 and 6 (in both runs alike).
    kernel = "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"
    assert got[kernel].shape == (3, 3, 3, 16) and not np.array_equal(
        final_tensors(f"{workdir}/smoke", 3)[kernel], got[kernel]
    )


def test_mpich_job_runs_under_slurm_srun_pmi2(cluster_user, openmpi_run, tmp_path):
    # After the MPICH test, the user's environment holds the Horovod built against MPICH: train.sbatch
    # starts its 2 ranks with `srun --mpi=pmi2` (SRUN_MPI), the PMI MPICH speaks (Slurm's pmix is Open MPI's).
    from tests.support.slurm_cluster import SlurmCluster

    if not _horovod_build(cluster_user).startswith("mpich-"):
        pytest.skip("the MPICH build is not installed (its test did not pass)")
    cluster = SlurmCluster(tmp_path / "slurm").start()
    try:
        scratch, path = cluster_user["scratch"], cluster_user["mpich"] + ":" + cluster_user["plain"]
        export = (
            f"ALL,SRUN_MPI=pmi2,PYTHON={cluster_user['venv']}/bin/python,PYTHONPATH={scratch},PATH={path}"
        )
        job = cluster.run(
            ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", f"--chdir={scratch}",
             f"--output={tmp_path}/slurm-%j.out", f"--export={export}",
             "launch/slurm/train.sbatch", "flags/smoke.flags", f"--workdir={tmp_path}"]
        ).stdout.strip().split(";")[0]  # fmt: skip
        state = cluster.wait(job, timeout=300)
    finally:
        cluster.stop()
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["local_size"] == 2 and summary["plan"]["total_steps"] == 6
