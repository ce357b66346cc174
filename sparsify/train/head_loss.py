"""The LM head and the loss in chunks of tokens: neither the model's [tokens, vocabulary] logits nor the
teacher's, nor their gradients, exist whole (at 8 x 2048 tokens and a vocabulary of 49152 each fp32 copy is
3.2 GB, and the whole-logits loss keeps several, more with a teacher's; docs/performance.md has the step's peak).

`head_losses` gives the cross-entropy (as transformers' ForCausalLMLoss: shifted labels, -100 ignored, the mean
over the rest) and the KL(teacher || model) of `loss.distillation_kl` (every position), each chunk's logits in
fp32 as those do. It keeps only its inputs (in the matmul's dtype) for the backward, which computes each chunk's
logits again (the teacher's too) and their gradient by hand: a head matmul more a step (two with a teacher),
where Liger-Kernel's gradients computed in the forward would keep a head-weight-sized gradient for each term
(the trainer weighs and logs CE and KL apart).

Where it runs: under FSDP2 the head's weight is whole only within the call of the FSDP unit that holds it
(accelerate 1.15 makes the final norm and the head one unit; before, the root module), whose forward hooks
gather it and put the backward's hooks (the gather where resharded, the gradient's reduce-scatter) on the
unit's outputs. So `chunked_head` makes the head's own forward compute the terms, returned in place of the
logits: every FSDP2 hook runs as for the logits, and a tied weight (the embeddings') gets its gradient once,
through the one parameter. A forward that changes the logits after the head (`whole_logits`: Gemma 2/3's
soft-capping, a head with a bias) needs the whole logits instead.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_BYTES = 256 * 2**20  # a chunk's fp32 logits; the backward holds about five such buffers at once
IGNORE_INDEX = -100  # transformers' label of a position without a loss
# config keys of a forward that transforms the logits after the head: Gemma 2/3's soft-capping, Cohere's and
# Granite's scales
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def whole_logits(model) -> bool:
    """Whether `model`'s loss needs its whole logits: its forward transforms them after the LM head, or the head
    is not a plain matmul (a bias, another module)."""
    head = model.get_output_embeddings()
    return (not isinstance(head, nn.Linear) or head.bias is not None
            or any(getattr(model.config, key, None) is not None for key in LOGIT_TRANSFORMS))


def _chunks(rows: int, size: int):
    return (slice(start, start + size) for start in range(0, rows, size))


class _HeadLosses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher_hidden, teacher_weight, temperature, rows):
        # the dtype autocast would give the head's matmul; the backward computes in the same, autocast or not
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        teacher = teacher_hidden is not None
        if teacher:
            teacher_hidden, teacher_weight = teacher_hidden.to(dtype), teacher_weight.to(dtype)
        ce = kl = torch.zeros((), device=hidden.device)
        for chunk in _chunks(len(hidden), rows):
            logits = F.linear(hidden[chunk], weight).float()
            ce = ce + F.cross_entropy(logits, labels[chunk], ignore_index=IGNORE_INDEX, reduction="sum")
            if teacher:
                target = F.log_softmax(F.linear(teacher_hidden[chunk], teacher_weight).float() / temperature, -1)
                kl = kl + F.kl_div(F.log_softmax(logits / temperature, -1), target, log_target=True,
                                   reduction="sum")
        count = (labels != IGNORE_INDEX).sum()
        ctx.save_for_backward(hidden, weight, labels, count, teacher_hidden, teacher_weight)
        ctx.temperature, ctx.rows = temperature, rows
        return torch.stack([ce / count, temperature ** 2 * kl / len(hidden)])

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, count, teacher_hidden, teacher_weight = ctx.saved_tensors
        temperature = ctx.temperature
        ce_scale = grad[0] / count
        kl_scale = grad[1] * temperature / len(hidden)  # d/dz of T^2 KL(p || softmax(z / T)) = T (softmax(z / T) - p)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)  # summed over chunks without bf16 roundings
        for chunk in _chunks(len(hidden), ctx.rows):
            logits = F.linear(hidden[chunk], weight).float()
            target = labels[chunk]
            grad_logits = logits.softmax(-1)  # d CE / d logits: softmax - one-hot of the label, 0 where ignored
            grad_logits.scatter_add_(-1, target.clamp_min(0)[:, None], grad_logits.new_full((len(target), 1), -1.0))
            grad_logits.mul_(((target != IGNORE_INDEX) * ce_scale)[:, None])
            if teacher_hidden is not None:
                kl_grad = (logits / temperature).softmax(-1)
                kl_grad.sub_((F.linear(teacher_hidden[chunk], teacher_weight).float() / temperature).softmax(-1))
                grad_logits.add_(kl_grad.mul_(kl_scale))
            grad_logits = grad_logits.to(hidden.dtype)
            grad_hidden[chunk] = grad_logits @ weight
            grad_weight.add_(grad_logits.T @ hidden[chunk])
        return grad_hidden, grad_weight, None, None, None, None, None


def head_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                teacher_hidden: torch.Tensor | None = None, teacher_weight: torch.Tensor | None = None,
                temperature: float = 1.0, rows: int | None = None) -> torch.Tensor:
    """[CE, KL] of the LM head `weight` [vocab, D] on the final hidden states `hidden` [tokens, D], computed `rows`
    tokens at a time (default: CHUNK_BYTES of fp32 logits): the cross-entropy against `labels` [tokens] (each
    position's next token, IGNORE_INDEX where none), averaged over the labelled positions; with the teacher's
    final hidden states and head, T^2 KL(teacher || model) at `temperature` averaged over all positions (else
    0). In the dtype autocast gives the head's matmul, the losses in fp32. Differentiable in `hidden` and
    `weight`."""
    rows = rows or max(1, CHUNK_BYTES // (4 * len(weight)))
    return _HeadLosses.apply(hidden, weight, labels, teacher_hidden, teacher_weight, temperature, rows)


@contextmanager
def chunked_head(model, labels: torch.Tensor, teacher_hidden: torch.Tensor | None = None,
                 teacher_weight: torch.Tensor | None = None, temperature: float = 1.0):
    """Within it, a call of `model` (a CausalLM, unwrapped; call it as prepared) returns head_losses' [CE, KL] as
    its `logits`: `labels` [batch, seq] as transformers takes them (the input ids, -100 where no loss), shifted
    here; the teacher's final hidden states [batch, seq, D] and LM head weight for the KL, or none. `model`'s
    forward must not transform the logits (whole_logits)."""
    head = model.get_output_embeddings()
    labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].flatten()  # as ForCausalLMLoss shifts them
    if teacher_hidden is not None:
        teacher_hidden = teacher_hidden.flatten(0, -2)

    def forward(hidden):
        # head.weight read here, inside the call: under FSDP2 the whole weight that its hooks gathered
        return head_losses(hidden.flatten(0, -2), head.weight, labels, teacher_hidden, teacher_weight, temperature)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
