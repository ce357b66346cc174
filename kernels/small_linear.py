"""x @ weight.T (+ bias) for calls of a few rows (decode: a token per sequence), inference only: fp32 accumulation,
the output in x's dtype.

A decode step's projection is a matrix-vector product whose time is the read of the weight; cuBLAS's kernels for
such shapes can take 64 weight rows a CTA, fewer CTAs than the GPU has SMs at N = 2048. A program here takes BN
rows of the weight (BN output columns, BN = 16 or 32) and streams them along K, STAGES - 1 steps of STEP_BYTES in
flight, against the call's rows of x, which make one tl.dot tile (rows beyond M masked: no memory traffic): each
weight element is read once, and N / BN programs cover the SMs from N = 16 * SMs rows on. K is not split: a split
needs a second kernel (the sum of fp32 partials, or the zeroing and the cast around fp32 atomics), whose launch and
dependency cost about what a projection takes at decode, while the projections that run here (an attention's q, k
and v in one launch, its o) have N = hidden size or more rows. A call of one row (batch-1 decode) takes no tl.dot
tile, whose 16 rows would be 15 of padding: a program takes 8 or 16 weight rows (`_block_rows`) and reduces their
products with x in fp32 FMAs, its K loop pipelined through shared memory like the tl.dot loop's (Triton pipelines a
loop without a dot only where the loop asks for it). Weights that share x (q, k and v) run in one launch
(`small_linear_grouped`): the grid is the concatenation of their row blocks and a program finds its weight, bias
and output by its block, so the weights stay separate tensors. Traced calls (torch.compile, export, dispatch
modes) reach the kernel through this copy's custom op.
reference.small_linear_reference is the same math in PyTorch."""
import itertools
import math

import torch

from .format import cdiv, on_device, use_triton
from .launch import custom_op, pdl_options, pdl_start, sm_count
from .reference import small_linear_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference
    triton = None

MAX_ROWS = 16  # rows of x a call takes: tl.dot's smallest tile, which every program holds whole
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what tl.dot takes with an fp32 accumulator
MAX_GROUP = 3  # weights one launch takes (an attention's q, k and v)
BLOCK_N = 16  # weight rows a program streams: tl.dot's narrowest tile, so that N rows make N / 16 programs
# Where the grid still has two programs an SM, a program takes twice the rows: every program reads all of x's
# rows (from L2) beside its weight rows, as many bytes as those at M = 16; wider blocks halve that traffic
WIDE_BLOCK_N, WIDE_PROGRAMS_PER_SM = 32, 2
# Weight bytes a program loads a step (BK = STEP_BYTES / (BN * element size)) and the pipeline's buffers
# (Triton's num_stages: STAGES - 1 steps load while one is multiplied): 24 KB of weight in flight a program,
# so that one program an SM has about the memory's bandwidth-latency product in flight; with its x tiles at
# most 48 KB of shared memory, which any GPU Triton targets holds (a Hopper SM several such programs)
STEP_BYTES, STAGES, WARPS = 8192, 4, 4
# One row of x: ROW_BLOCK_N weight rows a program, or half as many where a grid of such half-size programs has at
# most ROW_NARROW_PROGRAMS_PER_SM an SM: more programs, each a shorter stream, where the grid is small
ROW_BLOCK_N, ROW_NARROW_PROGRAMS_PER_SM = 16, 4
# Programs of the one-row kernel an SM holds at once: 4 warps at its 72 registers a thread (sm_90) fit 7 times in 64K
ROW_RESIDENT_PER_SM = 7
# Where the launch beats cuBLAS (small_linear_wins): K is not split, so a weight whose K exceeds MAX_K_PER_N x N
# streams long rows on few programs; at several rows of x a grid of 16-row programs beyond one round is slower, and
# at one row a grid beyond one round of resident programs (ROW_RESIDENT_PER_SM an SM), whose last round leaves SMs
# idle where cuBLAS's wider tiles do not
MAX_K_PER_N = 2


