"""The fused LM head losses (twell.training.head_loss; interpreter on CPU, also bf16 on GPU) against their PyTorch
reference: each row's CE, KL and softmax statistics, the gradient written over the logits, and the
autograd.Function's terms and gradients through the kernels against the same Function through the reference.
test_head_loss.py compares either with the whole logits.

Tolerances: the kernels and the reference compute the same fp32 terms in another order (an online max and sum of
exponentials over blocks of the vocabulary against torch's reductions), a few fp32 ulps of the row's log-sum-exp:
rtol / atol 1e-5 on the terms; the gradient of the logits (the kernels' exp(z - m) / s and p_t (exp(d) - 1)
against torch's softmaxes) within 1e-5 of the softmaxes in fp32, and rounded to their dtype both ways, within two
steps of it."""
import pytest
import torch

from helpers import head_loss_inputs_on_gpu, poison_allocations
from twell.training import head_loss
from twell.training.head_loss import (IGNORE_INDEX, STATS, TEACHER_STATS, add_product, grad_logits_,
                                      grad_logits_reference, head_losses, product_widens, row_losses,
                                      row_losses_reference, row_stats_reference)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MODULE = "twell.training.head_loss"
# (rows, vocabulary, the kernels' block): one row; a ragged last block; whole blocks; one block wider than a row
SHAPES = [(1, 37, 16), (9, 300, 64), (5, 256, 64), (12, 130, 256)]
TEACHERS = [(False, 1.0), (True, 1.0), (True, 2.5)]  # (a teacher, T)
STEP = {torch.float32: 2 ** -23, torch.float16: 2 ** -10}  # a step of the dtype at 1


