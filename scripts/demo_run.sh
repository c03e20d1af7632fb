#!/usr/bin/env bash
# The run behind the README's figures: two workers, one SIGKILLed at step 70 (torchrun restarts
# it), the job preempted with SIGTERM at step 130 and resumed by a single worker.
#
#   PATH=.venv/bin:$PATH scripts/demo_run.sh DATA_DIR OUT_DIR
#
# DATA_DIR holds MNIST/raw (any digits: real MNIST, or `elastic-mnist synth --out DATA_DIR`).
# Leaves OUT_DIR/{ckpt,runs}, OUT_DIR/run.{png,svg,pdf} (docs/run.png) and, where chromium is
# installed, OUT_DIR/tensorboard.png (docs/tensorboard.png, scripts/screenshot_tensorboard.sh);
# `make tensorboard LOGDIR=OUT_DIR/runs` shows the run.
set -euo pipefail
scripts=$(dirname "$(realpath "$0")")
data=$(realpath "$1"); out=$2
mkdir -p "$out" && cd "$out" && rm -rf ckpt runs
export OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
args=(train --device cpu --data-dir "$data" --no-download --epochs 3 --checkpoint-dir ckpt
      --logdir runs --run-id demo --checkpoint-every 10 --log-every 5)  # the figures' CPU run

wait_for_step() { until [[ -f ckpt/step-$(printf %08d "$1").json ]]; do sleep 0.1; done; }

torchrun --standalone --nproc_per_node=2 --max_restarts=2 -m elastic_mnist "${args[@]}" \
  > launch1.log 2>&1 &
agent=$!
wait_for_step 70
pkill -KILL -n -P "$agent" -f "elastic_mnist train"  # the agent's newest worker
wait_for_step 130
kill -TERM "$agent"; wait "$agent" || true
torchrun --standalone --nproc_per_node=1 -m elastic_mnist "${args[@]}" > launch2.log 2>&1
for format in png svg pdf; do elastic-mnist plot runs/demo -o run.$format; done
elastic-mnist evaluate --checkpoint-dir ckpt --json
if command -v chromium > /dev/null; then
  "$scripts/screenshot_tensorboard.sh" runs tensorboard.png
fi
