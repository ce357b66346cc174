"""Attention of a few query tokens over a key/value cache (decode), inference only:
out = softmax(q k^T * scale, where the mask allows) v for every query head, in fp32 with the probabilities rounded
to the values' dtype before their product with v, as SDPA's flash kernels round them.

At one query token SDPA's kernels take a block of queries a head: B x H programs, each streaming its head's whole
cache, the positions a static cache holds for later tokens included (its mask hides them), so that a decode step
of one sequence keeps a few SMs busy. Here a program takes one sequence's key/value head, its G query heads times
Q query tokens as the rows of one tile (grouped-query attention reads each key once for the G heads), over one
split of the cache's positions: the splits spread a small batch over the GPU (flash-decoding). A program first
finds the span of its positions that the mask lets some row attend (from the mask alone) and streams the keys and
values of that span's blocks only, BLOCK_N positions a step, pipelined, keeping the softmax online (a running
maximum and sum a row). A second launch adds the splits' partial rows, weighted by their maxima; a call whose
cache one split covers writes the output directly. The output is [B, Q, H, D], the layout in which transformers'
attention functions return it.
reference.decode_attention_reference is the same math in PyTorch."""
import torch

from .format import cdiv, on_device, use_triton
from .launch import custom_op, pdl_options, pdl_start, sm_count
from .reference import decode_attention_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference
    triton = None

MAX_QUERIES = 16  # query tokens a call takes (decode steps; longer calls are prefills, which SDPA's kernels tile)
MAX_ROWS = 64  # query heads of a key/value head times query tokens: the rows of a program's tile
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_N = 64  # cache positions a step: one tl.dot of the rows' queries against their keys
STAGES = 3  # the steps' pipeline (Triton's num_stages): two steps' keys and values in flight while one is used
PROGRAMS_PER_SM = 2  # programs the splits aim for on each SM
WARPS = 4  # a program's: 8 were slower


def decode_attention_fits(query, key, value, mask=None) -> bool:
    """Whether `decode_attention` takes these arguments: query [B, H, Q, D] with 1 to MAX_QUERIES tokens, key and
    value [B, Hkv, L, D] with H a multiple of Hkv and (H / Hkv) x Q at most MAX_ROWS, D at most MAX_HEAD_DIM, unit
    last strides, one dtype of DTYPES; mask None (every position allowed) or bool, broadcastable to [B, H, Q, L]
    (True: attend); all on one device."""
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        return False
    b, h, q, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    fits = (0 < b == key.shape[0] and key.shape[3] == d and 0 < hkv and h % hkv == 0 and 0 < q <= MAX_QUERIES
            and (h // hkv) * q <= MAX_ROWS and 0 < d <= MAX_HEAD_DIM and length > 0 and query.dtype in DTYPES
            and query.dtype == key.dtype == value.dtype and all(t.stride(-1) == 1 for t in (query, key, value))
            and query.device == key.device == value.device)
    if not fits or mask is None:
        return fits
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.device == query.device
            and all(m in (1, n) for m, n in zip(mask.shape, (b, h, q, length))))


def decode_attention(query, key, value, mask=None, scale=None, out=None):
    """Attention output [B, Q, H, D] in query's dtype (decode_attention_fits says what it takes); scale defaults to
    D^-0.5. A query row whose mask allows no position gets zeros. `out`, if given, is written instead of a new
    tensor. CPU tensors without the Triton interpreter take the reference."""
    if not decode_attention_fits(query, key, value, mask):
        raise ValueError(f"decode_attention: query {tuple(query.shape)} {query.dtype}, key {tuple(key.shape)} "
                         f"{key.dtype}, value {tuple(value.shape)} {value.dtype}"
                         + (f", mask {tuple(mask.shape)} {mask.dtype}" if mask is not None else "")
                         + f" (query [B, H, 1-{MAX_QUERIES}, D], key and value [B, Hkv, L, D], H a multiple of Hkv, "
                           f"at most {MAX_ROWS} query heads x tokens a key/value head, D <= {MAX_HEAD_DIM}, unit last "
                           f"strides, one dtype of {[str(t) for t in DTYPES]}; a bool mask broadcastable to "
                           "[B, H, Q, L])")
    return decode_attention_fitted(query, key, value, mask, scale, out)


