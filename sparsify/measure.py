"""Per-layer statistics of the gate activations on real text, and perplexity.

A forward hook on each MLP's gate projection reads the gate pre-activation (the first half of Phi-3's
fused gate_up_proj); a unit is active for a token when it is > 0. The same hook works on original SiLU
models (where this is the starting point of a conversion) and on converted ReLU ones. Beside per-token
counts it counts active units per (token, tile) for the candidate TwELL tile widths, which decides
whether a packed tile of `twell.slots(tile, compression)` slots overflows (the TwELL format), over
all tokens and over the tokens of at most `twell.format.HEAVY_UNITS` active units (batched calls run
heavier ones through the dense block, where their overflowing tiles cost nothing extra).
With `sharded` (a model whose weights FSDP shards over the processes of torch.distributed) every process
runs its share of the batches, as many forwards as the others (FSDP gathers a layer's weights
collectively), and the sums and counts are combined over the processes: each gets the statistics of all
the blocks.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twell import slots
from twell.format import HEAVY_UNITS

from .families import FamilySpec, mlp_modules
from .report import batch_progress

TILES = (64, 128, 256)
COMPRESSIONS = (2, 4, 8, 16)


def _batches(blocks: list[torch.Tensor], batch_size: int, sharded: bool = False):
    """(batch, counted) pairs: all batches of `blocks`, or with `sharded` this process's share (batches
    rank, rank + world, ...), padded with uncounted repeats of the first so that every process runs the
    same number of forwards."""
    batches = [torch.stack(blocks[i : i + batch_size]) for i in range(0, len(blocks), batch_size)]
    if not sharded:
        yield from ((batch, True) for batch in batches)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    for i in range(rank, -(-len(batches) // world) * world, world):
        yield (batches[i], True) if i < len(batches) else (batches[0], False)


@torch.no_grad()
def perplexity(model, blocks: list[torch.Tensor], batch_size: int = 8, sharded: bool = False,
               label: str | None = None) -> float:
    """exp of the mean next-token cross-entropy over all predicted tokens of the blocks; `label`: show a
    progress bar with it (on the first process)."""
    return _forward(model, blocks, batch_size, sharded, label=label)


def _forward(model, blocks, batch_size, sharded=False, counters=(), label=None) -> float:
    """Perplexity over the blocks; `counters` (gate hooks' callbacks) count only the counted batches."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # cross-entropy, predicted tokens
    batches = list(_batches(blocks, batch_size, sharded))
    shown = label is not None and (not sharded or dist.get_rank() == 0)
    for ids, counted in batch_progress(batches, label) if shown else batches:
        for counter in counters:
            counter.enabled = counted
        ids = ids.to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        if counted:
            sums[0] += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
            sums[1] += ids[:, 1:].numel()
    if sharded:
        dist.all_reduce(sums)
    model.train(was_training)
    return math.exp((sums[0] / sums[1]).item())


class LayerCounter:
    """Accumulates one layer's counts over batches: per-token active counts, per-unit firing counts,
    histograms of per-(token, tile) active counts, and active counts summed per sequence position."""

    def __init__(self):
        self.per_token, self.fired, self.position, self.tile_hist, self.light_hist = [], None, None, {}, {}
        self.units, self.enabled = None, True

    def __call__(self, gate: torch.Tensor):  # gate pre-activation [B, S, I]
        if not self.enabled:
            return
        active = gate > 0
        units = active.shape[-1]
        self.units = units
        self.per_token.append(active.sum(-1).flatten().cpu())
        fired = active.flatten(0, 1).sum(0, dtype=torch.int64).cpu()
        self.fired = fired if self.fired is None else self.fired + fired
        position = active.sum(-1, dtype=torch.int64).sum(0).cpu()
        self.position = position if self.position is None else self.position + position
        flat = active.flatten(0, 1)
        light = flat.sum(-1) <= HEAVY_UNITS
        for tile in TILES:
            if tile > units:
                continue
            padded = F.pad(flat, (0, -units % tile))  # a partial last tile counts as a tile
            counts = padded.view(flat.shape[0], -1, tile).sum(-1)
            for hists, pairs in ((self.tile_hist, counts.flatten()), (self.light_hist, counts[light].flatten())):
                hist = torch.bincount(pairs.cpu(), minlength=tile + 1)
                hists[tile] = hist if tile not in hists else hists[tile] + hist

    def merge(self, other: "LayerCounter"):
        """Adds another process's counts of the same layer."""
        self.per_token += other.per_token
        self.fired, self.position = _add(self.fired, other.fired), _add(self.position, other.position)
        for mine, theirs in ((self.tile_hist, other.tile_hist), (self.light_hist, other.light_hist)):
            for tile, hist in theirs.items():
                mine[tile] = _add(mine.get(tile), hist)
        self.units = self.units or other.units

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
                "overflow_frac": {str(c): hist[slots(tile, c) + 1 :].sum().item() / hist.sum().item()
                                  for c in COMPRESSIONS},
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


def _add(a, b):
    return b if a is None else a if b is None else a + b


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
def measure(model, spec: FamilySpec, blocks: list[torch.Tensor], batch_size: int = 8, sharded: bool = False,
            label: str | None = None) -> dict:
    """{"tokens", "perplexity", "layers": [per-layer statistics]} over the blocks (one forward pass).

    Per layer: mean / median / p99 / max active units per token, sparsity (fraction of inactive units),
    dead_frac (units that never fired on this text), per tile width the max and p99.9 of active units
    per (token, tile) and the fraction of (token, tile) pairs overflowing each compression's slots (also
    counting only the pairs of tokens with at most HEAVY_UNITS active units), and
    position_active (mean active units at each sequence position). `sharded`: see the module docstring;
    `label`: as for perplexity."""
    counters = [LayerCounter() for _ in mlp_modules(model, spec)]
    with gate_hooks(model, spec, counters):
        ppl = _forward(model, blocks, batch_size, sharded, counters, label)
    if sharded:  # every process's counters, in rank order, merged on each
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, counters)
        counters = gathered[0]
        for other in gathered[1:]:
            for counter, theirs in zip(counters, other):
                counter.merge(theirs)
    return {
        "tokens": sum(b.numel() for b in blocks),
        "perplexity": ppl,
        "layers": [c.result(len(blocks)) for c in counters],
    }
