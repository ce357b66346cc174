"""The LM head and its losses in chunks of tokens: the cross-entropy against the labels and, with a teacher's final
hidden states and head, T^2 KL(teacher || model) at temperature T; neither model's [tokens, vocabulary] logits nor
their gradients exist whole.

_HeadLosses keeps only its inputs (in the matmul's dtype) and a few fp32 statistics a token. Forward, the head's
matmul gives a chunk's logits (the teacher's too) and one program a row (_row_losses_kernel) reads them once, in
blocks of up to MAX_BLOCK entries with an online max and sum of exponentials: the row's CE (logsumexp(z) -
z[label], 0 where the label is IGNORE_INDEX) and KL terms in fp32, and the statistics of its softmaxes. Backward,
the matmul computes the chunk's logits again and one program a row (_grad_logits_kernel) writes their gradient over
them, in their dtype, from those statistics: ce_scale (softmax(z) - onehot(label)) + kl_scale (softmax(z / T) -
softmax(t / T)), the latter as p_t (exp(d) - 1) so that a model near its teacher keeps the digits of the
difference. The hidden states' and the weight's gradients are then two matmuls of it, the weight's summed over the
chunks in fp32 (add_product). Without Triton (CPU tensors outside the interpreter) each chunk takes the PyTorch
reference below: the fp32 logits, F.cross_entropy, F.kl_div and the softmaxes of the same terms."""
import functools

import torch
import torch.nn.functional as F

from ..format import on_device, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference
    triton = None

CHUNK_BYTES = 256 * 2**20  # a chunk's logits counted in fp32 (the reference's; the kernels hold the matmul's dtype)
IGNORE_INDEX = -100  # transformers' label of a position without a loss
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # logits the kernels read
MAX_BLOCK = 8192  # vocabulary entries a program reads a step (the whole row below this)
MAX_WARPS = 16
STATS, TEACHER_STATS = 2, 5  # fp32 statistics a token that the backward reads, without and with a teacher


