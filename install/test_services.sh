#!/usr/bin/env bash
# Debian packages the test suite needs beyond install/setup.sh: a real Slurm (slurm-wlm) and its
# authentication daemon (munge), for tests/test_slurm.py. The tests start the daemons themselves on free
# local ports (tests/slurm_cluster.py); nothing is started here. Idempotent.
set -euo pipefail
source "$(dirname "$0")/apt.sh"
apt_install_missing slurm-wlm munge
