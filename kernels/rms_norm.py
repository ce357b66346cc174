"""RMSNorm of a decoder in one launch: fp32 statistics, the family's weight form, the output in the input dtype;
differentiable where autograd records a gradient.

transformers' module runs the norm as about seven kernels (casts, square, mean, rsqrt, two products): at decode
size each is a launch, in a prefill a pass over the activations. One program here normalizes ROWS rows held in
registers. The two forms follow their modules' op order (FORMS), so that the outputs differ from transformers'
only where the fp32 sum of squares adds in another order. reference.rms_norm_reference is that op order in PyTorch.
`rms_norm_add` (inference) first adds a residual, as a pre-norm decoder layer does before its second norm, and
returns the sum beside the norm: one launch for the layer's add and norm (reference.rms_norm_add_reference).

Training: autograd through the module keeps several fp32 tensors of x's size per norm. _RMSNorm runs the
same forward kernel, which then also stores each row's fp32 rstd = rsqrt(mean(x^2) + eps), and keeps only x and
rstd (and the weight, a parameter). Its backward kernel recomputes x_hat = x * rstd and, with g the gradient
reaching x_hat (dy * weight or dy * (1 + weight), in fp32), writes dx = rstd * (g - x_hat * mean(g * x_hat));
each program sums dweight's terms over its rows in fp32, and one torch sum adds the programs' partial sums."""
import torch
from torch.autograd.function import once_differentiable

from .format import cdiv, on_device, use_triton
from .launch import pdl_options, pdl_start, sm_count
from .reference import rms_norm_add_reference, rms_norm_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference
    triton = None

# weight form -> how the module applies it to x_hat = x * rsqrt(mean(x^2) + eps), computed in fp32:
FORMS = {
    "llama": "weight * x_hat cast to the input dtype (Llama, Mistral, Qwen2/3, Phi-3)",
    "gemma": "x_hat * (1 + weight), in fp32, then cast to the input dtype (Gemma 1-3)",
}
MAX_WIDTH = 1 << 16  # widest row the kernel holds in registers
ROW_ELEMENTS = 2048  # a program takes rows until it holds this many elements


def rms_norm_fits(x, weight, form: str = "llama") -> bool:
    """Whether `rms_norm` takes these arguments: x [..., N] with N <= MAX_WIDTH and a unit last stride, weight
    [N] on x's device (in x's dtype for the "llama" form, whose product takes the weight's dtype)."""
    n = x.shape[-1]
    return (form in FORMS and weight.shape == (n,) and weight.device == x.device and 0 < n <= MAX_WIDTH
            and x.stride(-1) == 1 and (form != "llama" or weight.dtype == x.dtype))


def rms_norm(x, weight, eps: float, *, form: str = "llama"):
    """RMSNorm of x [..., N] with weight [N] as `form` (FORMS) computes it, in x's dtype, differentiable
    (rms_norm_fits says what it takes). CPU tensors without the Triton interpreter take the reference."""
    if not rms_norm_fits(x, weight, form):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"form {form!r} (forms {tuple(FORMS)}; rows of at most {MAX_WIDTH} with a unit last stride)")
    return rms_norm_fitted(x, weight, eps, form)


def rms_norm_fitted(x, weight, eps: float, form: str = "llama"):
    """`rms_norm` of arguments that rms_norm_fits has accepted, not checked again: for a caller that checks them
    itself to choose between the kernel and another path. Differentiable (_RMSNorm) where autograd records
    x's or weight's gradient."""
    if not use_triton(x):
        return rms_norm_reference(x, weight, eps, form)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, form)
    return _forward(x, weight, eps, form)[0]


def rms_norm_add_fits(x, residual, weight, form: str = "llama") -> bool:
    """Whether `rms_norm_add` takes these arguments: x and residual as rms_norm_fits takes x, of one shape, dtype
    and device."""
    return (rms_norm_fits(x, weight, form) and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.device == x.device and residual.stride(-1) == 1)


def rms_norm_add(x, residual, weight, eps: float, *, form: str = "llama"):
    """(rms_norm(residual + x), residual + x), the sum in x's dtype as torch adds them (rms_norm_add_fits says what
    it takes). Inference only: a call that would record a gradient raises. CPU tensors without the Triton
    interpreter take the reference."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, residual, weight)):
        raise ValueError("rms_norm_add has no backward: call it under torch.no_grad() or inference_mode(), or add "
                         "and normalize with rms_norm")
    if not rms_norm_add_fits(x, residual, weight, form):
        raise ValueError(f"rms_norm_add: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype}, weight {tuple(weight.shape)} {weight.dtype}, form {form!r} (x and "
                         f"residual of one shape and dtype, rows of at most {MAX_WIDTH} with a unit last stride)")
    return rms_norm_add_fitted(x, residual, weight, eps, form)


def rms_norm_add_fitted(x, residual, weight, eps: float, form: str = "llama"):
    """`rms_norm_add` of arguments that rms_norm_add_fits has accepted, not checked again."""
    if not use_triton(x):
        return rms_norm_add_reference(x, residual, weight, eps, form)
    out, _, summed = _forward(x, weight, eps, form, residual=residual)
    return out, summed


class _RMSNorm(torch.autograd.Function):
    """rms_norm with the backward kernel: saves x (as passed), the weight and rstd (fp32, one a row of x)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, form: str):
        out, rstd, _ = _forward(x, weight, eps, form, keep_rstd=True)
        ctx.form = form
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _backward(dy, x.reshape(-1, x.shape[-1]), weight, rstd, ctx.form)
        return dx.view(x.shape), dweight, None, None


