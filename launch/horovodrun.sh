#!/usr/bin/env bash
# Launch training with horovodrun: one rank per CPU socket, bound to that socket's cores (as mpirun.sh).
# With MPICH, MVAPICH2 or Intel MPI first on PATH it hands over to launch/mpirun.sh (Hydra; see below).
#
# Usage: launch/horovodrun.sh HOSTS NUM_RANKS FLAGFILE [extra flags...]
#   HOSTS      horovodrun host list "host1:slots,host2:slots" (e.g. localhost:2; slots = sockets)
#   NUM_RANKS  total ranks (one per socket on real nodes)
#   FLAGFILE   e.g. flags/fashion_mnist_lars.flags; extra flags override it
# Placement comes from launch/env.sh (hvd_lars_place): a host's slots spread over its sockets, each rank
# bound to an equal share of its socket's cores (override RANKS_PER_SOCKET, THREADS_PER_RANK,
# SOCKETS_PER_NODE, CORES_PER_SOCKET); MPI_BIND=none turns off binding. Each rank sizes its threads from the cores it is bound to (the run log
# prints them per rank); --intra_op_threads / --inter_op_threads / --input_threads override that.
# Example: launch/horovodrun.sh localhost:2 2 flags/smoke.flags   (on this 1-socket, 2-core machine: 2
#          ranks of one core each)
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
hosts=$1 ranks=$2 flagfile=$3
shift 3
[ -f "$flagfile" ] || { echo "launch/horovodrun.sh: flagfile '$flagfile' not found" >&2; exit 2; }
source "$(dirname "$0")/env.sh"
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || { echo "launch/horovodrun.sh: NUM_RANKS must be a whole number >= 1, got '$ranks'" >&2; exit 2; }
# Ranks per socket and cores per rank from the host list's slots and the sockets (launch/env.sh).
hvd_lars_place "$(hvd_lars_ranks_per_host "$hosts" "$ranks")" || exit 2
horovodrun_bin="$(dirname "$PYTHON")/horovodrun"
[ -x "$horovodrun_bin" ] || horovodrun_bin=horovodrun
# horovodrun starts the mpirun on PATH (its default launcher when Horovod has MPI), Open MPI's with
# --bind-to none unless given --binding-args: the same placement as mpirun.sh, N ranks per socket, T cores
# each, bound. (horovodrun --gloo has no binding option: its ranks run unbound and size their threads as
# node cores / local ranks.)
# MPICH, MVAPICH2 and Intel MPI (Hydra): horovodrun 0.28.1 does not recognise MPICH 4's Hydra (`mpirun
# --version` no longer says "MPICH": "Unknown MPI implementation") and ignores --binding-args for MPICH and
# Intel MPI, so the ranks are started by launch/mpirun.sh, Hydra's mpiexec, bound as there, from the same
# host list.
if [ "${MPI_FAMILY:-openmpi}" != openmpi ]; then
  hostfile="$(mktemp)"
  trap 'rm -f "$hostfile"' EXIT
  tr ',' '\n' <<<"$hosts" >"$hostfile"
  "$(dirname "$0")/mpirun.sh" "$hostfile" "$ranks" "$flagfile" "$@"
  exit
fi
if [ "${MPI_BIND:-core}" = none ]; then
  binding="--map-by ppr:${RANKS_PER_SOCKET}:socket --bind-to none"
else
  binding="--map-by ppr:${RANKS_PER_SOCKET}:socket:PE=${THREADS_PER_RANK} --bind-to core"
fi
exec "$horovodrun_bin" -np "$ranks" -H "$hosts" --binding-args="$binding" \
  "$PYTHON" -m hvd_lars.main --flagfile="$flagfile" "$@" 2> >(exec "${QUIET_TENSORFLOW[@]}" >&2)
