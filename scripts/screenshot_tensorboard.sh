#!/usr/bin/env bash
# docs/dashboards.md's TensorBoard picture: the custom scalars tab of LOGDIR's runs, drawn by headless
# Chromium from a TensorBoard that this script starts on a free local port and stops; smoothing
# off, since world size and restart generation are steps.
#
#   PATH=.venv/bin:$PATH scripts/screenshot_tensorboard.sh LOGDIR OUT.png [WIDTHxHEIGHT]
#
# Needs chromium (apt-get install chromium). TensorBoard answers before it has read the logs, so
# the picture is taken once its HTTP API serves the layout and the first run's scalars.
set -euo pipefail
logdir=$1; out=$(realpath -m "$2"); size=${3:-1600x1900}
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
tensorboard --logdir "$logdir" --host 127.0.0.1 --port "$port" --reload_interval 1 \
  > /dev/null 2>&1 &
board=$!
trap 'kill "$board" 2>/dev/null; wait "$board" 2>/dev/null || true' EXIT
api=http://127.0.0.1:$port/data/plugin
run=$(basename "$(find "$logdir" -name 'events.out.tfevents.*.layout' -printf '%h\n' | head -1)")
for _ in $(seq 120); do
  if curl -sf "$api/custom_scalars/layout" | grep -q category &&
     curl -sf "$api/scalars/scalars?run=$run&tag=train/loss" | grep -q '\['; then
    break
  fi
  sleep 0.5
done
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
  --window-size="${size/x/,}" --virtual-time-budget=20000 --screenshot="$out" \
  "http://127.0.0.1:$port/#custom_scalars&_smoothingWeight=0" 2> /dev/null
echo "wrote $out"
