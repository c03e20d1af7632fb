#!/usr/bin/env bash
# The GPU claims' checks in one go, for a machine with a GPU (a few minutes on one H200):
#
#   1. the CUDA tests (tests marked `cuda` in tests/): no host-to-device copy per step or per
#      evaluation batch, compiled steps give eager's gradients with one micro-batch per step (CUDA
#      graphs) and with four accumulated (without them), fp32 is IEEE and tf32 is TF32, a
#      checkpoint's CUDA generator resumes on the GPU (from a GPU, a CPU and an 8-GPU
#      checkpoint), bf16 + channels-last + torch.compile train;
#   2. the suite on a one-GPU laptop: a CPU test that starts two workers, with one GPU visible
#      (CUDA_VISIBLE_DEVICES=0), which passes only because the suite pins --device cpu;
#   3. a smoke test of the real launch: `torchrun --standalone --nproc_per_node=2 -m elastic_mnist
#      train --device cuda` (NCCL) when two GPUs are visible, one worker on one GPU otherwise,
#      SMOKE_STEPS (4) steps, then as many more resumed from its checkpoint, with SMOKE_FLAGS
#      added (SMOKE_FLAGS=--compile: on two GPUs, DDP with CUDA graphs); it fails unless both
#      launches exit 0 and the checkpoints, events and log say what they should
#      (scripts/check_smoke.py);
#   4. scripts/bench.py on the GPU: the fast path at batch 1,000, with and without accumulation,
#      against the seed loop, and one 60,000-sample epoch.
#
#   scripts/gpu_check.sh OUT_DIR [bench.py flags, e.g. --real-data DIR]
#
# Leaves in OUT_DIR: results.json (the bench's figures, as bench/results.json holds them),
# table.md (its table), smoke.json (the smoke test's launches and checks) and gpu_check.log
# (everything printed, ending with one line per step).
#
# Without a GPU it runs what it can on CPU at smoke-test sizes: steps 1 and 2 are skipped, the
# smoke test runs one CPU worker as a plain process (no torchrun), the bench only our worker;
# tests/test_gpu_check.py runs it so in the suite (about 20 s), so that the script stays tested.
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
gpus=$("$py" -c 'import platform, sys, torch
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = ", ".join(torch.cuda.get_device_name(i) for i in range(count)) or "none"
print(f"python {platform.python_version()}, torch {torch.__version__}, GPUs: {names}",
      file=sys.stderr)
print(count)')

if (( gpus > 0 )); then
  bench=(--device cuda)
  device=cuda nproc=$(( gpus >= 2 ? 2 : 1 ))
  launcher=("$py" -m torch.distributed.run --standalone --nproc_per_node="$nproc" -m elastic_mnist)
  launch="torchrun, $nproc worker(s) on cuda"
else
  echo "no GPU visible: the CPU-safe parts only, at smoke-test sizes"
  bench=(--device cpu --quick --only worker)
  device=cpu nproc=1
  launcher=("$py" -m elastic_mnist)  # one process: the dry run's seconds are the suite's
  launch="one process on cpu"
fi

work=$(mktemp -d)  # the runs' checkpoints and logs, kept out of OUT_DIR
trap 'rm -rf "$work"' EXIT
status=0
summary=()
step() {  # step NAME COMMAND...: runs it, notes how it went, and goes on either way
  local name=$1 code=0 began=$SECONDS outcome
  shift
  echo "== $name"
  "$@" || code=$?
  if (( code == 0 )); then outcome=ok; else outcome="FAILED (exit $code)"; status=1; fi
  summary+=("gpu_check: $name: $outcome ($(( SECONDS - began )) s)")
}

laptop() {  # step 2: jobs/local.sh with two CPU workers where one GPU is visible
  CUDA_VISIBLE_DEVICES=0 "$py" -m pytest -q -p no:cacheprovider tests/test_train.py \
    -k test_make_train_line_runs_via_jobs_local
}

smoke() {  # step 3: the real launch, SMOKE_STEPS steps, then resumed for as many more
  local dir=$work/smoke steps=${SMOKE_STEPS:-4} launch
  read -r -a flags <<< "${SMOKE_FLAGS:-}"
  "$py" -m elastic_mnist synth --out "$dir/digits" --train 512 --test 128 --seed 0 > /dev/null
  for launch in 1 2; do
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 "${launcher[@]}" \
      train --device "$device" --dataset synthetic --data-dir "$dir/digits" --no-download \
      --global-batch-size 64 --epochs 100 --max-steps $(( launch * steps )) --log-every 1 \
      --checkpoint-dir "$dir/ckpt" --logdir "$dir/runs" --run-id smoke ${flags[@]+"${flags[@]}"} \
      > "$dir/launch$launch.log" 2>&1 || { cat "$dir/launch$launch.log"; return 1; }
  done
  "$py" scripts/check_smoke.py "$dir" --steps "$steps" --world-size "$nproc" \
    --device "$device" --out "$out/smoke.json"
}

bench() {  # step 4
  "$py" scripts/bench.py "${bench[@]}" --out "$out/results.json" --work "$work/bench" "$@" \
    > "$out/table.md" && cat "$out/table.md"
}

if (( gpus > 0 )); then
  step "cuda tests" "$py" -m pytest -q -p no:cacheprovider -m cuda tests/
  step "two CPU workers with one GPU visible" laptop
else
  summary+=("gpu_check: cuda tests: skipped (no GPU)"
            "gpu_check: two CPU workers with one GPU visible: skipped (no GPU)")
fi
step "smoke test: $launch" smoke
step "bench" bench "$@"
printf '%s\n' "${summary[@]}"
echo "gpu_check: exit status $status; results in $out"
exit "$status"
