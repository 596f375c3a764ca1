#!/usr/bin/env bash
# One-command set-up for hvd_lars: as root on Debian 12 (or with sudo there), or as any user on a machine
# that has the build's tools already (a cluster's login node: environment modules, conda, pip).
#
# Idempotent: each step checks whether its result is already there, so a second run takes seconds.
#   1. What the build needs, looked for on PATH, before anything is changed: $PYTHON (3.10 or later) with
#      its venv module and, when Horovod has to be compiled, its headers (Python.h), a C++17 compiler
#      ($CXX, else c++) and an MPI compiler wrapper (mpicxx); always an MPI launcher (mpirun or mpiexec: Open
#      MPI, MPICH, MVAPICH2 or Intel MPI, whichever comes first on PATH) and the Fashion-MNIST files (in
#      $FASHION_MNIST_DIR, default Debian's folder; FASHION_MNIST_DIR=none skips them). cmake 3.13 or later
#      is taken from PATH, else from pip into the environment. When something is missing: root on Debian
#      (or a user with sudo) gets the Debian packages for it from apt-get; anyone else one message naming
#      each missing piece and how to get it without root, exit status 1, and nothing installed.
#   2. A virtual environment at $VENV (default .venv/ in the repository root) with TensorFlow 2.21.x,
#      tensorflow-datasets, absl-py, numpy and the test tools (requirements.txt). One this run made is
#      removed again if a later step fails.
#   3. Horovod 0.28.1 built from its source archive with MPI (the one on PATH) and Gloo against that
#      TensorFlow. The one source file that includes XLA headers at their pre-TF-2.16 location
#      (xla_mpi_ops.cc, used only for XLA-compiled GPU graphs) is left out of the build. The wheel is kept
#      in $HVD_LARS_WHEEL_CACHE/<MPI>-<version>/tf-<TF>-py<XY>/ (default ~/.cache/hvd_lars/wheels; e.g.
#      openmpi-4.1.4/tf-2.21.0-py311), so a build for one MPI is never installed for another, and a fresh
#      clone installs it in seconds. Checked by 2 ranks under that MPI's launcher.
#   4. The package itself (pip install -e .).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION=0.28.1
WHEEL_CACHE="${HVD_LARS_WHEEL_CACHE:-$HOME/.cache/hvd_lars/wheels}"
FASHION_MNIST_DIR="${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}"
FASHION_MNIST_FILES=(train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte)
CXX_BIN="${CXX:-c++}"

log() { printf '[setup] %s\n' "$*"; }
source "$ROOT/install/apt.sh"
source "$ROOT/install/mpi.sh"

