"""`sparsify bench CHECKPOINT`: dense vs TwELL speed of a converted checkpoint, in one process, on a GPU.

The checkpoint loads twice in bf16, plain (the family's class with a ReLU gate: dense) and with remote code
(TwellGatedMLP on each layer's plan). Each result row is one path of PATHS at one batch size, timed for both
loads in turn (CUDA-event medians, every timed call kept, `paired_speedup` the median of each round's
ratio), with a per-component GPU breakdown (sparsify.profiling) and its checks (logits and greedy tokens
against the dense load; graph replays against the step run directly). Inputs are text (`data`) or, without
it, random token ids, which a trained model answers with other activity than text. docs/design.md says how
each path and the breakdown are measured.
"""
from __future__ import annotations

import contextlib
import functools
import json
import platform
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch
from twell.layer_plan import layer_plans
from twell.reference import gate_values

from .config import BENCH_ON_CPU
from .errors import ConfigError
from .families import gate_weight, mlp_modules, spec_for
from .data import TextData
from .load import load_config, load_tokenizer, require_cuda, require_tokenizer
from .locations import resolve_data, resolve_source
from .report import describe, warn
from .measure import gate_hooks
from .profiling import COMPONENTS, breakdown
from .remote.generation import cache_arguments, generate_graphed
from .tune import relative_error

PROMPT_TOKENS = 16
CHECK_BATCH, CHECK_NEW = 4, 32  # greedy agreement: prompts of PROMPT_TOKENS, CHECK_NEW new tokens
PATHS = {
    "prefill": "decoder stack (no LM head), eager, batch x seq_len tokens",
    "prefill_compiled": "decoder stack (no LM head), torch.compile(fullgraph=True, dynamic=False), "
                        "batch x seq_len tokens",
    "generate_eager": "model.generate, greedy (dense: eager, dynamic cache; TwELL: the checkpoint's routed loop)",
    "generate_compiled": "model.generate, greedy, cache_implementation='static', compile_config=CompileConfig("
                         "fullgraph=True, dynamic=False) (dense: the decode step compiled by transformers, inductor, "
                         "reduce-overhead; TwELL: the checkpoint's routed loop, its step compiled as the "
                         "CompileConfig says and captured by the loop)",
    "generate_graphed": "generate_graphed(compile=True) (generation.py, shipped with the checkpoint): greedy, "
                        "static cache, the step through torch.compile(fullgraph=True, dynamic=False) (inductor, "
                        "default mode) and captured as one CUDA graph, one replay a token",
    "decode_step_graph": "one decode step over a static cache, captured as one CUDA graph and replayed (also run "
                         "directly: eager_step_ms; and the TwELL load with its attention projections on torch's "
                         "linear: twell_torch_projections, with its attention on sdpa: twell_sdpa_attention)",
    "decode_step_compiled_graph": "one decode step over a static cache through torch.compile(fullgraph=True, "
                                  "dynamic=False) (inductor, default mode), captured as one CUDA graph and replayed",
}


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
    plans = layer_plans(config.twell)
    return {"layers": [describe(plan) for plan in plans], "sparse_layers": sum(plan.is_sparse for plan in plans),
            "predicted_speedup": [plan.stats.get("predicted_speedup") for plan in plans]}


def versions() -> dict:
    import transformers
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}


def path_row(path: str, batch: int, tokens: int, seconds: dict, samples: dict | None = None, **extra) -> dict:
    """One result row: dense and twell ms per call of `tokens` tokens (`seconds`: the median of the timed
    calls in `samples`), tokens/s, and the speed-up. With samples, also `paired_speedup`: the median over
    the timed rounds of dense / twell within a round (the loads take turns, so a round's two calls share
    the host's state of the moment: steadier than the ratio of medians where the host drifts)."""
    loads = {name: {"ms": 1e3 * s, "tokens_per_s": tokens / s} for name, s in seconds.items()}
    for name, times in (samples or {}).items():
        loads[name]["samples_ms"] = [1e3 * t for t in times]
    if samples:
        extra["paired_speedup"] = statistics.median(d / t for d, t in zip(samples["dense"], samples["twell"]))
    return {"path": path, "what": PATHS[path], "batch": batch, "tokens": tokens, **loads,
            "speedup": seconds["dense"] / seconds["twell"], **extra}


