"""The LM head and the loss in chunks (sparsify.train.head_loss) against the whole logits: the cross-entropy as
transformers computes it and loss.distillation_kl, their gradients, and training with chunked_loss on and off.
The chunks run on twell.training.head_loss's kernels (under the interpreter on CPU). Tolerance: the same fp32
arithmetic summed in another order (over chunks and blocks of the vocabulary; the gradient by hand against
autograd's), a few ulps: rtol 1e-5 on the terms and 1e-4 / atol 1e-6 on the gradients (the trained weights:
test_chunked_loss_trains_as_the_whole_logits)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import SMALL_CHUNK_BYTES, VOCAB_SIZE, head_loss_inputs_on_gpu, tiny_model
from sparsify.config import TrainConfig
from sparsify.relufy import relufy
from sparsify.train import head_loss, train
from sparsify.train.head_loss import IGNORE_INDEX, chunked_head, head_losses, whole_logits
from sparsify.train.loss import distillation_kl, loss_terms
from sparsify.train.routing import tracked
from twell.training import head_loss as fused
from test_train import batches_from, config

BATCH, SEQ = 2, 11  # 22 tokens: a chunk of 5 rows leaves a partial one
WEIGHTS = (0.3, 0.7)  # the backward's weights of CE and KL: each term's gradient counts


def whole_terms(hidden, weight, labels, teacher_hidden, teacher_weight, temperature):
    logits = hidden @ weight.T
    ce = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)
    kl = distillation_kl(logits, teacher_hidden @ teacher_weight.T, temperature) if teacher_hidden is not None \
        else torch.zeros_like(ce)
    return torch.stack([ce, kl])


def weighted_grads(terms, inputs):
    return torch.autograd.grad(sum(w * t for w, t in zip(WEIGHTS, terms)), inputs)


@pytest.mark.parametrize("rows", [5, BATCH * SEQ, 1000])  # a partial last chunk; one chunk; tokens < a chunk
@pytest.mark.parametrize("teacher, temperature", [(False, 1.0), (True, 1.0), (True, 2.5)])
def test_chunked_terms_and_gradients_equal_the_whole_logits(rows, teacher, temperature):
    """CE over the labelled positions (-100 ignored), T^2 KL(teacher || model) over all, and their gradients in
    the hidden states and the head's weight, whatever the chunks."""
    generator = torch.Generator().manual_seed(0)
    tokens, dim, vocab = BATCH * SEQ, 8, 30
    hidden, weight, teacher_hidden, teacher_weight = (torch.randn(*shape, generator=generator) for shape in
                                                      ((tokens, dim), (vocab, dim), (tokens, dim), (vocab, dim)))
    hidden.requires_grad_(), weight.requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::4] = IGNORE_INDEX
    teacher_inputs = (teacher_hidden, teacher_weight) if teacher else (None, None)
    chunked = head_losses(hidden, weight, labels, *teacher_inputs, temperature, rows)
    whole = whole_terms(hidden, weight, labels, *teacher_inputs, temperature)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)
    assert (chunked[1] > 0) == teacher
    for mine, reference in zip(weighted_grads(chunked, (hidden, weight)), weighted_grads(whole, (hidden, weight))):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("rows", [5, BATCH * SEQ, 1000])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_in_the_model_equals_its_loss_and_gradients(rows, tied, monkeypatch):
    """Through a tiny Llama's own forward (the head's forward replaced for the call): the CE equals transformers'
    loss of the same labels (-100 among them), the KL distillation_kl of the whole logits, and every parameter's
    gradient the whole-logits one; a tied head's weight (the embeddings') gets both its gradients once."""
    monkeypatch.setattr(fused, "CHUNK_BYTES", 4 * VOCAB_SIZE * rows)  # `rows` tokens of the tiny vocabulary
    model, _ = tiny_model("llama", tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    teacher, _ = tiny_model("llama", seed=1)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 3:6] = IGNORE_INDEX
    params = list(model.parameters())
    with torch.no_grad():
        teacher_hidden = teacher.base_model(input_ids=ids).last_hidden_state
        teacher_logits = teacher(input_ids=ids).logits
    with chunked_head(model, labels, teacher_hidden, teacher.lm_head.weight, temperature=2.0):
        chunked = model(input_ids=ids).logits
    assert "forward" not in vars(model.lm_head)  # the head's own forward again after the call
    output = model(input_ids=ids, labels=labels)
    whole = torch.stack([output.loss, distillation_kl(output.logits, teacher_logits, 2.0)])
    # fp32 sums over the chunks in another order than over the whole logits (whose last bits depend on the CPU's
    # vector instructions)
    torch.testing.assert_close(chunked, whole, rtol=3e-5, atol=0)
    for mine, reference in zip(weighted_grads(chunked, params), weighted_grads(whole, params)):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-6)


