"""The sparse part of the hybrid training block: each row's positives of the gate pre-activation packed into ELL
slots (`pack_ell`: at most E a row; a row with more is marked for the dense backup, backup.py), u = x . up[j]
and h = g * u at a row's units with the backward's dh (`sddmm`), sums over a row's slots (`spmm`: out = h @
down^T, dx), the weight gradients from a per-unit list of the entries (`build_csc`, `wgrad`: a stable sort;
a busy unit's segments added in order: deterministic, no atomics), and a tiled transpose. What a kernel sums
is a named mode. Reference: training/reference.py."""
import torch

from .blocks import blocks
from .penalty import penalty_grad, penalty_of

try:
    import triton
    import triton.language as tl
    from triton.language import constexpr
except ImportError:  # CPU-only installs: hybrid.py runs the reference's math instead
    triton = None
    constexpr = int  # the modes below, which no kernel reads then

# Modes (MODE) of _spmm_kernel, which sums over a row's slots with the gathered weight rows w1[j], w2[j], and
# of _wgrad_kernel, which sums over a unit's entries with the gathered rows x[t]; a, b: values per entry
A = constexpr(0)  # sum a w1[j]; sum a x
A_AND_B = constexpr(1)  # sum a w1[j] + b w2[j]; out1 = sum a x and out2 = sum b x
A_TIMES_B = constexpr(2)  # sum (a b) w1[j]; sum (a b) x
# _wgrad_kernel only (its last mode, DH_GATED), x = dout: also dh = dout . w[unit] of each entry plus
# the penalty's term (the backward SDDMM, fused: the dout row is gathered once for both)
DH_GATED = constexpr(3)  # a = g, b = u: out1 = sum g u dout (d_down^T), d_gate_pre -> o1, d_up -> o2


