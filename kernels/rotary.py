"""Rotary position embedding of the query and key heads in one launch, differentiable where autograd records a
gradient.

transformers' apply_rotary_pos_emb computes q * cos + rotate_half(q) * sin and the same for k: about ten
elementwise kernels a layer (products, a negation, a concatenation, sums), each a launch at decode size. One
program here rotates every head of one token's q or k, each product and sum rounded to the output dtype as there
(the inputs' dtype, or where cos and sin are fp32 tables beside bf16 heads, under autocast, the promoted one), so
the outputs are equal bit for bit. reference.rotary_reference is that op order in PyTorch. The launch turns off
Triton's contraction of a product and a sum into one fused multiply-add, which would skip the product's rounding
(the compiler sees through the casts between them).

Training: the gradient of y = x * cos + rotate_half(x) * sin is dx = dy * cos + rotate_half^T(dy * sin), where
rotate_half^T(z) = (z2, -z1) over the halves of z. The same kernel computes it with sin's halves (s1, s2) taken as
(-s2, -s1) (INVERSE), for any table, with the products and sums that autograd through the reference rounds: the
gradients are equal bit for bit too. _Rotary saves only cos and sin."""
import torch
from torch.autograd.function import once_differentiable

from .format import on_device, use_triton
from .launch import pdl_options, pdl_start
from .reference import rotary_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference
    triton = None


def rotary_fits(q, k, cos, sin) -> bool:
    """Whether `rotary` takes these arguments: q [B, Hq, S, D] and k [B, Hk, S, D] of one dtype with unit last
    strides, cos and sin [B or 1, S, D] of one dtype (the rotation over the whole head, an even D), one device."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, _, s, d = q.shape
    return (k.shape[0] == b and k.shape[2:] == (s, d) and cos.shape[0] in (1, b) and cos.shape[1:] == (s, d)
            and d % 2 == 0 and q.dtype == k.dtype and cos.dtype == sin.dtype
            and len({t.device for t in (q, k, cos, sin)}) == 1 and all(t.stride(-1) == 1 for t in (q, k, cos, sin)))


def rotary(q, k, cos, sin):
    """(q_embed, k_embed) as rotary_reference, laid out as q and k (rotary_fits says what it takes). CPU tensors
    without the Triton interpreter take the reference."""
    if not rotary_fits(q, k, cos, sin):
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, cos / sin {tuple(cos.shape)} "
                         "(q [B, Hq, S, D] and k [B, Hk, S, D] of one dtype, cos and sin [B or 1, S, D] of one dtype)")
    return rotary_fitted(q, k, cos, sin)


def rotary_fitted(q, k, cos, sin):
    """`rotary` of arguments that rotary_fits has accepted, not checked again: for a caller that checks them itself
    to choose between the kernel and another path. Differentiable where autograd records q's or k's gradient
    (_Rotary); where it records cos's or sin's, the reference."""
    grad = torch.is_grad_enabled()
    if not use_triton(q) or (grad and (cos.requires_grad or sin.requires_grad)):
        return rotary_reference(q, k, cos, sin)
    if grad and (q.requires_grad or k.requires_grad):
        return _Rotary.apply(q, k, cos, sin)
    return _rotate(q, k, cos, sin)


class _Rotary(torch.autograd.Function):
    """rotary with the inverse rotation as its backward: saves cos and sin."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = q.dtype
        return _rotate(q, k, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = (d if d.stride(-1) == 1 else d.contiguous() for d in (dq, dk))  # a sum's gradient has stride 0
        # each term rounded to q's dtype, as autograd casts each product's gradient to its input's before adding
        return *_rotate(dq, dk, cos, sin, inverse=True, dtype=ctx.dtype), None, None


def _rotate(q, k, cos, sin, inverse: bool = False, dtype=None):
    """(q_out, k_out) laid out as q and k: the rotation by (cos, sin), or with `inverse` its transpose; in `dtype`
    (default: q's and cos's promoted), to which each product and sum is rounded."""
    b, hq, s, d = q.shape
    dtype = dtype or torch.promote_types(q.dtype, cos.dtype)
    q_out, k_out = torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)
    if q.numel() and k.numel():
        cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)
        with on_device(q):
            _rotary_kernel[(b * s, 2)](
                q, k, cos, sin, q_out, k_out, s, *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3],
                *k_out.stride()[:3], *cos.stride()[:2], *sin.stride()[:2], hq, k.shape[1], d // 2,
                HQ=triton.next_power_of_2(hq), HK=triton.next_power_of_2(k.shape[1]),
                HALF=triton.next_power_of_2(d // 2), INVERSE=inverse, num_warps=4, enable_fp_fusion=False,
                **pdl_options(q.device))
    return q_out, k_out


