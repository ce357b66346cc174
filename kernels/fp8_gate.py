"""fp8 gate (opt-in): the gate projection of gated_mlp's packing pass in e4m3 (float8_e4m3fn) on the tensor
cores, at twice the bf16 rate and half its weight bytes. The weight is quantized once (`quantize_weight`: one
scale a unit, its row's largest magnitude at 448, e4m3's largest value), x at each call (`quantize_rows`: one
scale a token), and the gate kernels compute g = (q(x) . q(w)) * scale_x * scale_w, accumulated in fp32.
Only the gate pass reads the fp8 copy: up, down and every dense path (heavy rows, overflowing tiles the out
kernel recomputes, calls that run dense) read the bf16 weights. Apart from it, e4m3 up and down rows
(`quantize_up_down`, a scale a unit) halve the bytes the batched out kernel gathers for each active unit.
References: quantize_rows_reference, gate_reference, up_down_reference."""
from typing import NamedTuple

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


def check_device(device: torch.device, what: str = "the fp8 gate") -> None:
    """ValueError where `device` is a GPU without fp8 tensor cores, which `what` needs (CPU tensors run the
    reference or the interpreter)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"{what} needs a GPU with fp8 tensor cores (compute capability 8.9 or newer: Ada, "
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


class UpDownE4m3(NamedTuple):
    """e4m3 copies of a block's up rows and down columns, with fp32 scales a unit (quantize_weight's)."""

    up: torch.Tensor  # [I, D]
    down_t: torch.Tensor  # [I, D]: row j is unit j's column of down
    up_scale: torch.Tensor  # [I]
    down_scale: torch.Tensor  # [I]


def quantize_up_down(up: torch.Tensor, down: torch.Tensor) -> UpDownE4m3:
    """The e4m3 copies of up [I, D] and down [D, I] that gated_mlp's `up_down_fp8` takes."""
    if up.dim() != 2 or down.shape != (up.shape[1], up.shape[0]):
        raise ValueError(f"up must be [I, D] and down [D, I], got {tuple(up.shape)} and {tuple(down.shape)}")
    up_q, up_scale = quantize_weight(up)
    down_q, down_scale = quantize_weight(down.t())
    return UpDownE4m3(up_q.contiguous(), down_q.contiguous(), up_scale, down_scale)  # the out kernel reads rows


def up_down_reference(up_down: UpDownE4m3) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [I, D], down [D, I]) in fp32 as the e4m3 copies hold them."""
    return up_down.up.float() * up_down.up_scale[:, None], (up_down.down_t.float() * up_down.down_scale[:, None]).t()


class E4m3Copy:
    """A layer's e4m3 copy of some weights, made by `make(*weights)` (quantize_weight, quantize_up_down) and held
    for its calls: remade where the weights moved or changed; under torch.compile the copy made by an eager call
    (else made in the traced graph); None where it would be made while a CUDA graph is captured (it would live in
    the graph's memory pool, freed with it, and every replay would quantize the weights again): that call reads
    the weights themselves."""

    def __init__(self, make):
        self.make, self.held = make, None  # held: (the weights' addresses, devices and versions, the copy)

    def __call__(self, *weights):
        if torch.compiler.is_compiling():
            return self.held[1] if self.held is not None else self.make(*weights)
        key = tuple((w.data_ptr(), w.device, w._version) for w in weights)
        if self.held is None or self.held[0] != key:
            if weights[0].is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            with torch.no_grad():
                self.held = (key, self.make(*weights))
        return self.held[1]

    def drop(self) -> None:
        self.held = None


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
