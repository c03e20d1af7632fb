#!/usr/bin/env bash
# What every node of a multi-node job runs: one torchrun agent, which starts this node's workers
# and meets the other nodes' agents at the rendezvous (this package's, `--rdzv_backend=elastic-mnist`,
# on the rendezvous store, a TCPStore). Arguments go to `elastic-mnist train`.
#
#   NNODES=1:4 RDZV_ENDPOINT=head:29400 RUN_ID=job42 jobs/node.sh \
#       --data-dir /shared/data --checkpoint-dir /shared/ckpt --logdir /shared/runs
#
# Environment (default):
#   NNODES          number of nodes, or MIN:MAX for an elastic job (1)
#   NPROC_PER_NODE  workers on this node (the GPUs visible, else 2)
#   RDZV_ENDPOINT   HOST:PORT of the rendezvous store, the same on every node; required unless
#                   NNODES is 1 (then localhost and a free port, like torchrun --standalone).
#                   HOST alone: the port is derived from RUN_ID (29400 + RUN_ID mod 1000 for a
#                   number, else from its checksum), the same on every node and another for each
#                   job, so that jobs whose first nodes share a machine do not collide
#   RUN_ID          the rendezvous id: the same on every node of one job, and another for each
#                   job; it names the run (elastic-mnist-HOST-PORT, after RDZV_ENDPOINT; with
#                   NNODES=1 a fresh one for each launch, as torchrun --standalone draws). The
#                   checkpoint folder's lease tells jobs apart by their store, not by this id
#   MAX_RESTARTS    restarts of this node's workers after failures before the agent gives up;
#                   nodes joining or leaving do not count (3)
#   RDZV_STORE      who serves the store: `agent`, the agent on the endpoint's host; or
#                   `external`, an `elastic-mnist rendezvous` process on the endpoint that
#                   outlives every node, the first one included (agent)
#   RDZV_BACKEND    elastic-mnist, this package's rendezvous (a node that joins, or whose worker
#                   died, enters the running job in process: nobody healthy restarts); or c10d,
#                   torch's own (every change but a lost node restarts every worker)
#                   (elastic-mnist)
#   RDZV_IS_HOST    true or false: whether this agent serves the store; auto: it does when the
#                   endpoint's host is this machine. Set it where several agents share one host:
#                   only one of them may serve (auto)
#   MONITOR_INTERVAL, JOIN_TIMEOUT, LAST_CALL_TIMEOUT, KEEP_ALIVE_INTERVAL,
#   KEEP_ALIVE_MAX_ATTEMPT   rendezvous timing, explained where they are set below
#   TORCHRUN        the launcher command, split on spaces (torchrun, else
#                   `python -m torch.distributed.run`)
#   RDZV_PRECHECK=0 under c10d, start torchrun without first waiting (up to JOIN_TIMEOUT) for the
#                   store to answer, on agents that do not serve it (our rendezvous always waits
#                   in the agent)
#   DRY_RUN=1       print the launch command, one argument per line, instead of running it
set -euo pipefail

die() {
  echo "jobs/node.sh: $*" >&2
  exit 2
}

NNODES=${NNODES:-1}
if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
  if [[ "$NNODES" != 1 ]]; then
    die "RDZV_ENDPOINT (HOST[:PORT] of the rendezvous store) is required with NNODES=$NNODES"
  fi
  if [[ "${RDZV_STORE:-agent}" != agent ]]; then
    die "RDZV_STORE=$RDZV_STORE needs RDZV_ENDPOINT, where the store runs"
  fi
  RDZV_ENDPOINT=localhost:0  # this node's agent serves the store on a port the OS chooses
fi
if [[ -z "${RUN_ID:-}" && "$NNODES" == 1 ]]; then  # a launch of its own, which none may join
  RUN_ID=$(cat /proc/sys/kernel/random/uuid 2> /dev/null ||
    python3 -c 'import uuid; print(uuid.uuid4())')
fi

# HOST without a port: one for this job alone, which every node derives alike.
if [[ "$RDZV_ENDPOINT" != *:* ]]; then
  if [[ "${RUN_ID:-}" =~ ^[0-9]{1,18}$ ]]; then  # a SLURM job id, say
    key=$((10#$RUN_ID))
  else
    key=$(printf '%s' "${RUN_ID:-elastic-mnist}" | cksum)
    key=${key%% *}
  fi
  RDZV_ENDPOINT=$RDZV_ENDPOINT:$((29400 + key % 1000))
fi
# Several nodes without RUN_ID: named after the store they share, alike on every node of the job
# and another for a job elsewhere.
RUN_ID=${RUN_ID:-elastic-mnist-${RDZV_ENDPOINT//[^A-Za-z0-9]/-}}

case "${RDZV_STORE:-agent}" in
  agent) is_host=${RDZV_IS_HOST:-auto} ;;
  external)
    # `elastic-mnist rendezvous` serves the store: no agent may try to, even on the same host.
    if [[ ! "${RDZV_IS_HOST:-false}" =~ ^(false|auto)$ ]]; then
      die "RDZV_IS_HOST=$RDZV_IS_HOST contradicts RDZV_STORE=external"
    fi
    is_host=false
    ;;
  *) die "RDZV_STORE must be agent or external, not '$RDZV_STORE'" ;;
esac
rdzv_backend=${RDZV_BACKEND:-elastic-mnist}
case "$rdzv_backend" in
  c10d | elastic-mnist) ;;
  *) die "RDZV_BACKEND must be elastic-mnist or c10d, not '$rdzv_backend'" ;;
