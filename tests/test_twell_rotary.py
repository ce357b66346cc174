"""The fused rotary embedding (twell.rotary; interpreter on CPU, bf16 on GPU) against the PyTorch reference,
which is transformers' apply_rotary_pos_emb op for op: equal bits, in the outputs and in the gradients against
autograd through the reference."""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from twell.reference import rotary_reference
from twell.rotary import rotary, rotary_fits

from helpers import poison_allocations

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def heads(batch, n_heads, seq, dim, dtype, generator):
    """[batch, heads, seq, dim] as the attention makes it: a projection's output viewed and transposed."""
    return torch.randn(batch, seq, n_heads, dim, generator=generator).to(DEV, dtype).transpose(1, 2)


def inputs(batch, hq, hk, seq, dim, dtype, cos_batch=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k = heads(batch, hq, seq, dim, dtype, generator), heads(batch, hk, seq, dim, dtype, generator)
    cos, sin = (torch.randn(cos_batch or batch, seq, dim, generator=generator).to(DEV, dtype) for _ in range(2))
    return q, k, cos, sin


@pytest.mark.parametrize("batch,hq,hk,seq,dim,cos_batch,dtype", [
    (1, 4, 4, 1, 16, None, torch.float32),  # one token
    (2, 4, 2, 6, 16, 1, torch.float32),  # grouped keys, positions shared by the batch
    (3, 3, 1, 5, 12, None, torch.float16),  # heads and half a head not powers of two
    (2, 8, 8, 33, 32, 1, torch.float16),
])
def test_rotary_matches_reference_bit_for_bit(batch, hq, hk, seq, dim, cos_batch, dtype, monkeypatch):
    allocations = poison_allocations(monkeypatch, "twell.rotary")
    q, k, cos, sin = inputs(batch, hq, hk, seq, dim, dtype, cos_batch)
    q_out, k_out = rotary(q, k, cos, sin)
    q_ref, k_ref = rotary_reference(q, k, cos, sin)
    assert len(allocations) == 2 and torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()  # laid out as the inputs
    # contiguous heads too
    q_out, k_out = rotary(q.contiguous(), k.contiguous(), cos, sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("batch,hq,hk,seq,dim,cos_batch,dtype", [
    (1, 4, 4, 1, 16, None, torch.float32),  # one token
    (2, 4, 2, 6, 16, 1, torch.float32),  # grouped keys, positions shared by the batch
    (3, 3, 1, 5, 12, None, torch.float16),  # heads and half a head not powers of two
    (2, 8, 8, 33, 32, 1, torch.float16),
    (2, 4, 2, 0, 8, None, torch.float32),  # no tokens
])
def test_rotary_gradients_match_autograd_through_reference_bit_for_bit(batch, hq, hk, seq, dim, cos_batch, dtype,
                                                                       monkeypatch):
    """The inverse rotation rounds each product and sum as autograd through the reference does. cos and sin are
    random, their halves unequal: the inverse takes any table. The buffers (2 forward, 2 backward) start NaN."""
    q, k, cos, sin = inputs(batch, hq, hk, seq, dim, dtype, cos_batch)
    q, k = q.requires_grad_(), k.requires_grad_()
    generator = torch.Generator().manual_seed(1)
    dq, dk = (torch.randn(t.shape, generator=generator).to(DEV, dtype) for t in (q, k))
    allocations = poison_allocations(monkeypatch, "twell.rotary")
    got = torch.autograd.grad(rotary(q, k, cos, sin), (q, k), (dq, dk))
    want = torch.autograd.grad(rotary_reference(q, k, cos, sin), (q, k), (dq, dk))
    assert len(allocations) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))
    # gradients broadcast from sums (stride 0), only q's output used
    got = torch.autograd.grad(rotary(q, k, cos, sin)[0].sum(), (q, k))
    want = torch.autograd.grad(rotary_reference(q, k, cos, sin)[0].sum(), (q, k), allow_unused=True)
    assert torch.equal(got[0], want[0]) and not got[1].any()