# Timed seconds each function gets at least, in up to MAX_ROUNDS rounds: a host-bound call of a few ms varies
# by tens of percent from call to call, which three calls do not settle
MIN_TIMED_S = 0.5
MAX_ROUNDS = 100


def _median_seconds(fns: dict, warmup: int = 1, repeats: int = 3) -> tuple[dict, dict, dict]:
    """Median wall time of each fn() between CUDA events, all its timed calls' seconds, and each one's last
    output: `repeats` rounds, more while a function has less than MIN_TIMED_S of timed calls. The functions take
    turns, so that a drift of the host's speed during the run (a shared GPU host's can change within a minute)
    falls on all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times, outputs = {name: [] for name in fns}, {}
    rounds = 0
    while rounds < repeats or rounds < MAX_ROUNDS and min(sum(t) for t in times.values()) < MIN_TIMED_S:
        rounds += 1
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outputs[name] = fn()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3)
    return {name: statistics.median(t) for name, t in times.items()}, times, outputs


def _generate(model, prompt, new_tokens, **options):
    # an explicit mask: random ids may contain the pad id, which must not be masked out
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **options)[:, prompt.shape[1]:]


def _timed_row(path, batch, tokens, calls: dict, models: dict, repeats: int, ranges: bool = True, **extra) -> dict:
    """path_row of `calls` (name -> fn), each load's breakdown, and for token outputs their agreement."""
    seconds, samples, outputs = _median_seconds(calls, repeats=repeats)
    split = {name: breakdown(calls[name], seconds[name], models[name] if ranges else None) for name in calls}
    if torch.is_tensor(outputs["dense"]):  # generated tokens
        extra["greedy_match"] = (outputs["dense"] == outputs["twell"]).float().mean().item()
    return path_row(path, batch, tokens, seconds, samples, breakdown=split, **extra)


@torch.inference_mode()
def prefill_row(models, ids, repeats) -> dict:
    calls = {name: lambda m=model: m.get_decoder()(input_ids=ids, use_cache=False) for name, model in models.items()}
    return _timed_row("prefill", ids.shape[0], ids.numel(), calls, models, repeats, length=ids.shape[1])


def prefill_shapes(specs, seq_len: int) -> list[tuple[int, int]]:
    """(sequences, tokens each) of the prefill rows: an int or "B" is B sequences of seq_len tokens, "BxS"
    B sequences of S tokens (batched short prompts: "64x64")."""
    shapes = []
    for spec in specs:
        batch, sep, length = str(spec).partition("x")
        try:
            shape = int(batch), int(length) if sep else seq_len
        except ValueError:
            raise ConfigError(f"a prefill row is BATCH or BATCHxLENGTH (64x64), got {spec!r}") from None
        if min(shape) < 1:
            raise ConfigError(f"a prefill row needs at least one sequence of one token, got {spec!r}")
        shapes.append(shape)
    return shapes


@torch.inference_mode()
def generate_row(models, prompt, new_tokens, repeats) -> dict:
    """model.generate of each load, and the dense load through the TwELL load's loop ("dense_loop":
    generate_graphed uncompiled), so that `loop_speedup` (dense_loop / twell) shows what sparsity gives
    beside what the loop gives. `first_call_s`: each call's first run (the loops capture their graphs)."""
    calls = {name: lambda m=model: _generate(m, prompt, new_tokens) for name, model in models.items()}
    calls["dense_loop"] = lambda: generate_graphed(models["dense"], prompt, new_tokens, min_new_tokens=new_tokens,
                                                   pad_token_id=0)[:, prompt.shape[1]:]
    first = _first_call_seconds(calls)
    row = _timed_row("generate_eager", prompt.shape[0], prompt.shape[0] * new_tokens, calls,
                     {**models, "dense_loop": models["dense"]}, repeats, first_call_s=first)
    row["loop_speedup"] = row["dense_loop"]["ms"] / row["twell"]["ms"]
    row["paired_loop_speedup"] = statistics.median(
        d / t for d, t in zip(row["dense_loop"]["samples_ms"], row["twell"]["samples_ms"]))
    return row


