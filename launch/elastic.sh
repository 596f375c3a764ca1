#!/usr/bin/env bash
# Launch elastic training: workers may leave and join while the job runs (hvd_lars.parallel.elastic).
#
# Usage: launch/elastic.sh DISCOVERY_SCRIPT MIN_NP MAX_NP FLAGFILE [extra flags...]
#   DISCOVERY_SCRIPT  executable that prints the hosts available now, one "host:slots" per line
#                     (Horovod's host discovery script); the job grows and shrinks with its output
#   MIN_NP / MAX_NP   fewest and most workers; the job starts with MIN_NP..MAX_NP and waits (up to
#                     HOROVOD_ELASTIC_TIMEOUT s, default 600) while fewer than MIN_NP are available
#   FLAGFILE          e.g. flags/fashion_mnist_lars.flags; it must give --global_batch_size, which stays
#                     the same whatever the number of workers (the per-rank batch adapts; a worker count
#                     that does not divide it stops the job with a message naming the counts that do)
# Elastic jobs run over Gloo (Horovod's requirement). NIC (default lo when every host is localhost, else
# Horovod's own interface detection, which needs 2 hosts) names the network interface.
# A host whose workers fail (killed, rebooted) is left out until it has cooled down: COOLDOWN_S="MIN MAX"
# seconds (default "10 60"; Horovod 0.28.1 waits MIN x 2^failures plus up to MIN more, within MIN..MAX: the
# first failure 20-30 s). Without a cooldown Horovod leaves a failed host out for good, even once the
# discovery script lists it again. Across hosts, run this on one of them (ssh node1 launch/elastic.sh ...):
# Gloo's rendezvous address must be one the hosts reach.
# Example (this machine): printf '#!/bin/sh\necho localhost:2\n' >/tmp/hosts.sh; chmod +x /tmp/hosts.sh
#          launch/elastic.sh /tmp/hosts.sh 1 2 flags/smoke.flags
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,20p' "$0" >&2
  exit 2
fi
discovery=$1 min_np=$2 max_np=$3 flagfile=$4
shift 4
[ -x "$discovery" ] || { echo "launch/elastic.sh: discovery script '$discovery' is not an executable file" >&2; exit 2; }
[ -f "$flagfile" ] || { echo "launch/elastic.sh: flagfile '$flagfile' not found" >&2; exit 2; }
for n in "$min_np" "$max_np"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "launch/elastic.sh: MIN_NP and MAX_NP must be whole numbers >= 1, got '$n'" >&2; exit 2; }
done
(( min_np <= max_np )) || { echo "launch/elastic.sh: MIN_NP $min_np exceeds MAX_NP $max_np" >&2; exit 2; }
source "$(dirname "$0")/env.sh"
# Threads per rank from the most slots a host offers now (horovodrun --gloo cannot bind ranks).
hvd_lars_place "$(hvd_lars_ranks_per_host "$("$discovery" | tr '\n' ',')" "$max_np")" || exit 2
# HOROVODRUN: the launcher to use (default: the one beside $PYTHON, else the PATH's).
horovodrun_bin="${HOROVODRUN:-$(dirname "$PYTHON")/horovodrun}"
[ -x "$horovodrun_bin" ] || horovodrun_bin=horovodrun
# Horovod's interface detection between hosts needs at least 2 of them; on one host, the loopback.
if [ -z "${NIC:-}" ] && ! "$discovery" | grep -qv '^\(localhost\|127\.0\.0\.1\):'; then
  NIC=lo
fi
nic_args=()
[ -n "${NIC:-}" ] && nic_args=(--network-interface "$NIC")
# Horovod 0.28.1's response cache off (results/faults.md, "A worker joining"): after `hvd.shutdown();
# hvd.init()` the surviving process fuses with another fusion threshold than a fresh one (fc1's 1 MiB
# gradient alone), and with the cache each rank fuses cached tensors by its own threshold, so the ranks
# send buffers of different sizes (gloo "op.preamble.length <= op.nbytes", abort). Without the cache only
# rank 0 fuses and every rank follows. A caller's own HOROVOD_CACHE_CAPACITY is kept.
export HOROVOD_CACHE_CAPACITY="${HOROVOD_CACHE_CAPACITY:-0}"
read -r cooldown_min cooldown_max extra <<<"${COOLDOWN_S:-10 60}"
[[ "$cooldown_min" =~ ^[0-9]+$ && "${cooldown_max:-}" =~ ^[0-9]+$ && -z "${extra:-}" ]] && ((cooldown_min <= cooldown_max)) ||
  { echo "launch/elastic.sh: COOLDOWN_S must be two whole numbers of seconds MIN MAX with MIN <= MAX, got '${COOLDOWN_S:-}'" >&2; exit 2; }
exec "$horovodrun_bin" -np "$min_np" --min-np "$min_np" --max-np "$max_np" \
  --host-discovery-script "$discovery" "${nic_args[@]}" \
  --blacklist-cooldown-range "$cooldown_min" "$cooldown_max" \
  "$PYTHON" -m hvd_lars.main --flagfile="$flagfile" --elastic "$@" 2> >(exec "${QUIET_TENSORFLOW[@]}" >&2)
