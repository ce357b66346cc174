"""Decode path at 17-64 tokens, launch rules A/B in one process: the whole block through twell.gated_mlp
with the decode path forced at every shape (large layers end it at 16 rows today), under
- before: the gate kernel's up pass at 17-32 rows a K loop of loads masked to active columns; the out
  kernel holding its row's whole TwELL up to 16 rows,
- gate: at 17-32 rows the active columns compacted and read 4 * block_k deep, 4 blocks in flight,
- now: gate, and the out kernel holding the TwELL up to 32 rows (out_config's chunk rule with it),
- up64: now, and the compacted up pass at 33-64 rows too (2 * block_k deep),
against the dense block and the batched path. CUDA-graph replays over 8 layer copies, per layer;
rel. errors against fp32.

    python benchmarks/decode_mid_rows.py --json benchmarks/results/decode_mid_rows_h100.json
"""
import argparse
import importlib
import sys

G = importlib.import_module("twell.gated_mlp")  # the module; twell.gated_mlp is also the function

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_inference import SHAPES, compare_rules, launch_rules, save_rows  # noqa: E402

CASES = [(d, i, 29) for d, i in SHAPES] + [(2048, 5632, 100)]
TOKENS = (17, 24, 32, 48, 64)
gate_now, held_now, rows_now = G.gate_config, G.HELD_ROWS, G.decode_rows  # the rules of today


def gate_before(m, tile, element_size, decode):
    cfg = gate_now(m, tile, element_size, decode)
    if decode and 16 < m <= 32:
        cfg = {k: v for k, v in cfg.items() if k not in ("UP_BK", "UP_STAGES")}
    return cfg


def gate_up64(m, tile, element_size, decode):
    cfg = gate_now(m, tile, element_size, decode)
    if decode and m > 32:
        block_k = 64 if element_size <= 2 else 32
        cfg = dict(cfg, UP_BK=2 * block_k, UP_STAGES=4)
    return cfg


RULES = {"before": (gate_before, 16), "gate": (gate_now, 16), "now": (gate_now, 32), "up64": (gate_up64, 32)}


def rules(gate_config, held_rows, decode_limit):
    return launch_rules(gate_config=gate_config, HELD_ROWS=held_rows, decode_rows=lambda d, i: decode_limit)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    variants = {name: lambda rule=rule, held=held: rules(rule, held, 64) for name, (rule, held) in RULES.items()}
    variants["batched"] = lambda: rules(gate_now, held_now, 0)
    rows = compare_rules(CASES, TOKENS, variants)
    for row in rows:
        row["planned_decode"] = row["M"] <= rows_now(row["D"], row["I"])
    save_rows(args.json, "decode_mid_rows.py", rows)


if __name__ == "__main__":
    main()
