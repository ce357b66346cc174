"""Held-out measurements beyond the conversions' own cross-entropy, the same for every model of a run.

Each model (the original, the control, every converted checkpoint) is loaded as the plain dense model its
config.json describes, without remote code (a converted checkpoint keeps the standard weight layout: a dense
ReLU Llama), in bf16 on a GPU, and measured on the same held-out blocks of each kind of document (code, prose):
next-token cross-entropy and top-1 accuracy. Greedy agreement with the original: from the same held-out prompts
each model continues greedily, and the share of its tokens equal to the original's at the same position and the
mean length of the prefix they share are reported. Each layer's active units a token (positive gate outputs) are
counted over the held-out blocks. Each converted model is also measured with its gate projections computed as the
opt-in fp8 gate computes them (`fp8_gate`: cross-entropy, accuracy and active units: the fp8 gate's error moves
units across zero, and the kernels' time follows the active units), with its up and down projections on the opt-in
e4m3 up and down rows (`fp8_up_down`) and with both (`fp8_gate_and_up_down`).
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from pathlib import Path
from statistics import mean

from corpus import read_documents
from pretrain import make_demo

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 64, 32, 32


def heldout_blocks(tok, corpus: Path, seq_len: int, tokens: int) -> dict:
    """{kind: [blocks, seq_len] token ids}: the held-out documents of each kind as one stream cut into blocks, at
    most `tokens` of it; kinds with less than one block are left out."""
    blocks = {}
    for kind, texts in read_documents(corpus / "valid.jsonl").items():
        stream = make_demo.token_ids(tok, texts)[:tokens]
        if len(stream) >= seq_len:
            blocks[kind] = stream[: len(stream) // seq_len * seq_len].view(-1, seq_len)
    if not blocks:
        raise SystemExit(f"{corpus / 'valid.jsonl'}: no kind of held-out document fills a block of {seq_len} tokens")
    return blocks


def greedy_prompts(blocks: dict):
    """[PROMPTS, PROMPT_TOKENS]: the first tokens of held-out blocks evenly spaced over all kinds' (fewer where
    there are fewer blocks)."""
    import torch

    starts = torch.cat([b[:, :PROMPT_TOKENS] for b in blocks.values()])
    return starts[torch.linspace(0, len(starts) - 1, min(PROMPTS, len(starts))).round().long().unique()]


def load(path: Path, device: str):
    """The model of `path` as transformers' own class for its config (no remote code), bf16 on a GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if not type(model).__module__.startswith("transformers.models."):
        raise SystemExit(f"{path}: loaded as {type(model).__module__}.{type(model).__name__}, not a transformers model")
    return model


def scores(model, blocks, batch: int, device: str) -> dict:
    """{"cross_entropy", "accuracy", "tokens"} of next-token prediction over `blocks` (each block's own tokens)."""
    import torch.nn.functional as F

    total = correct = count = 0
    for i in range(0, len(blocks), batch):
        x = blocks[i:i + batch].to(device)
        logits, targets = model(x).logits[:, :-1].float(), x[:, 1:]
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == targets).sum().item()
        count += targets.numel()
    return {"cross_entropy": total / count, "accuracy": correct / count, "tokens": count}


@contextmanager
def active_units(model):
    """Yields a list that on exit holds each decoder layer's mean count a token of units whose gate output is
    positive (a ReLU model's active units) over the forward passes made inside."""
    layers = model.model.layers
    active, tokens, counts = [0] * len(layers), [0] * len(layers), []

    def count(i, module, args, out):
        active[i] += (out > 0).sum().item()
        tokens[i] += out[..., 0].numel()

    handles = [layer.mlp.gate_proj.register_forward_hook(partial(count, i)) for i, layer in enumerate(layers)]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()
    counts.extend(a / t for a, t in zip(active, tokens))


def use_fp8_gate(model) -> None:
    """Each decoder layer's gate projection computed, in place, as twell's fp8 gate computes it
    (twell.fp8_gate.gate_reference: e4m3 x and weight, a scale a token and a unit, fp32 sums), on every token:
    the numerics of a checkpoint's use_fp8_gate() where its kernels serve, its dense fallbacks included."""
    from twell.fp8_gate import gate_reference, quantize_weight

    for layer in model.model.layers:
        projection = layer.mlp.gate_proj
        weight, scale = quantize_weight(projection.weight)

        def forward(x, weight=weight, scale=scale):
            return gate_reference(x.reshape(-1, x.shape[-1]), weight, scale).to(x.dtype).view(*x.shape[:-1], -1)
        projection.forward = forward


