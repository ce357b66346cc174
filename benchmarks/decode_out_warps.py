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
from bench_inference import SHAPES, compare_rules, launch_rules, save_rows  # noqa: E402

CASES = [(d, i, 29) for d, i in SHAPES] + [(2048, 5632, 100)]
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
VARIANTS = {name: lambda rule=rule: launch_rules(out_config=rule) for name, rule in RULES.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    rows = compare_rules(CASES, TOKENS, VARIANTS, keep=lambda d, i, m: m <= G.decode_rows(d, i))
    save_rows(args.json, "decode_out_warps.py", rows)


if __name__ == "__main__":
    main()
