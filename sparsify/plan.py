"""Per-layer kernel settings from measured statistics (twell.md section 5), through a cost model.

The model is `twell.format`'s (dense_time, twell_time: roofline terms and latencies fitted to the H100 block
benchmark; the batched gate kernel's rates depend on the tile width, and at tile 128 on an H100 a faster
kernel runs from 4 output tiles an SM), refined with the costs that its inputs leave out and `measure`
gives per (tile, compression):
- overflow: an overflowing (token, tile) is recomputed densely in the fallback (T gate rows, 2 * T * D
  bytes, at the L2 gather rate), so a fraction f of overflowing pairs costs f * 2 * D * I bytes per token
  (batched, only the pairs of tokens light enough to be walked: the heavier ones go through the dense
  block whole) (the compression costs nothing else: the kernels write and read only a tile's used slots;
  benchmarks/results/inference_tiles_h100.json, compressions 4, 8 and 16 alike where none overflows);
- the heaviest token (`max_active`): the batched out kernel walks a row in one program; a row above
  `twell.format.HEAVY_UNITS` (a sequence's first token often is one) goes to the dense block of heavy rows
  instead (twell.format.twell_time).
Every measured (tile, compression) gets a predicted speed-up over the dense block at `tokens` tokens
(default: a 16k-token prefill, the regime of the paper's benchmark); the best one is the layer's setting.
The speed-up depends on the token count (decode is memory-bound and wins most; a few hundred tokens can
lose on narrow layers, where the kernels' fixed latencies weigh most), so the plan also records
"sparse_tokens": the token-count ranges [lo, hi] (hi None: no bound) in which the setting beats dense by
`min_speedup`, judged at the points of TOKEN_GRID with boundaries halfway (geometrically) between them.
The modeling file runs the kernels only there; a layer with no such range is "dense". A layer narrower
than the shapes the model was fitted to (twell.format.FITTED_MIN_*) is "dense" too: its predictions would be
extrapolations. `measure` counts a tile as overflowing above the kernel's T / C slots (`twell.slots`).
`sparsify.tune.measure_plan` replaces the predictions by timings on a GPU (any width).
"""
from __future__ import annotations

from math import isqrt

from twell.format import FITTED_MIN_HIDDEN, FITTED_MIN_INTERMEDIATE, GATHER, decode_rows, dense_time, twell_time

TOKENS = 16384
# token counts the window is judged at: both sides of the decode path's ends (16 or 64 rows), then prefills
TOKEN_GRID = (1, 4, 16, 17, 32, 64, 65, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 16384)
FITTED_TILE = 128  # the tile the main grids were measured at: ties go to it
LLAMA_RATIO = 2.75      # I / D of the paper's models, used when the caller gives no hidden size


def overflow_at(tile_stats: dict, compression: int, batched: bool) -> float:
    """The share of (token, tile) pairs that overflow and are recomputed in a batched or a decode call
    (statistics measured before the light-token split: all pairs)."""
    light = batched and "overflow_frac_light" in tile_stats
    return tile_stats["overflow_frac_light" if light else "overflow_frac"][str(compression)]


def predicted_speedup(mean_active: float, overflow_frac: float, tile: int, d: int, i: int,
                      tokens: int = TOKENS, max_active: float | None = None) -> float:
    """Dense block time over TwELL block time predicted for one layer setting (`max_active`: the
    heaviest token's active count)."""
    sparse = twell_time(mean_active, d, i, tokens, max_active, tile)
    # overflow: the batched fallback recomputes the tile; decode reads its h densely and all its down rows,
    # about the same bytes
    sparse += tokens * overflow_frac * 2 * d * i / GATHER[0]
    return dense_time(d, i, tokens) / sparse


def token_ranges(wins: list[tuple[int, bool]]) -> list[list]:
    """[lo, hi] token-count ranges (hi None: unbounded) from (tokens, sparse wins) verdicts sorted by
    tokens; a range ends halfway (geometric mean, rounded down) to the next point with the other verdict."""
    ranges = []
    for n, (tokens, win) in enumerate(wins):
        if not win:
            continue
        lo = 1 if n == 0 else isqrt(wins[n - 1][0] * tokens) + 1
        hi = None if n == len(wins) - 1 else isqrt(tokens * wins[n + 1][0])
        if ranges and ranges[-1][1] == lo - 1:  # the previous point won too: extend its range
            ranges[-1][1] = hi
        else:
            ranges.append([lo, hi])
    return ranges