def logits_and_labels(rows, vocab, dtype, teacher, ignored="some", seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits, teacher_logits = (3 * torch.randn(rows, vocab, generator=generator) for _ in range(2))
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    if ignored == "all":
        labels[:] = IGNORE_INDEX
    else:
        labels[::3] = IGNORE_INDEX
    return (logits.to(DEV, dtype), teacher_logits.to(DEV, dtype) if teacher else None, labels.to(DEV))


@pytest.mark.parametrize("rows, vocab, block", SHAPES)
@pytest.mark.parametrize("teacher, temperature", TEACHERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ignored", ["some", "all"])
def test_row_losses_match_the_reference(rows, vocab, block, teacher, temperature, dtype, ignored, monkeypatch):
    """Each row's CE (0 where the label is IGNORE_INDEX), KL at T and the log-sum-exps kept for the backward,
    every element of the NaN-poisoned outputs written."""
    monkeypatch.setattr(head_loss, "MAX_BLOCK", block)
    logits, teacher_logits, labels = logits_and_labels(rows, vocab, dtype, teacher, ignored)
    allocations = poison_allocations(monkeypatch, MODULE)
    ce, kl, stats = row_losses(logits, labels, teacher_logits, temperature)
    assert allocations == [(rows,)] + [(rows,)] * teacher + [(rows, TEACHER_STATS if teacher else STATS)]
    want_ce, want_kl = row_losses_reference(logits, labels, teacher_logits, temperature)
    torch.testing.assert_close(ce, want_ce, rtol=1e-5, atol=1e-5)
    assert (ce[labels == IGNORE_INDEX] == 0).all()
    torch.testing.assert_close(stats, row_stats_reference(logits, teacher_logits, temperature), rtol=1e-5, atol=1e-5)
    if teacher:
        torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-5)
    else:
        assert kl is None


@pytest.mark.parametrize("rows, vocab, block", SHAPES)
@pytest.mark.parametrize("teacher, temperature", TEACHERS + [(False, 2.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ignored", ["some", "all"])
def test_grad_logits_written_over_the_logits_match_the_reference(rows, vocab, block, teacher, temperature, dtype,
                                                                  ignored, monkeypatch):
    """ce_scale (softmax - onehot), 0 on ignored rows, + kl_scale (softmax(z / T) - softmax(t / T)) from the
    row_losses statistics, over the logits themselves (every element: the logits are not their gradient), within a
    step of their dtype of the reference's."""
    monkeypatch.setattr(head_loss, "MAX_BLOCK", block)
    logits, teacher_logits, labels = logits_and_labels(rows, vocab, dtype, teacher, ignored)
    stats = row_losses(logits, labels, teacher_logits, temperature)[2]
    scales = torch.tensor([0.3, 0.7], device=DEV)
    want = grad_logits_reference(logits, labels, teacher_logits, scales, temperature)
    got = grad_logits_(logits.clone(), labels, teacher_logits, stats, scales, temperature)
    assert got.dtype == dtype and not got.isnan().any()
    # exp(z - lse) against torch's softmax: the fp32 rounding of z - lse (up to ~30 here), relative 30 * 2^-24 of
    # each softmax (their difference cancels), then the rounding to the logits' dtype
    z = logits.float()
    size = scales[0] * z.softmax(-1) + (scales[1] * ((z / temperature).softmax(-1) + (
        teacher_logits.float() / temperature).softmax(-1)) if teacher else 0)
    bound = 1e-5 * size + 2 * STEP[dtype] * want.float().abs() + (1e-7 if dtype == torch.float16 else 1e-9)
    assert ((got.float() - want.float()).abs() <= bound).all()
    if ignored == "all" and not teacher:
        assert (got == 0).all()


@pytest.mark.parametrize("teacher", [False, True])
def test_no_rows_launch_nothing_and_give_empty_terms(teacher, monkeypatch):
    """A chunk of no tokens: empty terms and statistics, the (empty) logits returned as their gradient; and the
    Function on no tokens: both means over no positions NaN (as transformers' CE over no labels), and the
    gradients empty or zero."""
    logits, teacher_logits, labels = logits_and_labels(0, 37, torch.float32, teacher)
    for kernel in ("_row_losses_kernel", "_grad_logits_kernel"):  # a launch would fail
        monkeypatch.setattr(head_loss, kernel, None)
    ce, kl, stats = row_losses(logits, labels, teacher_logits)
    assert ce.shape == (0,) and stats.shape == (0, TEACHER_STATS if teacher else STATS) and (kl is None) != teacher
    assert grad_logits_(logits, labels, teacher_logits, stats, torch.ones(2, device=DEV)) is logits
    hidden, weight = torch.zeros(0, 8, device=DEV, requires_grad=True), torch.randn(37, 8, device=DEV,
                                                                                   requires_grad=True)
    teacher_inputs = (torch.zeros(0, 8, device=DEV), torch.randn(37, 8, device=DEV)) if teacher else (None, None)
    terms = head_losses(hidden, weight, labels, *teacher_inputs)
    assert terms.isnan().all()
    terms.nan_to_num().sum().backward()
    assert hidden.grad.shape == (0, 8) and (weight.grad == 0).all()


def test_kl_gradient_of_a_model_near_its_teacher_keeps_its_digits(monkeypatch):
    """softmax(z / T) - softmax(t / T) where t is z moved by 1e-3 (a model at the start of its distillation from its
    source): taken as p_t (exp(d) - 1), about as far from the float64 difference as torch's fp32 softmaxes are
    (within 2.5x: the interpreter's exp is numpy's, whose last bits depend on the CPU's vector instructions; the
    difference of two softmaxes from their log-sum-exps, exp(z / T - lse) - exp(t / T - lse_t), is 2-4x as far)."""
    monkeypatch.setattr(head_loss, "MAX_BLOCK", 64)
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(8, 300, generator=generator)
    teacher_logits = logits + 1e-3 * torch.randn(8, 300, generator=generator)
    labels = torch.zeros(8, dtype=torch.long)
    scales = torch.tensor([0.0, 1.0])
    logits, teacher_logits, labels, scales = (t.to(DEV) for t in (logits, teacher_logits, labels, scales))
    exact = (logits.double() / 2).softmax(-1) - (teacher_logits.double() / 2).softmax(-1)
    stats = row_losses(logits, labels, teacher_logits, 2.0)[2]
    mine = grad_logits_(logits.clone(), labels, teacher_logits, stats, scales, 2.0)
    theirs = grad_logits_reference(logits, labels, teacher_logits, scales, 2.0)
    assert (mine.double() - exact).norm() <= 2.5 * (theirs.double() - exact).norm()


def head_inputs(tokens, dim, vocab, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden, weight, teacher_hidden, teacher_weight = (
        torch.randn(*shape, generator=generator).to(DEV, dtype)
        for shape in ((tokens, dim), (vocab, dim), (tokens, dim), (vocab, dim)))
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[:5] = IGNORE_INDEX  # the first chunk (of 5 rows) has no label
    labels[7::4] = IGNORE_INDEX
    return hidden.requires_grad_(), weight.requires_grad_(), teacher_hidden, teacher_weight, labels.to(DEV)


def terms_and_gradients(hidden, weight, labels, teacher_inputs, temperature, rows):
    terms = head_losses(hidden, weight, labels, *teacher_inputs, temperature, rows)
    return (terms, *torch.autograd.grad(0.3 * terms[0] + 0.7 * terms[1], (hidden, weight)))


@pytest.mark.parametrize("teacher, temperature", TEACHERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_losses_through_the_kernels_match_the_reference_path(teacher, temperature, dtype, monkeypatch):
    """The autograd.Function (chunks of 5 of 23 tokens, a vocabulary of 3.2 blocks) through the kernels and
    through the reference (the path of CPU tensors without the interpreter): the same terms, and gradients within
    rounding of the gradient of the logits to their dtype. Every buffer the kernels' path allocates starts NaN."""
    monkeypatch.setattr(head_loss, "MAX_BLOCK", 32)
    hidden, weight, teacher_hidden, teacher_weight, labels = head_inputs(23, 8, 103, dtype)
    teacher_inputs = (teacher_hidden, teacher_weight) if teacher else (None, None)
    with monkeypatch.context() as patch:
        patch.setattr(head_loss, "use_triton", lambda t: False)
        patch.setattr(head_loss, "row_losses", None)  # not called on this path
        want = terms_and_gradients(hidden, weight, labels, teacher_inputs, temperature, 5)
    allocations = poison_allocations(monkeypatch, MODULE)
    got = terms_and_gradients(hidden, weight, labels, teacher_inputs, temperature, 5)
    assert (23, TEACHER_STATS if teacher else STATS) in allocations  # the statistics: the kernels' path was taken
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert (got[0][1] > 0) == teacher
    for mine, reference in zip(got[1:], want[1:]):
        assert mine.dtype == reference.dtype and not mine.isnan().any()
        tolerance = 1e-5 if dtype == torch.float32 else 2 ** -9
        assert (mine.float() - reference.float()).norm() <= tolerance * reference.float().norm()


@pytest.mark.gpu
@pytest.mark.parametrize("teacher", [False, True])
def test_kernels_in_bf16_autocast_no_further_from_fp32_than_the_reference_on_gpu(teacher, monkeypatch):
    """Under bf16 autocast (the trainer's), at a real vocabulary (49152) and a partial last chunk: the terms and
    gradients through the kernels no further from the fp32 truth (the reference path in fp32) than the reference
    path's under the same autocast."""
    hidden, weight, labels, teacher_inputs = head_loss_inputs_on_gpu(teacher)
    with monkeypatch.context() as patch:
        patch.setattr(head_loss, "use_triton", lambda t: False)
        truth = terms_and_gradients(hidden, weight, labels, teacher_inputs, 2.0, 1024)
        with torch.autocast("cuda", torch.bfloat16):
            reference = terms_and_gradients(hidden, weight, labels, teacher_inputs, 2.0, 1024)
    with torch.autocast("cuda", torch.bfloat16):
        fused = terms_and_gradients(hidden, weight, labels, teacher_inputs, 2.0, 1024)
    for mine, theirs, exact in zip(fused, reference, truth):
        assert (mine.float() - exact).norm() <= 1.5 * (theirs.float() - exact).norm() + 1e-6 * exact.norm()


@pytest.mark.gpu
def test_weight_gradient_sums_bf16_products_in_fp32_on_gpu():
    """add_product adds a bf16 product into fp32: through addmm's out_dtype where torch takes it (product_widens),
    as close to the fp32 product of the same operands as cuBLAS's fp32 accumulation; else within bf16 rounding."""
    generator = torch.Generator("cuda").manual_seed(0)
    a, b = (torch.randn(*shape, generator=generator, device="cuda").bfloat16() for shape in ((512, 300), (300, 256)))
    out = torch.zeros(512, 256, device="cuda")
    for _ in range(3):
        add_product(out, a, b)
    exact = 3 * (a.double() @ b.double())
    tolerance = 1e-5 if product_widens(out.device, torch.bfloat16) else 2 ** -7
    assert (out.double() - exact).norm() <= tolerance * exact.norm()
