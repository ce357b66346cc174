#!/usr/bin/env bash
# DDP check of the hybrid training path on 2 GPUs: `sparsify convert demo` for 40 steps with every layer
# routed to twell.hybrid (--hybrid-below 1000), once by torchrun on 2 GPUs (batch 8 each) and once on 1 GPU
# with batch 16; prints the weights' largest relative difference and both logs (loss, path and hot units
# per layer), and writes them to OUT/ddp_hybrid_check.json. Run from the repository root with twell importable (pip install -e . or PYTHONPATH).
set -euo pipefail
out=${1:-/tmp/ddp_hybrid_check}
python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m cli convert demo -o "$out/two" --steps 40 \
    --hybrid-below 1000 --overwrite | tail -3
python3 -m cli convert demo -o "$out/one" --steps 40 --hybrid-below 1000 --batch-size 16 --overwrite | tail -3
OUT_DIR="$out" python3 - <<'PY'
import json, os
from safetensors.torch import load_file
out = os.environ["OUT_DIR"]
import torch, triton
a, b = load_file(f"{out}/two/model.safetensors"), load_file(f"{out}/one/model.safetensors")
result = dict(device=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), torch=torch.__version__,
              triton=triton.__version__, command="benchmarks/ddp_hybrid_check.sh",
              max_rel_weight_diff=max(((a[k].float() - b[k].float()).norm() / b[k].float().norm()).item() for k in b))
print("max rel weight diff 2 GPUs vs 1:", result["max_rel_weight_diff"])
for name in ("two", "one"):
    log = json.load(open(f"{out}/{name}/training_log.json"))["log"]
    result[name] = [dict(step=e["step"], loss=e["loss"], paths=[l["path"] for l in e["layers"]],
                         hot_units=[l.get("hot_units", 0) for l in e["layers"]]) for e in log]
    print(name, [(e["step"], round(e["loss"], 4), [l["path"][0] + str(l.get("hot_units", "")) for l in e["layers"]]) for e in log])
json.dump(result, open(f"{out}/ddp_hybrid_check.json", "w"), indent=1)
PY