def decode_attention_wins(batch: int, kv_heads: int, sms: int, repeated_kv: bool = False) -> bool:
    """Whether the kernel takes less GPU time than SDPA's at decode on a GPU of `sms` SMs, as timed against
    transformers' sdpa attention. Where that attention first copies each key/value head once for each of its query
    heads (`repeated_kv`: grouped-query heads under a mask, in transformers releases that do not pack the query heads
    over their key/value head), it reads and writes the cache several times over where the kernel reads it once:
    the kernel wins at every batch. Otherwise where the sequences' key/value heads are at most one an SM: there
    SDPA's grid (a program a head, or a key/value head where the query heads are packed over it) leaves SMs idle,
    which the kernel's splits fill; on a fuller grid SDPA streams the cache faster than the kernel's programs do."""
    return repeated_kv or batch * kv_heads <= sms


def splits(batch_heads: int, length: int, sms: int) -> int:
    """Splits of the cache's positions for `batch_heads` (sequences x key/value heads) programs a split: enough for
    PROGRAMS_PER_SM programs an SM, at least BLOCK_N positions each."""
    return max(1, min(cdiv(length, BLOCK_N), cdiv(PROGRAMS_PER_SM * sms, batch_heads)))


def decode_attention_fitted(query, key, value, mask=None, scale=None, out=None):
    """`decode_attention` of arguments that decode_attention_fits has accepted, not checked again: for a caller that
    checks them itself to choose between the kernel and another path. Traced calls (torch.compile, export, dispatch
    modes) reach the kernel through this copy's custom op."""
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or type(query) is not torch.Tensor:
        attended = _decode_attention_op(query, key, value, mask, scale)
        return attended if out is None else out.copy_(attended)
    return _launch(query, key, value, mask, scale, out)


