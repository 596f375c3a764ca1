#!/usr/bin/env bash
# An emulated cluster on one machine: hosts node1..nodeN as Linux namespaces joined by a bridge, each with
# its own network stack, host name, private /tmp and sshd, sharing the rest of the file system (the
# repository and its .venv) as cluster nodes share a home directory. Run as root.
#
# Usage: launch/emulated_cluster.sh up|down|status
#   up      create the hosts (idempotent: a second `up` boots again a host whose processes all died)
#   down    remove everything `up` made: processes, namespaces, links, keys, config blocks (safe to repeat)
#   status  list hosts, addresses, sshd, link shaping and traffic counters (exit 1 when no cluster is up)
# Environment (for `up`):
#   NODES=2            number of hosts, 1..99; nodeK has address 198.18.0.(10+K)/24, the bridge 198.18.0.1
#   LINK_RATE=         e.g. 10gbit, 1gbit, 100mbit: token-bucket (tc tbf) shaping of each host's link in both
#                      directions; empty: unshaped. (This kernel has no netem: latency cannot be added.)
#   LINK_BURST_MS=10   the token bucket's depth in ms at LINK_RATE (at least 64 KiB): how long a link may
#                      stay unfed and still make up the time; see shape() below
#   HVD_LARS_CLUSTER_DIR=/var/lib/hvd_lars_cluster   keys, sshd files, namespace handles (outside /tmp,
#                      which each host has of its own)
# Then `ssh node1`, `horovodrun -H node1:2,node2:2 ...` and `mpirun -H node1:2,node2:2 ...` work from this
# machine as from a cluster's login node (a block in root's ~/.ssh/config maps the names; another in
# /etc/hosts lets every host resolve every other, which Gloo needs). Open MPI also needs to be told which
# network to use: `-mca btl_tcp_if_include 198.18.0.0/24 -mca oob_tcp_if_include 198.18.0.0/24`.
# Examples:
#   sudo launch/emulated_cluster.sh up && ssh node2 hostname          # -> node2
#   sudo NODES=4 LINK_RATE=1gbit launch/emulated_cluster.sh up
#   sudo launch/emulated_cluster.sh down
set -euo pipefail

STATE="${HVD_LARS_CLUSTER_DIR:-/var/lib/hvd_lars_cluster}"
# The checkout the hosts run from; shared with them even where it lies under /tmp (e.g. a `mktemp -d`
# clone), which each host otherwise has its own of.
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
SUBNET=198.18.0.0/24
BRIDGE=hvdlars-br
BRIDGE_ADDRESS=198.18.0.1
MARK_BEGIN="# >>> hvd_lars emulated cluster (launch/emulated_cluster.sh; removed by its 'down') >>>"
MARK_END="# <<< hvd_lars emulated cluster <<<"
# ssh reads the config of the home directory in the password database, whatever $HOME says.
SSH_CONFIG="$(getent passwd "$(id -u)" | cut -d: -f6)/.ssh/config"
HOSTS_FILE=/etc/hosts
ME="launch/emulated_cluster.sh"

die() {
  echo "$ME: $*" >&2
  exit 1
}
log() { echo "[emulated_cluster] $*"; }

usage() {
  sed -n '2,25p' "$0" >&2
  exit 2
}

node_address() { echo "198.18.0.$((10 + $1))"; }
node_veth() { echo "hvdlars-n$1"; }

# --- checks ---------------------------------------------------------------------------------------------
require_root() {
  [ "$(id -u)" -eq 0 ] || die "must run as root: it creates network, UTS and mount namespaces, a bridge, \
veth links and one sshd per host, and edits root's ~/.ssh/config and /etc/hosts (you are $(id -un); try \
sudo $ME ${VERB})."
}

