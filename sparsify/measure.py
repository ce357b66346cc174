"""Per-layer statistics of the gate activations on real text, and perplexity.

A forward hook on each MLP's gate projection reads the gate pre-activation (the first half of Phi-3's
fused gate_up_proj); a unit is active for a token when it is > 0. The same hook works on original SiLU
models (where this is the starting point of a conversion) and on converted ReLU ones. Beside per-token
counts it counts active units per (token, tile) for the candidate TwELL tile widths, which decides
whether a packed tile of `twell.slots(tile, compression)` slots overflows (twell.md sections 2 and 5), over
all tokens and over the tokens of at most `twell.format.DENSE_HEAVY_UNITS` active units (large batched
calls run heavier ones through the dense block, where their overflowing tiles cost nothing extra).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from twell import slots
from twell.format import DENSE_HEAVY_UNITS

from .families import FamilySpec, mlp_modules

TILES = (64, 128, 256)
COMPRESSIONS = (2, 4, 8, 16)


def _batches(blocks: list[torch.Tensor], batch_size: int):
    for i in range(0, len(blocks), batch_size):
        yield torch.stack(blocks[i : i + batch_size])


@torch.no_grad()
def perplexity(model, blocks: list[torch.Tensor], batch_size: int = 8) -> float:
    """exp of the mean next-token cross-entropy over all predicted tokens of the blocks."""
    return _forward(model, blocks, batch_size)


def _forward(model, blocks, batch_size) -> float:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for ids in _batches(blocks, batch_size):
        ids = ids.to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
    model.train(was_training)
    return math.exp(total / count)


class _LayerCounter:
    """Accumulates one layer's counts over batches: per-token active counts, per-unit firing counts,
    histograms of per-(token, tile) active counts, and active counts summed per sequence position."""

    def __init__(self):
        self.per_token, self.fired, self.position, self.tile_hist, self.light_hist = [], None, None, {}, {}

    def __call__(self, gate: torch.Tensor):  # gate pre-activation [B, S, I]
        active = gate > 0
        units = active.shape[-1]
        self.units = units
        self.per_token.append(active.sum(-1).flatten().cpu())
        fired = active.flatten(0, 1).sum(0, dtype=torch.int64).cpu()
        self.fired = fired if self.fired is None else self.fired + fired
        position = active.sum(-1, dtype=torch.int64).sum(0).cpu()
        self.position = position if self.position is None else self.position + position
        flat = active.flatten(0, 1)
        light = flat.sum(-1) <= DENSE_HEAVY_UNITS
        for tile in TILES:
            if tile > units:
                continue
            padded = F.pad(flat, (0, -units % tile))  # a partial last tile counts as a tile
            counts = padded.view(flat.shape[0], -1, tile).sum(-1)
            for hists, pairs in ((self.tile_hist, counts.flatten()), (self.light_hist, counts[light].flatten())):
                hist = torch.bincount(pairs.cpu(), minlength=tile + 1)
                hists[tile] = hist if tile not in hists else hists[tile] + hist

    def result(self, sequences: int) -> dict:
        counts = torch.cat(self.per_token).double()
        mean = counts.mean().item()
        tiles = {}
        for tile, hist in self.tile_hist.items():
            cumulative = hist.cumsum(0).double() / hist.sum()
            light = self.light_hist[tile]
            tiles[str(tile)] = {
                "max": int(hist.nonzero().max()),
                "p999": int(torch.searchsorted(cumulative, torch.tensor(0.999, dtype=torch.float64))),
                "overflow_frac": {str(c): hist[slots(tile, c) + 1 :].sum().item() / hist.sum().item() for c in COMPRESSIONS},
                # pairs of the light tokens only, over all pairs
                "overflow_frac_light": {str(c): light[slots(tile, c) + 1 :].sum().item() / hist.sum().item()
                                        for c in COMPRESSIONS},
            }
        return {
            "units": self.units,
            "tokens": counts.numel(),
            "mean_active": mean,
            "median_active": counts.median().item(),
            "p99_active": torch.quantile(counts, 0.99).item(),
            "max_active": int(counts.max()),
            "sparsity": 1 - mean / self.units,
            "dead_frac": (self.fired == 0).double().mean().item(),
            "tiles": tiles,
            "position_active": (self.position.double() / sequences).tolist(),
        }


@contextmanager
def gate_hooks(model, spec: FamilySpec, callbacks: list):
    """While active, each layer's callback gets that layer's gate pre-activation [..., I] at every forward."""
    handles = [
        getattr(mlp, spec.gate_source).register_forward_hook(lambda mod, inp, out, c=c: c(spec.gate_from_output(out)))
        for mlp, c in zip(mlp_modules(model, spec), callbacks)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def measure(model, spec: FamilySpec, blocks: list[torch.Tensor], batch_size: int = 8) -> dict:
    """{"tokens", "perplexity", "layers": [per-layer statistics]} over the blocks (one forward pass).

    Per layer: mean / median / p99 / max active units per token, sparsity (fraction of inactive units),
    dead_frac (units that never fired on this text), per tile width the max and p99.9 of active units
    per (token, tile) and the fraction of (token, tile) pairs overflowing each compression's slots (also
    counting only the pairs of tokens with at most DENSE_HEAVY_UNITS active units), and
    position_active (mean active units at each sequence position)."""
    counters = [_LayerCounter() for _ in mlp_modules(model, spec)]
    with gate_hooks(model, spec, counters):
        ppl = _forward(model, blocks, batch_size)
    return {
        "tokens": sum(b.numel() for b in blocks),
        "perplexity": ppl,
        "layers": [c.result(len(blocks)) for c in counters],
    }
