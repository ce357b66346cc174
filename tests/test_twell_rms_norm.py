"""The fused RMSNorm (twell.rms_norm; interpreter on CPU, bf16 on GPU) against the PyTorch reference, which is
transformers' modules op for op."""
import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import twell.rms_norm  # noqa: F401  (the module, beside the function of the same name)
from twell.reference import rms_norm_reference
from twell.rms_norm import FORMS, MAX_WIDTH, rms_norm, rms_norm_fits

from helpers import poison_allocations

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the outputs may differ from the reference by the rounding of an fp32 sum of squares added in another order
# (and the division by N): one or two steps of the output dtype
ULPS = {torch.float32: 2 ** -21, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}


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
