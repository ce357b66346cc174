"""`sparsify bench CHECKPOINT`: dense vs TwELL speed of a converted checkpoint, in one process, on a GPU.

The checkpoint loads twice in bf16: plain (the family's own class with a ReLU gate: dense math, no
remote code) and with trust_remote_code=True (TwellGatedMLP: each layer on its planned kernel setting).
Figures (benchmarks.md method, CUDA events through triton's do_bench, medians after warm-up):
- prefill: the decoder stack (no LM head, as the paper's figure) over batch x seq_len token ids;
- decode step: one greedy step (a one-token forward of the whole model over a static KV cache holding
  `decode_context` tokens) captured as a CUDA graph and replayed: the GPU time a serving loop that captures
  its step pays (as transformers' compiled static-cache generate and vLLM-style servers do);
- decode: `generate`, eager, greedy, exactly `decode_tokens` new tokens after a short prompt, in tokens/s.
  Its per-step Python (sampling logic, cache bookkeeping, module calls) costs about as much as the GPU
  work of a small model, so this figure is host-bound and shows little of the MLP's speed-up.
Inputs are random token ids (seed 0): the mean active units that the figures go with are measured on
that same input (gate pre-activation > 0) and reported. A logits check runs before any timing: relative
error of the final-position logits of the prefill input (the token count each layer's window is judged
at), and how many greedy tokens of a short generation from 16-token prompts agree (bf16 rounding can flip
a near-tie, after which the continuations differ: both are reported).
"""
from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch

from .errors import ConfigError
from .families import mlp_modules, spec_for
from .load import load_config, resolve_source
from .measure import gate_hooks
from .plan import describe
from .tune import relative_error, require_cuda

PROMPT_TOKENS = 16
CHECK_BATCH, CHECK_NEW = 4, 32  # greedy agreement: prompts of PROMPT_TOKENS, CHECK_NEW new tokens


def logits_agreement(dense_logits: torch.Tensor, twell_logits: torch.Tensor, dense_tokens: torch.Tensor,
                     twell_tokens: torch.Tensor) -> dict:
    """Relative error of the logits and the fraction of greedy tokens that agree, position by position
    (also the length of the common prefix, the positions before the first disagreement, per sequence)."""
    same = dense_tokens == twell_tokens
    prefix = same.int().cumprod(-1).sum(-1)
    return {"logits_rel_err": relative_error(twell_logits, dense_logits),
            "greedy_match": same.float().mean().item(),
            "greedy_common_prefix": prefix.float().mean().item(),
            "greedy_tokens": same.numel()}


def plan_summary(config) -> dict:
    """Per-layer settings of a checkpoint's config.twell plan, and the count of sparse layers."""
    layers = config.twell["layers"]
    return {"layers": [describe(layer) for layer in layers],
            "sparse_layers": sum(layer["mode"] == "sparse" for layer in layers),
            "predicted_speedup": [layer.get("stats", {}).get("predicted_speedup") for layer in layers]}


def versions() -> dict:
    import transformers
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def _generate(model, prompt, new_tokens):
    # an explicit mask: random ids may contain the pad id, which must not be masked out
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[:, prompt.shape[1]:]


def _median_seconds(fns: dict, warmup: int = 1, repeats: int = 5) -> dict:
    """Median wall time of each fn() between CUDA events (for calls too long for do_bench's repetitions).
    The functions take turns, so that a drift of the host's speed during the run (seen on shared GPU
    hosts: the same eager `generate` 1.8x slower a minute later) falls on all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.inference_mode()
def decode_step(model, context: torch.Tensor) -> tuple[float, torch.Tensor]:
    """GPU seconds and logits [batch, vocab] of one decode step of `model` after the prompt `context`
    [batch, n]: a one-token forward over a static KV cache, captured as a CUDA graph (after warm-up on a
    side stream, which also compiles the kernels and builds their launch plans) and timed by replaying it.
    The logits are the replay's, checked against the same step run eagerly."""
    from transformers import StaticCache
    from triton.testing import do_bench

    batch, n = context.shape
    device = context.device
    cache = StaticCache(config=model.config, max_cache_len=n + 1)
    model(input_ids=context, past_key_values=cache, cache_position=torch.arange(n, device=device), use_cache=True)
    ids = context[:, -1:].clone()
    position = torch.full((1,), n, device=device)

    counters = [layer.cumulative_length for layer in cache.layers
                if torch.is_tensor(getattr(layer, "cumulative_length", None))]

    def step():  # rewrites cache slot n with the same values at every call
        for counter in counters:  # transformers 5 static layers count what they hold: back to n
            counter.fill_(n)
        return model(input_ids=ids, past_key_values=cache, cache_position=position,
                     position_ids=position.expand(batch, 1), use_cache=True).logits[:, -1]

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            eager = step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step()
    seconds = do_bench(graph.replay, return_mode="median") / 1e3
    error = relative_error(replayed.float(), eager.float())
    if error > 1e-3:
        raise RuntimeError(f"the CUDA-graph decode step differs from the eager one (relative error {error:.1e})")
    return seconds, replayed.clone()


@torch.inference_mode()
def mean_active(model, ids) -> list[float]:
    """Mean active units per token of each layer on `ids` (hooks on the gate projections)."""
    spec = spec_for(model.config)
    sums = [[] for _ in mlp_modules(model, spec)]
    with gate_hooks(model, spec, [lambda gate, s=s: s.append((gate > 0).sum(-1).float().mean()) for s in sums]):
        model.get_decoder()(input_ids=ids, use_cache=False)
    return [torch.stack(s).mean().item() for s in sums]