def _first_call_seconds(calls: dict) -> dict:
    """Wall seconds of each call's first run (where it compiles)."""
    seconds = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - start
    return seconds


@torch.inference_mode()
def compiled_prefill_row(models, ids, repeats) -> dict:
    """The prefill through torch.compile; the first call of each model compiles (compile_s)."""
    compiled = {name: torch.compile(model.get_decoder(), fullgraph=True, dynamic=False)
                for name, model in models.items()}
    calls = {name: lambda c=c: c(input_ids=ids, use_cache=False) for name, c in compiled.items()}
    compile_s = _first_call_seconds(calls)
    return _timed_row("prefill_compiled", ids.shape[0], ids.numel(), calls, models, repeats, ranges=False,
                      compile_s=compile_s)


def compiled_generate_row(models, prompt, new_tokens, repeats) -> dict:
    """The compiled path; the first call of each model compiles (its wall time reported as compile_s)."""
    from transformers import CompileConfig

    options = dict(cache_implementation="static", compile_config=CompileConfig(fullgraph=True, dynamic=False))
    calls = {name: lambda m=model: _generate(m, prompt, new_tokens, **options) for name, model in models.items()}
    compile_s = _first_call_seconds(calls)  # generate runs under no_grad itself
    return _timed_row("generate_compiled", prompt.shape[0], prompt.shape[0] * new_tokens, calls, models, repeats,
                      ranges=False, compile_s=compile_s)


def graphed_generate_row(models, prompt, new_tokens, repeats) -> dict:
    """generate_graphed with the compiled step, never stopping early (as min_new_tokens in the generate rows);
    the first call of each model compiles and captures (compile_s). `matches_generate`: per load, the
    fraction of its tokens equal to plain generate's."""
    calls = {name: lambda m=model: generate_graphed(m, prompt, new_tokens, eos_token_id=[], compile=True)[
        :, prompt.shape[1]:] for name, model in models.items()}
    compile_s = _first_call_seconds(calls)
    with torch.inference_mode():
        matches = {name: (calls[name]() == _generate(models[name], prompt, new_tokens)).float().mean().item()
                   for name in calls}
    return _timed_row("generate_graphed", prompt.shape[0], prompt.shape[0] * new_tokens, calls, models, repeats,
                      ranges=False, compile_s=compile_s, matches_generate=matches)


@torch.inference_mode()
def capture_step(model, context: torch.Tensor, compiled: bool = False):
    """(replay, eager step, logits [batch, vocab], relative error of the replay against the eager step) of
    one decode step of `model` after the prompt `context` [batch, n]: a one-token forward over a static KV
    cache, captured as a CUDA graph (after warm-up on a side stream, which also compiles the kernels and
    builds their launch plans). With `compiled`, the step's forward goes through torch.compile(fullgraph=True,
    dynamic=False), compiled during the warm-up, and the "eager step" is the compiled one run directly.
    The logits are the replay's; the error is reported with the row (and a warning printed above 1e-3), so
    that one failing check does not cost the other rows."""
    from transformers import StaticCache

    batch, n = context.shape
    device = context.device
    cache = StaticCache(config=model.config, max_cache_len=n + 1)
    model(input_ids=context, **cache_arguments(model, cache, torch.arange(n, device=device)), use_cache=True)
    ids = context[:, -1:].clone()
    position = torch.full((1,), n, device=device)
    step_cache = cache_arguments(model, cache, position)
    counters = [layer.cumulative_length for layer in cache.layers
                if torch.is_tensor(getattr(layer, "cumulative_length", None))]
    forward = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model

    def step():  # rewrites cache slot n with the same values at every call
        for counter in counters:  # transformers 5 static layers count what they hold: back to n
            counter.fill_(n)
        logits = forward(input_ids=ids, **step_cache, position_ids=position.expand(batch, 1), use_cache=True).logits
        return logits[:, -1]

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            eager = step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step()
    graph.replay()
    error = relative_error(replayed.float(), eager.float())
    if error > 1e-3:
        warn(f"{model.__class__.__name__}: the CUDA-graph decode step at batch {batch} differs from the eager one "
             f"(relative error {error:.1e})")
    return graph.replay, torch.inference_mode()(step), replayed.clone(), error


