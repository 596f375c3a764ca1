#!/usr/bin/env bash
# Launch training with Open MPI's mpirun: one rank per CPU socket, bound to that socket's cores.
#
# Usage: launch/mpirun.sh HOSTFILE NUM_RANKS FLAGFILE [extra flags...]
#   HOSTFILE   Open MPI hostfile ("node01 slots=2" per line; slots = sockets), or "localhost"
#   NUM_RANKS  total ranks
#   FLAGFILE   e.g. flags/resnet50_bs32k_lars.flags; extra flags override it
# Thread settings come from launch/env.sh (override THREADS_PER_RANK, RANKS_PER_SOCKET, ...); MPI_BIND=none
# turns off binding ranks to cores. Each rank sizes its threads from the cores it is bound to (the run log
# prints them per rank); --intra_op_threads / --inter_op_threads / --input_threads override that.
# Example (this 2-core test machine): RANKS_PER_SOCKET=2 launch/mpirun.sh localhost 2 flags/smoke.flags
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,11p' "$0" >&2
  exit 2
fi
hostfile=$1 ranks=$2 flagfile=$3
shift 3
[ -f "$flagfile" ] || { echo "launch/mpirun.sh: flagfile '$flagfile' not found" >&2; exit 2; }
source "$(dirname "$0")/env.sh"
if [ "$hostfile" = localhost ]; then
  hosts=(--host "localhost:$ranks")
else
  [ -f "$hostfile" ] || { echo "launch/mpirun.sh: hostfile '$hostfile' not found" >&2; exit 2; }
  hosts=(--hostfile "$hostfile")
fi
# Passed on only when set: the caller's PYTHONPATH (e.g. a checkout other than the installed one),
# Horovod's fusion settings (env.sh leaves them at Horovod's defaults) and its stall and Gloo timeouts.
forward=()
for name in PYTHONPATH HOROVOD_FUSION_THRESHOLD HOROVOD_CYCLE_TIME HOROVOD_STALL_CHECK_TIME_SECONDS \
  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS HOROVOD_GLOO_TIMEOUT_SECONDS; do
  [ -z "${!name:-}" ] || forward+=(-x "$name")
done
# ppr:N:socket places N ranks on each socket; PE=T gives each rank T cores, bound (OMP threads stay put).
# MPI_BIND=none leaves ranks unbound: for hosts that share one machine's cores (launch/emulated_cluster.sh),
# where each host would bind its ranks to the same cores as the others.
if [ "${MPI_BIND:-core}" = none ]; then
  placement=(--map-by "ppr:${RANKS_PER_SOCKET}:socket" --bind-to none)
else
  placement=(--map-by "ppr:${RANKS_PER_SOCKET}:socket:PE=${THREADS_PER_RANK}" --bind-to core)
fi
exec mpirun -np "$ranks" "${hosts[@]}" "${placement[@]}" \
  -x OMP_NUM_THREADS -x TF_ENABLE_ONEDNN_OPTS -x TF_CPP_MIN_LOG_LEVEL -x KMP_BLOCKTIME \
  -x PYTHONUNBUFFERED -x PATH "${forward[@]}" \
  "$PYTHON" -m hvd_lars.main --flagfile="$flagfile" "$@"