def head_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                teacher_hidden: torch.Tensor | None = None, teacher_weight: torch.Tensor | None = None,
                temperature: float = 1.0, rows: int | None = None) -> torch.Tensor:
    """[CE, KL] of the LM head `weight` [vocab, D] on the final hidden states `hidden` [tokens, D], computed `rows`
    tokens at a time (default: CHUNK_BYTES of fp32 logits): the cross-entropy against `labels` [tokens] (each
    position's next token, IGNORE_INDEX where none), averaged over the labelled positions; with the teacher's
    final hidden states and head, T^2 KL(teacher || model) at `temperature` averaged over all positions (else
    0). In the dtype autocast gives the head's matmul, the losses in fp32. Differentiable in `hidden` and
    `weight`."""
    rows = rows or max(1, CHUNK_BYTES // (4 * len(weight)))
    return _HeadLosses.apply(hidden, weight, labels, teacher_hidden, teacher_weight, temperature, rows)


def _chunks(rows: int, size: int):
    return (slice(start, start + size) for start in range(0, rows, size))


class _HeadLosses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher_hidden, teacher_weight, temperature, rows):
        # the dtype autocast would give the head's matmul; the backward computes in the same, autocast or not
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        teacher = teacher_hidden is not None
        if teacher:
            teacher_hidden, teacher_weight = teacher_hidden.to(dtype), teacher_weight.to(dtype)
        fused = use_triton(hidden) and dtype in DTYPES
        # each token's CE and KL terms, summed at the end; the kernels' statistics of its logits for the backward
        ce = torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
        kl = torch.empty_like(ce) if teacher else None
        stats = torch.empty(len(hidden), TEACHER_STATS if teacher else STATS, dtype=torch.float32,
                            device=hidden.device) if fused else None
        for chunk in _chunks(len(hidden), rows):
            logits = F.linear(hidden[chunk], weight)
            teacher_logits = F.linear(teacher_hidden[chunk], teacher_weight) if teacher else None
            if fused:
                row_losses(logits, labels[chunk], teacher_logits, temperature,
                           out=(ce[chunk], kl[chunk] if teacher else None, stats[chunk]))
            else:
                ce[chunk], kl_rows = row_losses_reference(logits, labels[chunk], teacher_logits, temperature)
                if teacher:
                    kl[chunk] = kl_rows
            del logits, teacher_logits  # freed before the next chunk's are made: one chunk's at a time
        count = (labels != IGNORE_INDEX).sum()
        ctx.save_for_backward(hidden, weight, labels, count, teacher_hidden, teacher_weight, stats)
        ctx.temperature, ctx.rows, ctx.fused = temperature, rows, fused
        kl = kl.sum() if teacher else torch.zeros_like(count, dtype=torch.float32)
        return torch.stack([ce.sum() / count, temperature ** 2 * kl / len(hidden)])

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, count, teacher_hidden, teacher_weight, stats = ctx.saved_tensors
        temperature = ctx.temperature
        # d/dz of T^2 KL(p || softmax(z / T)) = T (softmax(z / T) - p)
        scales = torch.stack([grad[0] / count, grad[1] * temperature / len(hidden)]).float()
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)  # summed over chunks without bf16 roundings
        for chunk in _chunks(len(hidden), ctx.rows):
            logits = F.linear(hidden[chunk], weight)
            teacher_logits = None if teacher_hidden is None else F.linear(teacher_hidden[chunk], teacher_weight)
            if ctx.fused:
                grad_logits = grad_logits_(logits, labels[chunk], teacher_logits, stats[chunk], scales, temperature)
            else:
                grad_logits = grad_logits_reference(logits, labels[chunk], teacher_logits, scales, temperature)
            del logits, teacher_logits  # freed before the matmuls but the gradient (the kernels': the logits)
            torch.mm(grad_logits, weight, out=grad_hidden[chunk])
            add_product(grad_weight, grad_logits.T, hidden[chunk])
            del grad_logits
        return grad_hidden, grad_weight, None, None, None, None, None


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """out += a @ b, out fp32 (or a's dtype). fp16 / bf16 operands go through cuBLAS into fp32 where torch takes
    addmm's out_dtype with an fp32 `self` (product_widens); else their product in their dtype is added."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif product_widens(out.device, a.dtype):
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.add_(a @ b)


@functools.cache
def product_widens(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.addmm(fp32 out, a, b, out_dtype=torch.float32, out=out) adds the product of `dtype` operands
    on `device` into out. addmm's out_dtype came in torch 2.8 for CUDA, first with `self` in the operands' dtype
    only (pytorch#167931 let it be out_dtype's): tried once a device and dtype, on 1 x 1 operands."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    out = torch.ones(1, 1, device=device)
    one = torch.ones(1, 1, dtype=dtype, device=device)
    try:
        torch.addmm(out, one, one, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError):
        return False
    return out.item() == 2.0


def row_losses_reference(logits, labels, teacher_logits=None, temperature: float = 1.0):
    """(CE [rows], KL [rows] or None) of logits [rows, V] in fp32: F.cross_entropy (0 where the label is
    IGNORE_INDEX) and F.kl_div(log_softmax(z / T), log_softmax(t / T)) summed over the vocabulary, unscaled."""
    logits = logits.float()
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    if teacher_logits is None:
        return ce, None
    target = F.log_softmax(teacher_logits.float() / temperature, -1)
    kl = F.kl_div(F.log_softmax(logits / temperature, -1), target, log_target=True, reduction="none").sum(-1)
    return ce, kl


def row_stats_reference(logits, teacher_logits=None, temperature: float = 1.0):
    """The statistics row_losses keeps, fp32 [rows, STATS] (softmax(z) = exp(z - m) / s): m = max(z), 1 / s; with
    a teacher [rows, TEACHER_STATS], also those of softmax(t / T) = exp((t - mt) / T) / st and logsumexp(z / T) -
    logsumexp(t / T)."""
    logits = logits.float()
    m = logits.amax(-1)
    stats = [m, 1 / (logits - m[:, None]).exp().sum(-1)]
    if teacher_logits is None:
        return torch.stack(stats, 1)
    teacher_logits = teacher_logits.float()
    mt = teacher_logits.amax(-1)
    lse_t = (teacher_logits / temperature).logsumexp(-1)
    return torch.stack(stats + [mt, 1 / ((teacher_logits - mt[:, None]) / temperature).exp().sum(-1),
                                (logits / temperature).logsumexp(-1) - lse_t], 1)


def grad_logits_reference(logits, labels, teacher_logits, scales, temperature: float = 1.0):
    """The gradient of scales[0] * sum(CE) + scales[1] / T * sum(T^2 KL) in logits [rows, V], in their dtype:
    scales[0] (softmax(z) - onehot(label)), 0 on rows labelled IGNORE_INDEX, + scales[1] (softmax(z / T) -
    softmax(t / T))."""
    dtype, logits = logits.dtype, logits.float()
    grad = logits.softmax(-1)
    grad.scatter_add_(-1, labels.clamp_min(0)[:, None], grad.new_full((len(labels), 1), -1.0))
    grad.mul_(((labels != IGNORE_INDEX) * scales[0])[:, None])
    if teacher_logits is not None:
        kl_grad = (logits / temperature).softmax(-1)
        kl_grad.sub_((teacher_logits.float() / temperature).softmax(-1))
        grad.add_(kl_grad.mul_(scales[1]))
    return grad.to(dtype)


def _tiling(vocab: int):
    """(block, warps) of a row of `vocab` logits."""
    block = min(triton.next_power_of_2(vocab), MAX_BLOCK)
    return block, max(1, min(MAX_WARPS, block // 512))


def row_losses(logits, labels, teacher_logits=None, temperature: float = 1.0, out=None):
    """row_losses_reference's (CE, KL) of logits [rows, V] (fp32, fp16 or bf16) from one read of
    them (and of the teacher's), and row_stats_reference's statistics, all fp32, by _row_losses_kernel: into `out`
    (CE [rows], KL [rows] or None, statistics [rows, STATS or TEACHER_STATS] with a unit last stride) or new
    tensors."""
    logits = logits.contiguous()
    rows, vocab = logits.shape
    teacher = teacher_logits is not None
    if out is None:
        ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
        out = (ce, torch.empty_like(ce) if teacher else None,
               torch.empty(rows, TEACHER_STATS if teacher else STATS, dtype=torch.float32, device=logits.device))
    ce, kl, stats = out
    if rows:
        block, warps = _tiling(vocab)
        labels = labels.contiguous()
        teacher_logits = teacher_logits.contiguous() if teacher else logits  # without: pointers never read
        with on_device(logits):
            _row_losses_kernel[(rows,)](
                logits, teacher_logits, labels, ce, kl if teacher else ce, stats, vocab, logits.stride(0),
                teacher_logits.stride(0), stats.stride(0), 1.0 / temperature, TEACHER=teacher,
                UNIT_T=temperature == 1, IGNORE=IGNORE_INDEX, BLOCK=block, num_warps=warps)
    return out


def grad_logits_(logits, labels, teacher_logits, stats, scales, temperature: float = 1.0):
    """grad_logits_reference written over logits (fp32, fp16 or bf16, unit last stride; returned) from row_losses'
    statistics `stats` of the same logits, by _grad_logits_kernel: one read of them (and of the teacher's), one
    write. `scales`: fp32 [2] on their device."""
    rows, vocab = logits.shape
    teacher = teacher_logits is not None
    if logits.stride(-1) != 1:
        raise ValueError(f"grad_logits_: logits {tuple(logits.shape)} of strides {logits.stride()}, not unit last")
    if rows:
        block, warps = _tiling(vocab)
        labels = labels.contiguous()
        teacher_logits = teacher_logits.contiguous() if teacher else logits
        with on_device(logits):
            _grad_logits_kernel[(rows,)](
                logits, teacher_logits, labels, stats, scales, vocab, logits.stride(0), teacher_logits.stride(0),
                stats.stride(0), 1.0 / temperature, TEACHER=teacher, IGNORE=IGNORE_INDEX, BLOCK=block,
                num_warps=warps)
    return logits


if triton is not None:

    @triton.jit
    def _row_losses_kernel(z_ptr, t_ptr, labels_ptr, ce_ptr, kl_ptr, stats_ptr, V, z_stride, t_stride,
                           stats_stride, inv_t, TEACHER: tl.constexpr, UNIT_T: tl.constexpr, IGNORE: tl.constexpr,
                           BLOCK: tl.constexpr):
        """Row program_id of z [rows, V] (and of the teacher's t): its CE into ce, its KL into kl, and into its row
        of stats row_stats_reference's statistics. UNIT_T: T is 1."""
        row = tl.program_id(0).to(tl.int64)
        z_row, t_row = z_ptr + row * z_stride, t_ptr + row * t_stride
        cols = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)  # running max of z and sums of exp(z - m), exp((z - m) / T)
        s = tl.zeros([], tl.float32)
        s_t = tl.zeros([], tl.float32)
        mt = tl.full([], float("-inf"), tl.float32)  # of t: max, sum of exp((t - mt) / T) and of that * (t - z)
        st = tl.zeros([], tl.float32)
        a = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK):
            on = start + cols < V
            z = tl.load(z_row + start + cols, mask=on, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            if TEACHER:
                if not UNIT_T:
                    s_t = s_t * tl.exp((m - m_new) * inv_t) + tl.sum(tl.exp((z - m_new) * inv_t), axis=0)
                t = tl.load(t_row + start + cols, mask=on, other=float("-inf")).to(tl.float32)
                mt_new = tl.maximum(mt, tl.max(t, axis=0))
                rescale = tl.exp((mt - mt_new) * inv_t)
                e = tl.exp((t - mt_new) * inv_t)
                st = st * rescale + tl.sum(e, axis=0)
                # masked entries: e is 0, and t - z is taken between zeros, not between two -inf
                a = a * rescale + tl.sum(e * (tl.where(on, t, 0.0) - tl.where(on, z, 0.0)), axis=0)
                mt = mt_new
            m = m_new
        label = tl.load(labels_ptr + row)
        labelled = label != IGNORE
        tl.device_assert(~labelled | ((label >= 0) & (label < V)), "a label outside the vocabulary")
        labelled = labelled & (label >= 0) & (label < V)  # no read outside the row (the assertion: debug only)
        z_label = tl.load(z_row + tl.where(labelled, label, 0), mask=labelled, other=0.0).to(tl.float32)
        tl.store(ce_ptr + row, tl.where(labelled, (m - z_label) + tl.log(s), 0.0))
        # the softmaxes as exp(z - m) / s, not exp(z - logsumexp(z)): z - m is exact near the max, where
        # logsumexp's rounding (relative to its size) would carry into every probability
        tl.store(stats_ptr + row * stats_stride, m)
        tl.store(stats_ptr + row * stats_stride + 1, 1.0 / s)
        if TEACHER:
            if UNIT_T:
                s_t = s
            # sum p_t (log p_t - log q) = E_p_t[(t - z) / T] + logsumexp(z / T) - logsumexp(t / T), the difference
            # of the two log-sum-exps taken as (m - mt) / T + log(s_t / st): no cancellation of two large terms
            lse_difference = (m - mt) * inv_t + tl.log(s_t / st)
            tl.store(kl_ptr + row, a * inv_t / st + lse_difference)
            tl.store(stats_ptr + row * stats_stride + 2, mt)
            tl.store(stats_ptr + row * stats_stride + 3, 1.0 / st)
            tl.store(stats_ptr + row * stats_stride + 4, lse_difference)

    @triton.jit
    def _grad_logits_kernel(z_ptr, t_ptr, labels_ptr, stats_ptr, scales_ptr, V, z_stride, t_stride, stats_stride,
                            inv_t, TEACHER: tl.constexpr, IGNORE: tl.constexpr, BLOCK: tl.constexpr):
        """Over row program_id of z [rows, V], in z's dtype: scales[0] (softmax(z) - onehot(label)) (0 where the
        label is IGNORE) + with TEACHER scales[1] (softmax(z / T) - softmax(t / T)), the softmaxes from the row's
        statistics in stats (row_stats_reference)."""
        row = tl.program_id(0).to(tl.int64)
        z_row, t_row = z_ptr + row * z_stride, t_ptr + row * t_stride
        cols = tl.arange(0, BLOCK)
        label = tl.load(labels_ptr + row)
        ce_scale = tl.where(label != IGNORE, tl.load(scales_ptr), 0.0)
        m = tl.load(stats_ptr + row * stats_stride)
        inv_s = tl.load(stats_ptr + row * stats_stride + 1)
        if TEACHER:
            kl_scale = tl.load(scales_ptr + 1)
            mt = tl.load(stats_ptr + row * stats_stride + 2)
            inv_st = tl.load(stats_ptr + row * stats_stride + 3)
            lse_difference = tl.load(stats_ptr + row * stats_stride + 4)
        for start in range(0, V, BLOCK):
            col = start + cols
            on = col < V
            z = tl.load(z_row + col, mask=on, other=0.0).to(tl.float32)
            grad = ce_scale * (tl.exp(z - m) * inv_s - tl.where(col == label, 1.0, 0.0))
            if TEACHER:
                t = tl.load(t_row + col, mask=on, other=0.0).to(tl.float32)
                # softmax(z / T) - softmax(t / T) = p_t (exp(d) - 1), d = (z - t) / T - (lse_z - lse_t): accurate
                # where the two are close (a model and its source), unlike the difference of the two softmaxes
                d = (z - t) * inv_t - lse_difference
                expm1 = tl.where(tl.abs(d) < 0.03125, d * (1.0 + d * (0.5 + d * (1.0 / 6.0))), tl.exp(d) - 1.0)
                grad += kl_scale * (tl.exp((t - mt) * inv_t) * inv_st) * expm1
            tl.store(z_row + col, grad.to(z_ptr.dtype.element_ty), mask=on)
