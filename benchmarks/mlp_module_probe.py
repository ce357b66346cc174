"""One layer's MLP module of a TwELL load (1-layer synthetic 1.5B-shape Llama from model_bench, 29 active
units), called directly at 1 token with a random x: host time per call for the module, the remote file's
gated_mlp, twell.gated_mlp at the planned and at the default setting, and the GPU time (do_bench). A random x
lacks the model's constant channel, so about half the units fire: this measures the overflow fallback.

    PYTHONPATH=benchmarks:$PYTHONPATH python benchmarks/mlp_module_probe.py
"""
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from triton.testing import do_bench

import twell
from model_bench import build_model, export, host_us


path = export(build_model(layers=1, active=29, device="cuda"), Path(tempfile.mkdtemp()) / "ckpt", active=29)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, trust_remote_code=True).cuda().eval()
mlp = model.model.layers[0].mlp
remote = sys.modules[type(mlp).__module__]
print("plan", mlp.mode, mlp.tile, mlp.compression)
x = torch.randn(1, 1, 2048, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    print("module", host_us(calls=100, fn=lambda: mlp(x)))
    g, u, d = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    print("down strides", d.stride(), "grad", d.requires_grad, "use_kernel", mlp._use_kernel(x))
    print("remote gated_mlp", host_us(calls=100, fn=lambda: remote.gated_mlp(x, g, u, d, tile=mlp.tile, compression=mlp.compression)))
    print("twell gated_mlp same weights", host_us(calls=100, fn=lambda: twell.gated_mlp(x, g, u, d, tile=mlp.tile, compression=mlp.compression)))
    print("twell tile 128 c8", host_us(calls=100, fn=lambda: twell.gated_mlp(x, g, u, d, tile=128, compression=8)))
    print("gpu do_bench", do_bench(lambda: twell.gated_mlp(x, g, u, d, tile=mlp.tile, compression=mlp.compression)) * 1e3)