def use_fp8_up_down(model) -> None:
    """Each decoder layer's up and down projections computed, in place, from the e4m3 copies of their rows
    (twell.fp8_gate.quantize_up_down, dequantized: up_down_reference; fp32 sums), on every token: the numerics of a
    checkpoint's use_fp8_up_down() up to the bf16 rounding of u (the kernels round h = g * u once), as if its
    kernels walked every row (they read the bf16 weights for heavy rows, overflowing tiles and smaller calls:
    likely an overestimate of the change)."""
    from twell.fp8_gate import quantize_up_down, up_down_reference

    for layer in model.model.layers:
        mlp = layer.mlp
        up, down = up_down_reference(quantize_up_down(mlp.up_proj.weight, mlp.down_proj.weight))
        for projection, weight in ((mlp.up_proj, up), (mlp.down_proj, down)):
            def forward(x, weight=weight):
                return (x.float() @ weight.t()).to(x.dtype)
            projection.forward = forward


FP8_VARIANTS = {"fp8_gate": (use_fp8_gate,), "fp8_up_down": (use_fp8_up_down,),
                "fp8_gate_and_up_down": (use_fp8_gate, use_fp8_up_down)}


def plain_projections(model) -> None:
    """Undoes use_fp8_gate and use_fp8_up_down: the projections' own forward again."""
    for module in model.modules():
        vars(module).pop("forward", None)


def pooled(parts: list) -> dict:
    """scores() of several sets of blocks as one."""
    count = sum(k["tokens"] for k in parts)
    return {"cross_entropy": sum(k["cross_entropy"] * k["tokens"] for k in parts) / count,
            "accuracy": sum(k["accuracy"] * k["tokens"] for k in parts) / count, "tokens": count}


def fp8_variant_scores(model, blocks: list, batch: int, device: str) -> dict:
    """{variant: pooled scores with each layer's active units} over `blocks` (tensors of blocks) under each of
    FP8_VARIANTS in turn, the projections plain again after each."""
    import torch

    results = {}
    for name, variant in FP8_VARIANTS.items():
        for use in variant:
            use(model)
        with torch.no_grad(), active_units(model) as active:
            results[name] = dict(pooled([scores(model, b, batch, device) for b in blocks]), active_units=active)
        plain_projections(model)
    return results


def greedy(model, prompts, batch: int, device: str):
    """[prompts, NEW_TOKENS]: each prompt's greedy continuation (the argmax at each step, no end of text: the
    model's end-of-text token is a token like any other), decoded with the model's KV cache."""
    import torch

    out = []
    for i in range(0, len(prompts), batch):
        x = prompts[i:i + batch].to(device)
        generated = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                                   eos_token_id=None, use_cache=True)
        out.append(generated[:, x.shape[1]:].cpu())
    return torch.cat(out)


def agreement(tokens, reference) -> dict:
    """Greedy agreement of `tokens` with `reference` ([prompts, NEW_TOKENS] each): the share of equal tokens at the
    same position, and the mean length of the prefix they share."""
    same = tokens == reference
    return {"agreement": same.float().mean().item(),
            "common_prefix": same.int().cumprod(dim=1).sum(dim=1).float().mean().item(),
            "prompts": len(tokens), "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS}


def measure(path: Path, blocks: dict, prompts, reference, batch: int, device: str) -> dict:
    """The metrics of the model in `path`: per kind and over all held-out blocks, and greedy agreement with
    `reference` (the original's continuations; None: this is the original, whose continuations and prompts are
    returned under "generations" and "prompts" instead)."""
    import torch

    model = load(path, device)
    with torch.no_grad(), active_units(model) as active:
        kinds = {kind: scores(model, b, batch, device) for kind, b in blocks.items()}
    with torch.no_grad():
        generated = greedy(model, prompts, batch, device)
    result = dict(pooled(list(kinds.values())), by_kind=kinds, active_units=active)
    if reference is None:
        result.update(prompts=prompts.tolist(), generations=generated.tolist())
    else:
        result["greedy"] = agreement(generated, torch.tensor(reference))
        result.update(fp8_variant_scores(model, list(blocks.values()), batch, device))
    return result


def metrics_line(metrics: dict) -> str:
    kinds = "  ".join(f"{kind} CE {k['cross_entropy']:.4f} acc {100 * k['accuracy']:.2f}%"
                      for kind, k in metrics["by_kind"].items())
    line = f"held-out top-1 {100 * metrics['accuracy']:.2f}%  CE {metrics['cross_entropy']:.4f}  {kinds}"
    if "active_units" in metrics:
        line += f"  active {mean(metrics['active_units']):.1f} a token"
    if "greedy" in metrics:
        line += (f"  greedy agreement {100 * metrics['greedy']['agreement']:.1f}%, common prefix "
                 f"{metrics['greedy']['common_prefix']:.1f} of {NEW_TOKENS}")
    for name, label in (("fp8_gate", "fp8 gate"), ("fp8_up_down", "e4m3 up/down"), ("fp8_gate_and_up_down", "both")):
        if name in metrics:
            fp8 = metrics[name]
            line += f"  {label}: CE {fp8['cross_entropy']:.4f} top-1 {100 * fp8['accuracy']:.2f}%"
            if "active_units" in fp8:
                line += f" active {mean(fp8['active_units']):.1f}"
    return line
