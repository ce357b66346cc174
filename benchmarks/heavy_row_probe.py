"""Batched block time with heavy rows (tokens with n active units) among M ordinary ones (29 active).
A row above `heavy_units(M)` units is not walked by its own program: it posts its work as items (list
spans, overflowing tiles) that the span kernel spreads over many programs. Compression 2 (64 slots per
128-unit tile: the heavy rows fit) and 8 (16 slots: their tiles overflow and are recomputed as items).
One heavy row in the middle, or one in every 2048 rows (a sequence's first token at 2048-token prompts).
The block is checked against the fp32 reference at the heavy rows in the same run.

    python benchmarks/heavy_row_probe.py --json benchmarks/results/heavy_row_split_h100.json
"""
import argparse
import json
import sys
from statistics import NormalDist

import torch
import triton
from triton.testing import do_bench

import twell
from bench_inference import dense, gate_pack, make_layer, make_x, reference, rel_err, twell_out
from twell.gated_mlp import gate_config, out_config

parser = argparse.ArgumentParser()
parser.add_argument("--json")
args = parser.parse_args()
K, TILE = 29, 128
rows = []
for d, i, m, every in ((2048, 5632, 16384, 0), (2048, 5632, 4096, 0), (2048, 5632, 16384, 2048),
                       (4096, 14336, 16384, 0)):
    w = make_layer(d, i, K)
    bias = NormalDist().inv_cdf(1 - K / i)
    for compression in (2, 8):
        for heavy in (0, 250, 500, 1000, 2000, 4000):
            if every and heavy not in (0, 2000):
                continue
            x = make_x(m, d)
            heavy_rows = list(range(0, m, every)) if every else [m // 2]
            if heavy:  # the unit fires where z > bias * x0 (z about N(0, 1)): x0 sets its share of units
                x[heavy_rows, 0] = NormalDist().inv_cdf(1 - heavy / i) / bias
            tw, dense_h = gate_pack(x, w["gate"], TILE, compression, gate_config(m, TILE, 2, False))
            counts = tw.counts.sum(1)
            sparse = lambda: twell.gated_mlp(x, w["gate"], w["up"], w["down_p"], tile=TILE, compression=compression)
            out = sparse()
            ref = reference(x[heavy_rows], w)
            out_ms = do_bench(lambda: twell_out(x, (tw, dense_h), w, out_config(m, d, False)), return_mode="median")
            block_ms = do_bench(sparse, return_mode="median")
            dense_ms = do_bench(lambda: dense(x, w), return_mode="median")
            r = dict(D=d, I=i, M=m, compression=compression, heavy_rows=len(heavy_rows) if heavy else 0,
                     heavy_units=int(counts[heavy_rows[0]]), max_per_tile=int(tw.counts.max()),
                     overflowing_pairs=int((tw.counts > tw.values.shape[2]).sum()), out_ms=out_ms,
                     block_ms=block_ms, dense_ms=dense_ms, speedup=dense_ms / block_ms,
                     heavy_rows_rel_err=rel_err(out[heavy_rows], ref),
                     dense_heavy_rows_rel_err=rel_err(dense(x[heavy_rows], w), ref))
            rows.append(r)
            print(r, flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       command="python " + " ".join(sys.argv), k=K, tile=TILE, rows=rows), f, indent=1)
