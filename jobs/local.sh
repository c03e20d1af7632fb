#!/usr/bin/env bash
# One node: one worker per GPU, or NPROC_PER_NODE CPU workers (2) where there is no GPU.
# Arguments are passed on to `elastic-mnist train`.
#
#   jobs/local.sh --epochs 2 --checkpoint-dir checkpoints --logdir runs
#
# Environment: NPROC_PER_NODE (default: GPUs visible, else 2), MAX_RESTARTS (default 3),
#   RESUME_COMMAND    the command that continues the run, for the line a Ctrl-C ends with
#                     (default: this script with its arguments; `make train` gives its own)
#   INTERRUPT_STATUS  this script's exit status after a clean stop on Ctrl-C (130, as a shell's
#                     for a program ended by SIGINT; `make train` sets 0: make then ends by the
#                     SIGINT it got itself, without an error line of its own)
#
# Ctrl-C stops the job quietly: the workers stop at the next step, all at the same one, save a
# checkpoint, and rank 0 says so in one line with the command that resumes. torchrun itself would
# answer the terminal's SIGINT with a 25-line traceback, so it runs in a process group of its own,
# out of the terminal's reach, and this script asks its workers to stop instead; they exit 0 and
# torchrun ends as after a finished run. A second Ctrl-C stops torchrun its own way (SIGTERM).
# SIGTERM and SIGHUP to this script go on to torchrun as they are.
set -euo pipefail

agent=
interrupted=0
interrupt() {
  interrupted=$((interrupted + 1))
  if [[ -z "$agent" ]]; then  # nothing started yet
    echo "jobs/local.sh: interrupted before training began" >&2
    exit "${INTERRUPT_STATUS:-130}"
  fi
  local workers
  workers=$(pgrep -P "$agent" || true)
  if (( interrupted == 1 )) && [[ -n "$workers" ]]; then
    # shellcheck disable=SC2086 # one pid per word
    kill -INT $workers 2> /dev/null || true
  else  # a second Ctrl-C, or torchrun between two groups of workers
    kill -TERM "$agent" 2> /dev/null || true
  fi
}
trap interrupt INT

gpus=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  if (( gpus > 0 )); then NPROC_PER_NODE=$gpus; else NPROC_PER_NODE=2; fi
fi
# torchrun sets one intra-op thread per worker when it starts several; on CPU share the cores.
if (( gpus == 0 )) && [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores=$(nproc)
  export OMP_NUM_THREADS=$(( cores / NPROC_PER_NODE > 0 ? cores / NPROC_PER_NODE : 1 ))
fi

# As every launch line of the README: torch 2.14's agents share their rendezvous store with the
# workers by default, and then a node joining a job hangs the agents. One node never sees a join,
# and restarts work either way (the workers build their group on a store of their own), but
# with the variable the worker has nothing to warn about.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

resume=${RESUME_COMMAND:-$(printf '%q ' "$0" "$@")}
set -m  # torchrun in a process group of its own: the terminal's Ctrl-C reaches this script only
torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" \
  --max_restarts="${MAX_RESTARTS:-3}" \
  -m elastic_mnist train --resume-command "${resume% }" "$@" &
agent=$!
set +m
trap 'kill -TERM "$agent" 2> /dev/null || true' TERM
trap 'kill -HUP "$agent" 2> /dev/null || true' HUP

# `wait` returns early when a trap has run: wait again until torchrun has ended.
status=0
while :; do
  wait "$agent" && status=0 || status=$?
  kill -0 "$agent" 2> /dev/null || break
done
if (( interrupted && status == 0 )); then
  exit "${INTERRUPT_STATUS:-130}"
fi
exit "$status"