def plan_layer(stats: dict, *, hidden_size: int | None = None, tokens: int = TOKENS,
               min_speedup: float = 1.0) -> dict:
    """One layer's {"mode", "tile", "compression", "sparse_tokens", "stats"} from its `measure` statistics."""
    units = stats["units"]
    d = hidden_size or round(units / LLAMA_RATIO)
    summary = {k: stats[k] for k in ("mean_active", "p99_active", "max_active", "dead_frac") if k in stats}
    if d < FITTED_MIN_HIDDEN or units < FITTED_MIN_INTERMEDIATE:
        return {"mode": "dense", "stats": summary | {"reason": (
            f"D {d} / I {units} is narrower than the cost model's shapes (from D {FITTED_MIN_HIDDEN} / I "
            f"{FITTED_MIN_INTERMEDIATE}): --measure times the kernels at any width")}}
    heaviest = stats.get("max_active")
    candidates = [
        (round(predicted_speedup(stats["mean_active"], overflow_at(t, int(c), tokens > decode_rows(d, units)),
                                 int(tile), d, units, tokens, heaviest), 3), int(tile), int(c))
        for tile, t in stats["tiles"].items()
        for c in t["overflow_frac"]
    ]
    if not candidates:  # I narrower than the smallest measured tile
        return {"mode": "dense", "stats": summary}
    # ties: the main grids' tile, then the narrower packing (compressions cost the same without overflow)
    speedup, tile, compression = max(candidates, key=lambda s: (s[0], s[1] == FITTED_TILE, s[2]))
    t = stats["tiles"][str(tile)]
    summary.update(predicted_speedup=speedup, max_tile_active_p999=t["p999"],
                   overflow_frac=t["overflow_frac"][str(compression)])
    ranges = token_ranges([(n, predicted_speedup(stats["mean_active"], overflow_at(t, compression, n > decode_rows(d, units)),
                                                 tile, d, units, n, heaviest) > min_speedup) for n in TOKEN_GRID])
    return layer_setting(tile, compression, ranges, summary)


def layer_setting(tile: int, compression: int, sparse_tokens: list[list], stats: dict) -> dict:
    """A plan entry: sparse with its token ranges, or dense (keeping the stats) where there are none."""
    if not sparse_tokens:
        return {"mode": "dense", "stats": stats}
    return {"mode": "sparse", "tile": tile, "compression": compression, "sparse_tokens": sparse_tokens,
            "stats": stats}


def plan_layers(layer_stats: list[dict], **options) -> list[dict]:
    """The per-layer plan written to config.json's "twell" section (options: those of `plan_layer`)."""
    return [plan_layer(s, **options) for s in layer_stats]


def describe(layer: dict) -> str:
    """Short text of a layer's setting for tables: 'T256 C8', 'T128 C8 at 1-64, 700+', 'dense', or '-' for
    none (mode None)."""
    if layer["mode"] is None:
        return "-"
    if layer["mode"] != "sparse":
        return "dense"
    ranges = layer.get("sparse_tokens", [[1, None]])
    where = "" if ranges == [[1, None]] else " at " + ", ".join(
        f"{lo}+" if hi is None else f"{lo}-{hi}" for lo, hi in ranges)
    return f"T{layer['tile']} C{layer['compression']}{where}"


def plan_model(model, spec, stats: dict, blocks, *, measure_kernels: bool = False, device=None,
               mlp_inputs=None) -> list[dict]:
    """The plan of a measured model: by the cost model from `stats` (measure's output), or with
    `measure_kernels` by timing each layer's candidates on the GPU over `blocks` (or the layers' captured
    `mlp_inputs`; sparsify.tune)."""
    if measure_kernels:
        from .tune import measure_plan

        return measure_plan(model, spec, blocks, device=device, mlp_inputs=mlp_inputs)
    return plan_layers(stats["layers"], hidden_size=model.config.hidden_size)
