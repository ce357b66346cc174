"""Timing a layer's kernel settings on the GPU, the input of `--measure`'s planner (`sparsify.plan.measure_plan`).

Each layer's MLP input is captured (forward pre-hook) on held-out token blocks, repeated to `tokens`
rows, and the layer's own weights in bf16 run every candidate: the dense path a layer planned dense
runs (gate, up and down linears, ReLU) and `twell.gated_mlp` at each (tile, compression). Times are
`triton.testing.do_bench` medians; a candidate counts only if its relative error against the fp32 block
stays within twice the dense bf16 path's own error (plus 1e-3), so a fast but wrong setting never wins.
`time_window` times dense and one setting again on the first rows at each count of WINDOW (decode sizes to
short prefills, where the kernels' latencies weigh most; up to GRAPH_TOKENS as CUDA-graph replays over
enough copies of the weights that they do not sit in L2), with the same error check.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from .families import FamilySpec, mlp_modules
from .measure import COMPRESSIONS, TILES

CANDIDATES = tuple(itertools.product(TILES, COMPRESSIONS[::-1]))  # the settings measure reports statistics for
TOKENS = 16384  # a 16k-token prefill, the regime of the paper's benchmark: the count a setting is chosen at
WINDOW = (1, 4, 16, 17, 64, 65, 128, 256, 512, 1024, 4096)  # token counts timed for the window (< TOKENS)
GRAPH_TOKENS = 1024


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
    for tile, compression in [(t, c) for t, c in candidates if t <= units]:
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


def activity(x, gate) -> dict:
    """Mean and p99 active units per token and the never-firing fraction of units on rows x."""
    active = F.linear(x, gate) > 0
    per_token = active.sum(-1).float()
    return {"mean_active": per_token.mean().item(), "p99_active": per_token.quantile(0.99).item(),
            "dead_frac": (~active.any(0)).float().mean().item()}
