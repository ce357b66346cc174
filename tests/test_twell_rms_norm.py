"""The fused RMSNorm (twell.rms_norm; interpreter on CPU, bf16 on GPU) against the PyTorch reference, which is
transformers' modules op for op: outputs, and gradients against autograd through the reference."""
import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from twell.reference import rms_norm_add_reference, rms_norm_reference
from twell.rms_norm import FORMS, MAX_WIDTH, rms_norm, rms_norm_add, rms_norm_add_fits, rms_norm_fits

from helpers import poison_allocations

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the outputs may differ from the reference by the rounding of an fp32 sum of squares added in another order
# (and the division by N): one or two steps of the output dtype
ULPS = {torch.float32: 2 ** -21, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}
# Gradients, norm-wise (dx = rstd * (g - x_hat * mean(g * x_hat)) cancels, so an element near zero has no relative
# bound). In fp32 the kernel and autograd differ only in the order of fp32 sums (a row's squares and g * x_hat,
# dweight's rows): a few units of 2^-24, bounded by 2^-18. In fp16 autograd also rounds dy * weight and each
# dy * x_hat to fp16 where the kernel keeps fp32, and both round the result: about three fp16 roundings (2^-11)
# apart, bounded by 2^-9.
GRAD_TOLERANCE = {torch.float32: 2 ** -18, torch.float16: 2 ** -9}


def inputs(shape, dtype, form, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(shape, generator=generator)
    weight = torch.randn(shape[-1], generator=generator) + (0 if form == "gemma" else 1)
    return x.to(DEV, dtype), weight.to(DEV, dtype)


def assert_rounding_close(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    bound = ULPS[out.dtype] * ref.float().abs() + 1e-6
    assert ((out.float() - ref.float()).abs() <= bound).all()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape,dtype", [
    ((1, 64), torch.float32),  # one row
    ((7, 100), torch.float32),  # N not a power of two, fewer rows than a program holds
    ((2, 70, 48), torch.float16),  # many rows over several programs, leading dimensions
    ((3, 5), torch.float16),
    ((2, 3000), torch.float32),  # one row a program, a ragged block
])
def test_rms_norm_matches_reference(shape, dtype, form, monkeypatch):
    """NaN-poisoned outputs: every element written."""
    allocations = poison_allocations(monkeypatch, "twell.rms_norm")
    x, weight = inputs(shape, dtype, form)
    assert_rounding_close(rms_norm(x, weight, 1e-6, form=form), rms_norm_reference(x, weight, 1e-6, form))
    assert len(allocations) == 1


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape,dtype", [((1, 64), torch.float32), ((7, 100), torch.float16),
                                         ((2, 70, 48), torch.float16), ((2, 3000), torch.float32)])
