#!/usr/bin/env bash
# Debian packages the test suite needs beyond install/setup.sh, for services the tests start themselves
# (nothing is started here). Idempotent.
#   slurm-wlm, munge: a real Slurm on free local ports (tests/test_slurm.py, tests/support/slurm_cluster.py).
#   openssh-server, openssh-client, iproute2, util-linux, procps: the emulated cluster of
#     launch/emulated_cluster.sh (sshd per host, ip/tc for namespaces, bridge and shaping, nsenter/unshare,
#     pgrep) for tests/test_cluster.py.
#   mpich, libmpich-dev: a second MPI beside Open MPI, for tests/test_setup.py (Horovod built against MPICH,
#     run under its mpiexec). Debian's alternatives keep pointing mpirun and mpicc at Open MPI (apt.sh checks).
set -euo pipefail
source "$(dirname "$0")/apt.sh"
apt_install_missing slurm-wlm munge openssh-server openssh-client iproute2 util-linux procps mpich libmpich-dev
