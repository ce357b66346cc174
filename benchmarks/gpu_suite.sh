#!/usr/bin/env bash
# One device call: GPU tests, the converted demo on the kernels, hybrid-routed vs dense conversion, and the
# model-level bench. Results and logs go to $OUT (the device tool brings them back). Each step runs even if
# an earlier one failed; the exit status says whether all passed.
#   bash benchmarks/gpu_suite.sh [CHECKPOINT]      (CHECKPOINT: a converted demo, default .gpu/demo-sparse)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/pp
ln -sfn "$PWD/kernels" /tmp/pp/twell
export PYTHONPATH=/tmp/pp:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_MODULES_CACHE=/tmp/hf_modules
checkpoint=${1:-.gpu/demo-sparse}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
step() { echo "=== $1"; shift; "$@" || { echo "FAILED: $*"; status=1; }; }
step "GPU tests" timeout 200 python3 -m pytest -q -m gpu tests -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml"
step "converted demo on the kernels" timeout 120 python3 benchmarks/checkpoint_kernel_check.py "$checkpoint" --force-sparse 64 4 --json "$OUT/demo_kernel_check_h100.json"
step "hybrid-routed vs dense conversion" timeout 200 python3 benchmarks/hybrid_convert.py --json "$OUT/hybrid_convert_h100.json"
step "model bench" timeout 230 python3 benchmarks/model_bench.py --active 29 100 --layers 4 --out "$OUT" --work /tmp/mb
exit $status
