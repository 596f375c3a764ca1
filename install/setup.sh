#!/usr/bin/env bash
# One-command set-up for hvd_lars on Debian 12 (run as root, or with sudo available).
#
# Idempotent: each step checks whether its result is already there, so a second run takes seconds.
#   1. Debian packages: Open MPI (Horovod's MPI controller and mpirun), the Fashion-MNIST data set,
#      compilers and cmake for the Horovod build.
#   2. A virtual environment at $VENV (default .venv/ in the repository root) with TensorFlow 2.21.x,
#      tensorflow-datasets, absl-py, numpy and the test tools (requirements.txt).
#   3. Horovod 0.28.1 built from its source archive with MPI and Gloo against that TensorFlow. The one
#      source file that includes XLA headers at their pre-TF-2.16 location (xla_mpi_ops.cc, used only for
#      XLA-compiled GPU graphs) is left out of the build. The built wheel is kept in $WHEEL_CACHE so a fresh
#      clone on the same machine installs it in seconds.
#   4. The package itself (pip install -e .).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION=0.28.1
WHEEL_CACHE="${HVD_LARS_WHEEL_CACHE:-$HOME/.cache/hvd_lars/wheels}"

log() { printf '[setup] %s\n' "$*"; }

# --- 1. Debian packages -----------------------------------------------------------------------------
source "$ROOT/install/apt.sh"
# python3-venv and python3-dev: the virtual environment and the Horovod build (Python.h).
apt_install_missing python3 python3-venv python3-dev openmpi-bin libopenmpi-dev dataset-fashion-mnist build-essential \
  cmake git

# --- 2. Virtual environment and Python requirements -------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
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

# --- 3. Horovod from source ---------------------------------------------------------------------------
horovod_ok() {
  "$PY" - <<'PY' 2>/dev/null
import horovod, horovod.tensorflow as hvd
from horovod.common.util import gloo_built, mpi_built
assert horovod.__version__ == "0.28.1", horovod.__version__
assert gloo_built() and mpi_built()
PY
}
if horovod_ok; then
  log "Horovod $HOROVOD_VERSION present"
else
  tf_version="$("$PY" -c 'import tensorflow as tf; print(tf.__version__)')"
  mkdir -p "$WHEEL_CACHE"
  wheel_dir="$WHEEL_CACHE/tf-$tf_version-py$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
  if ! ls "$wheel_dir"/horovod-"$HOROVOD_VERSION"-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION against TensorFlow $tf_version (about 8 minutes on 2 cores)"
    build="$(mktemp -d)"
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
    tar -xzf "$build"/horovod-"$HOROVOD_VERSION".tar.gz -C "$build"
    src="$build/horovod-$HOROVOD_VERSION"
    # TF >= 2.16 no longer ships the XLA headers this file includes; it only serves XLA GPU graphs.
    sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    if grep -q xla_mpi_ops "$src/horovod/tensorflow/CMakeLists.txt"; then
      echo "[setup] could not remove xla_mpi_ops.cc from Horovod's build" >&2; exit 1
    fi
    "$PY" -m pip install -q cmake
    mkdir -p "$wheel_dir"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip wheel --no-deps --no-build-isolation -w "$wheel_dir" "$src"
    rm -rf "$build"
  fi
  log "installing Horovod from $wheel_dir"
  "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-"$HOROVOD_VERSION"-*.whl
  # Horovod's runtime requirements (horovodrun), without letting pip touch TensorFlow.
  "$PY" -m pip install -q cloudpickle psutil pyyaml packaging
  horovod_ok || { echo "[setup] Horovod installed but lacks TensorFlow, MPI or Gloo support" >&2; exit 1; }
fi

# --- 4. The package -------------------------------------------------------------------------------------
if ! "$PY" -m pip show -q hvd_lars >/dev/null 2>&1 || [ "$ROOT/setup.cfg" -nt "$VENV/.hvd_lars_installed" ]; then
  log "installing hvd_lars (editable)"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  touch "$VENV/.hvd_lars_installed"
fi
log "ready: $VENV"
