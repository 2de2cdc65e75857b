#!/usr/bin/env bash
# Slurm's srun launches sppo as mpirun does: on a one-node Slurm cluster started here
# (tests/slurm/cluster.sh), the same two-rank ring-attention job runs under
# `srun --mpi=pmix -n 2` and under `mpirun -np 2`, and every step's loss must be equal to
# the bit (the metrics' JSONL). Each run must also say that it ran as 2 ranks.
#
#   bash tests/slurm/srun_vs_mpirun.sh [SPPO_BINARY]     (default: build/sppo)
#
# Exit 0 when the losses are equal; 1 when they differ or a run or a daemon failed; 77
# (skipped) where this machine cannot run a Slurm cluster, saying why: not root, or Slurm's
# and munge's Debian packages are not installed (.ci/run installs them). Without Slurm,
# tests/unit/test_comm_launcher.cpp checks the variables srun sets.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
sppo=$(readlink -f "${1:-$root/build/sppo}")
[ -x "$sppo" ] || { echo "srun_vs_mpirun: no sppo binary at $sppo (bash scripts/build.sh)"; exit 1; }
source "$here/cluster.sh"

why=$(slurm_cluster_why_not)
if [ -n "$why" ]; then
  echo "srun_vs_mpirun: skipped: cannot start a Slurm cluster here: $why"
  exit 77
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/sppo-slurm-XXXXXX")
cleanup() {
  slurm_cluster_down
  rm -rf "$work"
}
trap cleanup EXIT
# Variables an outer launcher may have left would make the runs here look like its ranks.
for v in $(compgen -e | grep -E '^(PMIX_|PMI_|OMPI_COMM_WORLD_|MPI_LOCAL)'); do unset "$v"; done

t0=$(date +%s.%N)
slurm_cluster_up || exit 1
t_up=$(date +%s.%N)
cd "$work"

job=(train --model small --seq-len 2048 --steps 3 --cp 2 --threads 1)
ok=1
run() {
  local name=$1
  shift
  if ! timeout 300 "$@" --metrics "$name.jsonl" >"$name.out" 2>&1; then
    echo "srun_vs_mpirun: $name failed: $*"
    tail -n 20 "$name.out"
    ok=0
  elif ! grep -q "^ranks: 2, talking over mpi" "$name.out"; then
    echo "srun_vs_mpirun: $name did not run as 2 ranks: $*"
    tail -n 20 "$name.out"
    ok=0
  fi
}
run srun srun --mpi=pmix -n 2 "$sppo" "${job[@]}"
t_srun=$(date +%s.%N)
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
run mpirun mpirun --oversubscribe --bind-to none -np 2 "$sppo" "${job[@]}"
t_mpirun=$(date +%s.%N)
[ "$ok" -eq 1 ] || exit 1

python3 - srun.jsonl mpirun.jsonl "$t0" "$t_up" "$t_srun" "$t_mpirun" <<'PY'
import json, sys
def losses(path):
    records = [json.loads(line) for line in open(path) if line.strip()]
    return [r["loss"] for r in records if "loss" in r]
srun, mpirun = losses(sys.argv[1]), losses(sys.argv[2])
t0, up, s, m = map(float, sys.argv[3:7])
print(f"srun   --mpi=pmix -n 2: losses {srun}")
print(f"mpirun -np 2          : losses {mpirun}")
print(f"seconds: cluster up {up - t0:.1f}, srun {s - up:.1f}, mpirun {m - s:.1f}")
if len(srun) != 3 or srun != mpirun:
    print("srun_vs_mpirun: the losses differ (or a run has not 3 steps)")
    sys.exit(1)
print("srun_vs_mpirun: equal")
PY
