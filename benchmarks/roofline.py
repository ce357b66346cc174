"""Roofline of a model_bench run: per component, what a call must move and compute, and how close its measured
time comes to the GPU's limit.

Reads a model_bench JSON (the model's shape, each row's profiler breakdown: GPU ms per component) and, for the
decode step and the prefill rows, counts per component the bytes (bf16 weights read once a call, activations
read and written once, the decode context's KV cache) and the FLOPs (2 a multiply-add; causal attention half the
square). The bound of a component is max(bytes / peak bandwidth, FLOPs / peak bf16 throughput); its share is
bound / measured time. The TwELL MLP reads the gate whole and the up and down rows of each token's active units
(the run's mean; at most the whole matrices), so its bound is the sparse format's, not the dense one's.
model_bench's model has no grouped-query attention (k and v as wide as q).

    python benchmarks/roofline.py benchmarks/results/model_bench_k29_28layers_fused_h200.json --json out.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# Spec-sheet peaks: HBM bandwidth (bytes/s) and dense bf16 tensor throughput (FLOP/s), by device name.
PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12)}
BF16 = 2
COMPONENTS = ("attention", "mlp", "norm", "lm_head")


def peaks(device: str) -> tuple[float, float]:
    for name, peak in PEAKS.items():
        if name in device:
            return peak
    raise SystemExit(f"no peak figures for {device!r}: add it to PEAKS ({', '.join(PEAKS)})")


def counts(shape: dict, vocab: int, batch: int, seq: int, context: int, active: float, twell: bool,
           lm_head: bool) -> dict[str, tuple[float, float]]:
    """(bytes, FLOPs) per component of one call over `batch` x `seq` new tokens after `context` cached ones."""
    d, i, layers = shape["hidden"], shape["intermediate"], shape["layers"]
    tokens = batch * seq
    kv_read = 2 * batch * context * d * BF16  # the cached keys and values of the decode context
    attention_flops = 8 * tokens * d * d + 4 * batch * d * (seq * context + seq * seq / 2)
    attention = (4 * d * d * BF16 + kv_read + 4 * tokens * d * BF16, attention_flops)
    if twell:  # gate whole; up and down rows of each token's active units, at most the whole matrices
        mlp = (d * i * BF16 + 2 * min(tokens * active, i) * d * BF16 + 2 * tokens * d * BF16,
               2 * tokens * d * i + 4 * tokens * active * d)
    else:
        mlp = (3 * d * i * BF16 + 2 * tokens * (d + i) * BF16, 6 * tokens * d * i)
    norm = (2 * 2 * tokens * d * BF16, 0.0)  # two norms a layer, each reads and writes the hidden state
    per_layer = {"attention": attention, "mlp": mlp, "norm": norm}
    result = {k: (layers * b, layers * f) for k, (b, f) in per_layer.items()}
    result["lm_head"] = (vocab * d * BF16, 2 * batch * vocab * d) if lm_head else (0.0, 0.0)
    return result


def row_table(row: dict, shape: dict, vocab: int, context: int, active: float, device: str) -> dict:
    bandwidth, throughput = peaks(device)
    decode = row["path"].startswith("decode")
    batch, seq = (row["batch"], 1) if decode else (row["batch"], row["length"])
    table = {}
    for load in ("dense", "twell"):
        breakdown = row["breakdown"][load]
        load_counts = counts(shape, vocab, batch, seq, context if decode else 0, active, load == "twell", decode)
        parts = {}
        for component in COMPONENTS:
            byte_count, flops = load_counts[component]
            ms = breakdown[f"{component}_ms"]
            if not byte_count or not ms:
                continue
            bound_ms = 1e3 * max(byte_count / bandwidth, flops / throughput)
            parts[component] = {"ms": round(ms, 3), "bytes": byte_count, "flops": flops,
                                "bandwidth_tb_s": round(byte_count / ms / 1e9, 2),
                                "tflop_s": round(flops / ms / 1e9, 1),
                                "bound_ms": round(bound_ms, 3), "share_of_bound": round(bound_ms / ms, 3)}
        total_bound = sum(p["bound_ms"] for p in parts.values())
        table[load] = {"wall_ms": round(breakdown["wall_ms"], 3), "components": parts,
                       "bound_ms": round(total_bound, 3),
                       "share_of_bound": round(total_bound / breakdown["wall_ms"], 3)}
    return {"path": row["path"], "batch": batch, "tokens_per_sequence": seq, **table}


def markdown(rows: list[dict]) -> str:
    lines = ["| call | component | load | ms | bytes (MB) | GFLOP | TB/s | TFLOP/s | bound ms | share of bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        call = f"{row['path']} {row['batch']} x {row['tokens_per_sequence']}"
        for component in (*COMPONENTS, "total"):
            for load in ("dense", "twell"):
                part = row[load] if component == "total" else row[load]["components"].get(component)
                if part is None:
                    continue
                ms = part.get("ms", part.get("wall_ms"))
                figures = ([f"{part['bytes'] / 1e6:.0f}", f"{part['flops'] / 1e9:.0f}", f"{part['bandwidth_tb_s']}",
                            f"{part['tflop_s']}"] if component != "total" else ["", "", "", ""])
                lines.append(f"| {call} | {component} | {load} | {ms} | " + " | ".join(figures)
                             + f" | {part['bound_ms']} | {100 * part['share_of_bound']:.0f}% |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", type=Path, help="a model_bench JSON")
    ap.add_argument("--json", type=Path, help="write the table here")
    ap.add_argument("--vocab", type=int, default=32000, help="the model's vocabulary (model_bench's default)")
    args = ap.parse_args(argv)
    bench = json.loads(args.bench.read_text())
    active = bench["mean_active_all_layers"]
    rows = [row_table(row, bench["shape"], args.vocab, bench["decode_context"], active, bench["device"])
            for row in bench["rows"]
            if row["path"] in ("decode_step_graph", "prefill") and row.get("breakdown")]
    result = {"source": args.bench.name, "device": bench["device"], "peaks": dict(zip(("bytes_s", "flop_s"),
              peaks(bench["device"]))), "mean_active": active, "rows": rows}
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