def _tiling(n: int):
    """(rows a program holds, the block over a row, warps) for rows of n elements."""
    block = triton.next_power_of_2(n)
    rows = max(1, ROW_ELEMENTS // block)
    return rows, block, max(1, min(16, rows * block // 256))


def _forward(x, weight, eps: float, form: str, keep_rstd: bool = False, residual=None):
    """(out, rstd, sum) of the kernel: rstd [M] fp32 with keep_rstd, else None; with a residual, the norm is of
    residual + x, returned as the sum (else None)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    m = x2.shape[0]
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device) if keep_rstd else None
    residual2 = residual.reshape(-1, n) if residual is not None else x2
    summed = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if m:
        rows, block, warps = _tiling(n)
        with on_device(x):
            _rms_norm_kernel[(cdiv(m, rows),)](
                x2, residual2, weight, out, summed, rstd, m, n, x2.stride(0), residual2.stride(0), eps,
                GEMMA=form == "gemma", STORE_RSTD=keep_rstd, RESIDUAL=residual is not None, ROWS=rows, BLOCK=block,
                num_warps=warps, **pdl_options(x.device))
    return out.view(x.shape), rstd, summed.view(x.shape) if summed is not None else None


def _backward(dy, x2, weight, rstd, form: str):
    """(dx [M, N] in x's dtype, dweight in weight's dtype) from dy of x2's size, x2 [M, N] and its rstd [M]. One
    program a multiprocessor, each taking every programs-th tile of rows, so that dweight's partial sums are few."""
    m, n = x2.shape
    dy = dy.reshape(m, n)
    if dy.stride(-1) != 1:  # a gradient broadcast from a sum has stride 0
        dy = dy.contiguous()
    rows, block, warps = _tiling(n)
    programs = min(cdiv(m, rows), sm_count(x2.device))
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
    if programs:
        with on_device(x2):
            _rms_norm_backward_kernel[(programs,)](
                x2, weight, rstd, dy, dx, partial, m, n, x2.stride(0), dy.stride(0), GEMMA=form == "gemma",
                ROWS=rows, BLOCK=block, num_warps=warps)
    return dx, partial.sum(0).to(weight.dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, rstd_ptr, M, N, x_stride, residual_stride,
                         eps, GEMMA: tl.constexpr, STORE_RSTD: tl.constexpr, RESIDUAL: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """ROWS rows of x [M, N] (unit column stride) into out, contiguous [M, N]; with STORE_RSTD each row's
        rsqrt(mean(x^2) + eps) into rstd [M]. With RESIDUAL the rows normalized are x + residual, rounded to x's
        dtype as torch's add rounds them, and stored into sum, contiguous [M, N]."""
        pdl_start(PDL)
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        live = (row < M)[:, None] & (cols < N)[None, :]
        rows = row.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows * x_stride + cols[None, :], mask=live, other=0.0)
        if RESIDUAL:
            r = tl.load(residual_ptr + rows * residual_stride + cols[None, :], mask=live, other=0.0)
            x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + rows * N + cols[None, :], x, mask=live)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=1) / N
        rstd = tl.math.rsqrt(variance + eps)
        x_hat = xf * rstd[:, None]
        w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if GEMMA:
            y = x_hat * (1.0 + w)
        else:  # x_hat rounded to the input dtype first, then the product rounded again
            y = x_hat.to(x.dtype).to(tl.float32) * w
        tl.store(out_ptr + rows * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=live)
        if STORE_RSTD:
            tl.store(rstd_ptr + row, rstd, mask=row < M)

    @triton.jit
    def _rms_norm_backward_kernel(x_ptr, weight_ptr, rstd_ptr, dy_ptr, dx_ptr, partial_ptr, M, N, x_stride,
                                  dy_stride, GEMMA: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """dx, contiguous [M, N], of the tiles of ROWS rows program_id, program_id + programs, ...; the sum of
        dweight's terms over those rows into row program_id of partial [programs, N] (fp32)."""
        cols = tl.arange(0, BLOCK)
        on = cols < N
        w = tl.load(weight_ptr + cols, mask=on, other=0.0).to(tl.float32)[None, :]
        if GEMMA:
            w = 1.0 + w
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for tile in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
            row = tile * ROWS + tl.arange(0, ROWS)
            live = (row < M)[:, None] & on[None, :]
            rstd = tl.load(rstd_ptr + row, mask=row < M, other=0.0)[:, None]
            rows = row.to(tl.int64)[:, None]
            x = tl.load(x_ptr + rows * x_stride + cols[None, :], mask=live, other=0.0)
            dy = tl.load(dy_ptr + rows * dy_stride + cols[None, :], mask=live, other=0.0).to(tl.float32)
            x_hat = x.to(tl.float32) * rstd
            if GEMMA:
                dw += tl.sum(dy * x_hat, axis=0)
            else:  # the forward multiplied the weight by x_hat rounded to the input dtype
                dw += tl.sum(dy * x_hat.to(x.dtype).to(tl.float32), axis=0)
            g = dy * w
            dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=1) / N)[:, None])
            tl.store(dx_ptr + rows * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=live)
        tl.store(partial_ptr + tl.program_id(0) * N + cols, dw, mask=on)