def test_rms_norm_add_matches_reference(shape, dtype, form, monkeypatch):
    """The residual add rounded as torch rounds it (equal bits) and the norm of that sum; residual rows with a stride
    of their own; NaN-poisoned outputs: every element of both written."""
    allocations = poison_allocations(monkeypatch, "twell.rms_norm")
    x, weight = inputs(shape, dtype, form)
    wide = torch.randn(*shape[:-1], shape[-1] + 8, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    residual = wide[..., :shape[-1]]
    out, summed = rms_norm_add(x, residual, weight, 1e-6, form=form)
    ref, ref_summed = rms_norm_add_reference(x, residual, weight, 1e-6, form)
    assert torch.equal(summed, ref_summed) and summed.is_contiguous()
    assert_rounding_close(out, ref)
    assert len(allocations) == 2


def test_rms_norm_add_refuses_what_it_does_not_take():
    x, weight = inputs((4, 32), torch.float32, "llama")
    assert rms_norm_add_fits(x, x.clone(), weight)
    for residual in (x[:3], x.half(), x.t().contiguous().t()):  # another shape, dtype, a column stride
        assert not rms_norm_add_fits(x, residual, weight)
        with pytest.raises(ValueError, match="rms_norm_add"):
            rms_norm_add(x, residual, weight, 1e-6)
    assert not rms_norm_add_fits(x, x, weight[:16])
    with pytest.raises(ValueError, match="no backward"):
        rms_norm_add(x, x.clone(), weight.requires_grad_(), 1e-6)


def gradients(norm, x, weight, dy):
    """(out, dx, dweight) of norm(x, weight) for out's gradient dy."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    out = norm(x, weight)
    return (out, *torch.autograd.grad(out, (x, weight), dy))


def assert_gradient_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype and not got.isnan().any()
    assert (got.float() - want.float()).norm() <= GRAD_TOLERANCE[want.dtype] * want.float().norm()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape,dtype", [
    ((1, 64), torch.float32),  # one row
    ((7, 100), torch.float32),  # N not a power of two
    ((2, 70, 48), torch.float16),  # more tiles of rows than programs: a program adds several into its dweight sum
    ((3, 5), torch.float16),
    ((2, 3000), torch.float32),  # one row a tile, a ragged block
    ((0, 40), torch.float16),  # no rows: dweight is zero
])
def test_rms_norm_gradients_match_autograd_through_reference(shape, dtype, form, monkeypatch):
    """The differentiable forward is the inference kernel's output, bit for bit; dx and dweight within
    GRAD_TOLERANCE. Every buffer the module allocates (out, rstd, dx, dweight's partial sums) starts NaN."""
    x, weight = inputs(shape, dtype, form)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    with torch.no_grad():
        inference = rms_norm(x, weight, 1e-6, form=form)
    allocations = poison_allocations(monkeypatch, "twell.rms_norm")
    out, dx, dweight = gradients(lambda x, w: rms_norm(x, w, 1e-6, form=form), x, weight, dy)
    _, dx_ref, dweight_ref = gradients(lambda x, w: rms_norm_reference(x, w, 1e-6, form), x, weight, dy)
    assert torch.equal(out, inference) and len(allocations) == 4
    assert_gradient_close(dx, dx_ref)
    assert_gradient_close(dweight, dweight_ref)


def test_rms_norm_gradients_of_strided_rows_and_a_wider_gemma_weight():
    """x rows with a row stride, an fp32 weight of the gemma form beside fp16 x (dweight in the weight's dtype),
    and a gradient broadcast from a sum (stride 0)."""
    x, _ = inputs((2, 9, 40), torch.float16, "gemma")
    weight = torch.randn(40, generator=torch.Generator().manual_seed(2)).to(DEV)
    wide = torch.zeros(2, 9, 64, dtype=torch.float16, device=DEV)
    wide[..., :40] = x

    def grads(norm):
        x_leaf, weight_leaf = wide.clone().requires_grad_(), weight.clone().requires_grad_()
        norm(x_leaf[..., :40], weight_leaf, 1e-6, form="gemma").float().sum().backward()
        return x_leaf.grad, weight_leaf.grad

    (dx, dweight), (dx_ref, dweight_ref) = grads(rms_norm), grads(rms_norm_reference)
    assert not dx[..., 40:].any()
    assert_gradient_close(dx[..., :40], dx_ref[..., :40])
    assert_gradient_close(dweight, dweight_ref)


def test_rms_norm_saves_x_and_rstd_only():
    """For backward the norm keeps x and the weight themselves (no copies) and one fp32 rstd a row; autograd
    through the reference keeps an fp32 x and an fp16 x_hat besides."""
    x, weight = (t.requires_grad_() for t in inputs((2, 9, 40), torch.float16, "llama"))

    def saved(norm):
        tensors = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: tensors.append(t) or t, lambda t: t):
            norm(x, weight, 1e-6)
        return tensors

    x_and_weight = {x.data_ptr(), weight.data_ptr()}
    kept = saved(rms_norm)
    assert {t.data_ptr() for t in kept} >= x_and_weight
    assert [(t.dtype, t.shape) for t in kept if t.data_ptr() not in x_and_weight] == [(torch.float32, (18,))]
    distinct = {t.data_ptr(): t.numel() * t.element_size() for t in saved(rms_norm_reference)
                if t.data_ptr() not in x_and_weight}
    assert sum(distinct.values()) > 18 * 40 * (4 + 2)


def test_rms_norm_row_stride_and_empty_input():
    x, weight = inputs((6, 40), torch.float32, "llama")
    wide = torch.randn(6, 64, device=DEV)
    wide[:, :40] = x
    assert_rounding_close(rms_norm(wide[:, :40], weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    assert rms_norm(x[:0], weight, 1e-5).shape == (0, 40)


def test_rms_norm_reference_is_transformers_modules():
    """The references are the modules' op order: equal bits in fp32 and bf16 (the modeling file checks the
    installed transformers the same way before it fuses a family's norms)."""
    for cls, form, eps in ((LlamaRMSNorm, "llama", "variance_epsilon"), (GemmaRMSNorm, "gemma", "eps")):
        module = cls(24, eps=1e-5)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(5, 24).to(dtype)
            with torch.no_grad():
                module.to(dtype).weight.copy_(torch.randn(24))
                assert torch.equal(module(x), rms_norm_reference(x, module.weight, getattr(module, eps), form))
                other = "gemma" if form == "llama" else "llama"
                assert not torch.equal(module(x), rms_norm_reference(x, module.weight, getattr(module, eps), other))


def test_rms_norm_refuses_what_it_does_not_take():
    x, weight = inputs((4, 32), torch.float32, "llama")
    assert rms_norm_fits(x, weight) and rms_norm_fits(x, weight.half(), "gemma")
    refused = [(x, weight.half(), "llama"),  # the llama form's product takes the weight's dtype
               (x, weight[:16], "llama"), (x, weight, "t5"), (x.t(), weight[:4], "llama")]  # column stride
    for args in refused:
        assert not rms_norm_fits(*args)
        with pytest.raises(ValueError, match="rms_norm"):
            rms_norm(args[0], args[1], 1e-6, form=args[2])
    wide = torch.zeros(1, MAX_WIDTH + 1, device=DEV)
    assert not rms_norm_fits(wide, torch.ones(MAX_WIDTH + 1, device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (8, 1, 2048), (4, 512, 2048), (1, 3, 4096), (2, 7, 16, 128),
                                   (3, 5632)])
def test_gpu_bf16_rms_norm(shape, form):
    """bf16 at model shapes (decode, prefill, Qwen3's per-head norms): within a bf16 step of the reference, which
    is transformers' module on the same GPU, and equal in nearly every element."""
    x, weight = inputs(shape, torch.bfloat16, form)
    out, ref = rms_norm(x, weight, 1e-6, form=form), rms_norm_reference(x, weight, 1e-6, form)
    assert_rounding_close(out, ref)
    assert (out != ref).float().mean() < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (8, 1, 2048), (4, 512, 2048), (1, 3, 4096)])
def test_gpu_bf16_rms_norm_add(shape, form):
    """bf16 at decoder shapes: the sum equal to torch's add, the norm within a bf16 step of the reference's."""
    x, weight = inputs(shape, torch.bfloat16, form)
    residual = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16)
    (out, summed), (ref, ref_summed) = (f(x, residual, weight, 1e-6, form=form) for f in (
        rms_norm_add, lambda *a, form: rms_norm_add_reference(*a, form)))
    assert torch.equal(summed, ref_summed)
    assert_rounding_close(out, ref)
    assert (out != ref).float().mean() < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(8, 2048, 2048), (3, 5632), (2, 7, 16, 128)])
def test_gpu_bf16_rms_norm_gradients(shape, form):
    """bf16 gradients at training shapes: against autograd through the reference in fp32 (the truth), the kernel's
    dx and dweight are no further than autograd through the reference in bf16 (twice its error, plus a bf16 step)."""
    x, weight = inputs(shape, torch.bfloat16, form)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16)
    _, *got = gradients(lambda x, w: rms_norm(x, w, 1e-6, form=form), x, weight, dy)
    _, *bf16 = gradients(lambda x, w: rms_norm_reference(x, w, 1e-6, form), x, weight, dy)
    _, *truth = gradients(lambda x, w: rms_norm_reference(x, w, 1e-6, form), x.float(), weight.float(), dy.float())
    for g, b, t in zip(got, bf16, truth):
        assert g.dtype == b.dtype and not g.isnan().any()
        error, reference_error = ((a.float() - t).norm() / t.norm() for a in (g, b))
        assert error <= 2 * reference_error + 2 ** -8
