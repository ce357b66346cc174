"""Per-layer kernel plans (`twell.layer_plan.LayerPlan`), by either of two planners:

- `plan_layers`: from `measure`'s statistics through twell's H100 cost model (`twell.cost_model`), plus the
  costs its inputs leave out and `measure` gives per (tile, compression): overflow (an overflowing (token,
  tile) is recomputed densely, so a fraction f of overflowing pairs costs f * 2 * D * I bytes a token at the
  gather rate; batched, only the pairs of tokens light enough to be walked count, the heavier ones go to the
  dense block of heavy rows whole) and the heaviest token (`max_active`). The compression costs nothing
  else: the kernels write and read only a tile's used slots. Every measured (tile, compression) gets a
  predicted speed-up over dense at `tokens` tokens (default: a 16k-token prefill); the best is the setting.
  A layer narrower than the shapes the model was fitted to is dense: its predictions would be extrapolations.
- `measure_plan` (`--measure`, CUDA): from timings of each layer's own weights and captured inputs
  (`sparsify.tune`): the fastest candidate whose error stays within the dense bf16 path's bound.

The speed-up depends on the token count (decode is memory-bound and wins most; a few hundred tokens can lose
on narrow layers, where the kernels' fixed latencies weigh most), so each planner also judges its setting at
a grid of token counts: "sparse_tokens" holds the ranges [lo, hi] (hi None: no bound) where it wins, with
boundaries halfway (geometrically) between the judged counts. A layer with no such range is dense.
"""
from __future__ import annotations

from math import exp, isqrt, log

import torch

from twell.cost_model import FITTED_MIN_HIDDEN, FITTED_MIN_INTERMEDIATE, GATHER, dense_time, twell_time
from twell.decode import DECODE_TILE
from twell.format import decode_rows, decode_slots
from twell.layer_plan import LayerPlan, Mode

from .errors import ConfigError
from .families import FamilySpec, down_weight, gate_weight, has_bias, mlp_modules, up_weight
from .load import require_cuda
from .tune import CANDIDATES, TOKENS, activity, capture_mlp_inputs, time_layer, time_window

# token counts the cost model judges a setting at: decode steps of a few sequences, both sides of the decode
# path's ends (16 or 64 rows), then prefills
TOKEN_GRID = (1, 2, 4, 8, 16, 17, 32, 64, 65, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 16384)
FITTED_TILE = 128  # the tile the cost model's main grids were measured at: ties go to it
LLAMA_RATIO = 2.75  # I / D of the paper's models, used when the caller gives no hidden size


