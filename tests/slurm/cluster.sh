# A one-node Slurm cluster in a temporary folder, for the tests that launch with srun.
# Sourced: `slurm_cluster_up` starts munged, slurmctld and slurmd (Debian's slurm-wlm and
# munge) with their configuration, sockets, state and logs in a new temporary folder
# ($slurm_cluster_dir), on free ports, and exports SLURM_CONF so that srun, sbatch and sinfo
# use it; `slurm_cluster_down` stops them and removes the folder. `slurm_cluster_why_not`
# prints why this machine cannot run one (nothing where it can).
#
# Nothing outside that folder is read or written: the munge key, munged's socket and Slurm's
# spool are its own, so a machine's own munge or Slurm, if any, is left alone. The daemons
# run as root (slurmd must, to start tasks as their user), with the plugins that need
# neither cgroups nor systemd: ProctrackType=proctrack/linuxproc, TaskPlugin=task/none.

slurm_cluster_pids=()
slurm_cluster_dir=""

slurm_cluster_why_not() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "slurmd must run as root to start tasks, and this is uid $(id -u)"
    return
  fi
  local missing=() c
  for c in munged slurmctld slurmd srun sinfo; do command -v "$c" >/dev/null || missing+=("$c"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "no ${missing[*]} (Debian's packages: apt-get install slurmd slurmctld slurm-client munge;" \
      ".ci/run installs them)"
  fi
}

# Two free TCP ports on this machine, one a line.
slurm_free_ports() {
  python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print("\n".join(str(s.getsockname()[1]) for s in socks))'
}

slurm_write_conf() {
  local dir=$1 node=$2 ctld_port=$3 slurmd_port=$4
  cat >"$dir/slurm.conf" <<CONF
ClusterName=sppo-test
SlurmctldHost=$node
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MessageTimeout=5
NodeName=$node NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=10 State=UP
CONF
}

slurm_cluster_up() {
  local dir ports node=localhost deadline v
  # munged wants every folder above its socket searchable by all: a new one under TMPDIR or /tmp.
  dir=$(mktemp -d "${TMPDIR:-/tmp}/sppo-slurm-XXXXXX") || return 1
  slurm_cluster_dir=$dir
  chmod 711 "$dir"
  mkdir -p "$dir/state" "$dir/spool"
  head -c 1024 /dev/urandom >"$dir/munge.key"
  chmod 600 "$dir/munge.key"
  mapfile -t ports < <(slurm_free_ports)
  slurm_write_conf "$dir" "$node" "${ports[0]}" "${ports[1]}"
  # A job around the tests (they may run inside one) must not reach this cluster's commands.
  for v in $(compgen -e | grep -E '^(SLURM_|SBATCH_|SRUN_|SALLOC_)'); do unset "$v"; done
  export SLURM_CONF=$dir/slurm.conf

  munged -F --key-file="$dir/munge.key" --socket="$dir/munge.sock" --pid-file="$dir/munged.pid" \
    --log-file="$dir/munged.log" --seed-file="$dir/munged.seed" >"$dir/munged.out" 2>&1 &
  slurm_cluster_pids+=($!)
  deadline=$((SECONDS + 10))
  until [ -S "$dir/munge.sock" ]; do
    if [ "$SECONDS" -ge "$deadline" ] || ! kill -0 "${slurm_cluster_pids[0]}" 2>/dev/null; then
      echo "slurm_cluster_up: munged did not start:"
      cat "$dir/munged.out"
      return 1
    fi
    sleep 0.1
  done
  slurmctld -D -i -f "$SLURM_CONF" >"$dir/slurmctld.out" 2>&1 &
  slurm_cluster_pids+=($!)
  slurmd -D -f "$SLURM_CONF" -N "$node" >"$dir/slurmd.out" 2>&1 &
  slurm_cluster_pids+=($!)
  # The node is up once slurmctld has heard from slurmd: "idle".
  deadline=$((SECONDS + 30))
  until [ "$(timeout 5 sinfo -h -n "$node" -o %t 2>/dev/null)" = idle ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "slurm_cluster_up: the node did not come up in 30 s; the daemons' logs:"
      tail -n 20 "$dir"/*.log "$dir"/*.out 2>/dev/null
      return 1
    fi
    sleep 0.1
  done
}

slurm_cluster_down() {
  local k pid t
  # In the reverse order of starting: slurmd, slurmctld, munged. A daemon still there 5 s
  # after SIGTERM (slurmd that cannot reach slurmctld waits on it) gets SIGKILL.
  for ((k = ${#slurm_cluster_pids[@]} - 1; k >= 0; k--)); do
    pid=${slurm_cluster_pids[k]}
    kill "$pid" 2>/dev/null || continue
    for t in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  slurm_cluster_pids=()
  [ -z "$slurm_cluster_dir" ] || rm -rf "$slurm_cluster_dir"
  slurm_cluster_dir=""
}