def small_linear_fits(x, weight, bias=None) -> bool:
    """Whether `small_linear` takes these arguments: x [..., K] with at most MAX_ROWS rows (the product of its
    leading dimensions) and a unit last stride, weight [N, K] contiguous, bias [N] or None, all of one dtype
    of DTYPES and on one device."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (x.dim() >= 1 and weight.dim() == 2 and weight.shape[1] == x.shape[-1] and weight.is_contiguous()
            and math.prod(x.shape[:-1]) <= MAX_ROWS and x.stride(-1) == 1
            and (bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()))
            and x.dtype in DTYPES and all(t.dtype == x.dtype and t.device == x.device for t in tensors))


def small_linear_grouped_fits(x, weights, biases=None) -> bool:
    """Whether `small_linear_grouped` takes these arguments: one to MAX_GROUP weights that small_linear_fits
    with x, each with a bias or none with one."""
    biases = _bias_list(weights, biases)
    return (0 < len(weights) <= MAX_GROUP and len(biases) == len(weights) and len({b is None for b in biases}) == 1
            and all(small_linear_fits(x, w, b) for w, b in zip(weights, biases)))


def small_linear_wins(m: int, rows, k: int, sms: int) -> bool:
    """Whether small_linear's launch of m rows of x through weights of `rows` rows each (K = k) takes less GPU
    time than F.linear's on a GPU of `sms` SMs, as timed at the supported families' attention projections and a
    grid of single weights: a grouped launch, which replaces one cuBLAS launch a weight, does; a single weight
    does where its K is at most MAX_K_PER_N x N and its grid is one round: at one row, of resident programs
    (ROW_RESIDENT_PER_SM an SM); at several, of programs (one an SM), or of WIDE_BLOCK_N-row programs."""
    if len(rows) > 1:
        return True
    if k > MAX_K_PER_N * rows[0]:
        return False
    block = _block_rows(m, rows[0], sms)
    programs = cdiv(rows[0], block)
    if m == 1:
        return programs <= ROW_RESIDENT_PER_SM * sms
    return programs <= sms or block == WIDE_BLOCK_N


def _block_rows(m: int, rows: int, sms: int) -> int:
    """Weight rows a program takes for m rows of x through `rows` weight rows in all."""
    if m == 1:
        narrow = ROW_BLOCK_N // 2
        return narrow if cdiv(rows, narrow) <= ROW_NARROW_PROGRAMS_PER_SM * sms else ROW_BLOCK_N
    return WIDE_BLOCK_N if cdiv(rows, WIDE_BLOCK_N) >= WIDE_PROGRAMS_PER_SM * sms else BLOCK_N


def small_linear(x, weight, bias=None):
    """x @ weight.T (+ bias), [..., N] in x's dtype, accumulated in fp32 (small_linear_fits says what it takes).
    CPU tensors without the Triton interpreter take the reference."""
    _check(x, [weight], [bias])
    return small_linear_fitted(x, weight, bias)


def small_linear_fitted(x, weight, bias=None):
    """`small_linear` of arguments that small_linear_fits has accepted, not checked again: for a caller that checks
    them itself to choose between the kernel and another path."""
    return small_linear_grouped_fitted(x, [weight], [bias])[0]


def small_linear_grouped(x, weights, biases=None):
    """[small_linear(x, w, b) for each weight w and bias b] in one launch (small_linear_grouped_fits says what it
    takes)."""
    biases = _bias_list(weights, biases)
    _check(x, weights, biases)
    return small_linear_grouped_fitted(x, weights, biases)


def _check(x, weights, biases):
    if not small_linear_grouped_fits(x, weights, biases):
        described = [f"weight {tuple(w.shape)} {w.dtype}" for w in weights]
        described += [f"bias {tuple(b.shape)} {b.dtype}" for b in biases if b is not None]
        raise ValueError(f"small_linear: x {tuple(x.shape)} {x.dtype}, {', '.join(described)} (x [..., K] of at most "
                         f"{MAX_ROWS} rows with a unit last stride; 1 to {MAX_GROUP} contiguous weights [N, K], each "
                         f"with a bias [N] or none; one dtype of {[str(t) for t in DTYPES]}, one device)")


def small_linear_grouped_fitted(x, weights, biases):
    """`small_linear_grouped` of arguments that small_linear_grouped_fits has accepted (`biases` a list, of Nones
    where there is none), not checked again: for a caller that checks them itself."""
    # eager calls skip the custom op, whose dispatch costs more host time than the kernel takes on the GPU at
    # decode; what traces the call (compile, export, dispatch modes, tensor subclasses) needs it
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or type(x) is not torch.Tensor:
        return _small_linear_op(x, weights, biases)
    return _launch(x, weights, biases)


def _launch(x, weights, biases):
    if not use_triton(x):
        return [small_linear_reference(x, w, b) for w, b in zip(weights, biases)]
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    m = x2.shape[0]
    outs = [torch.empty((m, w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    rows = sum(w.shape[0] for w in weights)
    if m and rows:
        sms = sm_count(x.device)
        bn = _block_rows(m, rows, sms)
        ends = list(itertools.accumulate(cdiv(w.shape[0], bn) for w in weights))  # of each weight's row blocks
        has_bias = biases[0] is not None

        def slots(args):  # MAX_GROUP of each argument: the unused repeat the last, which no program reads
            return [*args, *args[-1:] * (MAX_GROUP - len(args))]

        with on_device(x):
            _small_linear_kernel[(ends[-1],)](
                x2, *slots(weights), *slots(biases if has_bias else weights), *slots(outs), m, k, x2.stride(0),
                *slots([w.shape[0] for w in weights]), *slots(ends)[:2], HAS_BIAS=has_bias, BM=MAX_ROWS, BN=bn,
                BK=max(16, min(STEP_BYTES // (bn * x.element_size()), triton.next_power_of_2(k))), ROW=m == 1,
                STAGES=STAGES, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=WARPS,
                num_stages=STAGES, **pdl_options(x.device))
    return [out.view(*x.shape[:-1], w.shape[0]) for out, w in zip(outs, weights)]


def _bias_list(weights, biases):
    return [None] * len(weights) if biases is None else list(biases)


_small_linear_op = custom_op(
    "small_linear", lambda x, weights, biases: _launch(x, list(weights), list(biases)),
    "(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]",
    lambda x, weights, biases: [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights])


if triton is not None:

    @triton.jit
    def _small_linear_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, out0_ptr, out1_ptr, out2_ptr,
                             M, K, x_stride, N0, N1, N2, END0, END1, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, ROW: tl.constexpr, STAGES: tl.constexpr,
                             PRECISION: tl.constexpr, PDL: tl.constexpr):
        """Program p: BN rows of the weight whose row blocks hold block p of the grid (weight 0's blocks
        [0, END0), weight 1's [END0, END1), weight 2's the rest) into its output, contiguous [M, N]. With ROW
        (M = 1) the products are summed in FMAs instead of a tl.dot tile."""
        pdl_start(PDL)
        block = tl.program_id(0)
        second, third = block >= END0, block >= END1
        w_ptr = tl.where(third, w2_ptr, tl.where(second, w1_ptr, w0_ptr))
        b_ptr = tl.where(third, b2_ptr, tl.where(second, b1_ptr, b0_ptr))
        out_ptr = tl.where(third, out2_ptr, tl.where(second, out1_ptr, out0_ptr))
        n = tl.where(third, N2, tl.where(second, N1, N0))
        first = tl.where(third, END1, tl.where(second, END0, 0))
        rows = tl.arange(0, BM)
        cols = (block - first) * BN + tl.arange(0, BN)  # output columns: rows of the weight
        steps = tl.arange(0, BK)
        x_rows = x_ptr + rows[:, None].to(tl.int64) * x_stride
        w_rows = w_ptr + cols[:, None].to(tl.int64) * K
        live_rows, live_cols = (rows < M)[:, None], (cols < n)[:, None]
        if ROW:  # acc's rows all hold x's one row times the weight rows
            products = tl.zeros((BN, BK), dtype=tl.float32)
            for k in tl.range(0, K, BK, num_stages=STAGES):
                ks = k + steps
                x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
                w = tl.load(w_rows + ks[None, :], mask=live_cols & (ks < K)[None, :], other=0.0)
                products += w.to(tl.float32) * x.to(tl.float32)[None, :]
            acc = tl.broadcast_to(tl.sum(products, axis=1)[None, :], (BM, BN))
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, K, BK):
                ks = (k + steps)[None, :]
                x = tl.load(x_rows + ks, mask=live_rows & (ks < K), other=0.0)
                w = tl.load(w_rows + ks, mask=live_cols & (ks < K), other=0.0)
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows[:, None].to(tl.int64) * n + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live_rows & (cols < n)[None, :])
