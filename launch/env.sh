# Sourced by the launch scripts: thread and library settings for one rank per CPU socket.
# Every value can be overridden from the environment before launching.
#
# Why: each rank runs TensorFlow's intra-op pool on the cores of its own socket; OpenMP/oneDNN threads
# must match that count and stay bound, or ranks on one node fight over cores.

# The hosts' sockets and cores per socket: this machine's (lscpu), as a cluster's nodes are alike; export
# SOCKETS_PER_NODE and CORES_PER_SOCKET when launching from a machine unlike them (a login node).
_lscpu_field() { lscpu 2>/dev/null | awk -F: -v key="$1" '$1 == key {gsub(/ /, "", $2); print $2; exit}'; }
export SOCKETS_PER_NODE="${SOCKETS_PER_NODE:-$(_lscpu_field 'Socket(s)')}"
export SOCKETS_PER_NODE="${SOCKETS_PER_NODE:-1}"
export CORES_PER_SOCKET="${CORES_PER_SOCKET:-$(_lscpu_field 'Core(s) per socket')}"
export CORES_PER_SOCKET="${CORES_PER_SOCKET:-$(( $(nproc) / SOCKETS_PER_NODE ))}"

# hvd_lars_place RANKS_PER_HOST: where the launchers put that many ranks on each host, unless exported:
#   RANKS_PER_SOCKET = ceil(ranks per host / sockets): one rank per socket on real nodes (the paper's
#                      layout), more when a host runs more ranks than it has sockets (this 2-core machine);
#   THREADS_PER_RANK = the socket's cores / RANKS_PER_SOCKET (Slurm's --cpus-per-task when given);
#   OMP_NUM_THREADS  = THREADS_PER_RANK.
# Ranks that outnumber a socket's cores cannot each have cores of their own: then MPI_BIND=none and
# MPI_OVERSUBSCRIBE=1 (one line says so), as MPI_BIND=none would ask.
hvd_lars_place() {
  local per_host=$1
  [[ "$per_host" =~ ^[1-9][0-9]*$ ]] || { echo "launch: ranks per host must be a whole number >= 1, got '$per_host'" >&2; return 2; }
  export RANKS_PER_SOCKET="${RANKS_PER_SOCKET:-$(( (per_host + SOCKETS_PER_NODE - 1) / SOCKETS_PER_NODE ))}"
  if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export THREADS_PER_RANK="${THREADS_PER_RANK:-$SLURM_CPUS_PER_TASK}"
  fi
  export THREADS_PER_RANK="${THREADS_PER_RANK:-$(( CORES_PER_SOCKET / RANKS_PER_SOCKET > 0 ? CORES_PER_SOCKET / RANKS_PER_SOCKET : 1 ))}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$THREADS_PER_RANK}"
  if (( RANKS_PER_SOCKET * THREADS_PER_RANK > CORES_PER_SOCKET )) && [ "${MPI_BIND:-core}" != none ]; then
    echo "launch: $RANKS_PER_SOCKET ranks x $THREADS_PER_RANK threads per socket exceed its $CORES_PER_SOCKET cores: ranks run unbound" >&2
    export MPI_BIND=none MPI_OVERSUBSCRIBE=1
  fi
  return 0
}