if triton is not None:

    @triton.jit
    def _pack_kernel(g_ptr, idx_ptr, val_ptr, nnz_ptr, rowsum_ptr, fired_ptr, cold_ptr, M, I, E, stride_g,
                     HOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
        # BLOCK_M rows a program; per-unit counts of those rows go to a partial row of fired_ptr
        # (summed by torch afterwards): deterministic, no atomics
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        count = tl.zeros([BLOCK_M], tl.int32)
        total = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, I, BLOCK_I):
            cols = start + tl.arange(0, BLOCK_I)
            m2 = rmask[:, None] & (cols < I)[None, :]
            v = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=m2, other=0.0)
            v = v.to(tl.float32)
            pos = v > 0.0
            if HOT:  # hot units are dense columns, computed outside
                pos = pos & (tl.load(cold_ptr + cols, mask=cols < I, other=0) != 0)[None, :]
            # prefix sum over the positive mask: each value's slot, sorted by unit, deterministic
            incl = tl.cumsum(pos.to(tl.int32), 1)
            slot = count[:, None] + incl - 1
            keep = pos & (slot < E)
            tl.store(idx_ptr + rows[:, None] * E + slot, cols[None, :] + tl.zeros_like(slot), mask=keep)
            tl.store(val_ptr + rows[:, None] * E + slot, v, mask=keep)
            tl.store(fired_ptr + pid.to(tl.int64) * I + cols, tl.sum(pos.to(tl.int32), 0), mask=cols < I)
            count += tl.sum(pos.to(tl.int32), 1)
            total += tl.sum(tl.where(pos, v, 0.0), 1)
        tl.store(nnz_ptr + rows, count, mask=rmask)
        tl.store(rowsum_ptr + rows, total, mask=rmask)
        # unused slots (all of a backup row's) get unit I: idx is then the sort key of the CSC
        tl.debug_barrier()  # backup rows overwrite slots that other threads of this program wrote
        for s0 in range(0, E, BLOCK_I):
            slots = s0 + tl.arange(0, BLOCK_I)
            fill = rmask[:, None] & (slots < E)[None, :] & \
                ((slots[None, :] >= count[:, None]) | (count[:, None] > E))
            tl.store(idx_ptr + rows[:, None] * E + slots[None, :],
                     tl.zeros([BLOCK_M, BLOCK_I], tl.int32) + I, mask=fill)

    @triton.jit
    def _sddmm_kernel(a_ptr, w_ptr, idx_ptr, nnz_ptr, g_ptr, u_ptr, out1_ptr, out2_ptr, rowsum_ptr,
                      c_ptr, eps, D, E, stride_a, stride_w, BACKWARD: tl.constexpr, LOG: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        n = tl.load(nnz_ptr + row)
        n = tl.where(n > E, 0, n)  # backup rows: nothing here
        l1 = tl.full([], 0.0, tl.float32)
        for s0 in range(0, n, BLOCK_S):
            slots = s0 + tl.arange(0, BLOCK_S)
            smask = slots < n
            e = row * E + slots
            j = tl.load(idx_ptr + e, mask=smask, other=0).to(tl.int64)
            acc = tl.zeros([BLOCK_S], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                dmask = cols < D
                a = tl.load(a_ptr + row * stride_a + cols, mask=dmask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + j[:, None] * stride_w + cols[None, :],
                            mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(w * a[None, :], 1)
            if not BACKWARD:  # acc = u; h = g * u
                g = tl.load(g_ptr + e, mask=smask, other=0.0)
                tl.store(u_ptr + e, acc, mask=smask)
                l1 += tl.sum(penalty_of(tl.abs(g * acc), eps, LOG), 0)
            else:  # acc = dh from the output; add the penalty's term (c sign(h) for L1), c = dl1 / M
                c = tl.load(c_ptr)
                g = tl.load(g_ptr + e, mask=smask, other=0.0)
                u = tl.load(u_ptr + e, mask=smask, other=0.0)
                dh = acc + penalty_grad(g * u, c, eps, LOG)
                tl.store(out1_ptr + e, dh * u, mask=smask)
                tl.store(out2_ptr + e, dh * g, mask=smask)
        if not BACKWARD:
            tl.store(rowsum_ptr + row, l1)

    @triton.jit
    def _spmm_kernel(a_ptr, b_ptr, w1_ptr, w2_ptr, idx_ptr, nnz_ptr, out_ptr, D, E,
                     stride_w1, stride_w2, stride_out, MODE: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_D: tl.constexpr):
        # out = sum over the row's slots as MODE says (A, A_AND_B, A_TIMES_B)
        row = tl.program_id(0).to(tl.int64)
        n = tl.load(nnz_ptr + row)
        n = tl.where(n > E, 0, n)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            dmask = cols < D
            acc = tl.zeros([BLOCK_D], tl.float32)
            for s0 in range(0, n, BLOCK_S):
                slots = s0 + tl.arange(0, BLOCK_S)
                smask = slots < n
                e = row * E + slots
                j = tl.load(idx_ptr + e, mask=smask, other=0).to(tl.int64)
                m2 = smask[:, None] & dmask[None, :]
                a = tl.load(a_ptr + e, mask=smask, other=0.0)
                if MODE == A_TIMES_B:
                    a = a * tl.load(b_ptr + e, mask=smask, other=0.0)
                w = tl.load(w1_ptr + j[:, None] * stride_w1 + cols[None, :], mask=m2, other=0.0)
                acc += tl.sum(a[:, None] * w.to(tl.float32), 0)
                if MODE == A_AND_B:
                    b = tl.load(b_ptr + e, mask=smask, other=0.0)
                    w = tl.load(w2_ptr + j[:, None] * stride_w2 + cols[None, :], mask=m2, other=0.0)
                    acc += tl.sum(b[:, None] * w.to(tl.float32), 0)
            tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=dmask)

    @triton.jit
    def _wgrad_kernel(seg_unit_ptr, seg_first_ptr, perm_ptr, offsets_ptr, a_ptr, b_ptr, x_ptr, out1_ptr,
                      out2_ptr, part1_ptr, part2_ptr, w_ptr, c_ptr, o1_ptr, o2_ptr, eps, I, D, E, stride_x,
                      SEG: tl.constexpr, MODE: tl.constexpr, LOG: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr):
        # out1 (and out2) = sums over the unit's entries as MODE says (A, A_AND_B, A_TIMES_B); DH_GATED
        # (x = dout, BLOCK_D >= D) also writes each entry's gradients to o1 and o2.
        # A program per segment of at most SEG entries of one unit (busy units would otherwise leave
        # a long tail); a unit's first segment writes its output row, later ones a partial row that
        # _wgrad_reduce_kernel adds in order: deterministic.
        pid = tl.program_id(0)
        unit = tl.load(seg_unit_ptr + pid).to(tl.int64)  # I past the last segment
        if unit < I:
            k = pid - tl.load(seg_first_ptr + unit)
            start = tl.load(offsets_ptr + unit) + k * SEG
            end = tl.minimum(tl.load(offsets_ptr + unit + 1), start + SEG)
            row = tl.where(k == 0, unit, pid - unit - 1)
            dst1 = tl.where(k == 0, out1_ptr, part1_ptr) + row * D
            dst2 = tl.where(k == 0, out2_ptr, part2_ptr) + row * D
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                dmask = cols < D
                if MODE >= DH_GATED:
                    wrow = tl.load(w_ptr + unit * D + cols, mask=dmask, other=0.0).to(tl.float32)
                    c = tl.load(c_ptr)
                acc1 = tl.zeros([BLOCK_D], tl.float32)
                acc2 = tl.zeros([BLOCK_D], tl.float32)
                for e0 in range(start, end, BLOCK_N):
                    es = e0 + tl.arange(0, BLOCK_N)
                    emask = es < end
                    p = tl.load(perm_ptr + es, mask=emask, other=0)  # flat ELL position row * E + slot
                    t = (p // E).to(tl.int64)
                    xt = tl.load(x_ptr + t[:, None] * stride_x + cols[None, :],
                                 mask=emask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
                    a = tl.load(a_ptr + p, mask=emask, other=0.0)
                    if MODE == A_TIMES_B:
                        a = a * tl.load(b_ptr + p, mask=emask, other=0.0)
                    if MODE == DH_GATED:
                        u = tl.load(b_ptr + p, mask=emask, other=0.0)
                        dh = tl.sum(xt * wrow[None, :], 1) + penalty_grad(a * u, c, eps, LOG)
                        tl.store(o1_ptr + p, dh * u, mask=emask)
                        tl.store(o2_ptr + p, dh * a, mask=emask)
                        a = a * u
                    acc1 += tl.sum(a[:, None] * xt, 0)
                    if MODE == A_AND_B:
                        b = tl.load(b_ptr + p, mask=emask, other=0.0)
                        acc2 += tl.sum(b[:, None] * xt, 0)
                tl.store(dst1 + cols, acc1, mask=dmask)
                if MODE == A_AND_B:
                    tl.store(dst2 + cols, acc2, mask=dmask)

    @triton.jit
    def _wgrad_reduce_kernel(nseg_ptr, seg_first_ptr, out_ptr, part_ptr, D, BLOCK_D: tl.constexpr):
        unit = tl.program_id(0).to(tl.int64)
        nseg = tl.load(nseg_ptr + unit)
        if nseg > 1:
            first_part = tl.load(seg_first_ptr + unit) - unit  # = pid - unit - 1 at k = 1
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                dmask = cols < D
                acc = tl.load(out_ptr + unit * D + cols, mask=dmask, other=0.0)
                for q in range(0, nseg - 1):
                    acc += tl.load(part_ptr + (first_part + q) * D + cols, mask=dmask, other=0.0)
                tl.store(out_ptr + unit * D + cols, acc, mask=dmask)

    @triton.jit
    def _transpose_kernel(src_ptr, dst_ptr, R, C, stride_src, stride_dst, BLOCK: tl.constexpr):
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = (r < R)[:, None] & (c < C)[None, :]
        t = tl.load(src_ptr + r[:, None].to(tl.int64) * stride_src + c[None, :], mask=m)
        tl.store(dst_ptr + c[None, :].to(tl.int64) * stride_dst + r[:, None],
                 t.to(dst_ptr.dtype.element_ty), mask=m)


def pack_ell(pre, E, cold=None):
    """ELL of the positives of pre [M, I]: idx int32 [M, E] (I in unused slots), val fp32 [M, E],
    nnz int32 [M] (true count; > E marks a backup row), rowsum fp32 [M] (sum of positives),
    fired int64 [I]. Units where `cold` (int8 [I]) is 0 are skipped (hot units)."""
    M, I = pre.shape
    bl = blocks(pre.device)
    idx = torch.empty((M, E), dtype=torch.int32, device=pre.device)
    val = torch.empty((M, E), dtype=torch.float32, device=pre.device)
    nnz = torch.empty(M, dtype=torch.int32, device=pre.device)
    rowsum = torch.empty(M, dtype=torch.float32, device=pre.device)
    grid = triton.cdiv(M, bl["BLOCK_M"])
    fired = torch.empty((grid, I), dtype=torch.int32, device=pre.device)
    _pack_kernel[(grid,)](pre, idx, val, nnz, rowsum, fired, idx if cold is None else cold, M, I, E,
                          pre.stride(0), HOT=cold is not None, BLOCK_M=bl["BLOCK_M"], BLOCK_I=bl["BLOCK_I"],
                          num_warps=bl["PACK_WARPS"])
    return idx, val, nnz, rowsum, fired.sum(0)


def transpose(w, dtype):
    """w.t() as a contiguous tensor of dtype (a tiled copy: torch's strided one is far below bandwidth)."""
    R, C = w.shape
    out = torch.empty((C, R), dtype=dtype, device=w.device)
    block = 64 if w.is_cuda else 16
    _transpose_kernel[(triton.cdiv(R, block), triton.cdiv(C, block))](w, out, R, C, w.stride(0),
                                                                      out.stride(0), BLOCK=block)
    return out


def spmm(idx, nnz, a, w1, b=None, w2=None, *, dtype):
    """out [M, D] = sum over the row's slots of a * w1[j] (+ b * w2[j]; or (a * b) * w1[j] if w2 is
    None); w1, w2: [I, D] contiguous."""
    M, E = idx.shape
    D = w1.shape[1]
    bl = blocks(idx.device)
    out = torch.empty((M, D), dtype=dtype, device=idx.device)
    mode = A if b is None else (A_AND_B if w2 is not None else A_TIMES_B)
    _spmm_kernel[(M,)](a, a if b is None else b, w1, w1 if w2 is None else w2, idx, nnz, out, D, E,
                       w1.stride(0), (w1 if w2 is None else w2).stride(0), out.stride(0), MODE=mode,
                       BLOCK_S=bl["BLOCK_S"], BLOCK_D=min(bl["BLOCK_D"], triton.next_power_of_2(D)),
                       num_warps=4)
    return out


def build_csc(idx, I, seg):
    """Per-unit lists of ELL entries: perm (flat positions row * E + slot, grouped by unit, rows in
    order) and offsets [I + 1], from a stable sort (deterministic, no host sync); and the split of
    each unit's list into segments of at most seg entries for _wgrad_kernel."""
    key = idx.flatten()
    if I < 2**15 - 1:  # half the radix-sort passes
        key = key.to(torch.int16)
    keys, perm = torch.sort(key, stable=True)
    perm = perm.to(torch.int32)  # saved for backward: half the bytes
    offsets = torch.searchsorted(keys, torch.arange(I + 1, dtype=keys.dtype, device=idx.device))
    # every unit gets at least one segment (it writes its row, zeros if it never fired)
    nseg = torch.clamp_min((offsets[1:] - offsets[:-1] + seg - 1) // seg, 1)
    seg_end = torch.cumsum(nseg, 0)
    n_prog = I + triton.cdiv(perm.numel(), seg)  # upper bound of the segment count, no host sync
    seg_unit = torch.searchsorted(seg_end, torch.arange(n_prog, device=idx.device), right=True)
    return perm, offsets, nseg, seg_end - nseg, seg_unit


def fused_dh(D, device):
    """Whether the backward SDDMM rides in the d_down kernel (a whole dout row in one tile)."""
    return triton.next_power_of_2(D) <= blocks(device)["FUSE_D"]


def wgrad(csc, E, a, b, x, mode, w=None, c=None, o1=None, o2=None, eps=0.0):
    """Weight gradient rows [I, D] (fp32) as transposed-sparse x dense; modes: A, A_AND_B, A_TIMES_B, DH_GATED
    (_wgrad_kernel; its penalty L1, or the log penalty with eps > 0: penalty.py)."""
    perm, offsets, nseg, seg_first, seg_unit = csc
    I, n_prog = nseg.numel(), seg_unit.numel()
    D = x.shape[1]
    bl = blocks(x.device)
    block_d = triton.next_power_of_2(D) if mode >= DH_GATED else min(bl["BLOCK_D"], triton.next_power_of_2(D))
    outs, parts = [], []
    for _ in range(2 if mode == A_AND_B else 1):
        outs.append(torch.empty((I, D), dtype=torch.float32, device=x.device))
        parts.append(torch.empty((n_prog - I, D), dtype=torch.float32, device=x.device))
    out2, part2 = (outs[1], parts[1]) if mode == A_AND_B else (outs[0], parts[0])
    b = a if b is None else b
    _wgrad_kernel[(n_prog,)](seg_unit, seg_first, perm, offsets, a, b, x, outs[0], out2, parts[0], part2,
                             x if w is None else w, a if c is None else c, a if o1 is None else o1,
                             a if o2 is None else o2, float(eps), I, D, E, x.stride(0), SEG=bl["SEG"], MODE=mode,
                             LOG=eps > 0, BLOCK_N=bl["BLOCK_N"], BLOCK_D=block_d, num_warps=4)
    for out, part in zip(outs, parts):
        _wgrad_reduce_kernel[(I,)](nseg, seg_first, out, part, D, BLOCK_D=block_d, num_warps=4)
    return outs[0], (outs[1] if mode == A_AND_B else None)


def sddmm(a, w, idx, nnz, g, u, *, backward, c=None, eps=0.0):
    """Forward: writes u, returns each row's penalty of h = g u (L1, or the log penalty with eps > 0: penalty.py).
    Backward: returns (d_gate_pre, d_up) on the pattern."""
    M, E = idx.shape
    D = a.shape[1]
    bl = blocks(a.device)
    dev = a.device
    rowsum = torch.empty(M, dtype=torch.float32, device=dev) if not backward else None
    out1 = torch.empty((M, E), dtype=torch.float32, device=dev) if backward else None
    out2 = torch.empty((M, E), dtype=torch.float32, device=dev) if backward else None
    dummy = idx
    _sddmm_kernel[(M,)](a, w, idx, nnz, g if g is not None else dummy, u if u is not None else dummy,
                        out1 if out1 is not None else dummy, out2 if out2 is not None else dummy,
                        rowsum if rowsum is not None else dummy, c if c is not None else dummy,
                        float(eps), D, E, a.stride(0), w.stride(0), BACKWARD=backward, LOG=eps > 0,
                        BLOCK_S=bl["SDDMM_S"], BLOCK_D=bl["SDDMM_D"], num_warps=4)
    return rowsum if not backward else (out1, out2)
