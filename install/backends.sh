#!/usr/bin/env bash
# The library's backend-neutral wing (tests/test_every_backend.py) on Keras 3's other backends, each in an
# environment of its own without TensorFlow or Horovod: `pip install .` there must pull neither.
#   jax:   keras and jax from the package registry (about 700 MB, a minute or two the first time).
#   torch: only from a wheel already on this machine (pip's find-links): PyPI's torch brings several GB of
#          CUDA libraries. Without one, the torch check is skipped with a line saying how to run it.
# Environments: $BACKENDS_DIR/<backend> (default .venv-backends/), reused while the package's metadata is
# unchanged.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${BACKENDS_DIR:-$ROOT/.venv-backends}"
PYTHON="${PYTHON:-python3}"
KERAS="$("$ROOT/.venv/bin/python" -c 'import keras; print(keras.__version__)' 2>/dev/null || echo 3.15.1)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
log() { printf '[backends] %s\n' "$*"; }

environment() {  # $1 backend, $2 what to install from this machine's wheels alone, then from the registry
  local backend="$1" local_only="$2" env="$DIR/$1" stamp
  shift 2
  stamp="$(cat "$ROOT/setup.cfg" "$ROOT/hvd_lars/__init__.py" | sha256sum | cut -c1-16) $KERAS $local_only $*"
  if [ "$(cat "$env/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$env"
    "$PYTHON" -m venv "$env"
    if [ -n "$local_only" ]; then
      "$env/bin/pip" install -q --no-index --no-deps "$local_only" || { rm -rf "$env"; return 1; }
    fi
    "$env/bin/pip" install -q "keras==$KERAS" $local_only "$@" pytest "$ROOT" || { rm -rf "$env"; return 1; }
    echo "$stamp" > "$env/.stamp"
  fi
  if "$env/bin/python" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ("tensorflow", "horovod")))'; then
    :
  else
    log "$backend: installing the package pulled in TensorFlow or Horovod"; return 1
  fi
}

check() {  # $1 backend
  log "$1: tests/test_every_backend.py"
  (cd "$ROOT" && KERAS_BACKEND="$1" "$DIR/$1/bin/python" -m pytest -q -p no:cacheprovider \
    -W ignore::DeprecationWarning tests/test_every_backend.py)
}

environment jax "" jax
check jax
if environment torch "torch==$TORCH_VERSION" 2>/dev/null; then
  check torch
else
  log "torch: skipped (no torch $TORCH_VERSION wheel on this machine; PyPI's brings several GB of CUDA"
  log "  libraries). By hand: pip install keras torch pytest . in a fresh environment, then"
  log "  KERAS_BACKEND=torch python -m pytest tests/test_every_backend.py"
fi
