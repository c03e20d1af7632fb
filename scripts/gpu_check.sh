#!/usr/bin/env bash
# The GPU claims' checks in one go, for a machine with a GPU: 8 minutes at most on one H200, the
# most decisive checks first, each step in a time bound of its own, the results written as they
# come (scripts/gpu_check.py's docstring lists the steps and the files):
#
#   scripts/gpu_check.sh [OUT_DIR] [--budget S] [--bound STEP=S] [--dry-run] [bench.py flags]
#
# OUT_DIR defaults to bench/gpu (kept by git). Without a GPU it is its own dry run, at the
# tiniest sizes (tests/test_gpu_check.py runs it so).
#
# Python: GPU_CHECK_PYTHON where given; else .venv/bin/python where `make install` made one; else
# python3 with this checkout on PYTHONPATH, for GPU machines that cannot install anything (their
# own torch is used, 2.11 or newer: pyproject.toml's range; summary.json records its version).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then py=$GPU_CHECK_PYTHON
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$py" scripts/gpu_check.py "$@"