def bench_checkpoint(path: str | Path, *, batch: int = 64, seq_len: int = 2048, decode_tokens: int = 128,
                     decode_batch: int = 1, decode_context: int = 512, device: str = "cuda") -> dict:
    """Prefill and decode figures of the dense and the TwELL load of the checkpoint at `path`."""
    from transformers import AutoModelForCausalLM

    device = require_cuda(device, "sparsify bench")
    if min(batch, seq_len, decode_tokens, decode_batch, decode_context) < 1:
        raise ConfigError("--batch, --seq-len, --decode-tokens, --decode-context and the decode batch must be positive")
    config, _ = load_config(path)  # SourceError / UnsupportedModelError for what cannot be a checkpoint
    path = resolve_source(path)
    if not getattr(config, "twell", None):
        raise ConfigError(f"{path}: not a sparsify checkpoint (config.json has no twell section)")
    load = dict(dtype=torch.bfloat16)
    dense = AutoModelForCausalLM.from_pretrained(path, **load).to(device).eval()
    sparse = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **load).to(device).eval()
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)
    check_prompts = torch.randint(0, vocab, (CHECK_BATCH, PROMPT_TOKENS), generator=gen).to(device)
    prompt = torch.randint(0, vocab, (decode_batch, PROMPT_TOKENS), generator=gen).to(device)
    context = torch.randint(0, vocab, (decode_batch, decode_context), generator=gen).to(device)

    with torch.inference_mode():
        # logits on the timed prefill input itself (last position only), so that the check runs the layers
        # at the token count the figures are for: a smaller input could fall outside a layer's sparse window
        last = [m(ids, logits_to_keep=1, use_cache=False).logits[:, -1] for m in (dense, sparse)]
        check = logits_agreement(*last, *(_generate(m, check_prompts, CHECK_NEW) for m in (dense, sparse)))
        active = mean_active(dense, ids)
        models = {"dense": dense, "twell": sparse}
        steps = {name: decode_step(model, context) for name, model in models.items()}
        prefill = _median_seconds({name: lambda m=model: m.get_decoder()(input_ids=ids, use_cache=False)
                                   for name, model in models.items()})
        decode = _median_seconds({name: lambda m=model: _generate(m, prompt, decode_tokens)
                                  for name, model in models.items()})
    figures = {name: {"prefill_ms": 1e3 * prefill[name], "prefill_tokens_per_s": batch * seq_len / prefill[name],
                      "decode_step_ms": 1e3 * steps[name][0], "decode_step_tokens_per_s": decode_batch / steps[name][0],
                      "decode_s": decode[name], "decode_tokens_per_s": decode_batch * decode_tokens / decode[name]}
               for name in models}
    figures["prefill_speedup"] = figures["dense"]["prefill_ms"] / figures["twell"]["prefill_ms"]
    figures["decode_step_speedup"] = figures["dense"]["decode_step_ms"] / figures["twell"]["decode_step_ms"]
    check["decode_step_logits_rel_err"] = relative_error(steps["twell"][1], steps["dense"][1])
    figures["decode_speedup"] = figures["twell"]["decode_tokens_per_s"] / figures["dense"]["decode_tokens_per_s"]
    return {
        "checkpoint": str(path), "device": torch.cuda.get_device_name(device), "versions": versions(),
        "batch": batch, "seq_len": seq_len, "decode_tokens": decode_tokens, "decode_batch": decode_batch,
        "decode_context": decode_context,
        "prompt_tokens": PROMPT_TOKENS, "figures": figures, "check": check, "plan": plan_summary(config),
        "mean_active": active, "mean_active_all_layers": statistics.fmean(active),
    }


def bench_table(result: dict):
    """Rich table of a `bench_checkpoint` result."""
    from rich.table import Table

    f, c = result["figures"], result["check"]
    table = Table(title=f"{result['checkpoint']} on {result['device']}: {result['batch']} x {result['seq_len']} prefill; "
                        f"decode at batch {result['decode_batch']}: one step after {result['decode_context']} tokens "
                        f"(CUDA graph), {result['decode_tokens']} tokens of eager generate; "
                        f"mean active units {result['mean_active_all_layers']:.1f}, "
                        f"{result['plan']['sparse_layers']}/{len(result['plan']['layers'])} layers sparse")
    for column in ("", "prefill ms", "prefill tokens/s", "decode step ms", "decode step tokens/s",
                   "generate tokens/s"):
        table.add_column(column, justify="right")
    for name in ("dense", "twell"):
        table.add_row(name, f"{f[name]['prefill_ms']:.2f}", f"{f[name]['prefill_tokens_per_s']:,.0f}",
                      f"{f[name]['decode_step_ms']:.3f}", f"{f[name]['decode_step_tokens_per_s']:,.0f}",
                      f"{f[name]['decode_tokens_per_s']:,.1f}")
    table.add_row("speed-up", f"{f['prefill_speedup']:.2f}x", "", f"{f['decode_step_speedup']:.2f}x", "",
                  f"{f['decode_speedup']:.2f}x")
    table.caption = (f"logits rel. err {c['logits_rel_err']:.1e} (decode step {c['decode_step_logits_rel_err']:.1e}); "
                     f"greedy tokens agreeing {100 * c['greedy_match']:.0f}% "
                     f"(common prefix {c['greedy_common_prefix']:.1f} of {CHECK_NEW})")
    return table


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
