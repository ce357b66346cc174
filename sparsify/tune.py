"""`--measure`: the per-layer plan from timings on the GPU instead of the cost model.

Each layer's MLP input is captured (forward pre-hook) on held-out token blocks, repeated to `tokens`
rows, and the layer's own weights in bf16 run every candidate: the dense path a layer planned dense
runs (gate, up and down linears, ReLU) and `twell.gated_mlp` at each (tile, compression). Times are
`triton.testing.do_bench` medians; a candidate counts only if its relative error against the fp32 block
stays within twice the dense bf16 path's own error (plus 1e-3), so a fast but wrong setting never wins.
The fastest candidate is the layer's setting. Then dense and that setting are timed again on the first
rows at each count of WINDOW (decode sizes to short prefills, where the kernels' latencies weigh most;
up to GRAPH_TOKENS as CUDA-graph replays over enough copies of the weights that they do not sit in L2),
with the same error check, and the counts where the setting wins give the layer's "sparse_tokens"
(`sparsify.plan.token_ranges`). Its stats keep the measured times and errors.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from .errors import ConfigError
from .families import FamilySpec, down_weight, gate_weight, has_bias, mlp_modules, up_weight
from .plan import layer_setting, token_ranges

CANDIDATES = tuple(itertools.product((64, 128, 256), (16, 8, 4, 2)))
TOKENS = 16384
WINDOW = (1, 4, 16, 17, 64, 65, 128, 256, 512, 1024, 4096)  # token counts timed for the window (< TOKENS)
GRAPH_TOKENS = 1024


def require_cuda(device, what: str) -> torch.device:
    """The CUDA device to run on; ConfigError naming `what` when there is none."""
    device = torch.device(device or "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"{what} needs a CUDA GPU (got device {device}, CUDA available: {torch.cuda.is_available()})")
    return device


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@torch.no_grad()
def capture_mlp_inputs(model, spec: FamilySpec, blocks, tokens: int = TOKENS, keep: bool = True) -> list[torch.Tensor]:
    """Per layer, the MLP input rows [tokens, D] on the blocks (repeated, or cut, to `tokens` rows), in CPU
    memory. With keep=False the forwards run and nothing is kept (another process of an FSDP model: the
    forwards are collective); returns []."""
    mlps = mlp_modules(model, spec)
    captured = [[] for _ in mlps]
    handles = [mlp.register_forward_pre_hook(lambda mod, args, c=c: c.append(args[0].flatten(0, -2).cpu()))
               for mlp, c in zip(mlps, captured)] if keep else []
    device = next(model.parameters()).device
    rows = 0
    try:
        for block in blocks:
            block = torch.as_tensor(block, device=device).view(1, -1)
            model(input_ids=block, use_cache=False)
            rows += block.numel()
            if rows >= tokens:
                break
    finally:
        for h in handles:
            h.remove()
    if not keep:
        return []
    inputs = []
    for layer_rows in captured:
        x = torch.cat(layer_rows)
        inputs.append(x.repeat(-(-tokens // len(x)), 1)[:tokens].contiguous())
    return inputs


def dense_block(x, gate, up, down):
    return F.linear(F.relu(F.linear(x, gate)) * F.linear(x, up), down)


def error_ok(err: float, dense_err: float, rel_tolerance: float = 1e-3) -> bool:
    return err <= 2 * dense_err + rel_tolerance


def time_layer(x, gate, up, down, candidates) -> dict:
    """{"dense": {ms, rel_err}, (tile, compression): {ms, rel_err, overflow_frac, ok}} for one layer's
    bf16 weights and input rows x [M, D]."""
    import twell
    from triton.testing import do_bench

    ref = twell.gated_mlp_reference(x.float(), gate.float(), up.float(), down.float())
    dense_err = relative_error(dense_block(x, gate, up, down), ref)
    results = {"dense": {"ms": do_bench(lambda: dense_block(x, gate, up, down), return_mode="median"),
                         "rel_err": dense_err}}
    down_t = twell.prepare_down(down)
    units = gate.shape[0]
    for tile, compression in [(t, c) for t, c in candidates if t <= units]:  # as measure's tiles
        overflow = torch.zeros(1, dtype=torch.int64, device=x.device)
        out = twell.gated_mlp(x, gate, up, down_t, tile=tile, compression=compression, overflow=overflow)
        err = relative_error(out, ref)
        ms = do_bench(lambda: twell.gated_mlp(x, gate, up, down_t, tile=tile, compression=compression),
                      return_mode="median")
        results[(tile, compression)] = {
            "ms": ms, "rel_err": err, "overflow_frac": overflow.item() / (len(x) * -(-units // tile)),
            "ok": error_ok(err, dense_err),
        }
    return results


def fastest_correct(results: dict):
    """(ms, (tile, compression)) of the fastest candidate within the error bound, or None."""
    return min(((r["ms"], key) for key, r in results.items() if key != "dense" and r["ok"]), default=None)


def time_window(x, gate, up, down, tile: int, compression: int, points=WINDOW) -> list[dict]:
    """[{tokens, dense_ms, sparse_ms, ok}] for the first `tokens` rows of x at each of `points` (< len(x))."""
    import twell
    from triton.testing import do_bench, do_bench_cudagraph

    props = torch.cuda.get_device_properties(x.device)
    weight_bytes = 3 * gate.numel() * gate.element_size()
    # enough copies that together they are 4x the L2 (one layer's weights would stay there between replays)
    n_copies = min(8, max(1, -(-4 * getattr(props, "L2_cache_size", 50 << 20) // weight_bytes)))
    copies = [(gate, up, down, twell.prepare_down(down))]
    copies += [tuple(w.clone() for w in copies[0]) for _ in range(n_copies - 1)]

    def sparse(rows, gate, up, down, down_t):
        return twell.gated_mlp(rows, gate, up, down_t, tile=tile, compression=compression)

    def dense(rows, gate, up, down, down_t):
        return dense_block(rows, gate, up, down)

    def bench(fn, rows):
        if len(rows) <= GRAPH_TOKENS:
            return do_bench_cudagraph(lambda: [fn(rows, *w) for w in copies], return_mode="median") / len(copies)
        return do_bench(lambda: fn(rows, *copies[0]), return_mode="median")

    fp32 = [w.float() for w in (gate, up, down)]
    window = []
    for tokens in [n for n in points if n < len(x)]:
        rows = x[:tokens]
        ref = twell.gated_mlp_reference(rows.float(), *fp32)
        ok = error_ok(relative_error(sparse(rows, *copies[0]), ref), relative_error(dense(rows, *copies[0]), ref))
        window.append({"tokens": tokens, "dense_ms": bench(dense, rows), "sparse_ms": bench(sparse, rows), "ok": ok})
    return window


def layer_plan(activity_stats: dict, results: dict, window: list[dict], tokens: int = TOKENS) -> dict:
    """The plan entry from `time_layer`'s results (timed at `tokens` rows) and `time_window`'s for the
    fastest correct candidate: that setting, at the token counts where it beat dense; dense without one."""
    dense = results["dense"]
    stats = {**activity_stats, "dense_ms": round(dense["ms"], 4), "dense_rel_err": dense["rel_err"]}
    best = fastest_correct(results)
    if best is None:
        return {"mode": "dense", "stats": stats}
    ms, (tile, compression) = best
    r = results[(tile, compression)]
    stats.update(sparse_ms=round(ms, 4), measured_speedup=round(dense["ms"] / ms, 3), rel_err=r["rel_err"],
                 overflow_frac=r["overflow_frac"],
                 window=[[w["tokens"], round(w["dense_ms"], 4), round(w["sparse_ms"], 4)] for w in window])
    wins = [(w["tokens"], w["ok"] and w["sparse_ms"] < w["dense_ms"]) for w in window] + [(tokens, ms < dense["ms"])]
    return layer_setting(tile, compression, token_ranges(wins), stats)


def activity(x, gate) -> dict:
    """Mean and p99 active units per token and the never-firing fraction of units on rows x."""
    active = F.linear(x, gate) > 0
    per_token = active.sum(-1).float()
    return {"mean_active": per_token.mean().item(), "p99_active": per_token.quantile(0.99).item(),
            "dead_frac": (~active.any(0)).float().mean().item()}


def measure_plan(model, spec: FamilySpec, inputs, candidates=CANDIDATES, device="cuda", *,
                 tokens: int = TOKENS, mlp_inputs: list[torch.Tensor] | None = None) -> list[dict]:
    """config.twell "layers" from timings: `inputs` are token-id blocks (held-out text), `candidates`
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
            plan.append({"mode": "dense", "stats": activity(x, weights[0])})
            continue
        results = time_layer(x, *weights, candidates)
        best = fastest_correct(results)
        window = [] if best is None else time_window(x, *weights, *best[1])
        plan.append(layer_plan(activity(x, weights[0]), results, window, tokens))
    return plan