# hvd_lars_ranks_per_host HOSTS NUM_RANKS: the most ranks one host gets from a hostfile ("node01 slots=2",
# Open MPI's form, or "node01:2", Hydra's), a horovodrun host list ("node01:2,node02:2") or "localhost":
# the largest slot count (capped by NUM_RANKS), or NUM_RANKS spread evenly over hosts that give none.
hvd_lars_ranks_per_host() {
  local hosts=$1 ranks=$2 lines
  if [ "$hosts" = localhost ]; then echo "$ranks"; return; fi
  if [ -f "$hosts" ]; then lines="$(grep -v '^[[:space:]]*\(#\|$\)' "$hosts")"; else lines="$(tr ',' '\n' <<<"$hosts")"; fi
  awk -v ranks="$ranks" '
    NF { n++; s = 0
         if ($1 ~ /:[0-9]+$/) { s = $1; sub(/.*:/, "", s) }
         for (i = 2; i <= NF; i++) if ($i ~ /^(slots|max_slots)=/) { s = $i; sub(/.*=/, "", s) }
         if (s + 0 > most) most = s + 0 }
    END { even = n ? int((ranks + n - 1) / n) : ranks
          if (!most) most = even
          print (most > ranks ? ranks : most) }' <<<"$lines"
}
# oneDNN kernels (TF_ENABLE_ONEDNN_OPTS): left to TensorFlow, which chooses per CPU (on by itself on the
# AVX-512 Xeons and EPYCs here, off on an AVX2-only EPYC), so that a job of these scripts computes what a bare
# `horovodrun python -m hvd_lars.main` computes on the same CPU: the two round differently. Export it to
# choose; the launchers forward it when it is set.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
# Intel OpenMP: spin briefly, then sleep, so idle ranks do not steal the allreduce thread's core.
export KMP_BLOCKTIME="${KMP_BLOCKTIME:-1}"
# Horovod's tensor fusion is left at its defaults (128 MiB buffer, 1 ms cycle in 0.28.1): 64 MiB / 5 ms
# measured no different on ResNet-50's and AlexNet's gradients (results/communication.md). Set
# HOROVOD_FUSION_THRESHOLD / HOROVOD_CYCLE_TIME before launching to change them; the launchers pass them on.
# Faults (tests/test_faults.py, results/faults.md). A rank that dies ends the job through its
# launcher within seconds: mpirun (also under horovodrun) kills the other ranks when one exits on a signal
# or non-zero, horovodrun --gloo's driver does the same, srun does with --kill-on-bad-exit=1 (train.sbatch).
# Horovod's own timers cover a rank that is alive but stuck (a deadlock, a hung file system): the stall
# check warns, naming the missing ranks and tensors, after 60 s (Horovod's default); the stall shutdown
# ends the job after 15 min instead of never (Horovod's default is never). 15 min is longer than rank 0's
# longest lone work while the others wait in a collective: listing an ImageNet image folder on a network
# file system, a checkpoint written to a slow disk. Gloo's operations and rendezvous give up after 60 s
# without their peers (Horovod's default is 30 s, short for a 100-host rendezvous).
export HOROVOD_STALL_CHECK_TIME_SECONDS="${HOROVOD_STALL_CHECK_TIME_SECONDS:-60}"
export HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="${HOROVOD_STALL_SHUTDOWN_TIME_SECONDS:-900}"
export HOROVOD_GLOO_TIMEOUT_SECONDS="${HOROVOD_GLOO_TIMEOUT_SECONDS:-60}"
# A host whose link goes silent (power, cable, switch port) sends no reset: mpirun would wait for its
# daemon there for the kernel's TCP retransmission limit (15 min and more; measured: still hung after
# 240 s on the emulated cluster). ssh's keepalive ends mpirun's session with that host after about 4 x 10 s
# of silence (3 unanswered probes, 10 s apart, after 10 s without data), and mpirun then aborts the job
# (measured: exit 255 37-39 s after the link went down; with 4 x 15 s the job still ran after 90 s). The
# ranks on the silent host itself end through --hang_timeout_s (hvd_lars.training.faults.ProgressWatchdog), which
# must be the longer of the two: when a rank's watchdog ends it first, mpirun starts aborting the job and
# then waits for its daemon on the silent host (measured: still running 90 s after the silence, 4 of 4).
export OMPI_MCA_plm_rsh_args="${OMPI_MCA_plm_rsh_args:--o ServerAliveInterval=10 -o ServerAliveCountMax=3}"
# A signal to mpirun (kill, Ctrl-C, a scheduler) makes it send its ranks SIGCONT, wait this many seconds,
# send SIGTERM, wait again and SIGKILL them. Open MPI's default, 1 s, kills a rank before its update and
# checkpoint complete; the ranks begin their stop at the SIGCONT (hvd_lars/training/faults.py), so
# they get twice this to checkpoint, and mpirun lingers as long after they have exited.
export OMPI_MCA_odls_base_sigkill_timeout="${OMPI_MCA_odls_base_sigkill_timeout:-10}"
# Open MPI's allreduce from 1 MiB up on 3 or more ranks is the ring: hvd_lars.main points each rank at
# hvd_lars/parallel/ompi_allreduce_rules.conf before MPI starts (hvd_lars/parallel/ompi_allreduce_rules.py says why;
# export OMPI_MCA_coll_tuned_use_dynamic_rules=0 to keep Open MPI's own choice).
# Open MPI refuses root unless told (containers, CI).
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export PYTHONUNBUFFERED=1

# The Python of the project's virtual environment unless the caller chose one.
HVD_LARS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HVD_LARS_ROOT
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$HVD_LARS_ROOT/.venv/bin/python" ]; then PYTHON="$HVD_LARS_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON
# horovodrun imports TensorFlow to check Horovod's build, which prints TensorFlow's start-up notices: the
# launchers lead its standard error through this filter, which writes every other line
# (hvd_lars/quiet_tensorflow.py; TF_CPP_MIN_LOG_LEVEL=0 shows them).
QUIET_TENSORFLOW=("$PYTHON" "$HVD_LARS_ROOT/hvd_lars/quiet_tensorflow.py")

# Which MPI the launchers start (the first mpirun, else mpiexec, on PATH): MPI_FAMILY is openmpi, or mpich,
# mvapich or intelmpi (their launcher is Hydra); MPI_VERSION, MPI_LAUNCHER (install/mpi.sh). Unset when
# there is none.
source "$HVD_LARS_ROOT/install/mpi.sh"
mpi_identify || true
