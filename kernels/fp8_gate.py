"""fp8 gate (opt-in): the gate projection of gated_mlp's packing pass in e4m3 (float8_e4m3fn) on the tensor
cores, at twice the bf16 rate and half its weight bytes. The weight is quantized once (`quantize_weight`: one
scale a unit, its row's largest magnitude at 448, e4m3's largest value), x at each call (`quantize_rows`: one
scale a token), and the gate kernels compute g = (q(x) . q(w)) * scale_x * scale_w, accumulated in fp32.
Only the gate pass reads the fp8 copy: up, down and every dense path (heavy rows, overflowing tiles the out
kernel recomputes, calls that run dense) read the bf16 weights. References: quantize_rows_reference,
gate_reference."""
import torch

from .format import cdiv, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference path
    triton = None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TINY = 1e-12  # a row of zeros gets this largest magnitude: its scale stays finite and its values zero
ROW_BLOCK = 8192  # elements a quantize program takes: whole rows, several where D is small


FP8_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada, Hopper and newer (Triton refuses e4m3 dots below)


def check_device(device: torch.device) -> None:
    """ValueError where `device` is a GPU without fp8 tensor cores (CPU tensors run the reference or the
    interpreter)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"the fp8 gate needs a GPU with fp8 tensor cores (compute capability 8.9 or newer: Ada, "
                         f"Hopper); {torch.cuda.get_device_name(device)} is {major}.{minor}")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight in e4m3 [I, D], fp32 scale [I]): row j is quantized at scale max|w_j| / 448."""
    if weight.dim() != 2:
        raise ValueError(f"the gate weight must be 2-D [I, D], got shape {tuple(weight.shape)}")
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp_min(TINY)
    # a tensor over a tensor: correctly rounded, as the kernel's division (a number over a tensor is a
    # reciprocal times the number in torch, rounded twice)
    return (w * (torch.full_like(amax, E4M3_MAX) / amax)[:, None]).to(E4M3), amax / E4M3_MAX


def quantize_rows_reference(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x2 in e4m3 [M, D], fp32 scale [M]), a scale a row, as quantize_weight does a row of the weight."""
    return quantize_weight(x2)


def gate_reference(x2: torch.Tensor, weight_e4m3: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp8 gate's pre-activation g [M, I] in fp32: (q(x) . q(w)) * scale_x * scale_w."""
    xq, sx = quantize_rows_reference(x2)
    return (xq.float() @ weight_e4m3.float().t()) * sx[:, None] * scale[None, :]


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_reference on a GPU (or the interpreter): one read of x, its rows made contiguous."""
    if not use_triton(x2):
        return quantize_rows_reference(x2)
    m, d = x2.shape
    out = torch.empty(m, d, dtype=E4M3, device=x2.device)
    scale = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m == 0:
        return out, scale
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(ROW_BLOCK // block_d, triton.next_power_of_2(m)))
    _quantize_rows_kernel[(cdiv(m, rows),)](x2, out, scale, m, d, x2.stride(0), x2.stride(1), TINY=TINY,
                                            MAX=E4M3_MAX, ROWS=rows, BLOCK_D=block_d,
                                            num_warps=4 if rows * block_d <= 4096 else 8)
    return out, scale


if triton is not None:

    @triton.jit
    def _round_e4m3(v):
        """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic: the cast
        that follows is then exact on every converter (the interpreter's rounds wrongly where the rounding
        carries into the exponent). Three mantissa bits: a step of 2^(e - 3) at exponent e, subnormals from
        2^-6 down in steps of 2^-9. v * 2^(3 - e) is below 16 in magnitude, where adding and taking away
        1.5 * 2^23 rounds it to an integer, ties to even (fp32 addition rounds so)."""
        e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6) - 3
        step = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        return (v * inv + 12582912.0 - 12582912.0) * step

    @triton.jit
    def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, M, D, stride_xm, stride_xk, TINY: tl.constexpr,
                              MAX: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        """quantize_rows_reference, ROWS rows a program; divisions correctly rounded, as torch's."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, BLOCK_D)
        mask = (rows < M)[:, None] & (d < D)[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + d[None, :] * stride_xk, mask=mask,
                    other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), TINY)
        q = _round_e4m3(tl.minimum(tl.maximum(x * tl.math.div_rn(MAX, amax)[:, None], -MAX), MAX))
        tl.store(out_ptr + rows[:, None].to(tl.int64) * D + d[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + rows, tl.math.div_rn(amax, MAX), mask=rows < M)
