"""Decode out kernel's step width and warps, A/B in one process: the whole block through twell.gated_mlp
on the decode path as planned (its rows: decode_rows), under
- before: 32 units a step and 4 warps at every decode row count (output chunks of 64-256 columns),
- above: 16 units a step and 2 warps above HELD_ROWS rows (where each program builds its part of the row's
  list from the tile counts, no held TwELL), the same chunks: out_config's rule since session 14,
- all: 16 units a step and 2 warps at every decode row count, the same chunks,
against the dense block. CUDA-graph replays over 8 layer copies, per layer; rel. errors against fp32.
(A sweep at 40-64 rows found 16 units and 2 warps best among 2-8 warps, 16-64 units and 128-2048 columns:
12.6 against 16.2 us at 64 rows for D 2048 / I 5632; benchmarks/NOTES-inference.md, session 14.)

    python benchmarks/decode_out_warps.py --json benchmarks/results/decode_out_warps_h100.json
"""
import argparse
import importlib
import sys

G = importlib.import_module("twell.gated_mlp")  # the module; twell.gated_mlp is also the function

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_inference import (  # noqa: E402
    LAYERS, dense, launch_rules, make_layer, make_x, per_layer_us, print_row, reference, rel_err, save_rows, sparse)

CASES = [(d, i, 29) for d, i in ((896, 4864), (2048, 5632), (2048, 8192), (3584, 18944), (4096, 14336))]
CASES.append((2048, 5632, 100))
TOKENS = (1, 4, 8, 12, 16, 17, 24, 32, 40, 48, 64)
out_now = G.out_config


def steps(above_rows, ch, warps):
    """out_config's decode chunks with ch units a step and `warps` warps above above_rows rows (BD 256
    there, as out_config has it above HELD_ROWS)."""
    def rule(m, d, decode, tiles=1):
        cfg = out_now(m, d, decode, tiles)
        return dict(cfg, CH=ch, num_warps=warps) if decode and m > above_rows else cfg
    return rule


RULES = {"before": steps(0, 32, 4), "above": steps(G.HELD_ROWS, 16, 2), "all": steps(0, 16, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    rows = []
    for d, i, k in CASES:
        layers = [make_layer(d, i, k) for _ in range(LAYERS)]
        for m in TOKENS:
            if m > G.decode_rows(d, i):
                continue
            x = make_x(m, d)
            ref = reference(x, layers[0])
            row = dict(D=d, I=i, k=k, M=m, dense_us=per_layer_us(lambda lw: dense(x, lw), layers))
            for name, rule in RULES.items():
                with launch_rules(out_config=rule):
                    row[f"err_{name}"] = rel_err(sparse(x, layers[0], 128, 8), ref)
                    row[f"{name}_us"] = per_layer_us(lambda lw: sparse(x, lw, 128, 8), layers)
            print_row(row)
            rows.append(row)
        del layers
    save_rows(args.json, "decode_out_warps.py", rows)


if __name__ == "__main__":
    main()
