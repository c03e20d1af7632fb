#!/usr/bin/env bash
# One node: one worker per GPU, or NPROC_PER_NODE CPU workers (2) where there is no GPU.
# Arguments are passed on to `elastic-mnist train`.
#
#   jobs/local.sh --epochs 2 --checkpoint-dir checkpoints --logdir runs
#
# Environment: NPROC_PER_NODE (default: GPUs visible, else 2), MAX_RESTARTS (default 3).
set -euo pipefail

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

exec torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" \
  --max_restarts="${MAX_RESTARTS:-3}" \
  -m elastic_mnist train "$@"
