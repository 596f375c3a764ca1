#!/usr/bin/env bash
# Runs the unit tier (the Keras conformance tests among them: LARS, DistributedOptimizer, schedules,
# callbacks, checkpoints held to what every Keras 3 optimizer promises) against each Keras release named,
# with the project's TensorFlow, and writes results/keras_versions.md (override with OUT=...). The Keras
# range setup.cfg and requirements.txt declare is the one whose every minor passed here
# (checks/test_install_bounds.py, in `make check-docs`, holds them to it). About 3-5 minutes per release on
# 2 cores:
#
#   bash install/check_keras_versions.sh 3.12.4 3.13.2 3.14.1 3.15.1
#
# Each release is installed with `pip install --no-deps --target` into a temporary folder put first on
# PYTHONPATH, so the project's environment is not changed; Keras's own requirements are the environment's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
OUT="${OUT:-$ROOT/results/keras_versions.md}"
[ $# -ge 1 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export TF_CPP_MIN_LOG_LEVEL=2
rows=()
for version in "$@"; do
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$WORK/$version" "keras==$version"
  got="$(PYTHONPATH="$WORK/$version" "$PY" -c 'import keras; print(keras.__version__)' 2>/dev/null)"
  [ "$got" = "$version" ] || { echo "keras $version did not install (imports as $got)" >&2; exit 1; }
  log="$WORK/$version.log"
  status=0
  (cd "$ROOT" && PYTHONPATH="$WORK/$version" "$PY" -m pytest -q -m unit -p no:cacheprovider -n 2 \
    --dist loadgroup >"$log" 2>&1) || status=$?
  summary="$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')"
  failed="$(grep -E '^FAILED ' "$log" | sed 's/^FAILED //; s/ - .*//' | head -20 | tr '\n' ' ' || true)"
  rows+=("| $version | $([ "$status" -eq 0 ] && echo pass || echo fail) | $summary | ${failed:-} |")
  echo "keras $version: $summary" >&2
done
{
  echo "# The unit tier against each Keras release"
  echo
  # -dirty: the tests ran on uncommitted changes, which no commit holds (checks/test_results_files.py refuses it).
  dirty="$(git -C "$ROOT" status --porcelain --untracked-files=no | grep -q . && echo -dirty || true)"
  echo "Command: \`bash install/check_keras_versions.sh $*\`, git $(git -C "$ROOT" rev-parse HEAD)$dirty, $(date -u '+%Y-%m-%d %H:%M UTC')."
  # The CPU's identity and the tf.matmul rate through the one helper every benchmark's report uses (the
  # rate does not bear on these results, pass or fail only; every record in results/ names it).
  echo "Machine: $(cd "$ROOT" && PYTHONPATH="$ROOT" "$PY" -m benchmarks.common --machine_line 2>/dev/null); TensorFlow $("$PY" -c 'import importlib.metadata as m; print(m.version("tensorflow"))')."
  echo
  echo "| Keras | unit tier | pytest's summary | tests that failed |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} >"$OUT"
cat "$OUT"