# --- 1. What the build needs ---------------------------------------------------------------------------
# Each missing piece adds a line to `missing` (what, and how to get it without root) and its Debian
# packages to `debs`.
mpi_key() { mpi_identify && echo "$MPI_FAMILY-$MPI_VERSION"; }
python_xy() { "$PYTHON" -c 'import sys; print("%d%d" % sys.version_info[:2])'; }
# Horovod needs no compiling when the environment has it for this MPI already, or the cache holds a wheel
# for this MPI, Python and the TensorFlow minor requirements.txt pins.
TF_MINOR="$(sed -n 's/^tensorflow==\([0-9]*\.[0-9]*\).*/\1/p' "$ROOT/requirements.txt")"
build_needed() {
  local key xy
  key="$(mpi_key)" || return 0
  [ "$(cat "$VENV/.hvd_lars_horovod" 2>/dev/null | cut -d' ' -f1)" = "$key" ] && return 1
  xy="$(python_xy 2>/dev/null)" || return 0
  ! ls "$WHEEL_CACHE/$key"/tf-"${TF_MINOR:-none}".*-py"$xy"/horovod-"$HOROVOD_VERSION"-*.whl >/dev/null 2>&1
}
find_missing() {
  missing=() debs=()
  local how_mpi="\`module load openmpi\` (or mpich, mvapich2, intel-mpi: \`module avail mpi\` lists them), or conda: \`conda install -c conda-forge openmpi-mpicxx\` (or mpich-mpicxx)"
  if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    missing+=("Python 3.10 or later as \$PYTHON ($PYTHON): \`module load python/3.11\`, or a conda environment (\`conda create -n hvd python=3.11\`), then PYTHON=python3")
    debs+=(python3 python3-venv python3-dev)
  else
    if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
      missing+=("Python's venv module with ensurepip for $PYTHON: a Python of a module or conda has it (\`module load python\`); Debian: python3-venv")
      debs+=(python3-venv)
    fi
  fi
  if ! command -v mpirun >/dev/null 2>&1 && ! command -v mpiexec >/dev/null 2>&1; then
    missing+=("an MPI launcher (mpirun or mpiexec): $how_mpi")
    debs+=(openmpi-bin libopenmpi-dev)
  elif ! mpi_identify; then
    missing+=("an MPI launcher that names its MPI: $(command -v mpirun || command -v mpiexec) --version names none of Open MPI, MPICH, MVAPICH2, Intel MPI; load one of those (\`module load openmpi\`)")
  fi
  if build_needed; then
    if "$PYTHON" -c 'import sys' 2>/dev/null \
      && ! "$PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path("include"), "Python.h")))' 2>/dev/null; then
      missing+=("Python's headers (Python.h, not in $("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("include"))' 2>/dev/null)) for the Horovod build: a Python of a module or conda has them (\`module load python\`); Debian: python3-dev")
      debs+=(python3-dev)
    fi
    if ! command -v "$CXX_BIN" >/dev/null 2>&1 \
      || ! printf 'template <class T> constexpr bool f() { if constexpr (sizeof(T) > 0) return true; return false; }\nint main() { return f<int>() ? 0 : 1; }\n' \
        | "$CXX_BIN" -std=c++17 -x c++ - -o /dev/null >/dev/null 2>&1; then
      missing+=("a C++17 compiler (\$CXX, else c++: GCC 7+ or Clang 5+) for the Horovod build: \`module load gcc\`, or conda: \`conda install -c conda-forge gxx_linux-64\` (sets CXX)")
      debs+=(build-essential)
    fi
    local wrapper
    wrapper="$(command -v mpicxx || command -v mpic++ || true)"
    if [ -z "$wrapper" ]; then
      missing+=("an MPI C++ compiler wrapper (mpicxx) for the Horovod build: the MPI module has it beside mpirun; $how_mpi; Debian: libopenmpi-dev")
      debs+=(libopenmpi-dev)
    elif [ -n "${MPI_FAMILY:-}" ]; then
      local wrapper_family launcher_family=mpich
      wrapper_family="$(mpi_wrapper_family "$wrapper")"
      [ "$MPI_FAMILY" != openmpi ] || launcher_family=openmpi
      if [ "$wrapper_family" != "$launcher_family" ]; then
        missing+=("an MPI compiler wrapper and launcher of one MPI: $wrapper is ${wrapper_family/mpich/MPICH-family}'s, $MPI_LAUNCHER is $MPI_FAMILY $MPI_VERSION's; load one MPI only (\`module purge; module load <mpi>\`)")
      fi
    fi
  fi
  if [ "$FASHION_MNIST_DIR" != none ]; then
    local f absent=()
    for f in "${FASHION_MNIST_FILES[@]}"; do
      [ -e "$FASHION_MNIST_DIR/$f.gz" ] || [ -e "$FASHION_MNIST_DIR/$f" ] || absent+=("$f.gz")
    done
    if ((${#absent[@]})); then
      missing+=("the Fashion-MNIST files ${absent[*]} (or uncompressed, without .gz) in $FASHION_MNIST_DIR: download the four from https://github.com/zalandoresearch/fashion-mnist (folder data/fashion) into a folder, run again with FASHION_MNIST_DIR=<that folder>, and train with --data_dir=<that folder> (FASHION_MNIST_DIR=none if you train on other data only); Debian: dataset-fashion-mnist")
      [ "$FASHION_MNIST_DIR" != /usr/share/datasets/fashion-mnist ] || debs+=(dataset-fashion-mnist)
    fi
  fi
}

find_missing
if ((${#missing[@]})) && ((${#debs[@]})) && apt_usable; then
  # With them, as before: Debian's cmake for the build and git for the runs' provenance (when absent).
  apt_install_missing "${debs[@]}" cmake git
  find_missing
fi
if ((${#missing[@]})); then
  {
    echo "[setup] install/setup.sh cannot set up here: missing"
    for line in "${missing[@]}"; do echo "  - $line"; done
    echo "Nothing was installed. (As root on Debian, or with sudo there, install/setup.sh installs these with apt-get.)"
  } >&2
  exit 1
fi
log "MPI: $MPI_FAMILY $MPI_VERSION ($MPI_LAUNCHER)"

# From here on, a failure leaves no half-made environment behind: one this run created is removed.
created_venv=""
build=""
cleanup() {
  local rc=$?
  [ -z "$build" ] || rm -rf "$build"
  if [ "$rc" -ne 0 ] && [ -n "$created_venv" ]; then
    rm -rf "$VENV"
    echo "[setup] failed (exit $rc): removed the environment $VENV this run had begun" >&2
  fi
}
trap cleanup EXIT

# --- 2. Virtual environment and Python requirements -------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  created_venv=1
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
REQ_STAMP="$VENV/.hvd_lars_requirements.sha256"
req_sum="$(sha256sum "$ROOT/requirements.txt" | cut -d' ' -f1)"
if [ "$(cat "$REQ_STAMP" 2>/dev/null)" != "$req_sum" ]; then
  log "installing Python requirements"
  "$PY" -m pip install -q --upgrade pip wheel setuptools
  "$PY" -m pip install -q -r "$ROOT/requirements.txt"
  echo "$req_sum" >"$REQ_STAMP"
else
  log "Python requirements present"
fi

# --- 3. Horovod from source, for the MPI on PATH ------------------------------------------------------
key="$MPI_FAMILY-$MPI_VERSION"
tf_version="$("$PY" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')"
wheel_key="$key tf-$tf_version-py$(python_xy)"
horovod_ok() {
  "$PY" - <<'PY' 2>/dev/null
import horovod, horovod.tensorflow as hvd
from horovod.common.util import gloo_built, mpi_built
assert horovod.__version__ == "0.28.1", horovod.__version__
assert gloo_built() and mpi_built()
PY
}
# 2 ranks under the launcher: a Horovod built against another MPI starts two worlds of size 1 instead.
horovod_runs_2_ranks() {
  local flags=()
  [ "$MPI_FAMILY" != openmpi ] || flags=(--oversubscribe)
  local out
  out="$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_CPP_MIN_LOG_LEVEL=3 \
    "$MPI_LAUNCHER" -np 2 "${flags[@]}" "$PY" -c '
import horovod.tensorflow as hvd
hvd.init()
assert hvd.mpi_enabled() and hvd.size() == 2, (hvd.mpi_enabled(), hvd.size())
print(f"[setup] Horovod rank {hvd.rank()} of {hvd.size()} under MPI")
' 2>&1)" || true
  grep -q "rank 1 of 2" <<<"$out" || { printf '%s\n' "$out" | tail -20 >&2; return 1; }
}
# The build the stamp records (checked by horovod_ok and 2 ranks when installed) still in place: its
# version and its TensorFlow extension, found without importing TensorFlow (seconds on every make).
horovod_still_installed() {
  "$PY" - "$HOROVOD_VERSION" <<'PY' 2>/dev/null
import glob, importlib.metadata as m, importlib.util as u, os, sys
assert m.version("horovod") == sys.argv[1]
assert glob.glob(os.path.join(os.path.dirname(u.find_spec("horovod").origin), "tensorflow", "mpi_lib*.so"))
PY
}
if [ "$(cat "$VENV/.hvd_lars_horovod" 2>/dev/null)" = "$wheel_key" ] && horovod_still_installed; then
  log "Horovod $HOROVOD_VERSION for $key present"
else
  wheel_dir="$WHEEL_CACHE/$key/tf-$tf_version-py$(python_xy)"
  if ! ls "$wheel_dir"/horovod-"$HOROVOD_VERSION"-*.whl >/dev/null 2>&1; then
    build="$(mktemp -d)"
    # A cache this user cannot write (one shared read-only) still serves its wheels; a new one stays here.
    mkdir -p "$wheel_dir" 2>/dev/null && [ -w "$wheel_dir" ] || wheel_dir="$build/wheels"
    log "building Horovod $HOROVOD_VERSION against TensorFlow $tf_version and $key (4-8 minutes on 2 cores)"
    # The source archive only (no wheel exists); its metadata from the environment's setuptools, so that
    # pip needs nothing else from the index (a wheelhouse with --no-index serves too).
    "$PY" -m pip download -q --no-deps --no-binary horovod --no-build-isolation "horovod==$HOROVOD_VERSION" -d "$build"
    tar -xzf "$build"/horovod-"$HOROVOD_VERSION".tar.gz -C "$build"
    src="$build/horovod-$HOROVOD_VERSION"
    # TF >= 2.16 no longer ships the XLA headers this file includes; it only serves XLA GPU graphs.
    sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    if grep -q xla_mpi_ops "$src/horovod/tensorflow/CMakeLists.txt"; then
      echo "[setup] could not remove xla_mpi_ops.cc from Horovod's build" >&2
      exit 1
    fi
    # cmake from PATH when recent enough (Horovod asks for 3.13), else pip's in the environment. CMake 4
    # refuses Gloo's cmake_minimum_required(VERSION 2.8.12) unless told the minimum policy version.
    if ! cmake --version 2>/dev/null | awk '/version/ {split($3, v, "."); exit !(v[1] > 3 || (v[1] == 3 && v[2] >= 13))}'; then
      log "no cmake 3.13+ on PATH: installing pip's cmake into $VENV"
      "$PY" -m pip install -q cmake
      export HOROVOD_CMAKE="$VENV/bin/cmake"
    fi
    # The MPI is the one whose mpicxx comes first on PATH (CMake's FindMPI asks the wrapper), as checked
    # in step 1; CXX, when set, is the C++ compiler.
    CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip wheel --no-deps --no-build-isolation -w "$wheel_dir" "$src"
  fi
  log "installing Horovod from $wheel_dir"
  "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-"$HOROVOD_VERSION"-*.whl
  # Horovod's runtime requirements (horovodrun), without letting pip touch TensorFlow.
  "$PY" -m pip install -q cloudpickle psutil pyyaml packaging
  horovod_ok || { echo "[setup] Horovod installed but lacks TensorFlow, MPI or Gloo support" >&2; exit 1; }
  horovod_runs_2_ranks || {
    echo "[setup] Horovod from $wheel_dir does not run 2 ranks under $MPI_LAUNCHER ($key)" >&2
    exit 1
  }
  echo "$wheel_key" >"$VENV/.hvd_lars_horovod"
fi

# --- 4. The package -------------------------------------------------------------------------------------
# Installed, and from this checkout (an environment another checkout installed into imports that one).
installed_here() {
  (cd / && "$PY" -c 'import importlib.util as u, sys; s = u.find_spec("hvd_lars"); sys.exit(not s or s.origin != sys.argv[1])' \
    "$ROOT/hvd_lars/__init__.py")
}
if ! installed_here || [ "$ROOT/setup.cfg" -nt "$VENV/.hvd_lars_installed" ]; then
  log "installing hvd_lars (editable)"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  touch "$VENV/.hvd_lars_installed"
fi
log "ready: $VENV"