class Switch(NamedTuple):
    """A decoder kernel of the modeling file that a TwellForCausalLM method switches off (called with False, then
    True), timed beside the two loads in the uncompiled decode-step rows: what the kernel gives to the replayed step,
    in one run (the step run directly takes sdpa and the projections' own forward either way: attention_signature,
    ProjectionGroup.signature)."""

    method: str
    speedup: str  # the row's key of the switched load's time over the TwELL load's
    error: str  # the row's key of its logits' error against the TwELL load's
    label: str  # what the table calls the kernel


# load name: its switch
SWITCHED_OFF = {"twell_torch_projections": Switch("fuse_projections", "small_linear_speedup",
                                                  "torch_projections_rel_err", "projections on small_linear"),
                "twell_sdpa_attention": Switch("fuse_attention", "decode_attention_speedup", "sdpa_attention_rel_err",
                                               "attention on its kernel")}


@contextlib.contextmanager
def switched_off(model, method: str):
    """`model` (a TwELL load) with the kernel that `method` switches off inside the block."""
    getattr(model, method)(False)
    try:
        yield
    finally:
        getattr(model, method)()


def graph_step_row(models, context, compiled: bool = False) -> dict:
    """decode_step_graph (or, `compiled`, decode_step_compiled_graph): the replay's median time, and the
    breakdown of the step run directly (compiled: by kernel name, as module ranges cannot reach inside).
    Uncompiled, also each load's step run directly (`eager_step_ms`: the host's launches included), and the
    replays of the TwELL load with a decoder kernel switched off (SWITCHED_OFF) where its modeling file has the
    switch."""
    from triton.testing import do_bench

    steps = {name: capture_step(model, context, compiled) for name, model in models.items()}
    seconds = {name: do_bench(replay, return_mode="median") / 1e3 for name, (replay, *_) in steps.items()}
    split, eager_ms = {}, {}
    for name, (_, step, *_) in steps.items():
        split[name] = breakdown(step, seconds[name], None if compiled else models[name])
        if not compiled:  # the step uncaptured: the host's launches included
            eager_ms[name] = do_bench(step, return_mode="median")
    extra = {"eager_step_ms": eager_ms} if eager_ms else {}
    twell = models["twell"]
    # last: switching back gives the projections new groups, whose first uncaptured call launches small_linear
    for name, switch in SWITCHED_OFF.items():
        if not compiled and hasattr(twell, switch.method):
            with switched_off(twell, switch.method):
                steps[name] = capture_step(twell, context)
            seconds[name] = do_bench(steps[name][0], return_mode="median") / 1e3
            extra.update({switch.speedup: seconds[name] / seconds["twell"],
                          switch.error: relative_error(steps["twell"][2], steps[name][2])})
    batch = context.shape[0]
    return path_row("decode_step_compiled_graph" if compiled else "decode_step_graph", batch, batch, seconds,
                    breakdown=split, context=context.shape[1],
                    logits_rel_err=relative_error(steps["twell"][2], steps["dense"][2]),
                    graph_vs_eager_rel_err={name: step[3] for name, step in steps.items()}, **extra)


@torch.inference_mode()
def mean_active(model, ids) -> list[float]:
    """Mean active units per token of each layer on `ids` (hooks on the gate projections)."""
    spec = spec_for(model.config)
    sums = [[] for _ in mlp_modules(model, spec)]
    with gate_hooks(model, spec, [lambda gate, s=s: s.append((gate > 0).sum(-1).float().mean()) for s in sums]):
        model.get_decoder()(input_ids=ids, use_cache=False)
    return [torch.stack(s).mean().item() for s in sums]


FP8_COUNT_ROWS = 8192  # rows of an MLP input whose fp32 gate values are made at once