esac
case "$is_host" in
  auto | true | false) ;;
  *) die "RDZV_IS_HOST must be true, false or auto, not '$is_host'" ;;
esac

if [[ -z "${NPROC_PER_NODE:-}" || -z "${OMP_NUM_THREADS:-}" ]]; then
  gpus=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
fi
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  if (( gpus > 0 )); then NPROC_PER_NODE=$gpus; else NPROC_PER_NODE=2; fi
fi
# torchrun sets one intra-op thread per worker when it starts several; on CPU share the cores.
if [[ -z "${OMP_NUM_THREADS:-}" ]] && (( gpus == 0 )); then
  cores=$(nproc)
  export OMP_NUM_THREADS=$(( cores / NPROC_PER_NODE > 0 ? cores / NPROC_PER_NODE : 1 ))
fi

# Under c10d with TCPStore sharing on (torch 2.14's default), a node joining a running job hangs
# both agents for 60 s and then fails them (the old rank 0 never writes MASTER_ADDR for the new round).
# Restarts after failures work either way: the workers build each attempt's process group on a
# store of their own (elastic_mnist/attempt_store.py). Our rendezvous does not read it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# Rendezvous timing: the values that make recovery fast. With torch's defaults a lost node is
# declared after 15 s of missed keep-alives and every round then waits 30 s for late nodes; with
# these, 3 s and 2 s. What a fault costs with them: the README's recovery table
# (scripts/recovery.py).
#
# A node that stops sending keep-alives is declared dead after KEEP_ALIVE_MAX_ATTEMPT missed beats
# KEEP_ALIVE_INTERVAL seconds apart: 3 s instead of 15 s (5 s x 3). A beat is one small write to
# the store per node per second.
keep_alive_interval=${KEEP_ALIVE_INTERVAL:-1}
keep_alive_max_attempt=${KEEP_ALIVE_MAX_ATTEMPT:-3}
# Once the minimum number of nodes has joined, a round waits LAST_CALL_TIMEOUT seconds for more
# before it closes; torch's 30 s would be added to every start and every recovery. Nodes that
# start together join within a second or two of each other; a later one joins as a scale-up.
last_call_timeout=${LAST_CALL_TIMEOUT:-2}
# How long a node waits for the minimum number of nodes before giving up: torch's default, kept
# long because a queued node or a pod waiting for a GPU machine can take minutes to come.
join_timeout=${JOIN_TIMEOUT:-600}
# How often the agent checks on its workers: a failed worker is noticed within half a second,
# at a fifth of the polling of torch 2.14's 0.1 s, and well inside the 3 s a lost node takes.
monitor_interval=${MONITOR_INTERVAL:-0.5}

rdzv_conf=join_timeout=$join_timeout,last_call_timeout=$last_call_timeout
rdzv_conf+=,keep_alive_interval=$keep_alive_interval,keep_alive_max_attempt=$keep_alive_max_attempt
if [[ "$is_host" != auto ]]; then
  rdzv_conf+=,is_host=$is_host
fi

# An agent that does not serve the store must reach it. torchrun would try for minutes and end in
# a traceback; say plainly what is wrong once JOIN_TIMEOUT has passed without an answer.
is_local() {
  local host=$1 ip
  [[ "$host" == localhost || "$host" == 127.* || "$host" == "$(hostname)" ]] && return 0
  ip=$(getent hosts "$host" | awk '{ print $1; exit }') || return 1
  [[ "$ip" == 127.* ]] || hostname -I 2> /dev/null | tr ' ' '\n' | grep -qxF "$ip"
}
wait_for_store() {
  local host=${RDZV_ENDPOINT%:*} port=${RDZV_ENDPOINT##*:} deadline=$((SECONDS + join_timeout))
  until timeout 2 bash -c "exec 3<>/dev/tcp/$host/$port" 2> /dev/null; do
    ((SECONDS < deadline)) || die "no rendezvous store answers at $RDZV_ENDPOINT after ${join_timeout} s (JOIN_TIMEOUT); start the head node or the store first, or fix RDZV_ENDPOINT"
    sleep 1
  done
}
serves_store=$is_host
if [[ "$is_host" == auto ]]; then
  serves_store=$(is_local "${RDZV_ENDPOINT%:*}" && echo true || echo false)
fi
# Our rendezvous waits for the store itself (JOIN_TIMEOUT, then one line): torchrun starts at once,
# and the nodes that start together arrive within a second of each other, not a poll apart.
if [[ "$serves_store" == false && "$rdzv_backend" == c10d && "${DRY_RUN:-0}" != 1 &&
      "${RDZV_PRECHECK:-1}" == 1 ]]; then
  wait_for_store
fi

if [[ -n "${TORCHRUN:-}" ]]; then
  read -r -a launcher <<< "$TORCHRUN"
elif command -v torchrun > /dev/null; then
  launcher=(torchrun)
else
  launcher=(python -m torch.distributed.run)
fi

cmd=("${launcher[@]}"
  --nnodes="$NNODES"
  --nproc_per_node="$NPROC_PER_NODE"
  --rdzv_backend="$rdzv_backend"
  --rdzv_endpoint="$RDZV_ENDPOINT"
  --rdzv_id="$RUN_ID"
  --rdzv_conf="$rdzv_conf"
  --max_restarts="${MAX_RESTARTS:-3}"
  --monitor_interval="$monitor_interval"
  -m elastic_mnist train "$@")

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
exec "${cmd[@]}"
