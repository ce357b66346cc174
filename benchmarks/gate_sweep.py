"""Launch-configuration sweep of the TwELL gate kernel (matmul + packing epilogue) at D=2048, I=5632,
k=29, against cuBLAS's gate matmul alone, with each configuration's registers, spills and shared memory
(which decide how many programs share an SM, and so whether one program's epilogue overlaps another's
main loop). Output must equal the default configuration's packing.

    python benchmarks/gate_sweep.py [--tokens 16384] [--json out.json]
"""
import argparse
import json
import sys

import torch
import triton
from triton.testing import do_bench

from bench_inference import make_layer, make_x
from twell.format import cdiv, slots
from twell.gated_mlp import gate_config, gate_launch

CONFIGS = {  # tile: [(BM, BK, num_warps, num_stages), ...]
    128: [(256, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 5),
          (64, 64, 4, 4), (64, 64, 4, 3)],
    256: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 64, 8, 4), (128, 32, 8, 4)],
}


def run(m, d=2048, i=5632, k=29, compression=8):
    w, x = make_layer(d, i, k), make_x(m, d)  # benchmarks.md's bias-channel recipe
    rows = [dict(kernel="cublas_gate", ms=do_bench(lambda: x @ w["gate"].t(), return_mode="median"))]
    print(rows[-1], flush=True)
    for tile, configs in CONFIGS.items():
        s = slots(tile, compression)
        bufs = lambda: (torch.full((m, cdiv(i, tile), s), float("nan"), dtype=x.dtype, device="cuda"),  # noqa: E731
                        torch.full((m, cdiv(i, tile), s), -1, dtype=torch.int32, device="cuda"),
                        torch.full((m, cdiv(i, tile)), -1, dtype=torch.int32, device="cuda"))
        ref = bufs()
        gate_launch(x, w["gate"], None, tile, s, x.dtype, gate_config(m, tile, 2, m <= 64))(x, w["gate"], w["gate"], *ref)
        for bm, bk, warps, stages in configs:
            cfg = dict(BM=bm, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
            launch = gate_launch(x, w["gate"], None, tile, s, x.dtype, cfg)
            out = bufs()
            try:
                compiled = launch.kernel[launch.grid](x, w["gate"], w["gate"], *out, *launch.scalars, **launch.options)
            except Exception as e:  # out of shared memory or registers
                print(tile, cfg, "failed:", type(e).__name__, str(e)[:100], flush=True)
                continue
            valid = torch.arange(s, device="cuda") < ref[2].clamp(max=s)[..., None]
            same = torch.equal(out[2], ref[2]) and torch.equal(out[1][valid], ref[1][valid]) and \
                torch.equal(out[0][valid], ref[0][valid])
            t = do_bench(lambda: launch(x, w["gate"], w["gate"], *out), return_mode="median")
            rows.append(dict(kernel="gate_pack", tile=tile, **cfg, ms=t, same_as_default=same,
                             regs=compiled.n_regs, spills=compiled.n_spills, smem=compiled.metadata.shared))
            print(rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 4096])
    p.add_argument("--json")
    args = p.parse_args()
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command="python " + " ".join(sys.argv), results={m: run(m) for m in args.tokens})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
