#!/usr/bin/env bash
# Launch training with horovodrun.
#
# Usage: launch/horovodrun.sh HOSTS NUM_RANKS FLAGFILE [extra flags...]
#   HOSTS      horovodrun host list "host1:slots,host2:slots" (e.g. localhost:2)
#   NUM_RANKS  total ranks (one per socket on real nodes)
#   FLAGFILE   e.g. flags/fashion_mnist_lars.flags; extra flags override it
# Example: launch/horovodrun.sh localhost:2 2 flags/fashion_mnist_lars.flags --epochs=3
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,9p' "$0" >&2
  exit 2
fi
hosts=$1 ranks=$2 flagfile=$3
shift 3
[ -f "$flagfile" ] || { echo "launch/horovodrun.sh: flagfile '$flagfile' not found" >&2; exit 2; }
source "$(dirname "$0")/env.sh"
horovodrun_bin="$(dirname "$PYTHON")/horovodrun"
[ -x "$horovodrun_bin" ] || horovodrun_bin=horovodrun
exec "$horovodrun_bin" -np "$ranks" -H "$hosts" \
  "$PYTHON" -m hvd_lars.main --flagfile="$flagfile" --intra_op_threads="$THREADS_PER_RANK" "$@"