@torch.inference_mode()
def fp8_gate_mean_active(model, ids) -> list[float]:
    """Mean active units per token of each layer of a TwELL load whose gate pass reads fp8 (use_fp8_gate), on
    `ids`: g as its batched kernel call computes it (twell.reference.gate_values: the fp8 gate where its packing
    pass serves, bf16 where the dense fallbacks recompute) on each MLP's input in the load's own forward, so that
    the fp8 error the layers before carry counts too; layers whose kernels never serve count their bf16 gate."""
    spec = spec_for(model.config)
    mlps = mlp_modules(model, spec)
    counts = [[0, 0] for _ in mlps]

    def count(tally, mlp, args):
        x2 = args[0].reshape(-1, args[0].shape[-1])
        gate = gate_weight(mlp, spec)
        fp8 = mlp.gate_e4m3()  # the copy its kernels read
        for rows in x2.split(FP8_COUNT_ROWS):
            g = gate_values(rows, gate, fp8, mlp.plan.tile, mlp.plan.compression)
            tally[0] += (g > 0).sum().item()
        tally[1] += len(x2)

    handles = [mlp.register_forward_pre_hook(functools.partial(count, tally)) for mlp, tally in zip(mlps, counts)]
    try:
        model.get_decoder()(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [active / tokens for active, tokens in counts]


RANDOM_IDS_WARNING = ("no --data: the inputs are random token ids, on which a trained model's layers are more "
                      "active than on text, so the figures misstate its speed; pass --data with text")


def text_inputs(data, tokenizer, device="cpu", text_column: str = "text"):
    """ids(batch, length): `batch` consecutive blocks of `length` tokens of `data`'s held-out text (sparsify.data:
    a folder's valid* files, else the head of the text; rows read from `text_column`), cycled when the text
    holds fewer blocks."""
    blocks, asked = {}, {}  # per length: the blocks read, and the largest batch they were read for

    def ids(batch: int, length: int) -> torch.Tensor:
        if asked.get(length, 0) < batch:
            blocks[length] = TextData(data, tokenizer, length, eval_tokens=batch * length,
                                      text_column=text_column).eval_blocks
            asked[length] = batch
        held = blocks[length]
        return torch.stack([held[i % len(held)] for i in range(batch)]).to(device)

    return ids


def _loads(path, device, fp8_gate: bool, fp8_up_down: bool = False) -> dict:
    """{"dense": the checkpoint's plain load, "twell": its remote-code load (its gate pass in fp8 with `fp8_gate`,
    its out pass on e4m3 up and down rows with `fp8_up_down`)}, bf16, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    load = dict(dtype=torch.bfloat16)
    models = {"dense": AutoModelForCausalLM.from_pretrained(path, **load).to(device).eval(),
              "twell": AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **load).to(device).eval()}
    for method, wanted in (("use_fp8_gate", fp8_gate), ("use_fp8_up_down", fp8_up_down)):
        if wanted and not hasattr(models["twell"], method):
            raise ConfigError(f"{path}: its modeling file predates {method}() (a checkpoint of an earlier sparsify: "
                              "a conversion by this one writes a modeling file that has it)")
        if wanted:
            getattr(models["twell"], method)()
    return models


def bench_checkpoint(path: str | Path, *, seq_len: int = 2048, prefill_batches=(1, 8, 64), generate_batches=(1, 8),
                     compiled_batches=(1, 8), compiled_prefill_batches=(), decode_tokens: int = 64,
                     decode_context: int = 512, repeats: int = 3, generate_repeats: int = 7,
                     device: str = "cuda", data: str | None = None, text_column: str = "text",
                     fp8_gate: bool = False, fp8_up_down: bool = False) -> dict:
    """All rows (PATHS) for the dense and the TwELL load of the checkpoint at `path`: prefill at each of
    `prefill_batches` (prefill_shapes: B sequences of seq_len tokens, or "BxS"; compiled: at each of
    `compiled_prefill_batches` x seq_len), eager generate and the
    graph step at each of `generate_batches`, compiled generate, the compiled graph step and generate_graphed at
    each of `compiled_batches` (empty: none);
    `repeats` timed calls a load, `generate_repeats` for the generate rows; inputs from the text of `data`
    (rows read from `text_column`; None: random token ids, with a warning). `fp8_gate`: the TwELL load's gate pass
    in fp8 (its use_fp8_gate()); `fp8_up_down`: its out pass on e4m3 up and down rows (its use_fp8_up_down())."""
    device = require_cuda(device, "sparsify bench", BENCH_ON_CPU)
    shapes = prefill_shapes(prefill_batches, seq_len)
    sizes = (seq_len, decode_tokens, decode_context, repeats, generate_repeats, *generate_batches,
             *compiled_batches, *compiled_prefill_batches)
    if not prefill_batches or min(sizes) < 1:
        raise ConfigError("--seq-len, --decode-tokens, --decode-context, --repeats, --generate-repeats and the batch "
                          "sizes must be positive, with at least one prefill batch")
    config, _ = load_config(path)  # SourceError / UnsupportedModelError for what cannot be a checkpoint
    path = resolve_source(path)
    if not getattr(config, "twell", None):
        raise ConfigError(f"{path}: not a sparsify checkpoint (config.json has no twell section)")
    if data is not None:
        tokenizer = load_tokenizer(str(path))
        require_tokenizer(tokenizer, path, config)
        resolve_data(data)  # missing / empty / unknown format: before loading any weight
    models = _loads(path, device, fp8_gate, fp8_up_down)
    if data is None:
        warn(RANDOM_IDS_WARNING)
        gen = torch.Generator().manual_seed(0)

        def ids(batch, length):
            return torch.randint(0, config.vocab_size, (batch, length), generator=gen).to(device)
    else:
        ids = text_inputs(data, tokenizer, device, text_column)

    prefill_ids = {shape: ids(*shape) for shape in shapes}
    largest = prefill_ids[max(shapes, key=lambda shape: shape[0] * shape[1])]
    with torch.inference_mode():
        # logits on the largest timed prefill input itself (last position only), so that the check runs the
        # layers at a token count the figures are for: a smaller input could fall outside a sparse window
        last = [m(largest, logits_to_keep=1, use_cache=False).logits[:, -1] for m in models.values()]
        prompts = ids(CHECK_BATCH, PROMPT_TOKENS)
        check = logits_agreement(*last, *(_generate(m, prompts, CHECK_NEW) for m in models.values()))
        active = mean_active(models["dense"], largest)
        fp8_active = fp8_gate_mean_active(models["twell"], largest) if fp8_gate else None
    rows, start = [], time.perf_counter()

    def add(row):  # progress: each row as it is done
        rows.append(row)
        print(f"{row['path']}, batch {row['batch']}: {row['dense']['ms']:.2f} / {row['twell']['ms']:.2f} ms, "
              f"{row['speedup']:.2f}x ({time.perf_counter() - start:.0f} s)", flush=True)

    for shape in shapes:
        add(prefill_row(models, prefill_ids[shape], repeats))
    for batch in generate_batches:
        add(generate_row(models, ids(batch, PROMPT_TOKENS), decode_tokens, generate_repeats))
        add(graph_step_row(models, ids(batch, decode_context)))
    if compiled_batches or compiled_prefill_batches:
        if hasattr(torch._dynamo.config, "recompile_limit"):  # dense and twell steps at each batch: one code object
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for batch in compiled_prefill_batches:
        shape = batch, seq_len
        add(compiled_prefill_row(models, prefill_ids[shape] if shape in prefill_ids else ids(*shape), repeats))
    for batch in compiled_batches:
        add(compiled_generate_row(models, ids(batch, PROMPT_TOKENS), decode_tokens, generate_repeats))
        add(graph_step_row(models, ids(batch, decode_context), compiled=True))
        add(graphed_generate_row(models, ids(batch, PROMPT_TOKENS), decode_tokens, generate_repeats))
    return {
        "checkpoint": str(path), "device": torch.cuda.get_device_name(device), "versions": versions(),
        "inputs": f"text: {data}" if data is not None else "random token ids",
        "seq_len": seq_len, "decode_tokens": decode_tokens, "decode_context": decode_context,
        "prompt_tokens": PROMPT_TOKENS, "repeats": repeats, "generate_repeats": generate_repeats, "paths": PATHS,
        "rows": rows, "component_time": "union", "check": check, "plan": plan_summary(config), "fp8_gate": fp8_gate,
        "fp8_up_down": fp8_up_down, "mean_active": active, "mean_active_all_layers": statistics.fmean(active),
        **({"fp8_gate_mean_active": fp8_active, "fp8_gate_mean_active_all_layers": statistics.fmean(fp8_active)}
           if fp8_gate else {}),
    }


def bench_table(result: dict):
    """Rich tables of a `bench_checkpoint` result: the rows, then each row's breakdown."""
    from rich.console import Group
    from rich.table import Table

    c = result["check"]
    title = (f"{result['checkpoint']} on {result['device']}: mean active units {result['mean_active_all_layers']:.1f}, "
             f"{result['plan']['sparse_layers']}/{len(result['plan']['layers'])} layers sparse"
             + (f", TwELL's gate pass in fp8 (its mean active units {result['fp8_gate_mean_active_all_layers']:.1f})"
                if result.get("fp8_gate") else "")
             + (", its out pass on e4m3 up and down rows" if result.get("fp8_up_down") else ""))
    rows = Table(title=title, caption=f"logits rel. err {c['logits_rel_err']:.1e}; greedy tokens agreeing "
                                      f"{100 * c['greedy_match']:.0f}% (common prefix {c['greedy_common_prefix']:.1f} "
                                      f"of {CHECK_NEW}); paths: {'; '.join(f'{k}: {v}' for k, v in PATHS.items())}")
    for column in ("path", "batch", "tokens", "dense ms", "twell ms", "dense tokens/s", "twell tokens/s",
                   "speed-up (pairs)", "check"):
        rows.add_column(column, justify="left" if column == "path" else "right")
    parts = ("wall", "gpu_busy", "gpu_idle", *COMPONENTS)
    split = Table(title="breakdown: ms per call (GPU ms per component; idle = wall - busy)")
    for column in ("path", "batch", "load", *parts):
        split.add_column(column, justify="left" if column in ("path", "load") else "right")
    for row in result["rows"]:
        check = (f"greedy {100 * row['greedy_match']:.0f}%" if "greedy_match" in row else
                 f"rel. err {row['logits_rel_err']:.1e}" if "logits_rel_err" in row else "")
        if "graph_vs_eager_rel_err" in row:
            check += "; graph vs eager " + "/".join(f"{e:.1e}" for e in row["graph_vs_eager_rel_err"].values())
        if "matches_generate" in row:
            check += "; as generate " + "/".join(f"{100 * m:.0f}%" for m in row["matches_generate"].values())
        if "loop_speedup" in row:
            check += f"; vs dense loop {row['loop_speedup']:.2f}x"
        for switch in SWITCHED_OFF.values():
            if switch.speedup in row:
                check += f"; {switch.label} {row[switch.speedup]:.2f}x (rel. err {row[switch.error]:.1e})"
        if "compile_s" in row:
            check += f"; compile {row['compile_s']['dense']:.0f}/{row['compile_s']['twell']:.0f} s"
        batch = f"{row['batch']}x{row['length']}" if "length" in row else str(row["batch"])  # prefill shapes
        rows.add_row(row["path"], batch, str(row["tokens"]), f"{row['dense']['ms']:.2f}",
                     f"{row['twell']['ms']:.2f}", f"{row['dense']['tokens_per_s']:,.0f}",
                     f"{row['twell']['tokens_per_s']:,.0f}",
                     f"{row['speedup']:.2f}x" + (f" ({row['paired_speedup']:.2f}x)" if "paired_speedup" in row else ""),
                     check)
        for load in row["breakdown"]:
            b = row["breakdown"][load]
            split.add_row(row["path"], batch, load, *(f"{b[f'{p}_ms']:.2f}" for p in parts))
    return Group(rows, split)


def write_json(result: dict, path: str | Path) -> Path:
    """`result` as JSON at `path`, replaced whole (a run killed mid-write leaves the previous file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(result, indent=1) + "\n")
    partial.replace(path)
    return path
