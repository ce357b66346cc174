#!/usr/bin/env bash
# One device call: the model-level bench at the paper's 1.5B shape (28 layers, D 2048 / I 5632, 29 active
# units), dense vs TwELL in one process: prefill 1/8/64 x 2048, eager generate and the CUDA-graph step at
# batch 1 and 8, compiled static-cache generate at batch 1 and 8, each with its breakdown. JSON and log to $OUT.
#   bash benchmarks/model_bench_gpu.sh [ARGS]     (full: about 6-9 minutes, most of it the four compiles;
#                                                  ARGS go to model_bench.py, e.g. --compiled-batch 1)
#   bash benchmarks/model_bench_gpu.sh --quick    (smoke: 4 layers, batch-1 decode paths; about 2 minutes)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/pp
ln -sfn "$PWD/kernels" /tmp/pp/twell
export PYTHONPATH=/tmp/pp:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_MODULES_CACHE=/tmp/hf_modules
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${1:-}" = "--quick" ]; then
  args=(--quick)
else
  args=(--layers 28 --active 29 "$@")
fi
timeout 560 python3 benchmarks/model_bench.py "${args[@]}" --out "$OUT" --work /tmp/mb 2>&1 | tee "$OUT/model_bench.log"
exit "${PIPESTATUS[0]}"
