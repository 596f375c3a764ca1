# Sourced by the install scripts.
#
# apt_usable: true on Debian (dpkg-query and apt-get on PATH) for root, or for a user whose sudo works
# without a password or can ask for one (a terminal); false elsewhere (a cluster's login node).
apt_usable() {
  command -v apt-get >/dev/null 2>&1 && command -v dpkg-query >/dev/null 2>&1 || return 1
  [ "$(id -u)" -eq 0 ] && return 0
  command -v sudo >/dev/null 2>&1 && { sudo -n true 2>/dev/null || [ -t 0 ]; }
}

# apt_install_missing PKG...: installs the Debian packages not yet installed (apt-get update first, only when
# something is missing), quietly; prints what it did. The choices of the alternatives systems MPI packages
# register (mpirun, mpi: which MPI /usr/bin/mpirun and /usr/bin/mpicc are) are the same afterwards as
# before: a second MPI (mpich beside openmpi-bin) registers itself but does not take them over.
APT_KEPT_ALTERNATIVES=(mpirun mpi)
apt_install_missing() {
  local missing=() p sudo="" name
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    echo "[apt] present: $*"
    return 0
  fi
  echo "[apt] installing: ${missing[*]}"
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  local -A before=()
  for name in "${APT_KEPT_ALTERNATIVES[@]}"; do
    before[$name]="$(_alternative_value "$name")"
  done
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  for name in "${APT_KEPT_ALTERNATIVES[@]}"; do
    local now
    now="$(_alternative_value "$name")"
    if [ -n "${before[$name]}" ] && [ "$now" != "${before[$name]}" ]; then
      echo "[apt] alternative $name: keeping ${before[$name]} (the install had chosen $now)"
      $sudo update-alternatives --quiet --set "$name" "${before[$name]}"
    fi
  done
}

# The file an alternatives group points to now (empty when the group does not exist, as mpirun's does on a
# machine with no MPI yet: update-alternatives then exits 2, which must not end a caller under set -e and
# pipefail).
_alternative_value() {
  { update-alternatives --query "$1" 2>/dev/null || true; } | sed -n 's/^Value: //p'
}
