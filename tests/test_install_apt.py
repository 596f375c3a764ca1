"""install/apt.sh's apt_install_missing, run under `set -euo pipefail` as install/setup.sh runs it, with
stand-ins for dpkg-query, apt-get and update-alternatives on PATH: a fresh Debian machine has no MPI, so
the alternatives groups the function keeps (mpirun, mpi) do not exist before the install."""

import os
import subprocess
import textwrap

import pytest

from tests.support import REPO

pytestmark = pytest.mark.horovod


def _install(tmp_path, groups_before):
    """The stand-ins: dpkg-query (nothing installed), apt-get (logs its arguments; `install` creates the
    groups), update-alternatives (exit 2 for a group that does not exist, as Debian's does)."""
    folder = tmp_path / "bin"
    folder.mkdir(parents=True)
    state = folder / "state"
    state.mkdir()
    for group, value in groups_before.items():
        (state / group).write_text(value)
    scripts = {
        "dpkg-query": "exit 1\n",
        "id": "echo 0\n",
        "apt-get": textwrap.dedent(f"""\
            echo "$*" >> {folder}/apt-get.log
            case " $* " in *" install "*)
              echo /usr/bin/mpirun.openmpi > {state}/mpirun
              echo /usr/bin/mpicc.openmpi > {state}/mpi ;;
            esac
            """),
        "update-alternatives": textwrap.dedent(f"""\
            [ "$1" = --quiet ] && shift
            case "$1" in
              --query) [ -f {state}/"$2" ] || exit 2; echo "Value: $(cat {state}/"$2")" ;;
              --set) echo "$2 $3" >> {folder}/set.log; echo "$3" > {state}/"$2" ;;
            esac
            """),
    }
    for name, body in scripts.items():
        path = folder / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    env = dict(os.environ, PATH=f"{folder}:{os.environ['PATH']}")
    script = (
        f"set -euo pipefail; source {REPO}/install/apt.sh; apt_install_missing openmpi-bin libopenmpi-dev"
    )
    return folder, subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


def test_install_goes_through_with_no_mpi_alternatives_yet_and_keeps_an_earlier_mpirun(tmp_path):
    bin_dir, result = _install(tmp_path / "fresh", groups_before={})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[apt] installing: openmpi-bin libopenmpi-dev" in result.stdout
    log = (bin_dir / "apt-get.log").read_text().splitlines()
    assert log == ["update -qq", "install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev"]
    # Nothing to keep: the groups did not exist before.
    assert not (bin_dir / "set.log").exists()
    # An mpirun an earlier MPI had chosen is kept.
    kept = "/usr/bin/mpirun.mpich"
    bin_dir, result = _install(tmp_path / "mpich", groups_before={"mpirun": kept})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"[apt] alternative mpirun: keeping {kept} (the install had chosen /usr/bin/mpirun.openmpi)" in (
        result.stdout
    )
    assert (bin_dir / "set.log").read_text().splitlines() == [f"mpirun {kept}"]
    assert (bin_dir / "state" / "mpirun").read_text().strip() == kept
