#!/usr/bin/env bash
# Checks that `pip install .` into a fresh virtual environment that holds only TensorFlow gives a working
# package, as a user installs it. Writes the record
# results/pip_install.md (override with OUT=...). About 5 minutes; run from anywhere:
#
#   bash install/check_pip_install.sh
#
# Steps, in a temporary folder (removed at the end):
#   1. a virtual environment made with "$PYTHON -m venv" (no --system-site-packages: nothing of the
#      project's .venv is visible), pip, then the user's TensorFlow ($TF_SPEC, default the version of the
#      project's .venv, from the package index or pip's cache);
#   2. the committed tree (git archive HEAD) installed with `pip install <tree>[train]`, not editable; what pip
#      added besides hvd_lars is listed (it must be what setup.cfg's install_requires names);
#   3. outside the repository: hvd_lars imported from site-packages, one LARS step on a one-layer model
#      against the update rule computed with NumPy, the console scripts, and --dataset=imagenet2012
#      refused naming the extra while tensorflow-datasets is missing;
#   4. `pip install <tree>[imagenet]`: tensorflow-datasets arrives and its imagenet2012 builder answers;
#   5. Horovod as the README says to bring it: the wheel install/setup.sh built for this TensorFlow, Python
#      and the MPI on PATH (from $HVD_LARS_WHEEL_CACHE; skipped when absent), `horovodrun --check-build`, then
#      examples/keras_horovod_lars.py on 2 ranks with that environment's horovodrun, and the installed
#      hvd-lars-train on flags/smoke.flags (6 updates) on 2 ranks, from outside the checkout, to its end.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROJECT_PY="$ROOT/.venv/bin/python"
# The same interpreter the project's environment was made from (the Horovod wheel is built for it).
PYTHON="${PYTHON:-$("$PROJECT_PY" -c 'import sys; print(sys._base_executable)' 2>/dev/null || echo python3)}"
TF_VERSION="$("$PROJECT_PY" -c 'import importlib.metadata as m; print(m.version("tensorflow"))' 2>/dev/null || echo 2.21.0)"
TF_SPEC="${TF_SPEC:-tensorflow==$TF_VERSION}"
WHEEL_CACHE="${HVD_LARS_WHEEL_CACHE:-$HOME/.cache/hvd_lars/wheels}"
OUT="${OUT:-$ROOT/results/pip_install.md}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export TF_CPP_MIN_LOG_LEVEL=2 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset PYTHONPATH
LOG="$WORK/log.md"
note() { printf '%s\n' "$*" | tee -a "$LOG"; }
started=$(date +%s)

# --- 1. A fresh environment with TensorFlow only ------------------------------------------------------
VENV="$WORK/venv"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip setuptools wheel
"$PY" -m pip install -q "$TF_SPEC"
"$PY" -m pip freeze | sort > "$WORK/with_tensorflow.txt"

# --- 2. pip install . of the committed tree -----------------------------------------------------------
mkdir "$WORK/src"
SHA="$(git -C "$ROOT" rev-parse HEAD)"  # the commit checked, whatever HEAD is by the end
git -C "$ROOT" archive "$SHA" | tar -x -C "$WORK/src"
"$PY" -m pip install -q "$WORK/src[train]"
"$PY" -m pip freeze | sort > "$WORK/with_hvd_lars.txt"
added="$(comm -13 "$WORK/with_tensorflow.txt" "$WORK/with_hvd_lars.txt" | tr '\n' ' ')"
note "- \`pip install .\` added: $added"

# --- 3. The package, used from outside the repository -------------------------------------------------
cd "$WORK"
"$PY" - <<'EOF' | tee -a "$LOG"
import os, subprocess, sys
import numpy as np
import keras
import hvd_lars
from hvd_lars import LARS

assert "site-packages" in hvd_lars.__file__, hvd_lars.__file__
# One LARS step (momentum 0.9 from zero velocity, weight decay 0.01, eta 0.001) on a bias-free Dense layer.
w0 = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
x = np.array([[1.0, 2.0]], np.float32)
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, use_bias=False)])
model.layers[0].kernel.assign(w0)
optimizer = LARS(0.1, momentum=0.9, weight_decay=0.01, eta=0.001)
model.compile(optimizer=optimizer, loss="mse")
y = np.zeros((1, 2), np.float32)
model.train_on_batch(x, y)
g = 2 * x.T @ (x @ w0 - y) / 2  # d/dw of the mean over 2 outputs of (x w - y)^2
trust = 0.001 * np.linalg.norm(w0) / (np.linalg.norm(g) + 0.01 * np.linalg.norm(w0))
want = w0 - 0.1 * trust * (g + 0.01 * w0)
got = model.layers[0].kernel.numpy()
np.testing.assert_allclose(got, want, rtol=1e-5)
print(f"- one LARS step from {hvd_lars.__file__}: weights {got.ravel().round(6).tolist()} = NumPy's update rule")
# absl's --helpfull (all modules' flags: the console script is not the module defining them) exits
# with status 1 after printing; argparse's --help with 0.
for script, option, flag in (("hvd-lars-train", "--helpfull", "--global_batch_size"), ("hvd-lars-plot", "--help", "run_dir")):
    path = os.path.join(os.path.dirname(sys.executable), script)
    result = subprocess.run([path, option], capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1) and flag in result.stdout, result.stdout[-1000:] + result.stderr[-2000:]
    print(f"- `{script} {option}` lists {flag}")