def test_logits_transformed_after_the_head_or_in_one_chunk_take_the_whole_logits(monkeypatch):
    """Gemma 2's soft-capping (and a head with a bias) needs the whole logits: loss_terms takes them with
    chunked_loss on, the same terms as with it off; a model without takes the chunks where its micro-batch's fp32
    logits exceed one chunk, the whole logits where they fit in one."""
    calls = []
    monkeypatch.setattr(head_loss, "head_losses", lambda *args: calls.append(1) or head_losses(*args))
    ids = next(batches_from()(0, 0, 1))
    one_chunk = 4 * ids.numel() * VOCAB_SIZE
    monkeypatch.setattr(fused, "CHUNK_BYTES", one_chunk - 1)
    gemma, _ = tiny_model("gemma2")
    assert gemma.config.final_logit_softcapping and whole_logits(gemma)
    llama, _ = tiny_model("llama")
    assert not whole_logits(llama)
    llama.lm_head.bias = torch.nn.Parameter(torch.zeros(llama.config.vocab_size))
    assert whole_logits(llama)
    teacher = copy.deepcopy(gemma)
    mlps = relufy(gemma)
    with tracked(mlps, 128):
        terms = [loss_terms(gemma, mlps, ids, teacher, config(distill=0.5, distill_temperature=2.0,
                                                              chunked_loss=chunked))[0] for chunked in (True, False)]
        assert not calls
        torch.testing.assert_close(torch.stack(terms[0]), torch.stack(terms[1]), rtol=0, atol=0)
        assert terms[0].kl > 0
        model, _ = tiny_model("gemma3_text")  # no soft-capping
        mlps = relufy(model)
    with tracked(mlps, 128):
        loss_terms(model, mlps, ids, None, config())
        assert calls == [1]
        monkeypatch.setattr(fused, "CHUNK_BYTES", one_chunk)
        loss_terms(model, mlps, ids, None, config())
    assert calls == [1]


@pytest.mark.parametrize("family, tied, settings", [
    ("llama", False, dict(distill=0.5, distill_temperature=2.0, distill_hidden=1.0)),
    ("qwen2", True, dict()),
])
def test_chunked_loss_trains_as_the_whole_logits(family, tied, settings, monkeypatch):
    """3 steps with chunked_loss (chunks of 5 of the 32 tokens) and without: the same logged terms and the same
    weights within fp32 rounding (the KL, near 0 between a model and its source, a difference of sums of several
    nats: its rounding is absolute, about 1e-7). The kernels' softmaxes round otherwise than torch's, and Adam's
    first steps (about lr * g / |g|) turn that rounding in a gradient near 0 into a weight's difference of a few
    1e-6 (of steps of 1e-3): atol 1e-5 on the weights."""
    monkeypatch.setattr(fused, "CHUNK_BYTES", SMALL_CHUNK_BYTES)
    calls = []
    monkeypatch.setattr(head_loss, "head_losses", lambda *args: calls.append(1) or head_losses(*args))
    runs = []
    for chunked in (True, False):
        model, _ = tiny_model(family, tie_word_embeddings=tied)
        teacher = copy.deepcopy(model) if settings else None
        result = train(model, relufy(model), batches_from(), config(steps=3, chunked_loss=chunked, **settings),
                       device="cpu", show_progress=False, teacher=teacher)
        runs.append((result.log, result.model.state_dict(), len(calls)))
    (chunked_log, chunked_weights, chunked_calls), (log, weights, calls_after) = runs
    assert chunked_calls == 3 and calls_after == chunked_calls  # a call a step, none without chunked_loss
    assert ("kl" in log[0]) == bool(settings) and chunked_log[0].keys() == log[0].keys()
    for key in {"loss", "cross_entropy", "kl", "hidden", "l1"} & log[0].keys():
        assert [e[key] for e in chunked_log] == pytest.approx([e[key] for e in log], rel=1e-5, abs=1e-6), key
    for name, w in weights.items():
        torch.testing.assert_close(chunked_weights[name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_chunked_loss_is_a_setting_a_resumed_run_may_change():
    from sparsify.resume import RESUME_FREE

    assert TrainConfig().chunked_loss and "chunked_loss" in RESUME_FREE


@pytest.mark.gpu
@pytest.mark.parametrize("teacher", [False, True])
def test_chunked_terms_in_bf16_autocast_on_gpu(teacher):
    """Under bf16 autocast (the trainer's), at a real vocabulary and a partial last chunk: the terms and
    gradients no further from the fp32 truth than the whole logits' under the same autocast."""
    hidden, weight, labels, teacher_inputs = head_loss_inputs_on_gpu(teacher)
    truth = whole_terms(hidden, weight, labels, *teacher_inputs, 2.0)
    truth_grads = weighted_grads(truth, (hidden, weight))
    with torch.autocast("cuda", torch.bfloat16):
        chunked = head_losses(hidden, weight, labels, *teacher_inputs, 2.0, rows=1024)
        whole = whole_terms(hidden, weight, labels, *teacher_inputs, 2.0)
    for mine, reference, exact in zip(weighted_grads(chunked, (hidden, weight)) + (chunked,),
                                      weighted_grads(whole, (hidden, weight)) + (whole,), truth_grads + (truth,)):
        assert (mine.float() - exact).norm() <= 1.5 * (reference.float() - exact).norm() + 1e-6 * exact.norm()
