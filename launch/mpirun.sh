#!/usr/bin/env bash
# Launch training with the MPI on PATH: one rank per CPU socket, bound to that socket's cores. Open MPI's
# mpirun, or the Hydra mpiexec of MPICH, MVAPICH2 and Intel MPI (launch/env.sh tells them apart).
#
# Usage: launch/mpirun.sh HOSTFILE NUM_RANKS FLAGFILE [extra flags...]
#   HOSTFILE   hostfile ("node01 slots=2" per line, Open MPI's form, or "node01:2", Hydra's; slots =
#              sockets), or "localhost"
#   NUM_RANKS  total ranks
#   FLAGFILE   e.g. flags/resnet50_bs32k_lars.flags; extra flags override it
# Placement comes from launch/env.sh (hvd_lars_place): the ranks a host gets (its slots, or all of them on
# localhost) spread over its sockets, each bound to an equal share of its socket's cores (override
# RANKS_PER_SOCKET, THREADS_PER_RANK, SOCKETS_PER_NODE, CORES_PER_SOCKET); MPI_BIND=none turns off binding. Each rank sizes its threads from the cores it is bound to (the run log
# prints them per rank); --intra_op_threads / --inter_op_threads / --input_threads override that.
# Example: launch/mpirun.sh localhost 2 flags/smoke.flags   (on this 1-socket, 2-core machine: 2 ranks of
#          one core each)
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
hostfile=$1 ranks=$2 flagfile=$3
shift 3
[ -f "$flagfile" ] || { echo "launch/mpirun.sh: flagfile '$flagfile' not found" >&2; exit 2; }
source "$(dirname "$0")/env.sh"
[ -n "${MPI_FAMILY:-}" ] || { echo "launch/mpirun.sh: no MPI launcher (mpirun or mpiexec of Open MPI, MPICH, MVAPICH2 or Intel MPI) on PATH" >&2; exit 2; }
[ "$hostfile" = localhost ] || [ -f "$hostfile" ] || { echo "launch/mpirun.sh: hostfile '$hostfile' not found" >&2; exit 2; }
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || { echo "launch/mpirun.sh: NUM_RANKS must be a whole number >= 1, got '$ranks'" >&2; exit 2; }
# Ranks per socket and cores per rank from the hostfile's slots (or the ranks on localhost) and the sockets.
hvd_lars_place "$(hvd_lars_ranks_per_host "$hostfile" "$ranks")" || exit 2
if [ "$MPI_FAMILY" != openmpi ]; then
  # Hydra (MPICH, MVAPICH2, Intel MPI). Hosts: -hosts, or -f with Hydra's "host:slots" lines (an Open MPI
  # hostfile's "host slots=N" is rewritten so).
  if [ "$hostfile" = localhost ]; then
    hosts=(-hosts localhost)
  else
    hydra_hosts="$(mktemp)"
    trap 'rm -f "$hydra_hosts"' EXIT
    awk '!/^[[:space:]]*(#|$)/ { n = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) n = substr($i, 7); print ($1 ~ /:/ || NF == 1 && n == 1 ? $1 : $1 ":" n) }' \
      "$hostfile" >"$hydra_hosts"
    hosts=(-f "$hydra_hosts")
  fi
  # Binding: MPICH's and MVAPICH2's Hydra place ranks over sockets and bind each to T cores (-bind-to
  # core:T); Intel MPI's pins through I_MPI_PIN_DOMAIN (omp: OMP_NUM_THREADS cores per rank).
  if [ "$MPI_FAMILY" = intelmpi ]; then
    if [ "${MPI_BIND:-core}" = none ]; then placement=(-genv I_MPI_PIN 0); else placement=(-genv I_MPI_PIN_DOMAIN omp); fi
  elif [ "${MPI_BIND:-core}" = none ]; then
    placement=(-bind-to none)
  else
    placement=(-map-by socket -bind-to "core:${THREADS_PER_RANK}")
  fi
  # Environment: all of it (-genvall, Hydra's default made explicit): the thread settings env.sh exports,
  # PATH, PYTHONPATH, Horovod's settings, and whatever `module load` set (LD_LIBRARY_PATH, I_MPI_*, UCX_*).
  # -genvall, -genvlist and -genvnone exclude one another in Hydra; -genvlist would forward only the named.
  # A rank that exits non-zero or on a signal ends the job: Hydra kills the others.
  "$MPI_LAUNCHER" -n "$ranks" "${hosts[@]}" "${placement[@]}" -genvall \
    "$PYTHON" -m hvd_lars.main --flagfile="$flagfile" "$@"
  exit
fi
if [ "$hostfile" = localhost ]; then
  hosts=(--host "localhost:$ranks")
else
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
  placement=(--map-by "ppr:${RANKS_PER_SOCKET}:socket" --bind-to none ${MPI_OVERSUBSCRIBE:+--oversubscribe})
else
  placement=(--map-by "ppr:${RANKS_PER_SOCKET}:socket:PE=${THREADS_PER_RANK}" --bind-to core)
fi
exec mpirun -np "$ranks" "${hosts[@]}" "${placement[@]}" \
  -x OMP_NUM_THREADS ${TF_ENABLE_ONEDNN_OPTS:+-x TF_ENABLE_ONEDNN_OPTS} -x TF_CPP_MIN_LOG_LEVEL -x KMP_BLOCKTIME \
  -x PYTHONUNBUFFERED -x PATH "${forward[@]}" \
  "$PYTHON" -m hvd_lars.main --flagfile="$flagfile" "$@"
