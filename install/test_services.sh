#!/usr/bin/env bash
# Debian packages the test suite needs beyond install/setup.sh: a real Slurm (slurm-wlm) and its
# authentication daemon (munge), for tests/test_slurm.py. The tests start the daemons themselves on free
# local ports (tests/slurm_cluster.py); nothing is started here. Idempotent.
set -euo pipefail
missing=()
for p in slurm-wlm munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[test_services] installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The Debian package starts no daemon in containers; the tests do. Keep a distribution-started slurmctld
# (if any) from holding the ports: the tests use their own configuration and ports anyway.
echo "[test_services] slurm-wlm and munge present"