require_tools() {
  local missing=() t
  for t in ip tc nsenter unshare ssh ssh-keygen /usr/sbin/sshd mount; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  ((${#missing[@]} == 0)) || die "missing ${missing[*]}: install the Debian packages openssh-server \
openssh-client iproute2 util-linux (install/test_services.sh does)."
}

check_settings() {
  [[ "$NODES" =~ ^[0-9]+$ ]] && ((NODES >= 1 && NODES <= 99)) ||
    die "NODES='$NODES': expected a whole number of hosts from 1 to 99."
  [[ "$LINK_BURST_MS" =~ ^[0-9]+$ ]] && ((LINK_BURST_MS >= 1 && LINK_BURST_MS <= 1000)) ||
    die "LINK_BURST_MS='$LINK_BURST_MS': expected a whole number of milliseconds from 1 to 1000 (default 10)."
  if [ -n "$LINK_RATE" ]; then
    [[ "$LINK_RATE" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit)$ ]] ||
      die "LINK_RATE='$LINK_RATE': expected a tc rate such as 100mbit, 1gbit or 10gbit (or empty: unshaped)."
  fi
}

# Bytes per second of a tc rate (LINK_RATE syntax).
rate_bytes_per_s() {
  awk -v r="$1" 'BEGIN {
    n = r + 0; u = r; sub(/^[0-9.]+/, "", u)
    m = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : (u == "gbit") ? 1e9 : (u == "tbit") ? 1e12 : 1
    printf "%d\n", n * m / 8 }'
}

# --- marker blocks in shared files (edited in place: /etc/hosts may be a bind mount) ----------------------
remove_block() {
  local file=$1 kept
  [ -f "$file" ] || return 0
  grep -qF "$MARK_BEGIN" "$file" || return 0
  kept="$(awk -v b="$MARK_BEGIN" -v e="$MARK_END" '$0 == b {skip = 1; next} $0 == e {skip = 0; next} !skip' "$file")"
  if [ -n "$kept" ]; then printf '%s\n' "$kept" >"$file"; else : >"$file"; fi
}

append_block() {
  local file=$1 body=$2
  remove_block "$file"
  # A file that does not end in a newline would glue its last line to the marker.
  if [ -s "$file" ] && [ -n "$(tail -c1 "$file")" ]; then echo >>"$file"; fi
  printf '%s\n%s\n%s\n' "$MARK_BEGIN" "$body" "$MARK_END" >>"$file"
}

# --- up -------------------------------------------------------------------------------------------------
make_state_dir() {
  if [ -f "$STATE/cluster.env" ]; then
    local up_nodes up_rate up_burst
    up_nodes="$(sed -n 's/^NODES=//p' "$STATE/cluster.env")"
    up_rate="$(sed -n 's/^LINK_RATE=//p' "$STATE/cluster.env")"
    up_burst="$(sed -n 's/^LINK_BURST_MS=//p' "$STATE/cluster.env")"
    [ "$up_nodes" = "$NODES" ] && [ "$up_rate" = "$LINK_RATE" ] && [ "${up_burst:-$LINK_BURST_MS}" = "$LINK_BURST_MS" ] ||
      die "a cluster with NODES=$up_nodes LINK_RATE='$up_rate' LINK_BURST_MS=${up_burst:-?} is up; run '$ME down' first to change it."
  fi
  mkdir -p "$STATE/ns" "$STATE/ssh"
  chmod 700 "$STATE" "$STATE/ssh"
  # What existed before, so that `down` removes only what `up` created.
  if [ ! -f "$STATE/cluster.env" ]; then
    {
      echo "NODES=$NODES"
      echo "LINK_RATE=$LINK_RATE"
      echo "LINK_BURST_MS=$LINK_BURST_MS"
      echo "CREATED_SSH_DIR=$([ -d "$(dirname "$SSH_CONFIG")" ] && echo 0 || echo 1)"
      echo "CREATED_SSH_CONFIG=$([ -e "$SSH_CONFIG" ] && echo 0 || echo 1)"
      echo "CREATED_RUN_SSHD=$([ -d /run/sshd ] && echo 0 || echo 1)"
      echo "CREATED_RUN_NETNS=$([ -d /run/netns ] && echo 0 || echo 1)"
    } >"$STATE/cluster.env"
  fi
  # Namespace handles live on a private mount, so that the mount namespaces bound here do not
  # propagate into themselves.
  if ! mountpoint -q "$STATE/ns"; then
    mount --bind "$STATE/ns" "$STATE/ns"
    mount --make-private "$STATE/ns"
  fi
}

make_keys() {
  local k
  [ -f "$STATE/ssh/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C "hvd_lars emulated cluster" \
    -f "$STATE/ssh/id_ed25519"
  cp "$STATE/ssh/id_ed25519.pub" "$STATE/ssh/authorized_keys"
  chmod 600 "$STATE/ssh/authorized_keys"
  : >"$STATE/ssh/known_hosts"
  for k in $(seq 1 "$NODES"); do
    mkdir -p "$STATE/node$k"
    [ -f "$STATE/node$k/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N "" -C "node$k" \
      -f "$STATE/node$k/ssh_host_ed25519_key"
    echo "node$k,$(node_address "$k") $(cut -d' ' -f1-2 "$STATE/node$k/ssh_host_ed25519_key.pub")" \
      >>"$STATE/ssh/known_hosts"
  done
}

make_name_blocks() {
  local k names="" hosts="" ssh=""
  for k in $(seq 1 "$NODES"); do
    names+=" node$k"
    hosts+="$(node_address "$k") node$k"$'\n'
    ssh+="Host node$k"$'\n'"  HostName $(node_address "$k")"$'\n'
  done
  ssh+="Host${names}
  User root
  IdentityFile $STATE/ssh/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $STATE/ssh/known_hosts
  StrictHostKeyChecking yes
  LogLevel ERROR"
  append_block "$HOSTS_FILE" "${hosts%$'\n'}"
  mkdir -p "$(dirname "$SSH_CONFIG")"
  chmod 700 "$(dirname "$SSH_CONFIG")"
  touch "$SSH_CONFIG"
  append_block "$SSH_CONFIG" "$ssh"
}

make_bridge() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
    ip addr add "$BRIDGE_ADDRESS/24" dev "$BRIDGE"
  fi
  ip link set "$BRIDGE" up
}

# Token-bucket shaping of one device: up to 50 ms queued before drops; a burst of LINK_BURST_MS at the rate
# (at least 64 KiB, a GSO segment, so that the bucket does not drop the large segments veth carries).
# Why 10 ms and not 2: the bucket keeps at most one burst of the link time that passes while nothing is
# queued, and all the hosts' TCP senders share this machine's cores; with 8 busy hosts on 2 cores a sender
# is likely off the CPU for longer than 2.6 ms at times (inferred, not traced), which a real host with
# cores of its own is not. With 2 ms (64 KiB at 200 Mbit/s) a plain TCP ring of 8 hosts with no MPI took
# 1.33-1.41x the ring bound (medians); with 10 ms 0.98-0.99x (results/archive/tcp_ring.md). The average rate is
# the same: over any t seconds a link carries at most rate x t + burst.
shape() {
  local netns=$1 dev=$2 burst
  burst="$(($(rate_bytes_per_s "$LINK_RATE") * LINK_BURST_MS / 1000))"
  ((burst >= 65536)) || burst=65536
  ip ${netns:+-n "$netns"} link set dev "$dev" gso_max_size 65536 2>/dev/null || true
  tc ${netns:+-n "$netns"} qdisc replace dev "$dev" root tbf rate "$LINK_RATE" burst "$burst" latency 50ms
}

make_node() {
  local k=$1 name="node$1" veth address
  veth="$(node_veth "$k")" address="$(node_address "$k")"
  [ -e "/run/netns/$name" ] || ip netns add "$name"
  if ! ip link show "$veth" >/dev/null 2>&1; then
    ip link add "$veth" type veth peer name eth0 netns "$name"
    ip link set "$veth" master "$BRIDGE" up
    ip -n "$name" addr add "$address/24" dev eth0
    ip -n "$name" link set eth0 up
    ip -n "$name" link set lo up
    if [ -n "$LINK_RATE" ]; then
      shape "" "$veth"       # toward the host (its downlink)
      shape "$name" eth0     # from the host (its uplink)
    fi
  fi
  # The host's own name and /tmp (with the checkout bound back in if it lies under /tmp): UTS and mount
  # namespaces kept by bind mounts. A host with no process
  # left (never started, or all killed) boots afresh, with an empty /tmp as after a reboot: stale PMIx
  # and Open MPI session files of its dead jobs would break the next ones. Slave propagation: mounts
  # made on the machine later still appear; the host's /tmp stays its own.
  if [ -z "$(ip netns pids "$name")" ] || ! mountpoint -q "$STATE/ns/$name.uts" ||
    ! mountpoint -q "$STATE/ns/$name.mnt"; then
    for f in "$STATE/ns/$name.uts" "$STATE/ns/$name.mnt"; do
      if mountpoint -q "$f"; then umount "$f"; fi
    done
    touch "$STATE/ns/$name.uts" "$STATE/ns/$name.mnt"
    local keep=":"
    case "$REPO_ROOT/" in
      /tmp/*)
        mkdir -p "$STATE/$name/checkout"
        keep="mount --bind '$REPO_ROOT' '$STATE/$name/checkout'"
        keep="$keep && mount -t tmpfs -o mode=1777 tmpfs /tmp && mkdir -p '$REPO_ROOT'"
        keep="$keep && mount --bind '$STATE/$name/checkout' '$REPO_ROOT'"
        ;;
      *) keep="mount -t tmpfs -o mode=1777 tmpfs /tmp" ;;
    esac
    unshare --uts="$STATE/ns/$name.uts" --mount="$STATE/ns/$name.mnt" --propagation slave \
      sh -c "hostname $name && $keep"
  fi
  # sshd in all three namespaces (`ip netns exec` would also remount /sys and hide the cgroup tree
  # that slurmd needs; nsenter enters only what it is told).
  cat >"$STATE/$name/sshd_config" <<EOF
ListenAddress $address
Port 22
HostKey $STATE/$name/ssh_host_ed25519_key
PidFile $STATE/$name/sshd.pid
AuthorizedKeysFile $STATE/ssh/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
X11Forwarding no
UseDNS no
MaxStartups 100:30:200
MaxSessions 100
Subsystem sftp internal-sftp
EOF
  if ! node_sshd_alive "$k"; then
    mkdir -p /run/sshd
    nsenter --net="/run/netns/$name" --uts="$STATE/ns/$name.uts" --mount="$STATE/ns/$name.mnt" \
      /usr/sbin/sshd -f "$STATE/$name/sshd_config" -E "$STATE/$name/sshd.log"
  fi
}

# True when node K's sshd runs (a killed one may linger as a zombie, or its pid be reused: match the
# command line, which a zombie no longer has).
node_sshd_alive() {
  local pid
  pid="$(cat "$STATE/node$1/sshd.pid" 2>/dev/null)" || return 1
  [ -n "$pid" ] && tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF "$STATE/node$1/sshd_config"
}

wait_for_ssh() {
  local k deadline=$((SECONDS + 30))
  for k in $(seq 1 "$NODES"); do
    until [ "$(ssh -o BatchMode=yes -o ConnectTimeout=5 "node$k" hostname 2>/dev/null)" = "node$k" ]; do
      ((SECONDS < deadline)) || die "ssh node$k does not answer after 30 s; see $STATE/node$k/sshd.log"
      sleep 0.2
    done
  done
}

cmd_up() {
  check_settings
  make_state_dir
  make_keys
  make_name_blocks
  make_bridge
  local k
  for k in $(seq 1 "$NODES"); do make_node "$k"; done
  wait_for_ssh
  log "up: $NODES hosts on $SUBNET, link ${LINK_RATE:-unshaped}; try: ssh node1 hostname"
}

# --- down -----------------------------------------------------------------------------------------------
state_value() { sed -n "s/^$1=//p" "$STATE/cluster.env" 2>/dev/null || true; }

# Hosts to remove: those recorded by `up`, and any nodeK whose link or handle is still there.
known_nodes() {
  local n k
  n="$(state_value NODES)"
  {
    [ -n "$n" ] && seq 1 "$n"
    ip -o link show 2>/dev/null | sed -n 's/^[0-9]*: hvdlars-n\([0-9]*\)[@:].*/\1/p'
    for f in "$STATE"/ns/node*.uts; do [ -e "$f" ] && basename "$f" .uts | sed 's/^node//'; done
  } | sort -nu
}

# Ends every process in the host's network namespace (sshd, slurmd, ranks): TERM, then KILL.
kill_node_processes() {
  local name=$1 pids i
  [ -e "/run/netns/$name" ] || return 0
  for i in $(seq 1 50); do
    pids="$(ip netns pids "$name" 2>/dev/null | tr '\n' ' ')"
    [ -n "${pids// /}" ] || return 0
    if ((i < 25)); then kill -TERM $pids 2>/dev/null || true; else kill -KILL $pids 2>/dev/null || true; fi
    sleep 0.2
  done
  die "processes $pids of $name survive SIGKILL"
}

cmd_down() {
  local k name veth
  for k in $(known_nodes); do
    name="node$k"
    kill_node_processes "$name"
    for f in "$STATE/ns/$name.uts" "$STATE/ns/$name.mnt"; do
      if mountpoint -q "$f" 2>/dev/null; then umount "$f"; fi
    done
    if [ -e "/run/netns/$name" ]; then ip netns del "$name"; fi
    # Deleting the namespace deletes its end of the veth pair, and the kernel then removes this end
    # in the background: it may vanish between the check and the delete ("Cannot find device").
    veth="$(node_veth "$k")"
    if ip link show "$veth" >/dev/null 2>&1 && ! ip link del "$veth" 2>/dev/null; then
      if ip link show "$veth" >/dev/null 2>&1; then die "cannot delete link $veth"; fi
    fi
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
  remove_block "$HOSTS_FILE"
  remove_block "$SSH_CONFIG"
  if [ "$(state_value CREATED_SSH_CONFIG)" = 1 ] && [ -f "$SSH_CONFIG" ] && [ ! -s "$SSH_CONFIG" ]; then
    rm -f "$SSH_CONFIG"
  fi
  if [ "$(state_value CREATED_SSH_DIR)" = 1 ]; then rmdir "$(dirname "$SSH_CONFIG")" 2>/dev/null || true; fi
  if [ "$(state_value CREATED_RUN_SSHD)" = 1 ]; then rmdir /run/sshd 2>/dev/null || true; fi
  # `ip netns add` made /run/netns a mount point of its own; undone when no namespace is left in it.
  if [ "$(state_value CREATED_RUN_NETNS)" = 1 ] && [ -d /run/netns ] && [ -z "$(ls -A /run/netns)" ]; then
    if mountpoint -q /run/netns; then umount /run/netns; fi
    rmdir /run/netns
  fi
  if mountpoint -q "$STATE/ns" 2>/dev/null; then umount "$STATE/ns"; fi
  rm -rf "$STATE"
  log "down: nothing of the emulated cluster is left"
}

# --- status ---------------------------------------------------------------------------------------------
cmd_status() {
  local n k name veth shaping rx tx sshd rc=0
  n="$(state_value NODES)"
  if [ -z "$n" ] || ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    echo "no emulated cluster is up (state: $STATE)"
    return 1
  fi
  echo "emulated cluster: $n hosts, bridge $BRIDGE $BRIDGE_ADDRESS on $SUBNET, link rate \
$(state_value LINK_RATE | sed 's/^$/unshaped/'), state in $STATE"
  printf '%-8s %-13s %-14s %-8s %-36s %14s %14s\n' host address link sshd shaping "received (B)" "sent (B)"
  for k in $(seq 1 "$n"); do
    name="node$k" veth="$(node_veth "$k")"
    if node_sshd_alive "$k"; then sshd="up"; else sshd="DOWN" rc=1; fi
    shaping="$(tc qdisc show dev "$veth" 2>/dev/null | sed -n 's/.*tbf.* \(rate .*\)/tbf \1/p' | head -1)"
    # The host-side end's counters: what it transmits, the host received, and the other way round.
    rx="$(cat "/sys/class/net/$veth/statistics/tx_bytes" 2>/dev/null || echo ?)"
    tx="$(cat "/sys/class/net/$veth/statistics/rx_bytes" 2>/dev/null || echo ?)"
    printf '%-8s %-13s %-14s %-8s %-36s %14s %14s\n' "$name" "$(node_address "$k")" "$veth" "$sshd" \
      "${shaping:-none}" "$rx" "$tx"
  done
  return $rc
}

VERB="${1:-}"
NODES="${NODES:-2}"
LINK_RATE="${LINK_RATE:-}"
LINK_BURST_MS="${LINK_BURST_MS:-10}"
case "$VERB" in
  up)
    require_root
    require_tools
    cmd_up
    ;;
  down)
    require_root
    cmd_down
    ;;
  status)
    require_root
    cmd_status
    ;;
  *) usage ;;
esac
