"""Rotary position embedding of the query and key heads in one launch, inference only.

transformers' apply_rotary_pos_emb computes q * cos + rotate_half(q) * sin and the same for k: about ten
elementwise kernels a layer (products, a negation, a concatenation, sums), each a launch at decode size. One
program here rotates every head of one token's q or k, each product and sum rounded to the input dtype as there,
so the outputs are equal bit for bit. reference.rotary_reference is that op order in PyTorch. The launch turns off
Triton's contraction of a product and a sum into one fused multiply-add, which would skip the product's rounding
(the compiler sees through the casts between them)."""
import torch

from .format import on_device, use_triton
from .reference import rotary_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference
    triton = None


def rotary_fits(q, k, cos, sin) -> bool:
    """Whether `rotary` takes these arguments: q [B, Hq, S, D] and k [B, Hk, S, D] with unit last strides, cos
    and sin [B or 1, S, D] (the rotation over the whole head, an even D), all of one dtype and device."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    b, _, s, d = q.shape
    return (k.shape[0] == b and k.shape[2:] == (s, d) and cos.shape[0] in (1, b) and cos.shape[1:] == (s, d)
            and d % 2 == 0 and len({t.dtype for t in (q, k, cos, sin)}) == 1
            and len({t.device for t in (q, k, cos, sin)}) == 1 and all(t.stride(-1) == 1 for t in (q, k, cos, sin)))


def rotary(q, k, cos, sin):
    """(q_embed, k_embed) as rotary_reference, laid out as q and k (rotary_fits says what it takes). CPU tensors
    without the Triton interpreter take the reference."""
    if not rotary_fits(q, k, cos, sin):
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, cos / sin {tuple(cos.shape)} "
                         "(q [B, Hq, S, D], k [B, Hk, S, D], cos and sin [B or 1, S, D], one dtype)")
    return rotary_fitted(q, k, cos, sin)


def rotary_fitted(q, k, cos, sin):
    """`rotary` of arguments that rotary_fits has accepted, not checked again: for a caller that checks them itself
    to choose between the kernel and another path."""
    if not use_triton(q):
        return rotary_reference(q, k, cos, sin)
    b, hq, s, d = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.numel() and k.numel():
        cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)
        with on_device(q):
            _rotary_kernel[(b * s, 2)](
                q, k, cos, sin, q_out, k_out, s, *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3],
                *k_out.stride()[:3], *cos.stride()[:2], *sin.stride()[:2], hq, k.shape[1], d // 2,
                HQ=triton.next_power_of_2(hq), HK=triton.next_power_of_2(k.shape[1]),
                HALF=triton.next_power_of_2(d // 2), num_warps=4, enable_fp_fusion=False)
    return q_out, k_out


if triton is not None:

    @triton.jit
    def _rotate_heads(x_ptr, out_ptr, cos1, cos2, sin1, sin2, b, s, x_b, x_s, x_h, out_b, out_s, out_h, heads, half,
                      H: tl.constexpr, HALF: tl.constexpr):
        """Every head of token (b, s): out = x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1)
        over the halves x1, x2 of the head; each product and the sum rounded to x's dtype."""
        h = tl.arange(0, H)[:, None]
        c = tl.arange(0, HALF)[None, :]
        live = (h < heads) & (c < half)
        x = x_ptr + b * x_b + s * x_s + h * x_h + c
        x1 = tl.load(x, mask=live, other=0.0)
        x2 = tl.load(x + half, mask=live, other=0.0)
        dtype = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        y1 = (f1 * cos1).to(dtype).to(tl.float32) + (-f2 * sin1).to(dtype).to(tl.float32)
        y2 = (f2 * cos2).to(dtype).to(tl.float32) + (f1 * sin2).to(dtype).to(tl.float32)
        out = out_ptr + b * out_b + s * out_s + h * out_h + c
        tl.store(out, y1.to(dtype), mask=live)
        tl.store(out + half, y2.to(dtype), mask=live)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, S, q_b, q_h, q_s, k_b, k_h, k_s,
                       qo_b, qo_h, qo_s, ko_b, ko_h, ko_s, cos_b, cos_s, sin_b, sin_s, HQ_N, HK_N, half,
                       HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr):
        """Program (token, 0) rotates the token's q heads, (token, 1) its k heads."""
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
        if tl.program_id(1) == 0:
            _rotate_heads(q_ptr, q_out_ptr, cos1, cos2, sin1, sin2, b, s, q_b, q_s, q_h, qo_b, qo_s, qo_h, HQ_N, half,
                          HQ, HALF)
        else:
            _rotate_heads(k_ptr, k_out_ptr, cos1, cos2, sin1, sin2, b, s, k_b, k_s, k_h, ko_b, ko_s, ko_h, HK_N, half,
                          HK, HALF)