@pytest.mark.parametrize("batch,hq,hk,seq,dim,cos_batch", [(2, 4, 2, 6, 16, 1), (3, 3, 1, 5, 12, None)])
def test_rotary_of_fp16_heads_and_fp32_tables(batch, hq, hk, seq, dim, cos_batch, monkeypatch):
    """fp32 cos and sin beside fp16 (bf16 on a GPU) heads, as under autocast: fp32 outputs, as PyTorch's type
    promotion gives them, and fp16 gradients, equal bit for bit to the reference's in both (the kernel's buffers,
    2 forward and 2 backward, start NaN)."""
    allocations = poison_allocations(monkeypatch, "twell.rotary")
    q, k, cos, sin = inputs(batch, hq, hk, seq, dim, torch.float16, cos_batch)
    q, k, cos, sin = q.requires_grad_(), k.requires_grad_(), cos.float(), sin.float()
    got, want = rotary(q, k, cos, sin), rotary_reference(q, k, cos, sin)
    assert [t.dtype for t in got] == [torch.float32] * 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    generator = torch.Generator().manual_seed(1)
    dq, dk = (torch.randn(t.shape, generator=generator).to(DEV) for t in got)
    got, want = (torch.autograd.grad(out, (q, k), (dq, dk)) for out in (got, want))
    assert [t.dtype for t in got] == [torch.float16] * 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(allocations) == 4


def test_rotary_saves_cos_and_sin_only():
    """For backward the rotation keeps cos and sin themselves; with a gradient for them it runs the reference."""
    q, k, cos, sin = inputs(2, 4, 2, 5, 8, torch.float32)
    q, k = q.requires_grad_(), k.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rotary(q, k, cos, sin)
    assert [t.data_ptr() for t in saved] == [cos.data_ptr(), sin.data_ptr()]
    cos.requires_grad_()
    got = torch.autograd.grad(sum(t.sum() for t in rotary(q, k, cos, sin)), cos)
    want = torch.autograd.grad(sum(t.sum() for t in rotary_reference(q, k, cos, sin)), cos)
    assert torch.equal(got[0], want[0])


def test_rotary_reference_is_transformers_function():
    q, k, cos, sin = inputs(2, 4, 2, 5, 8, torch.float32)
    q, k, cos, sin = (t.cpu().bfloat16() for t in (q, k, cos, sin))
    for got, want in zip(apply_rotary_pos_emb(q, k, cos, sin), rotary_reference(q, k, cos, sin)):
        assert torch.equal(got, want)


def test_rotary_refuses_what_it_does_not_take():
    q, k, cos, sin = inputs(2, 4, 2, 5, 8, torch.float32)
    assert rotary_fits(q, k, cos, sin)
    refused = [(q, k, cos[..., :4], sin[..., :4]),  # a partial rotation (Phi-3's partial_rotary_factor)
               (q[..., :7], k[..., :7], cos[..., :7], sin[..., :7]),  # odd head size
               (q, k[:1], cos, sin), (q, k, cos[:, :4], sin[:, :4]), (q, k.half(), cos, sin), (q, k, cos, sin.half()),
               (q.transpose(2, 3), k.transpose(2, 3), cos, sin)]  # no unit stride along the head
    for args in refused:
        assert not rotary_fits(*args)
        with pytest.raises(ValueError, match="rotary"):
            rotary(*args)
    empty = inputs(2, 4, 2, 0, 8, torch.float32)
    assert [t.shape for t in rotary(*empty)] == [(2, 4, 0, 8), (2, 2, 0, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,hq,hk,seq,cos_batch", [(1, 16, 16, 1, None), (8, 16, 16, 1, None),
                                                      (4, 16, 16, 512, 1), (2, 32, 8, 7, None)])
def test_gpu_bf16_rotary_bit_for_bit(batch, hq, hk, seq, cos_batch):
    q, k, cos, sin = inputs(batch, hq, hk, seq, 128, torch.bfloat16, cos_batch)
    for got, want in zip(rotary(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,hq,hk,seq,cos_batch", [(8, 16, 16, 2048, 1), (2, 32, 8, 7, None)])
def test_gpu_bf16_rotary_gradients_bit_for_bit(batch, hq, hk, seq, cos_batch):
    q, k, cos, sin = inputs(batch, hq, hk, seq, 128, torch.bfloat16, cos_batch)
    q, k = q.requires_grad_(), k.requires_grad_()
    generator = torch.Generator().manual_seed(1)
    dq, dk = (torch.randn(t.shape, generator=generator).to(DEV, torch.bfloat16) for t in (q, k))
    got = torch.autograd.grad(rotary(q, k, cos, sin), (q, k), (dq, dk))
    want = torch.autograd.grad(apply_rotary_pos_emb(q, k, cos, sin), (q, k), (dq, dk))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
