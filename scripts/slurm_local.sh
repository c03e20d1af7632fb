#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying jobs/slurm.sbatch for real: munged,
# slurmctld and slurmd, configured under a temporary folder, stopped again on exit.
#
#   scripts/slurm_local.sh COMMAND [ARG...]   start the cluster, run COMMAND, stop the cluster
#   scripts/slurm_local.sh                    start it and wait; Ctrl-C (or SIGTERM) stops it
#
# COMMAND (or, without one, the shell that runs `export SLURM_CONF=...` as printed) talks to this
# cluster through SLURM_CONF. Installs Debian's slurm-wlm and munge with apt when they are missing
# (as root). Nothing outside the temporary folder is touched: munge gets a key and a socket of its
# own there, the daemons listen on free ports.
#
# Environment (default):
#   SLURM_LOCAL_DIR        where to keep the configuration, state and logs (a new mktemp folder,
#                          removed on exit unless COMMAND failed)
#   SLURM_LOCAL_HOLD       seconds SLURM holds a requeued job before starting it again: its
#                          credential lifetime, AuthInfo=cred_expire (SLURM's default is 120) (10)
#   SLURM_LOCAL_INSTALL=0  fail instead of installing what is missing
#
# The configuration is the issue's: proctrack/linuxproc (no cgroups needed), task/none,
# JobRequeue=1, one node with this machine's cores, no GPUs. The scheduler runs every 2 s instead
# of every 60 s, so that a job is started within seconds of its hold ending.
set -euo pipefail

die() {
  echo "scripts/slurm_local.sh: $*" >&2
  exit 2
}

hold=${SLURM_LOCAL_HOLD:-10}
# It is also the lifetime of the credential each job step is launched with: not too short.
[[ "$hold" =~ ^[0-9]+$ ]] && (( hold >= 5 )) ||
  die "SLURM_LOCAL_HOLD must be a number of seconds, 5 or more, not '$hold'"

# --- install what is missing ------------------------------------------------------------------
missing=()
for tool in munged slurmctld slurmd sbatch; do
  command -v "$tool" > /dev/null || missing+=("$tool")
done
if (( ${#missing[@]} )); then
  [[ "${SLURM_LOCAL_INSTALL:-1}" == 1 ]] || die "not installed: ${missing[*]} (SLURM_LOCAL_INSTALL=0)"
  (( EUID == 0 )) || die "not installed: ${missing[*]}; run as root to install slurm-wlm and munge with apt"
  echo "slurm_local: installing slurm-wlm and munge (missing: ${missing[*]})" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q > /dev/null && apt-get install -y -q slurm-wlm munge > /dev/null ||
    die "apt-get install slurm-wlm munge failed"
fi
command -v python3 > /dev/null || die "python3 is needed to find free ports"

# --- configure --------------------------------------------------------------------------------
if [[ -n "${SLURM_LOCAL_DIR:-}" ]]; then
  dir=$(realpath -m "$SLURM_LOCAL_DIR")
  mkdir -p "$dir" && chmod 700 "$dir"
else
  dir=$(mktemp -d "${TMPDIR:-/tmp}/slurm-local.XXXXXX")
fi
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
user=$(id -un)
host=$(hostname -s)
cpus=$(nproc)
read -r ctld_port slurmd_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

# munge: a key and a socket of this cluster's own, beside the system's (if any).
dd if=/dev/urandom of="$dir/munge.key" bs=1 count=1024 status=none
chmod 600 "$dir/munge.key"
socket=$dir/munge.socket

cat > "$dir/slurm.conf" << EOF
# Written by scripts/slurm_local.sh: a one-node cluster for trying jobs on this machine.
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$socket,cred_expire=$hold
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$dir/slurm.conf

# --- start, and stop on exit ------------------------------------------------------------------
pids=()
status=0
stop_cluster() {
  trap - EXIT INT TERM
  # Jobs first, while slurmd can still end their processes.
  if [[ -n "${ctld_pid:-}" ]] && scontrol ping > /dev/null 2>&1; then
    if [[ -n "$(squeue -h -o %i 2> /dev/null)" ]]; then
      echo "slurm_local: cancelling the jobs still queued or running" >&2
      scancel --user="$user" 2> /dev/null || true
      for _ in $(seq 60); do
        [[ -z "$(squeue -h -o %i 2> /dev/null)" ]] && break
        sleep 0.5
      done
    fi
  fi
  local i pid
  for (( i = ${#pids[@]} - 1; i >= 0; i-- )); do  # slurmd, slurmctld, munged
    pid=${pids[i]}
    kill -TERM "$pid" 2> /dev/null || continue
    for _ in $(seq 40); do
      kill -0 "$pid" 2> /dev/null || break
      sleep 0.25
    done
    kill -KILL "$pid" 2> /dev/null || true
    wait "$pid" 2> /dev/null || true
  done
  if (( status == 0 )) && [[ -z "${SLURM_LOCAL_DIR:-}" ]]; then
    rm -rf "$dir"
  else
    echo "slurm_local: configuration, state and logs kept in $dir" >&2
  fi
  exit "$status"
}
trap stop_cluster EXIT
trap 'status=130; exit' INT
trap 'status=143; exit' TERM

wait_until() {  # wait_until SECONDS WHAT COMMAND...
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" > /dev/null 2>&1; do
    if (( SECONDS >= deadline )); then
      status=1
      echo "slurm_local: $what did not happen within the time allowed; logs in $dir/log" >&2
      exit 1
    fi
    sleep 0.2
  done
}

munged --foreground --force --socket="$socket" --key-file="$dir/munge.key" \
  --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge.seed" \
  > "$dir/log/munged.out" 2>&1 &
pids+=($!)
wait_until 10 "munged answering on $socket" test -S "$socket"

# -c: a fresh start, without the jobs of an earlier run in the same SLURM_LOCAL_DIR.
slurmctld -D -c -f "$SLURM_CONF" > "$dir/log/slurmctld.out" 2>&1 &
ctld_pid=$!
pids+=("$ctld_pid")
wait_until 30 "slurmctld answering scontrol ping" scontrol ping

slurmd -D -f "$SLURM_CONF" -N "$host" > "$dir/log/slurmd.out" 2>&1 &
pids+=($!)
node_ready() { [[ "$(sinfo -h -n "$host" -o %T)" == idle ]]; }
wait_until 30 "node $host becoming idle" node_ready

echo "slurm_local: one-node cluster up ($host, $cpus CPUs, requeue hold ${hold} s); SLURM_CONF=$SLURM_CONF" >&2
if (( $# )); then
  "$@" || status=$?
else
  trap 'exit' INT TERM  # the way to stop it: not a failure
  echo "slurm_local: in another shell: export SLURM_CONF=$SLURM_CONF; Ctrl-C here stops the cluster" >&2
  while kill -0 "${pids[@]}" 2> /dev/null; do sleep 1; done
  echo "slurm_local: a daemon stopped; logs in $dir/log" >&2
  status=1
fi
