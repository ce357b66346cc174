"""Host-side cost of one decode-size call (M = 1) of twell.gated_mlp against the dense block: wall time per
call when issued back to back (what an eager `generate` loop pays) and GPU time (do_bench), on a GPU.

    python benchmarks/host_overhead.py
"""
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import twell

D, I, k = 2048, 5632, 29
torch.manual_seed(0)
x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
x[:, 0] = 1
gate = torch.randn(I, D, device="cuda") / D**0.5
gate[:, 0] = -torch.special.ndtri(torch.tensor(1 - k / I))
gate, up = gate.bfloat16(), (torch.randn(I, D, device="cuda") / D**0.5).bfloat16()
down = twell.prepare_down((torch.randn(D, I, device="cuda") / k**0.5).bfloat16())
gate_up = torch.cat([gate, up])


def dense():
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.relu(g) * u, down)


def sparse():
    return twell.gated_mlp(x, gate, up, down)


for name, fn in (("dense", dense), ("twell", sparse)):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 200 * 1e6
    print(f"{name}: {wall:.1f} us a call issued back to back, GPU {do_bench(fn, return_mode='median') * 1e3:.1f} us")