if triton is not None:

    @triton.jit
    def _rotate_heads(x_ptr, out_ptr, cos1, cos2, sin1, sin2, b, s, x_b, x_s, x_h, out_b, out_s, out_h, heads, half,
                      H: tl.constexpr, HALF: tl.constexpr):
        """Every head of token (b, s): out = x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1)
        over the halves x1, x2 of the head; each product and the sum rounded to out's dtype."""
        h = tl.arange(0, H)[:, None]
        c = tl.arange(0, HALF)[None, :]
        live = (h < heads) & (c < half)
        x = x_ptr + b * x_b + s * x_s + h * x_h + c
        x1 = tl.load(x, mask=live, other=0.0)
        x2 = tl.load(x + half, mask=live, other=0.0)
        dtype = out_ptr.dtype.element_ty
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        y1 = (f1 * cos1).to(dtype).to(tl.float32) + (-f2 * sin1).to(dtype).to(tl.float32)
        y2 = (f2 * cos2).to(dtype).to(tl.float32) + (f1 * sin2).to(dtype).to(tl.float32)
        out = out_ptr + b * out_b + s * out_s + h * out_h + c
        tl.store(out, y1.to(dtype), mask=live)
        tl.store(out + half, y2.to(dtype), mask=live)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, S, q_b, q_h, q_s, k_b, k_h, k_s,
                       qo_b, qo_h, qo_s, ko_b, ko_h, ko_s, cos_b, cos_s, sin_b, sin_s, HQ_N, HK_N, half,
                       HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr,
                       PDL: tl.constexpr):
        """Program (token, 0) rotates the token's q heads, (token, 1) its k heads; with INVERSE by the transposed
        rotation: out = x * cos + rotate_half^T(x * sin)."""
        pdl_start(PDL)
        token = tl.program_id(0)
        b = (token // S).to(tl.int64)
        s = (token % S).to(tl.int64)
        c = tl.arange(0, HALF)[None, :]
        on = c < half
        cos = cos_ptr + b * cos_b + s * cos_s + c
        sin = sin_ptr + b * sin_b + s * sin_s + c
        cos1 = tl.load(cos, mask=on, other=0.0).to(tl.float32)
        cos2 = tl.load(cos + half, mask=on, other=0.0).to(tl.float32)
        sin1 = tl.load(sin, mask=on, other=0.0).to(tl.float32)
        sin2 = tl.load(sin + half, mask=on, other=0.0).to(tl.float32)
        if INVERSE:  # out1 = x1 * cos1 + x2 * sin2, out2 = x2 * cos2 - x1 * sin1; a negation changes no rounding
            sin1, sin2 = -sin2, -sin1
        if tl.program_id(1) == 0:
            _rotate_heads(q_ptr, q_out_ptr, cos1, cos2, sin1, sin2, b, s, q_b, q_s, q_h, qo_b, qo_s, qo_h, HQ_N, half,
                          HQ, HALF)
        else:
            _rotate_heads(k_ptr, k_out_ptr, cos1, cos2, sin1, sin2, b, s, k_b, k_s, k_h, ko_b, ko_s, ko_h, HK_N, half,
                          HK, HALF)
