"""Decode out-kernel chunk width (BD) A/B: the whole gated block at 1-16 tokens through twell.gated_mlp with
out_config's chunk rule (a launch walks at most DECODE_WALK_BUDGET TwELL tiles) against the rule before it
(BD 64 up to 8 rows, else 256), in the same process; plus the breakdown of one call (gate+up launch, out
launch at BD 64/128/256). CUDA-graph replays over 8 layer copies, per layer; rel. errors against fp32.

    python benchmarks/decode_out_chunks.py --json benchmarks/results/decode_out_chunks_h100.json
"""
import argparse
import importlib
import sys

import triton
from triton.testing import do_bench_cudagraph

from twell.format import decode_rows

G = importlib.import_module("twell.gated_mlp")  # the module; twell.gated_mlp is also the function

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_inference import (  # noqa: E402
    LAYERS, SHAPES, dense, gate_pack, launch_rules, make_layer, make_x, per_layer_us, print_row, reference, rel_err,
    save_rows, sparse, twell_out)

TOKENS = (1, 4, 8, 12, 16)
rule_now = G.out_config


def rule_before(m, d, decode, tiles=1):
    cfg = rule_now(m, d, decode, tiles)
    return dict(cfg, BD=64 if m <= 8 else 256) if decode else cfg



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    rows = []
    for d, i in SHAPES:
        layers = [make_layer(d, i, 29) for _ in range(LAYERS)]
        for m in (m for m in TOKENS if m <= decode_rows(d, i)):
            x = make_x(m, d)
            ref = reference(x, layers[0])
            row = dict(D=d, I=i, M=m, tiles=triton.cdiv(i, G.DECODE_TILE),
                       BD_before=rule_before(m, d, True)["BD"],
                       BD_now=rule_now(m, d, True, triton.cdiv(i, G.DECODE_TILE))["BD"],
                       dense_us=per_layer_us(lambda lw: dense(x, lw), layers))
            for name, rule in (("before", rule_before), ("now", rule_now)):
                with launch_rules(out_config=rule):
                    row[f"err_{name}"] = rel_err(sparse(x, layers[0], 128, 8), ref)
                    row[f"twell_{name}_us"] = per_layer_us(lambda lw: sparse(x, lw, 128, 8), layers)
            row["speedup_before"] = row["dense_us"] / row["twell_before_us"]
            row["speedup_now"] = row["dense_us"] / row["twell_now_us"]
            # breakdown: the gate (+ fused up) launch and the out launch alone, at each chunk width
            gcfg = G.gate_config(m, G.DECODE_TILE, 2, decode=True)
            row["gate_up_us"] = per_layer_us(lambda lw: gate_pack(x, lw["gate"], G.DECODE_TILE, 8, dict(gcfg),
                                                                  up=lw["up"]), layers)
            packed = [gate_pack(x, lw["gate"], G.DECODE_TILE, 8, dict(gcfg), up=lw["up"]) for lw in layers]
            for bd in (64, 128, 256):
                cfg = dict(rule_now(m, d, True), BD=bd)
                row[f"out_bd{bd}_us"] = do_bench_cudagraph(
                    lambda: [twell_out(x, p, lw, cfg, packed_h=True) for p, lw in zip(packed, layers)],
                    rep=50, return_mode="median") / LAYERS * 1e3
            print_row(row)
            rows.append(row)
    save_rows(args.json, "decode_out_chunks.py", rows)


if __name__ == "__main__":
    main()
