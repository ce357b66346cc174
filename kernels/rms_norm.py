"""RMSNorm of a decoder in one launch, inference only: fp32 statistics, the family's weight form, the output in
the input dtype.

transformers' module runs the norm as about seven kernels (casts, square, mean, rsqrt, two products): at decode
size each is a launch, in a prefill a pass over the activations. One program here normalizes ROWS rows held in
registers. The two forms follow their modules' op order (FORMS), so that the outputs differ from transformers'
only where the fp32 sum of squares adds in another order. reference.rms_norm_reference is that op order in PyTorch."""
import torch

from .format import cdiv, on_device, use_triton
from .reference import rms_norm_reference

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
    """RMSNorm of x [..., N] with weight [N] as `form` (FORMS) computes it, in x's dtype (rms_norm_fits says what
    it takes). CPU tensors without the Triton interpreter take the reference."""
    if not rms_norm_fits(x, weight, form):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"form {form!r} (forms {tuple(FORMS)}; rows of at most {MAX_WIDTH} with a unit last stride)")
    return rms_norm_fitted(x, weight, eps, form)


def rms_norm_fitted(x, weight, eps: float, form: str = "llama"):
    """`rms_norm` of arguments that rms_norm_fits has accepted, not checked again: for a caller that checks them
    itself to choose between the kernel and another path."""
    n = x.shape[-1]
    if not use_triton(x):
        return rms_norm_reference(x, weight, eps, form)
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m:
        block = triton.next_power_of_2(n)
        rows = max(1, ROW_ELEMENTS // block)
        with on_device(x):
            _rms_norm_kernel[(cdiv(m, rows),)](
                x2, weight, out, m, n, x2.stride(0), eps, GEMMA=form == "gemma", ROWS=rows, BLOCK=block,
                num_warps=max(1, min(16, rows * block // 256)))
    return out.view(x.shape)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, M, N, x_stride, eps, GEMMA: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
        """ROWS rows of x [M, N] (unit column stride) into out, contiguous [M, N]."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        live = (rows < M)[:, None] & (cols < N)[None, :]
        rows = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows * x_stride + cols[None, :], mask=live, other=0.0)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=1) / N
        x_hat = xf * tl.math.rsqrt(variance + eps)[:, None]
        w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if GEMMA:
            y = x_hat * (1.0 + w)
        else:  # x_hat rounded to the input dtype first, then the product rounded again
            y = x_hat.to(x.dtype).to(tl.float32) * w
        tl.store(out_ptr + rows * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=live)
