#!/usr/bin/env bash
# One GPU run: GPU tests, the converted demo on the kernels, hybrid-routed vs dense conversion, small_linear
# against F.linear, decode attention against sdpa, the model-level bench, and the FSDP check on one GPU; with two
# or more GPUs also the DDP checks (plain, and with calibration: each process fits its share of the layers) and the
# FSDP check on two (`sparsify convert demo` for 40 steps with every layer on the hybrid kernels, on N GPUs with
# batch 16 / N each (torchrun: DDP; accelerate with recipes/accelerate/fsdp.yaml: FSDP2) against a plain run on
# 1 GPU with batch 16: both logs, the weights' largest relative difference and any calibration records, in
# $OUT/<name>_hybrid_check.json).
# Results and logs go to $OUT.
# Each step runs even if an earlier one failed; the exit status says whether all passed.
#   bash benchmarks/gpu_suite.sh [CHECKPOINT]      (CHECKPOINT: a converted demo, default .gpu/demo-sparse)
#   ONLY='2 GPUs' bash benchmarks/gpu_suite.sh     (only the steps whose title matches this regex)
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/pp
ln -sfn "$PWD/kernels" /tmp/pp/twell
export PYTHONPATH=/tmp/pp:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_MODULES_CACHE=/tmp/hf_modules
checkpoint=${1:-.gpu/demo-sparse}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
ONLY=${ONLY:-.}
step() { [[ $1 =~ $ONLY ]] || return 0; echo "=== $1"; shift; "$@" || { echo "FAILED: $*"; status=1; }; }
multi_gpu_check() {  # NAME N "OPTIONS" LAUNCHER...: the demo on N GPUs started by LAUNCHER against 1 GPU with all N
    # batches, both with convert's OPTIONS added
    local name=$1 gpus=$2 options=$3; shift 3
    local work=/tmp/${name}_hybrid_check
    timeout 150 "$@" -m cli convert demo -o "$work/two" --steps 40 --hybrid-below 1000 --no-measure --batch-size $((16 / gpus)) \
        $options --overwrite | tail -3 &&
    timeout 150 python3 -m cli convert demo -o "$work/one" --steps 40 --hybrid-below 1000 --no-measure --batch-size 16 \
        $options --overwrite | tail -3 &&
    NAME="$name" WORK="$work" OUT="$OUT" python3 - <<'PY'
import json, os
import accelerate, torch, transformers, triton
from safetensors.torch import load_file
name, work, out = os.environ["NAME"], os.environ["WORK"], os.environ["OUT"]
a, b = load_file(f"{work}/two/model.safetensors"), load_file(f"{work}/one/model.safetensors")
result = dict(device=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), torch=torch.__version__,
              triton=triton.__version__, transformers=transformers.__version__, accelerate=accelerate.__version__,
              command=f"benchmarks/gpu_suite.sh ({name} check)",
              max_rel_weight_diff=max(((a[k].float() - b[k].float()).norm() / b[k].float().norm()).item() for k in b))
print("max rel weight diff launched vs plain:", result["max_rel_weight_diff"])
fits = [json.load(open(f"{work}/{run}/config.json"))["twell"]["training"].get("calibration") for run in ("two", "one")]
if fits[1]:  # calibrated: each layer's fitted record, launched against plain
    result["calibration"] = dict(zip(("two", "one"), fits))
    print("calibration records launched / plain:", *(f["layers"] for f in fits), sep="\n")
for run in ("two", "one"):
    log = json.load(open(f"{work}/{run}/training_log.json"))["log"]
    result[run] = [dict(step=e["step"], loss=e["loss"], paths=[l["path"] for l in e["layers"]],
                        hot_units=[l.get("hot_units", 0) for l in e["layers"]]) for e in log]
    print(run, [(e["step"], round(e["loss"], 4), [l["path"][0] + str(l.get("hot_units", "")) for l in e["layers"]]) for e in log])
json.dump(result, open(f"{out}/{name}_hybrid_check.json", "w"), indent=1)
PY
}
step "GPU tests" timeout 400 python3 -m pytest -q -m gpu tests -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml"
step "converted demo on the kernels" timeout 120 python3 benchmarks/checkpoint_kernel_check.py "$checkpoint" --force-sparse 64 4 --json "$OUT/demo_kernel_check_h100.json"
step "hybrid-routed vs dense conversion" timeout 200 python3 benchmarks/hybrid_convert.py --json "$OUT/hybrid_convert_h100.json"
step "small_linear against F.linear" timeout 200 python3 benchmarks/small_linear_bench.py --json "$OUT/small_linear_bench.json"
step "decode attention against sdpa" timeout 150 python3 benchmarks/decode_attention_bench.py --json "$OUT/decode_attention_bench.json"
step "model bench (quick: 4 layers, batch-1 decode paths)" timeout 320 python3 benchmarks/model_bench.py --quick --out "$OUT" --work /tmp/mb
step "FSDP: 1 process against a plain run" multi_gpu_check fsdp1 1 "" python3 -m accelerate.commands.launch \
    --config_file recipes/accelerate/fsdp.yaml --num_processes 1
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step "DDP: 2 GPUs against 1" multi_gpu_check ddp 2 "" python3 -m torch.distributed.run --standalone --nproc_per_node 2
    step "DDP with calibration: 2 GPUs against 1" multi_gpu_check ddp_calibrate 2 \
        "--calibrate-steps 30 --calibrate-sparsity 0.5 --swap-steps 0 --l1-log-scale 0.2" \
        python3 -m torch.distributed.run --standalone --nproc_per_node 2
    step "FSDP: 2 GPUs against 1" multi_gpu_check fsdp 2 "" python3 -m accelerate.commands.launch \
        --config_file recipes/accelerate/fsdp.yaml --num_processes 2
fi
exit $status
