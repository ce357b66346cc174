"""Where the block's time goes between decode and batched sizes (16-512 tokens): the dense block, cuBLAS's
gate matmul alone, twell.gated_mlp as planned today, and the decode path forced beyond its rows (the gate
kernel fuses up for its tile's active units, the out kernel only gathers down rows), each split into its
gate launch and out launch. Also the bytes floor: the gate matrix plus the up and down rows of the units
active in any row, at 3 TB/s. CUDA-graph replays over 8 layer copies, per layer; rel. errors against fp32.

    python benchmarks/mid_rows_probe.py --json benchmarks/results/mid_rows_h100.json
"""
import argparse
import importlib
import sys

G = importlib.import_module("twell.gated_mlp")  # the module; twell.gated_mlp is also the function

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_inference import (  # noqa: E402
    LAYERS, dense, launch_rules, make_layer, make_x, per_layer_us, plan_launches, print_row, reference, rel_err,
    save_rows, sparse)

SHAPES = ((2048, 5632), (4096, 14336))
TOKENS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
HBM = 3.0e12



def decode_forced():
    """The decode path at any row count: gate row blocks of at most 64 rows."""
    config = G.gate_config
    return launch_rules(decode_rows=lambda d, i: 1 << 30,
                        gate_config=lambda m, tile, element_size, decode: config(min(m, 64), tile, element_size,
                                                                                 decode))


def launches_us(x, layers):
    """The plan's gate launch and out launch, each timed alone over the layer copies."""
    gate, out = plan_launches(x, layers)
    return per_layer_us(gate, layers), per_layer_us(out, layers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    rows = []
    for d, i in SHAPES:
        layers = [make_layer(d, i, 29) for _ in range(LAYERS)]
        for m in TOKENS:
            x = make_x(m, d)
            ref = reference(x, layers[0])
            g = x @ layers[0]["gate"].t()
            union = int((g > 0).any(0).sum())
            row = dict(D=d, I=i, M=m, union_units=union, mean_active=(g > 0).sum(1).float().mean().item(),
                       floor_us=(2 * d * i + 4 * d * union) / HBM * 1e6,
                       dense_us=per_layer_us(lambda lw: dense(x, lw), layers),
                       cublas_gate_us=per_layer_us(lambda lw: x @ lw["gate"].t(), layers),
                       planned_decode=m <= G.decode_rows(d, i),
                       err_now=rel_err(sparse(x, layers[0], 128, 8), ref),
                       now_us=per_layer_us(lambda lw: sparse(x, lw, 128, 8), layers))
            row["now_gate_us"], row["now_out_us"] = launches_us(x, layers)
            with decode_forced():
                row["err_decode"] = rel_err(sparse(x, layers[0], 128, 8), ref)
                row["decode_us"] = per_layer_us(lambda lw: sparse(x, lw, 128, 8), layers)
                row["decode_gate_us"], row["decode_out_us"] = launches_us(x, layers)
            print_row(row)
            rows.append(row)
    save_rows(args.json, "mid_rows_probe.py", rows)


if __name__ == "__main__":
    main()
