"""Batched block time with one heavy row (a token with n active units) among M = 16384 ordinary ones (29
active): the out kernel walks each row in one program, so the heaviest row's serial walk bounds the launch.
Tile 128 with 64 slots (compression 2), so that the heavy row does not overflow. Fits the seconds per unit
of that walk (twell.format.ROW_UNIT) from the rows where it dominates.

    python benchmarks/heavy_row_probe.py --json results/heavy_row_h100.json
"""
import argparse
import json
import sys
from statistics import NormalDist

import torch
import triton
from triton.testing import do_bench

import twell
from bench_inference import dense, gate_pack, make_layer, make_x, twell_out
from twell.gated_mlp import gate_config, out_config

parser = argparse.ArgumentParser()
parser.add_argument("--json")
args = parser.parse_args()
M, K, TILE, C = 16384, 29, 128, 2
rows = []
for d, i in ((2048, 5632), (4096, 14336)):
    w = make_layer(d, i, K)
    bias = NormalDist().inv_cdf(1 - K / i)
    for heavy in (0, 250, 500, 1000, 2000, 4000):
        x = make_x(M, d)
        if heavy:  # the unit fires where z > bias * x0 (z about N(0, 1)): x0 sets its share of units
            x[M // 2, 0] = NormalDist().inv_cdf(1 - heavy / i) / bias
        tw, dense_h = gate_pack(x, w["gate"], TILE, C, gate_config(M, TILE, 2, False))
        counts = tw.counts.sum(1)
        out_ms = do_bench(lambda: twell_out(x, (tw, dense_h), w, out_config(M, d, False)), return_mode="median")
        block_ms = do_bench(lambda: twell.gated_mlp(x, w["gate"], w["up"], w["down_p"], tile=TILE, compression=C),
                            return_mode="median")
        r = dict(D=d, I=i, heavy_units=int(counts[M // 2]), max_per_tile=int(tw.counts.max()),
                 overflowing_pairs=int((tw.counts > tw.values.shape[2]).sum()), out_ms=out_ms, block_ms=block_ms,
                 dense_ms=do_bench(lambda: dense(x, w), return_mode="median"))
        rows.append(r)
        print(r, flush=True)
for d in (2048, 4096):
    base = next(r["out_ms"] for r in rows if r["D"] == d and r["heavy_units"] < 100)
    tail = [(r["heavy_units"], r["out_ms"]) for r in rows if r["D"] == d and r["out_ms"] > 2 * base]
    if tail:
        print(f"D {d}: seconds per unit of the heavy row's walk",
              [f"{n}: {ms * 1e-3 / n:.2e}" for n, ms in tail])
if args.json:
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       command="python " + " ".join(sys.argv), M=M, k=K, tile=TILE, compression=C, rows=rows), f, indent=1)
