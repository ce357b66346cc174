"""Per-layer kernel settings from measured statistics (twell.md section 5): a small pure rule that the
kernel work refines with a cost model.

A layer runs dense when it is too active to gain (mean active units per token >= `max_active`: the
authors switch a layer to the sparse kernel only below 50), or when even the widest packing (C = 2)
overflows too often. Otherwise it takes the tile width and compression with the smallest packed width
(largest compression) whose overflow fraction is at most `max_overflow`, the wider tile on ties
(fewer tiles per row, as the authors' T = 256). Overflowing tiles stay correct (dense fallback), but
each costs extra work, hence the threshold.
"""
from __future__ import annotations

MAX_ACTIVE = 50
MAX_OVERFLOW = 1e-3


def plan_layer(stats: dict, *, max_active: float = MAX_ACTIVE, max_overflow: float = MAX_OVERFLOW) -> dict:
    """One layer's {"mode", "tile", "compression", "stats"} from its `measure` statistics."""
    summary = {k: stats[k] for k in ("mean_active", "p99_active", "dead_frac")}
    if stats["mean_active"] < max_active:
        candidates = [
            (int(c), int(tile), overflow)
            for tile, t in stats["tiles"].items()
            for c, overflow in t["overflow_frac"].items()
            if overflow <= max_overflow
        ]
        if candidates:
            compression, tile, overflow = max(candidates, key=lambda x: (x[0], x[1]))
            summary.update(max_tile_active_p999=stats["tiles"][str(tile)]["p999"], overflow_frac=overflow)
            return {"mode": "sparse", "tile": tile, "compression": compression, "stats": summary}
    return {"mode": "dense", "stats": summary}


def plan_layers(layer_stats: list[dict], **thresholds) -> list[dict]:
    """The per-layer plan written to config.json's "twell" section."""
    return [plan_layer(s, **thresholds) for s in layer_stats]


def describe(layer: dict) -> str:
    """Short text of a layer's setting for tables: 'T256 C8' or 'dense'."""
    return f"T{layer['tile']} C{layer['compression']}" if layer["mode"] == "sparse" else "dense"
