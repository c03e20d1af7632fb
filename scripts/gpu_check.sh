#!/usr/bin/env bash
# The CUDA fast path's checks in one go, for a machine with a GPU (under 5 minutes on one H200):
# the fast-path tests, then scripts/bench.py on the GPU. Without a GPU it runs the same steps on
# CPU at smoke-test sizes, so that the script itself stays tested.
#
#   scripts/gpu_check.sh OUT_DIR [bench.py flags, e.g. --real-data DIR]
#
# Leaves in OUT_DIR: results.json (the bench's figures, as bench/results.json holds them),
# table.md (its table) and gpu_check.log (everything printed).
#
# Python: .venv/bin/python where `make install` made one; else python3 with this checkout on
# PYTHONPATH, for GPU machines that cannot install anything (their own torch is used, and
# results.json records its version).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUT_DIR [bench.py flags]" >&2
  exit 2
fi
mkdir -p "$1"
out=$(cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
exec > >(tee "$out/gpu_check.log") 2>&1

if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -c 'import platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__}, GPU: {gpu}")'

if "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  bench=(--device cuda)
else
  echo "no GPU visible: the CPU-safe parts only, at smoke-test sizes"
  bench=(--device cpu --quick --only seed,worker,floor)
fi

work=$(mktemp -d)  # the runs' checkpoints and logs, kept out of OUT_DIR
status=0
"$py" -m pytest -q -p no:cacheprovider tests/test_fast_path.py || status=$?
"$py" scripts/bench.py "${bench[@]}" --out "$out/results.json" --work "$work" "$@" \
  > "$out/table.md" || status=$?
cat "$out/table.md"
echo "gpu_check: exit status $status; results in $out"
exit "$status"