def _launch(query, key, value, mask, scale, out=None):
    b, h, q, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    if out is None:
        out = torch.empty((b, q, h, d), dtype=query.dtype, device=query.device)
    if not use_triton(query):
        out.copy_(decode_attention_reference(query, key, value, mask, scale))
        return out
    group_rows = (h // hkv) * q
    bm, bd = max(16, triton.next_power_of_2(group_rows)), max(16, triton.next_power_of_2(d))
    n_split = splits(b * hkv, length, sm_count(query.device))
    keys = cdiv(cdiv(length, n_split), BLOCK_N) * BLOCK_N  # positions a split
    n_split = cdiv(length, keys)
    mask_strides = mask.expand(b, h, q, length).stride() if mask is not None else (0, 0, 0, 0)
    if n_split > 1:  # fp32 partial rows and their (maximum, sum), every one written by its split's program
        partial = torch.empty((b * hkv, n_split, bm, bd), dtype=torch.float32, device=query.device)
        stats = torch.empty((b * hkv, n_split, bm, 2), dtype=torch.float32, device=query.device)
    else:
        partial = stats = out
    dims = dict(HKV=hkv, G=h // hkv, Q=q, D=d, BM=bm, BD=bd)
    pdl = pdl_options(query.device)
    with on_device(query):
        _decode_attention_kernel[(b * hkv, n_split)](
            query, key, value, query if mask is None else mask, out, partial, stats, scale, length, keys,
            *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *mask_strides, *out.stride()[:3],
            **dims, BN=BLOCK_N, HAS_MASK=mask is not None, SPLIT=n_split > 1,
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32", STAGES=STAGES, num_warps=WARPS, **pdl)
        if n_split > 1:
            _combine_splits_kernel[(b * hkv, group_rows)](
                partial, stats, out, n_split, *out.stride()[:3], **dims,
                SP=max(2, triton.next_power_of_2(n_split)), num_warps=4, **pdl)
    return out


_decode_attention_op = custom_op(
    "decode_attention", lambda query, key, value, mask, scale: _launch(query, key, value, mask, scale),
    "(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor",
    lambda query, key, value, mask, scale: query.new_empty(query.shape[0], query.shape[2], query.shape[1],
                                                           query.shape[3]))


if triton is not None:

    @triton.jit
    def _allowed(mask_ptr, b, head, token, n, live, hi, sm_b, sm_h, sm_q, sm_l):
        """[rows, positions n] that the mask allows (n below hi, live rows)."""
        inside = live[:, None] & (n < hi)[None, :]
        at = b * sm_b + head[:, None] * sm_h + token[:, None] * sm_q + n[None, :].to(tl.int64) * sm_l
        return tl.load(mask_ptr + at, mask=inside, other=0) != 0

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, stats_ptr, scale, L, KEYS,
                                 sq_b, sq_h, sq_q, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_h, sm_q, sm_l,
                                 so_b, so_q, so_h, HKV: tl.constexpr, G: tl.constexpr, Q: tl.constexpr,
                                 D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                                 HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                                 STAGES: tl.constexpr, PDL: tl.constexpr):
        """Program (sequence x key/value head, split): rows r = g * Q + t of its tile are query head
        kv_head * G + g at token t; positions [split * KEYS, split * KEYS + KEYS) of the cache."""
        pdl_start(PDL)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = (pid // HKV).to(tl.int64)
        kv_head = pid % HKV
        r = tl.arange(0, BM)
        live = r < G * Q
        head = kv_head * G + r // Q
        token = r % Q
        d = tl.arange(0, BD)
        dmask = d < D
        q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + token[:, None] * sq_q + d[None, :],
                    mask=live[:, None] & dmask[None, :], other=0.0)
        k_head = k_ptr + b * sk_b + kv_head * sk_h
        v_head = v_ptr + b * sv_b + kv_head * sv_h
        row_max = tl.full((BM,), float("-inf"), tl.float32)
        row_sum = tl.zeros((BM,), dtype=tl.float32)
        acc = tl.zeros((BM, BD), dtype=tl.float32)
        lo = split * KEYS
        hi = tl.minimum(lo + KEYS, L)
        if HAS_MASK:  # the span of the split's positions that some row may attend: only its blocks are read
            first, last = hi, lo
            for n0 in tl.range(lo, hi, BN, num_stages=STAGES):
                n = n0 + tl.arange(0, BN)
                seen = tl.max(_allowed(mask_ptr, b, head, token, n, live, hi, sm_b, sm_h, sm_q, sm_l).to(tl.int32),
                              axis=0) > 0
                first = tl.minimum(first, tl.min(tl.where(seen, n, hi), axis=0))
                last = tl.maximum(last, tl.max(tl.where(seen, n + 1, lo), axis=0))
            lo, hi = first, last
        for n0 in tl.range(lo, hi, BN, num_stages=STAGES):
            n = n0 + tl.arange(0, BN)
            inside = n < hi
            if HAS_MASK:
                allowed = _allowed(mask_ptr, b, head, token, n, live, hi, sm_b, sm_h, sm_q, sm_l)
            else:
                allowed = live[:, None] & inside[None, :]
            kv_mask = inside[:, None] & dmask[None, :]
            k = tl.load(k_head + n[:, None].to(tl.int64) * sk_l + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_head + n[:, None].to(tl.int64) * sv_l + d[None, :], mask=kv_mask, other=0.0)
            s = tl.where(allowed, tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(s, axis=1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing allowed yet
            p = tl.exp(s - shift[:, None])
            rescale = tl.exp(row_max - shift)
            row_sum = row_sum * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            row_max = new_max
        if SPLIT:  # the whole tile, padding included: the combining program reads exactly these
            at = (pid * tl.num_programs(1) + split) * BM + r
            tl.store(part_ptr + at[:, None] * BD + d[None, :], acc)
            tl.store(stats_ptr + at * 2, row_max)
            tl.store(stats_ptr + at * 2 + 1, row_sum)
        else:
            o = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
            tl.store(out_ptr + b * so_b + token[:, None] * so_q + head[:, None] * so_h + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=live[:, None] & dmask[None, :])

    @triton.jit
    def _combine_splits_kernel(part_ptr, stats_ptr, out_ptr, SPLITS, so_b, so_q, so_h, HKV: tl.constexpr,
                               G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                               BD: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
        """Program (sequence x key/value head, row): the row's splits, each weighted by exp(its maximum - the
        largest), summed and divided by their weighted sums (zeros where no split allowed a position)."""
        pdl_start(PDL)
        pid = tl.program_id(0)
        r = tl.program_id(1)
        b = (pid // HKV).to(tl.int64)
        head = (pid % HKV) * G + r // Q
        s = tl.arange(0, SP)
        at = (pid * SPLITS + s) * BM + r
        on = s < SPLITS
        row_max = tl.load(stats_ptr + at * 2, mask=on, other=float("-inf"))
        row_sum = tl.load(stats_ptr + at * 2 + 1, mask=on, other=0.0)
        top = tl.max(row_max, axis=0)
        weight = tl.exp(row_max - tl.where(top == float("-inf"), 0.0, top))
        total = tl.sum(row_sum * weight, axis=0)
        d = tl.arange(0, BD)
        acc = tl.load(part_ptr + at[:, None] * BD + d[None, :], mask=on[:, None], other=0.0)
        o = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + b * so_b + (r % Q) * so_q + head * so_h + d, o.to(out_ptr.dtype.element_ty), mask=d < D)
