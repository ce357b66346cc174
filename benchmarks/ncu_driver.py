"""Nsight Compute driver: three twell.gated_mlp calls at D 2048, I 5632, 29 active units (benchmarks.md's
bias-channel recipe), M tokens from argv (default 16384); ncu profiles one launch of the named kernel:

    ncu --kernel-name _twell_out_kernel --launch-skip 2 --launch-count 1 --clock-control none \
        --section SpeedOfLight ... python benchmarks/ncu_driver.py 16384
"""
import sys

import torch

import twell
from bench_inference import make_layer, make_x

m = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
w, x = make_layer(2048, 5632, 29), make_x(m, 2048)
for _ in range(3):
    twell.gated_mlp(x, w["gate"], w["up"], w["down_p"])
torch.cuda.synchronize()