def overflow_at(tile_stats: dict, tile: int, compression: int, batched: bool) -> float:
    """The share of (token, tile) pairs that overflow and are recomputed in a batched or a decode call
    (statistics measured before the light-token split: all pairs). A decode tile holds at most DECODE_SLOTS
    of its min(tile, DECODE_TILE) units, the density of a `tile` tile at compression max(compression,
    min(tile, DECODE_TILE) // DECODE_SLOTS), whose share is the one read for decode."""
    if batched:
        light = "overflow_frac_light" in tile_stats
        return tile_stats["overflow_frac_light" if light else "overflow_frac"][str(compression)]
    decode_tile = min(tile, DECODE_TILE)
    return tile_stats["overflow_frac"][str(decode_tile // decode_slots(decode_tile, compression))]


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


def _setting(tile: int, compression: int, sparse_tokens: list[list], stats: dict) -> LayerPlan:
    """Sparse at its token ranges, or dense (keeping the stats) where there are none."""
    if not sparse_tokens:
        return LayerPlan(stats=stats)
    return LayerPlan(Mode.SPARSE, tile, compression, sparse_tokens, stats)


def outside_cost_model(hidden_size: int, intermediate_size: int) -> bool:
    """Whether a layer is narrower than the shapes the cost model was fitted to (its plan by the model is
    dense: its predictions would be extrapolations)."""
    return hidden_size < FITTED_MIN_HIDDEN or intermediate_size < FITTED_MIN_INTERMEDIATE


def measured_by_default(hidden_size: int, intermediate_size: int, device) -> bool:
    """Whether `convert` times the kernel settings unasked: on a CUDA GPU, where the cost model does not
    cover the layer shape."""
    on_gpu = torch.device(device or "cuda").type == "cuda" and torch.cuda.is_available()
    return on_gpu and outside_cost_model(hidden_size, intermediate_size)


def choose_measure(asked: bool | None, model_config, device: str | None, say=None) -> bool:
    """Whether `convert` and `analyze` plan by timing the kernels: as asked, else measured_by_default, which
    `say` (a print function, or None) is told."""
    if asked is not None:
        return asked
    d, units = model_config.hidden_size, model_config.intermediate_size
    if not measured_by_default(d, units, device):
        return False
    if say:
        say(f"planning by timing the kernels on this GPU: layers of D {d} / I {units} are narrower than the cost "
            f"model's shapes (--no-measure: plan them dense)")
    return True


def plan_layer(stats: dict, *, hidden_size: int | None = None, tokens: int = TOKENS,
               min_speedup: float = 1.0) -> LayerPlan:
    """One layer's plan from its `measure` statistics, by the cost model."""
    units = stats["units"]
    d = hidden_size or round(units / LLAMA_RATIO)
    summary = {k: stats[k] for k in ("mean_active", "p99_active", "max_active", "dead_frac") if k in stats}
    if outside_cost_model(d, units):
        return LayerPlan(stats=summary | {"reason": (
            f"D {d} / I {units} is narrower than the cost model's shapes (from D {FITTED_MIN_HIDDEN} / I "
            f"{FITTED_MIN_INTERMEDIATE}): on a GPU, convert and analyze time the kernels at any width instead "
            "(--measure)")})
    heaviest = stats.get("max_active")

    def speedup_at(n: int, tile: int, compression: int) -> float:
        overflow = overflow_at(stats["tiles"][str(tile)], tile, compression, n > decode_rows(d, units))
        return predicted_speedup(stats["mean_active"], overflow, tile, d, units, n, heaviest)

    def across_sizes(tile: int, compression: int) -> float:
        """Geometric mean speed-up over the grid, in 1% steps: decode tiles overflow where a prefill's do not."""
        return round(exp(sum(log(speedup_at(n, tile, compression)) for n in TOKEN_GRID) / len(TOKEN_GRID)), 2)

    candidates = [(round(speedup_at(tokens, int(tile), int(c)), 3), int(tile), int(c))
                  for tile, t in stats["tiles"].items() for c in t["overflow_frac"]]
    if not candidates:  # I narrower than the smallest measured tile
        return LayerPlan(stats=summary)
    # among the fastest: the setting faster across call sizes, the main grids' tile, then the narrower packing
    # (compressions cost the same without overflow)
    best = max(s[0] for s in candidates)
    speedup, tile, compression = max((s for s in candidates if s[0] == best),
                                     key=lambda s: (across_sizes(s[1], s[2]), s[1] == FITTED_TILE, s[2]))
    t = stats["tiles"][str(tile)]
    summary.update(predicted_speedup=speedup, max_tile_active_p999=t["p999"],
                   overflow_frac=t["overflow_frac"][str(compression)])
    ranges = token_ranges([(n, speedup_at(n, tile, compression) > min_speedup) for n in TOKEN_GRID])
    return _setting(tile, compression, ranges, summary)


def plan_layers(layer_stats: list[dict], **options) -> list[LayerPlan]:
    """The cost model's plan of every layer (options: those of `plan_layer`)."""
    return [plan_layer(s, **options) for s in layer_stats]


def fastest_correct(results: dict):
    """(ms, (tile, compression)) of the fastest candidate within the error bound, or None."""
    return min(((r["ms"], key) for key, r in results.items() if key != "dense" and r["ok"]), default=None)


def timed_layer_plan(activity_stats: dict, results: dict, window: list[dict], tokens: int = TOKENS) -> LayerPlan:
    """The plan from `tune.time_layer`'s results (timed at `tokens` rows) and `tune.time_window`'s for the
    fastest correct candidate: that setting, at the token counts where it beat dense; dense without one."""
    dense = results["dense"]
    stats = {**activity_stats, "dense_ms": round(dense["ms"], 4), "dense_rel_err": dense["rel_err"]}
    best = fastest_correct(results)
    if best is None:
        return LayerPlan(stats=stats)
    ms, (tile, compression) = best
    r = results[(tile, compression)]
    stats.update(sparse_ms=round(ms, 4), measured_speedup=round(dense["ms"] / ms, 3), rel_err=r["rel_err"],
                 overflow_frac=r["overflow_frac"],
                 window=[[w["tokens"], round(w["dense_ms"], 4), round(w["sparse_ms"], 4)] for w in window])
    wins = [(w["tokens"], w["ok"] and w["sparse_ms"] < w["dense_ms"]) for w in window] + [(tokens, ms < dense["ms"])]
    return _setting(tile, compression, token_ranges(wins), stats)


def measure_plan(model, spec: FamilySpec, inputs, candidates=CANDIDATES, device="cuda", *,
                 tokens: int = TOKENS, mlp_inputs: list[torch.Tensor] | None = None) -> list[LayerPlan]:
    """Every layer's plan from timings: `inputs` are token-id blocks (held-out text), `candidates`
    (tile, compression) pairs tried beside dense on every layer. The model must be on the CUDA device,
    unless `mlp_inputs` (capture_mlp_inputs of the model, e.g. run sharded) are given: then each layer's
    weights are copied to the GPU in turn."""
    device = require_cuda(device, "--measure")
    if mlp_inputs is None and next(model.parameters()).device.type != "cuda":
        raise ConfigError("--measure: the model must be on the CUDA GPU")
    xs = mlp_inputs if mlp_inputs is not None else capture_mlp_inputs(model, spec, inputs, tokens)
    plan = []
    for mlp, x in zip(mlp_modules(model, spec), xs):
        weights = [w.detach().to(device, torch.bfloat16).contiguous()
                   for w in (gate_weight(mlp, spec), up_weight(mlp, spec), down_weight(mlp, spec))]
        x = x.to(device, torch.bfloat16)
        if has_bias(mlp, spec):  # the kernels take no bias: such layers run dense
            plan.append(LayerPlan(stats=activity(x, weights[0])))
            continue
        results = time_layer(x, *weights, candidates)
        best = fastest_correct(results)
        window = [] if best is None else time_window(x, *weights, *best[1])
        plan.append(timed_layer_plan(activity(x, weights[0]), results, window, tokens))
    return plan


def plan_model(model, spec, stats: dict, blocks, *, measure_kernels: bool = False, device=None,
               mlp_inputs=None) -> list[LayerPlan]:
    """The plan of a measured model: by the cost model from `stats` (measure's output), or with
    `measure_kernels` by timing each layer's candidates on the GPU over `blocks` (or the layers' captured
    `mlp_inputs`)."""
    if measure_kernels:
        return measure_plan(model, spec, blocks, device=device, mlp_inputs=mlp_inputs)
    return plan_layers(stats["layers"], hidden_size=model.config.hidden_size)
