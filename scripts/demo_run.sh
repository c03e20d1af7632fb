#!/usr/bin/env bash
# The run behind docs/dashboards.md's figures: two nodes of one worker each on this machine, each its own
# jobs/node.sh agent (node 0's serves the rendezvous store). Node 1's worker is SIGKILLed at step
# 50 (its agent restarts it, and torchrun every worker), node 1 is SIGKILLed whole at step 100
# (node 0's worker goes on alone, in the same process) and a new node 1 joins at step 130 (every
# worker restarts, at world size 2).
#
#   PATH=.venv/bin:$PATH scripts/demo_run.sh DATA_DIR OUT_DIR
#
# DATA_DIR holds MNIST/raw (any digits: real MNIST, or `elastic-mnist synth --out DATA_DIR`).
# Leaves OUT_DIR/{ckpt,runs}, OUT_DIR/run.{png,svg,pdf} (docs/run.png) and, where chromium is
# installed, OUT_DIR/tensorboard.png (docs/tensorboard.png, scripts/screenshot_tensorboard.sh);
# `make tensorboard LOGDIR=OUT_DIR/runs` shows the run.
set -euo pipefail
scripts=$(dirname "$(realpath "$0")")
jobs=$(realpath "$scripts/../jobs")
data=$(realpath "$1"); out=$2
mkdir -p "$out" && cd "$out" && rm -rf ckpt runs ./*.log
export OMP_NUM_THREADS=1 NNODES=1:2 NPROC_PER_NODE=1 RUN_ID=demo MAX_RESTARTS=3
RDZV_ENDPOINT=127.0.0.1:$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export RDZV_ENDPOINT
# The figures' CPU run, in batches of 128 (315 steps in 5 epochs of 8,000 digits, the faults'
# steps below among them), as the job's defaults were when the pictures were taken.
args=(--device cpu --data-dir "$data" --no-download --epochs 5 --checkpoint-dir ckpt
      --logdir runs --checkpoint-every 10 --checkpoint-every-seconds 0 --log-every 5
      --global-batch-size 128 --micro-batch-size 32 --lr 2e-3 --warmup-steps 50)

node() {  # node N: a jobs/node.sh agent (it execs torchrun) in a session of its own
  RDZV_IS_HOST=$([[ $1 == 0 ]] && echo true || echo false) \
    setsid "$jobs/node.sh" "${args[@]}" > "node$1-$2.log" 2>&1 &
}
wait_for_step() { until [[ -f ckpt/step-$(printf %08d "$1").json ]]; do sleep 0.1; done; }
workers() { pgrep -P "$1" -f "elastic_mnist train" || true; }

node 0 a; first=$!
node 1 a; second=$!
wait_for_step 50
kill -KILL "$(workers "$second" | head -1)"        # a worker dies: everyone restarts
wait_for_step 100
victims=$(workers "$second")                        # a node dies: the other goes on in process
kill -KILL "$second" $victims
wait_for_step 130
node 1 b; third=$!                                  # a node joins: everyone restarts
wait "$first" "$third"
for format in png svg pdf; do elastic-mnist plot runs/demo -o run.$format; done
elastic-mnist evaluate --checkpoint-dir ckpt --json
if command -v chromium > /dev/null; then
  "$scripts/screenshot_tensorboard.sh" runs tensorboard.png
fi
