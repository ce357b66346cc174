"""The LM head and the loss in chunks of tokens: neither the model's [tokens, vocabulary] logits nor the
teacher's, nor their gradients, exist whole (at 8 x 2048 tokens and a vocabulary of 49152 each fp32 copy is
3.2 GB, and the whole-logits loss keeps several, more with a teacher's; docs/performance.md has the step's peak).

`head_losses` (twell.training.head_loss: the op, its Triton kernels and their PyTorch reference) gives the
cross-entropy (as transformers' ForCausalLMLoss: shifted labels, -100 ignored, the mean over the rest) and the
KL(teacher || model) of `loss.distillation_kl` (every position), in fp32 as those do. It keeps only its inputs (in
the matmul's dtype) and a few fp32 statistics a token for the backward, which computes each chunk's logits again
(the teacher's too) and writes their gradient over them: a head matmul more a step (two with a teacher), where
Liger-Kernel's gradients computed in the forward would keep a head-weight-sized gradient for each term (the
trainer weighs and logs CE and KL apart).

Where it runs: under FSDP2 the head's weight is whole only within the call of the FSDP unit that holds it
(accelerate 1.15 makes the final norm and the head one unit; before, the root module), whose forward hooks
gather it and put the backward's hooks (the gather where resharded, the gradient's reduce-scatter) on the
unit's outputs. So `chunked_head` makes the head's own forward compute the terms, returned in place of the
logits: every FSDP2 hook runs as for the logits, and a tied weight (the embeddings') gets its gradient once,
through the one parameter. A forward that changes the logits after the head (`whole_logits`: Gemma 2's
soft-capping, a head with a bias) needs the whole logits instead, and a micro-batch whose fp32 logits fit in one
chunk (`spans_chunks`) takes them too: there the chunks would save at most the whole loss's few extra copies of
logits under 256 MiB, for the backward's head matmul.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from twell.training import head_loss as head_loss_op
from twell.training.head_loss import IGNORE_INDEX, head_losses

# config keys of a forward that transforms the logits after the head (where set): Gemma 2's soft-capping, Cohere's and
# Granite's scales
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def whole_logits(model) -> bool:
    """Whether `model`'s loss needs its whole logits: its forward transforms them after the LM head, or the head
    is not a plain matmul (a bias, another module)."""
    head = model.get_output_embeddings()
    return (not isinstance(head, nn.Linear) or head.bias is not None
            or any(getattr(model.config, key, None) is not None for key in LOGIT_TRANSFORMS))


def spans_chunks(model, ids: torch.Tensor) -> bool:
    """Whether `model`'s fp32 logits on `ids` exceed one chunk of head_losses (CHUNK_BYTES); its head a plain
    matmul (not whole_logits). The head's weight shape is the whole vocabulary's under FSDP2 too (a DTensor's)."""
    return 4 * ids.numel() * model.get_output_embeddings().weight.shape[0] > head_loss_op.CHUNK_BYTES


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
