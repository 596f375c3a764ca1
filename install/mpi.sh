# Sourced by install/setup.sh and launch/env.sh. mpi_identify: which MPI the first mpirun (else mpiexec)
# on PATH belongs to, from what the launcher itself prints (as horovodrun decides; Open MPI 4/5 print
# "mpirun (Open MPI) X.Y.Z", MPICH's Hydra "HYDRA build details: ... Version: X.Y.Z", Intel MPI
# "Intel(R) MPI Library ..., Version 2021.N"). Sets and exports:
#   MPI_LAUNCHER  the launcher's path
#   MPI_FAMILY    openmpi | mpich | mvapich | intelmpi (the last three start ranks with Hydra)
#   MPI_VERSION   e.g. 4.1.4
# Returns 1, setting nothing, when there is no launcher or its output names none of these.
mpi_identify() {
  local launcher out family version
  launcher="$(command -v mpirun || command -v mpiexec)" || return 1
  out="$("$launcher" --version 2>&1 | head -40)" || true
  case "$out" in
    *"Open MPI"* | *OpenRTE*)
      family=openmpi
      version="$(sed -n 's/.*(Open MPI) \([0-9][0-9.a-z]*\).*/\1/p; s/.*(OpenRTE) \([0-9][0-9.a-z]*\).*/\1/p' <<<"$out" | head -1)"
      ;;
    *"Intel(R) MPI"*)
      family=intelmpi
      version="$(sed -n 's/.*Version \([0-9][0-9.]*\).*/\1/p' <<<"$out" | head -1)"
      ;;
    *HYDRA* | *MPICH*)
      # mpichversion (MPICH and MVAPICH2 install it beside the launcher) names the library; Hydra's own
      # version line is the fallback.
      local lib
      lib="$(mpichversion 2>/dev/null | head -1)" || true
      case "$lib" in
        MVAPICH*) family=mvapich ;;
        *) family=mpich ;;
      esac
      version="$(sed -n 's/^[A-Z0-9]* Version:[[:space:]]*\([0-9][0-9.a-z]*\).*/\1/p' <<<"$lib" | head -1)"
      [ -n "$version" ] || version="$(sed -n 's/^[[:space:]]*Version:[[:space:]]*\([0-9][0-9.a-z]*\).*/\1/p' <<<"$out" | head -1)"
      ;;
    *) return 1 ;;
  esac
  export MPI_LAUNCHER="$launcher" MPI_FAMILY="$family" MPI_VERSION="${version:-unknown}"
}

# mpi_wrapper_family WRAPPER: openmpi or mpich (the MPICH ABI family: MPICH, MVAPICH2, Intel MPI) for an MPI
# compiler wrapper, from the option only that family's wrappers know (Open MPI: --showme; the others: -show).
mpi_wrapper_family() {
  if "$1" --showme:version 2>&1 | grep -q "Open MPI"; then
    echo openmpi
  elif "$1" -show >/dev/null 2>&1; then
    echo mpich
  else
    echo unknown
  fi
}
