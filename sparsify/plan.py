"""Per-layer kernel settings from measured statistics (twell.md section 5), through a cost model.

The model is `twell.choose_setting`'s (rates fitted to the H100 block benchmark at tile 128,
compression 8: dense cuBLAS block, Triton gate matmul + packing epilogue per active unit, L2 gathers of
up and down rows), refined with the two costs that its inputs leave out and `measure` gives per
(tile, compression):
- overflow: an overflowing (token, tile) is recomputed densely in the fallback (T gate rows, 2 * T * D
  bytes, at the gather rate), so a fraction f of overflowing pairs costs f * 2 * D * I bytes per token;
- packed width: values (2 B) and indices (4 B) of I / C slots per token are written and read once; the
  difference to the fitted C = 8 goes at HBM speed.
Every measured (tile, compression) gets a predicted speed-up over the dense block at `tokens` tokens
(default: a 16k-token prefill, the regime the fit and the paper's benchmark use); the best one runs if it
beats dense by `min_speedup`, otherwise the layer runs dense. `measure` counts a tile as overflowing
above the kernel's T / C slots (`twell.slots`). `sparsify.tune.measure_plan` replaces the prediction by timings on a GPU.
"""
from __future__ import annotations

from twell.format import DENSE_FLOPS, GATE_FLOPS, EPILOGUE_S, GATHER_BYTES, choose_setting

TOKENS = 16384
FITTED_COMPRESSION, FITTED_TILE = 8, 128
HBM_BYTES = 3.0e12      # H100 device copy (benchmarks.md)
PACKED_ENTRY_BYTES = 12  # a bf16 value and an int32 index, written once and read once
LLAMA_RATIO = 2.75      # I / D of the paper's models, used when the caller gives no hidden size


def predicted_speedup(mean_active: float, overflow_frac: float, compression: int, d: int, i: int,
                      tokens: int = TOKENS) -> float:
    """Dense block time over TwELL block time predicted for one layer setting."""
    if tokens <= 64:  # decode: memory-bound; packed width and fallback are negligible next to the weights
        return choose_setting(mean_active, 0, d, i, tokens)["predicted_speedup"]
    dense = 6 * tokens * d * i / DENSE_FLOPS
    sparse = 2 * tokens * d * i / GATE_FLOPS + tokens * mean_active * (EPILOGUE_S + 4 * d / GATHER_BYTES)
    sparse += tokens * overflow_frac * 2 * d * i / GATHER_BYTES
    sparse += tokens * PACKED_ENTRY_BYTES * i * (1 / compression - 1 / FITTED_COMPRESSION) / HBM_BYTES
    return dense / sparse


def plan_layer(stats: dict, *, hidden_size: int | None = None, tokens: int = TOKENS,
               min_speedup: float = 1.0) -> dict:
    """One layer's {"mode", "tile", "compression", "stats"} from its `measure` statistics."""
    units = stats["units"]
    d = hidden_size or round(units / LLAMA_RATIO)
    summary = {k: stats[k] for k in ("mean_active", "p99_active", "dead_frac")}
    candidates = [
        (round(predicted_speedup(stats["mean_active"], overflow, int(c), d, units, tokens), 3), int(tile), int(c))
        for tile, t in stats["tiles"].items()
        for c, overflow in t["overflow_frac"].items()
    ]
    if not candidates:  # I narrower than the smallest measured tile
        return {"mode": "dense", "stats": summary}
    # ties (no overflow anywhere): the tile the rates were fitted at, then the narrower packing
    speedup, tile, compression = max(candidates, key=lambda s: (s[0], s[1] == FITTED_TILE, s[2]))
    summary["predicted_speedup"] = speedup
    if speedup <= min_speedup:
        return {"mode": "dense", "stats": summary}
    t = stats["tiles"][str(tile)]
    summary.update(max_tile_active_p999=t["p999"], overflow_frac=t["overflow_frac"][str(compression)])
    return {"mode": "sparse", "tile": tile, "compression": compression, "stats": summary}


def plan_layers(layer_stats: list[dict], **options) -> list[dict]:
    """The per-layer plan written to config.json's "twell" section (options: those of `plan_layer`)."""
    return [plan_layer(s, **options) for s in layer_stats]


def describe(layer: dict) -> str:
    """Short text of a layer's setting for tables: 'T256 C8' or 'dense'."""
    return f"T{layer['tile']} C{layer['compression']}" if layer["mode"] == "sparse" else "dense"


def plan_model(model, spec, stats: dict, blocks, *, measure_kernels: bool = False, device=None) -> list[dict]:
    """The plan of a measured model: by the cost model from `stats` (measure's output), or with
    `measure_kernels` by timing each layer's candidates on the GPU over `blocks` (sparsify.tune)."""
    if measure_kernels:
        from .tune import measure_plan

        return measure_plan(model, spec, blocks, device=device)
    return plan_layers(stats["layers"], hidden_size=model.config.hidden_size)