result = subprocess.run(
    [sys.executable, "-m", "hvd_lars.main", "--dataset=imagenet2012", "--model=small_cnn", "--global_batch_size=8",
     "--peak_learning_rate=0.1", "--epochs=1", "--warmup_epochs=0", "--workdir=runs"],
    capture_output=True, text=True, timeout=300,
)
assert result.returncode == 2 and "pip install 'hvd_lars[imagenet]'" in result.stderr, result.stderr[-2000:]
print(f"- without the extra, --dataset=imagenet2012 says: `{result.stderr.strip().splitlines()[-1][:160]}...`")
EOF

# --- 4. The ImageNet extra ----------------------------------------------------------------------------
"$PY" -m pip install -q "$WORK/src[train,imagenet]"
"$PY" -m pip freeze | sort > "$WORK/with_imagenet.txt"
note "- \`pip install .[imagenet]\` added: $(comm -13 "$WORK/with_hvd_lars.txt" "$WORK/with_imagenet.txt" | tr '\n' ' ')"
"$PY" - <<'EOF' | tee -a "$LOG"
import tempfile
from hvd_lars.data import imagenet_preparation
with tempfile.TemporaryDirectory() as tmp:
    try:
        imagenet_preparation.prepare(tmp, tmp)
    except imagenet_preparation.CannotPrepare as e:
        assert "ILSVRC2012_img_train.tar" in str(e)
        print("- with the extra, the imagenet2012 preparation loads and asks for the ILSVRC-2012 tars")
EOF

# --- 5. Horovod as the README says to bring it, and the example on 2 ranks ----------------------------
pyver="$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
# The wheel built for the MPI on PATH (install/setup.sh keys its cache by MPI family and version).
source "$ROOT/install/mpi.sh"
mpi_identify || MPI_FAMILY=none MPI_VERSION=none
wheel_dir="$WHEEL_CACHE/$MPI_FAMILY-$MPI_VERSION/tf-$TF_VERSION-py$pyver"
wheel="$(ls "$wheel_dir"/horovod-*.whl 2>/dev/null | head -1 || true)"
if [ -n "$wheel" ]; then
  "$PY" -m pip install -q --no-deps "$wheel"
  "$PY" -m pip install -q cloudpickle psutil pyyaml packaging
  "$VENV/bin/horovodrun" --check-build > "$WORK/check_build.txt"
  marked="$(grep '\[X\]' "$WORK/check_build.txt" | tr -s ' ' | tr '\n' ',' | sed 's/,$//')"
  note "- Horovod from \`$(basename "$wheel")\` (install/setup.sh's build); \`horovodrun --check-build\` marks (frameworks, controllers, tensor operations):$marked"
  if [ -f "$WORK/src/examples/keras_horovod_lars.py" ]; then
    "$VENV/bin/horovodrun" -np 2 -H localhost:2 "$PY" "$WORK/src/examples/keras_horovod_lars.py" \
      --out="$WORK/example" > "$WORK/example.log" 2>&1 || { tail -50 "$WORK/example.log"; exit 1; }
    note "- \`horovodrun -np 2 python examples/keras_horovod_lars.py\`: $(grep -h 'example:' "$WORK/example.log" | sed 's/^\[[0-9],0\]<stdout>://' | tr '\n' ' ')"
  else
    note "- examples/keras_horovod_lars.py not in this commit: the 2-rank example was not run"
  fi
  (cd "$WORK" && "$VENV/bin/horovodrun" -np 2 -H localhost:2 "$VENV/bin/hvd-lars-train" \
    --flagfile="$WORK/src/flags/smoke.flags" --workdir="$WORK/runs") > "$WORK/train.log" 2>&1 \
    || { tail -50 "$WORK/train.log"; exit 1; }
  note "- \`horovodrun -np 2 hvd-lars-train --flagfile=flags/smoke.flags\`: $(grep -h '\] finished smoke' "$WORK/train.log" | sed 's/^.*\[hvd_lars\] //')"
else
  note "- no Horovod wheel in $wheel_dir (run install/setup.sh once): Horovod not checked"
fi

# --- The record -------------------------------------------------------------------------------------
elapsed=$(( $(date +%s) - started ))
{
  echo "# pip install . into a fresh environment with TensorFlow"
  echo
  echo "Command: \`bash install/check_pip_install.sh\` (this script), git $SHA, $(date -u '+%Y-%m-%d %H:%M UTC'), $elapsed s."
  # The CPU's identity and the tf.matmul rate through the one helper every benchmark's report uses.
  echo "Machine: $(cd "$ROOT" && PYTHONPATH="$ROOT" "$PROJECT_PY" -m benchmarks.common --machine_line 2>/dev/null)"
  echo "Environment: $("$PYTHON" --version 2>&1), made with \`python -m venv\` (no system site packages), then \`pip install $TF_SPEC\`."
  echo
  cat "$LOG"
} > "$OUT"
cat "$OUT"
