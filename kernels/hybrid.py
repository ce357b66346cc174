"""Hybrid TwELL training kernels: a ReLU-gated MLP block, forward and backward (autograd), on the per-row sparse
pattern of its gate: rows with at most max_nnz active units go through ELL slots and row-gathering kernels, the
others through a dense backup over a device-side row list, with no host synchronization; also the block's L1
term and activity statistics. Training only: not copied into checkpoints. Design: docs/design.md, "Hybrid
training kernels"; reference: hybrid_gated_mlp_reference. A launch configuration beyond the GPU (Triton's
OutOfResources) makes that pass (forward or backward) of blocks of that shape and dtype run the reference's
math, with a warning.
"""
import warnings
from typing import NamedTuple

import torch

from .format import on_device, use_triton

try:
    import triton
    import triton.language as tl
    from triton.language import constexpr

    from triton.runtime.errors import OutOfResources

    _HAS_TRITON = True
except ImportError:  # CPU-only installs: the reference path below computes the same outputs and stats
    constexpr = int  # the modes below, which no kernel reads then
    _HAS_TRITON = False
    OutOfResources = None

# Modes (MODE) of _spmm_kernel, which sums over a row's slots with the gathered weight rows w1[j], w2[j], and
# of _wgrad_kernel, which sums over a unit's entries with the gathered rows x[t]; a, b: values per entry
A = constexpr(0)  # sum a w1[j]; sum a x
A_AND_B = constexpr(1)  # sum a w1[j] + b w2[j]; out1 = sum a x and out2 = sum b x
A_TIMES_B = constexpr(2)  # sum (a b) w1[j]; sum (a b) x
# _wgrad_kernel only (its last mode, DH_GATED), x = dout: also dh = dout . w[unit] of each entry plus
# the L1 term (the backward SDDMM, fused: the dout row is gathered once for both)
DH_GATED = constexpr(3)  # a = g, b = u: out1 = sum g u dout (d_down^T), d_gate_pre -> o1, d_up -> o2
# Modes of _rows_units_kernel, over the backup rows
ROWS_FORWARD = constexpr(0)  # h over the gate pre-activation, sum |h|
ROWS_BACKWARD = constexpr(1)  # d_gate_pre, d_up, h


class HybridStats(NamedTuple):
    l1: torch.Tensor  # scalar, differentiable: mean over tokens of sum over units of |h|
    active: torch.Tensor  # scalar float: mean active units per token (detached)
    fired: torch.Tensor  # int64 [I]: tokens in which each unit fired (detached)
    backup_rows: torch.Tensor  # int64 scalar: rows that went to the dense backup


_empty = torch.empty  # every buffer a kernel writes comes from here (tests poison it with NaN)


if _HAS_TRITON:

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
                      c_ptr, D, E, stride_a, stride_w,
                      BACKWARD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
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
                l1 += tl.sum(tl.abs(g * acc), 0)
            else:  # acc = dh from the output; add the L1 term c * sign(h), c = dl1 / M
                c = tl.load(c_ptr)
                g = tl.load(g_ptr + e, mask=smask, other=0.0)  # g > 0 on the pattern, so sign(h) = sign(u)
                u = tl.load(u_ptr + e, mask=smask, other=0.0)
                sgn = tl.where(u > 0.0, 1.0, tl.where(u < 0.0, -1.0, 0.0))
                dh = acc + c * sgn
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
                      out2_ptr, part1_ptr, part2_ptr, w_ptr, c_ptr, o1_ptr, o2_ptr, I, D, E, stride_x,
                      SEG: tl.constexpr, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
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
                    if MODE == DH_GATED:  # g > 0 on the pattern: sign(h) = sign(u)
                        u = tl.load(b_ptr + p, mask=emask, other=0.0)
                        sgn = tl.where(u > 0.0, 1.0, tl.where(u < 0.0, -1.0, 0.0))
                        dh = tl.sum(xt * wrow[None, :], 1) + c * sgn
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


    @triton.jit
    def _backup_tile(pid_tile, n_n, order_ptr, count, BM: tl.constexpr, BN: tl.constexpr):
        """Rows (gathered through the backup list) and columns of one backup tile."""
        i = (pid_tile // n_n) * BM + tl.arange(0, BM)
        rmask = i < count
        rows = tl.load(order_ptr + i, mask=rmask, other=0).to(tl.int64)
        return rows, rmask, (pid_tile % n_n) * BN + tl.arange(0, BN)

    @triton.jit
    def _rows_dots(x_ptr, dout_ptr, w1_ptr, w2_ptr, w3_ptr, rows, rmask, cols, N, K, stride_x, stride_dout,
                   stride_w3k, stride_w3n, BACKWARD: tl.constexpr, DOT: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr):
        """x[rows] @ w1[cols]^T; backward also x[rows] @ w2[cols]^T and dout[rows] @ w3[:, cols] (w3 [K, N] by
        strides)."""
        acc1 = tl.zeros((BM, BN), tl.float32)
        acc2 = tl.zeros((BM, BN), tl.float32)
        acc3 = tl.zeros((BM, BN), tl.float32)
        cmask = cols < N
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            am = rmask[:, None] & kmask[None, :]
            wm = kmask[:, None] & cmask[None, :]
            a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=am, other=0.0)
            w = tl.load(w1_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=wm, other=0.0)
            acc1 = tl.dot(a, w, acc1, input_precision=DOT)
            if BACKWARD:
                w = tl.load(w2_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=wm, other=0.0)
                acc2 = tl.dot(a, w, acc2, input_precision=DOT)
                a = tl.load(dout_ptr + rows[:, None] * stride_dout + ks[None, :], mask=am, other=0.0)
                w = tl.load(w3_ptr + ks[:, None].to(tl.int64) * stride_w3k + cols[None, :] * stride_w3n,
                            mask=wm, other=0.0)
                acc3 = tl.dot(a, w, acc3, input_precision=DOT)
        return acc1, acc2, acc3

    @triton.jit
    def _rows_units_kernel(order_ptr, count_ptr, x_ptr, dout_ptr, w1_ptr, w2_ptr, w3_ptr, o1_ptr, o2_ptr,
                           o3_ptr, l1_ptr, c_ptr, cold_ptr, N, K, stride_x, stride_dout, stride_o, stride_w3k,
                           stride_w3n, MODE: tl.constexpr, HOT: tl.constexpr, DOT: tl.constexpr,
                           NPROG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # Dense [backup rows, units] tiles. ROWS_FORWARD: h = relu(o1) * (x @ up^T) over o1 = the gate
        # pre-activation, in place, and the program's sum |h| into l1_ptr. ROWS_BACKWARD: g, u recomputed
        # (w1 = gate, w2 = up), dh = dout @ down (w3) + c sign(h): o1 = dh u [g > 0], o2 = dh relu(g), o3 = h.
        # With HOT, units where cold_ptr is 0 count as inactive (they are dense columns, computed outside).
        count = tl.load(count_ptr)
        n_n = tl.cdiv(N, BN)
        dt = o1_ptr.dtype.element_ty
        l1 = tl.zeros((BM, BN), tl.float32)
        for t in range(tl.program_id(0), tl.cdiv(count, BM) * n_n, NPROG):
            rows, rmask, cols = _backup_tile(t, n_n, order_ptr, count, BM, BN)
            m = rmask[:, None] & (cols < N)[None, :]
            offs = rows[:, None] * stride_o + cols[None, :]
            acc1, acc2, acc3 = _rows_dots(x_ptr, dout_ptr, w1_ptr, w2_ptr, w3_ptr, rows, rmask, cols, N, K,
                                          stride_x, stride_dout, stride_w3k, stride_w3n,
                                          MODE == ROWS_BACKWARD, DOT, BM, BN, BK)
            if HOT:
                on = (tl.load(cold_ptr + cols, mask=cols < N, other=0) != 0)[None, :]
            else:
                on = cols[None, :] >= 0
            if MODE == ROWS_FORWARD:
                g = tl.where(on, tl.maximum(tl.load(o1_ptr + offs, mask=m, other=0.0).to(tl.float32), 0.0), 0.0)
                h = (g * acc1.to(dt).to(tl.float32)).to(dt)
                tl.store(o1_ptr + offs, h, mask=m)
                l1 += tl.abs(h.to(tl.float32))
            else:
                c = tl.load(c_ptr)
                pre = tl.where(on, acc1.to(dt).to(tl.float32), 0.0)  # as the forward's matmul output
                g = tl.maximum(pre, 0.0)
                u = acc2.to(dt).to(tl.float32)
                h = (g * u).to(dt).to(tl.float32)
                dh = acc3 + c * tl.where(h > 0.0, 1.0, tl.where(h < 0.0, -1.0, 0.0))
                tl.store(o1_ptr + offs, (dh * u * (pre > 0.0)).to(dt), mask=m)
                tl.store(o2_ptr + offs, (dh * g).to(dt), mask=m)
                tl.store(o3_ptr + offs, h.to(dt), mask=m)
        if MODE == ROWS_FORWARD:
            tl.store(l1_ptr + tl.program_id(0), tl.sum(tl.sum(l1, 1), 0))

    @triton.jit
    def _hot_grads_kernel(g_ptr, u_ptr, dh_ptr, c_ptr, dgp_ptr, du_ptr, h_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        dt = h_ptr.dtype.element_ty
        g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + i, mask=m, other=0.0).to(tl.float32)
        h = (tl.maximum(g, 0.0) * u).to(dt).to(tl.float32)  # as the forward's h
        dh = tl.load(dh_ptr + i, mask=m, other=0.0).to(tl.float32) + \
            tl.load(c_ptr) * tl.where(h > 0.0, 1.0, tl.where(h < 0.0, -1.0, 0.0))
        tl.store(dgp_ptr + i, (dh * u * (g > 0.0)).to(dt), mask=m)
        tl.store(du_ptr + i, (dh * tl.maximum(g, 0.0)).to(dt), mask=m)
        tl.store(h_ptr + i, h.to(dt), mask=m)

    @triton.jit
    def _rows_mm_kernel(order_ptr, count_ptr, a_ptr, a2_ptr, b_ptr, b2_ptr, c_ptr, N, K, stride_a,
                        stride_bk, stride_bn, stride_c, TWO: tl.constexpr, RELU_A: tl.constexpr,
                        DOT: tl.constexpr, NPROG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):
        # c[rows] = a[rows] @ b (+ a2[rows] @ b2) for the backup rows; b, b2 [K, N] by the same strides
        count = tl.load(count_ptr)
        n_n = tl.cdiv(N, BN)
        for t in range(tl.program_id(0), tl.cdiv(count, BM) * n_n, NPROG):
            rows, rmask, cols = _backup_tile(t, n_n, order_ptr, count, BM, BN)
            cmask = cols < N
            acc = tl.zeros((BM, BN), tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                am = rmask[:, None] & (ks < K)[None, :]
                bm = (ks < K)[:, None] & cmask[None, :]
                a_offs = rows[:, None] * stride_a + ks[None, :]
                b_offs = ks[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn
                a = tl.load(a_ptr + a_offs, mask=am, other=0.0)
                if RELU_A:
                    a = tl.maximum(a, 0.0).to(a.dtype)
                acc = tl.dot(a, tl.load(b_ptr + b_offs, mask=bm, other=0.0), acc, input_precision=DOT)
                if TWO:
                    acc = tl.dot(tl.load(a2_ptr + a_offs, mask=am, other=0.0),
                                 tl.load(b2_ptr + b_offs, mask=bm, other=0.0), acc, input_precision=DOT)
            tl.store(c_ptr + rows[:, None] * stride_c + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _rows_wgrad_kernel(order_ptr, count_ptr, a_ptr, b_ptr, c_ptr, N, K, stride_a, stride_b,
                           DOT: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # c [N, K] (fp32) += a[rows]^T @ b[rows] over the backup rows; nothing to do (no write) when none
        count = tl.load(count_ptr)
        if count > 0:
            cols = tl.program_id(0) * BN + tl.arange(0, BN)
            ks = tl.program_id(1) * BK + tl.arange(0, BK)
            acc = tl.zeros((BN, BK), tl.float32)
            for i0 in range(0, count, BR):
                i = i0 + tl.arange(0, BR)
                rmask = i < count
                rows = tl.load(order_ptr + i, mask=rmask, other=0).to(tl.int64)
                a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :],
                            mask=rmask[:, None] & (cols < N)[None, :], other=0.0)
                b = tl.load(b_ptr + rows[:, None] * stride_b + ks[None, :],
                            mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
                acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT)
            offs = cols[:, None].to(tl.int64) * K + ks[None, :]
            m = (cols < N)[:, None] & (ks < K)[None, :]
            tl.store(c_ptr + offs, tl.load(c_ptr + offs, mask=m, other=0.0) + acc, mask=m)


# Tile sizes: GPU ones for speed; small ones in the CPU interpreter so that small test shapes still run
# every loop several times.
GPU_BLOCKS = dict(BLOCK_M=64, BLOCK_I=64, PACK_WARPS=4, SDDMM_S=4, SDDMM_D=1024,
                  BLOCK_S=4, BLOCK_D=2048, BLOCK_N=4, SEG=512, FUSE_D=2048, BACKUP=(64, 64, 64), NPROG=528)
CPU_BLOCKS = dict(BLOCK_M=16, BLOCK_I=32, PACK_WARPS=4, SDDMM_S=4, SDDMM_D=16, BLOCK_S=4,
                  BLOCK_D=16, BLOCK_N=4, SEG=8, FUSE_D=64, BACKUP=(16, 16, 16), NPROG=3)


def _blocks(device):
    return GPU_BLOCKS if device.type == "cuda" else CPU_BLOCKS


def _pack(pre, E, cold=None):
    """ELL of the positives of pre [M, I]: idx int32 [M, E] (I in unused slots), val fp32 [M, E],
    nnz int32 [M] (true count; > E marks a backup row), rowsum fp32 [M] (sum of positives),
    fired int64 [I]. Units where `cold` (int8 [I]) is 0 are skipped (hot units)."""
    M, I = pre.shape
    bl = _blocks(pre.device)
    idx = _empty((M, E), dtype=torch.int32, device=pre.device)
    val = _empty((M, E), dtype=torch.float32, device=pre.device)
    nnz = _empty(M, dtype=torch.int32, device=pre.device)
    rowsum = _empty(M, dtype=torch.float32, device=pre.device)
    grid = triton.cdiv(M, bl["BLOCK_M"])
    fired = _empty((grid, I), dtype=torch.int32, device=pre.device)
    _pack_kernel[(grid,)](pre, idx, val, nnz, rowsum, fired, idx if cold is None else cold, M, I, E,
                          pre.stride(0), HOT=cold is not None, BLOCK_M=bl["BLOCK_M"], BLOCK_I=bl["BLOCK_I"],
                          num_warps=bl["PACK_WARPS"])
    return idx, val, nnz, rowsum, fired.sum(0)


def _transpose(w, dtype):
    """w.t() as a contiguous tensor of dtype (a tiled copy: torch's strided one is far below bandwidth)."""
    R, C = w.shape
    out = _empty((C, R), dtype=dtype, device=w.device)
    block = 64 if w.is_cuda else 16
    _transpose_kernel[(triton.cdiv(R, block), triton.cdiv(C, block))](w, out, R, C, w.stride(0),
                                                                      out.stride(0), BLOCK=block)
    return out


def _spmm(idx, nnz, a, w1, b=None, w2=None, *, dtype):
    """out [M, D] = sum over the row's slots of a * w1[j] (+ b * w2[j]; or (a * b) * w1[j] if w2 is
    None); w1, w2: [I, D] contiguous."""
    M, E = idx.shape
    D = w1.shape[1]
    bl = _blocks(idx.device)
    out = _empty((M, D), dtype=dtype, device=idx.device)
    mode = A if b is None else (A_AND_B if w2 is not None else A_TIMES_B)
    _spmm_kernel[(M,)](a, a if b is None else b, w1, w1 if w2 is None else w2, idx, nnz, out, D, E,
                       w1.stride(0), (w1 if w2 is None else w2).stride(0), out.stride(0), MODE=mode,
                       BLOCK_S=bl["BLOCK_S"], BLOCK_D=min(bl["BLOCK_D"], triton.next_power_of_2(D)),
                       num_warps=4)
    return out


def _csc(idx, I, seg):
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


def _fused_dh(D, device):
    """Whether the backward SDDMM rides in the d_down kernel (a whole dout row in one tile)."""
    return triton.next_power_of_2(D) <= _blocks(device)["FUSE_D"]


def _wgrad(csc, E, a, b, x, mode, w=None, c=None, o1=None, o2=None):
    """Weight gradient rows [I, D] (fp32) as transposed-sparse x dense; modes: A, A_AND_B, A_TIMES_B, DH_GATED
    (_wgrad_kernel)."""
    perm, offsets, nseg, seg_first, seg_unit = csc
    I, n_prog = nseg.numel(), seg_unit.numel()
    D = x.shape[1]
    bl = _blocks(x.device)
    block_d = triton.next_power_of_2(D) if mode >= DH_GATED else min(bl["BLOCK_D"], triton.next_power_of_2(D))
    outs, parts = [], []
    for _ in range(2 if mode == A_AND_B else 1):
        outs.append(_empty((I, D), dtype=torch.float32, device=x.device))
        parts.append(_empty((n_prog - I, D), dtype=torch.float32, device=x.device))
    out2, part2 = (outs[1], parts[1]) if mode == A_AND_B else (outs[0], parts[0])
    b = a if b is None else b
    _wgrad_kernel[(n_prog,)](seg_unit, seg_first, perm, offsets, a, b, x, outs[0], out2, parts[0], part2,
                             x if w is None else w, a if c is None else c, a if o1 is None else o1,
                             a if o2 is None else o2, I, D, E, x.stride(0), SEG=bl["SEG"], MODE=mode,
                             BLOCK_N=bl["BLOCK_N"], BLOCK_D=block_d, num_warps=4)
    for out, part in zip(outs, parts):
        _wgrad_reduce_kernel[(I,)](nseg, seg_first, out, part, D, BLOCK_D=block_d, num_warps=4)
    return outs[0], (outs[1] if mode == A_AND_B else None)


def _sddmm(a, w, idx, nnz, g, u, *, backward, c=None):
    """Forward: writes u, returns per-row sum |g u|. Backward: returns (d_gate_pre, d_up) on the pattern."""
    M, E = idx.shape
    D = a.shape[1]
    bl = _blocks(a.device)
    dev = a.device
    rowsum = _empty(M, dtype=torch.float32, device=dev) if not backward else None
    out1 = _empty((M, E), dtype=torch.float32, device=dev) if backward else None
    out2 = _empty((M, E), dtype=torch.float32, device=dev) if backward else None
    dummy = idx
    _sddmm_kernel[(M,)](a, w, idx, nnz, g if g is not None else dummy, u if u is not None else dummy,
                        out1 if out1 is not None else dummy, out2 if out2 is not None else dummy,
                        rowsum if rowsum is not None else dummy, c if c is not None else dummy,
                        D, E, a.stride(0), w.stride(0), BACKWARD=backward,
                        BLOCK_S=bl["SDDMM_S"], BLOCK_D=bl["SDDMM_D"], num_warps=4)
    return rowsum if not backward else (out1, out2)


def _backup_list(nnz, E):
    """The dense backup's rows (nnz > E) first, in row order (int32 [M]), and their count (int32 [1]),
    both on the device: no host sync; and the count as the int64 scalar of the stats."""
    over = nnz > E
    order = torch.argsort((~over).to(torch.uint8), stable=True).to(torch.int32)
    count = over.sum()
    return order, count.to(torch.int32).reshape(1), count


def _hot_grads(g, u, dh, c):
    """d_gate_pre, d_up and h of the hot columns from g, u and dout @ down[:, hot], one pass."""
    outs = [_empty(g.shape, dtype=g.dtype, device=g.device) for _ in range(3)]
    n = g.numel()
    block = 1024 if g.is_cuda else 64
    _hot_grads_kernel[(triton.cdiv(n, block),)](g, u, dh, c, *outs, n, BLOCK=block, num_warps=4)
    return outs


def _dot(t):
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _backup_launch(device, M, N):
    """Persistent programs of a backup kernel over at most [M, N] (the count decides the tiles they
    take): (programs, tile rows, tile columns, K step)."""
    bl = _blocks(device)
    bm, bn, bk = bl["BACKUP"]
    return min(bl["NPROG"], triton.cdiv(M, bm) * triton.cdiv(N, bn)), bm, bn, bk


def _rows_units(mode, backup, x, w1, *, pre=None, w2=None, dout=None, down=None, c=None, cold=None):
    """_rows_units_kernel over the backup rows. ROWS_FORWARD writes h over `pre` and returns the backup's
    sum |h|; ROWS_BACKWARD returns [M, I] buffers with only the backup rows written: (d_gate_pre, d_up, h).
    (Transient, dense-sized: the backup's size is known only on the device.)"""
    order, count = backup
    M, K = x.shape
    N = w1.shape[0]
    nprog, bm, bn, bk = _backup_launch(x.device, M, N)
    if mode == ROWS_FORWARD:
        o1 = o2 = o3 = pre
        l1 = _empty(nprog, dtype=torch.float32, device=x.device)
    else:
        o1, o3 = (_empty((M, N), dtype=x.dtype, device=x.device) for _ in range(2))
        o2 = _empty((M, N), dtype=x.dtype, device=x.device)
        l1 = o1
    _rows_units_kernel[(nprog,)](order, count, x, x if dout is None else dout, w1, w1 if w2 is None else w2,
                                 x if down is None else down, o1, o2, o3, l1, l1 if c is None else c,
                                 order if cold is None else cold, N, K,
                                 x.stride(0), x.stride(0) if dout is None else dout.stride(0), o1.stride(0),
                                 0 if down is None else down.stride(0), 0 if down is None else down.stride(1),
                                 MODE=mode, HOT=cold is not None, DOT=_dot(x), NPROG=nprog, BM=bm, BN=bn, BK=bk,
                                 num_warps=4)
    return l1.sum() if mode == ROWS_FORWARD else (o1, o2, o3)


def _rows_mm(backup, a, b, out, a2=None, b2=None, relu_a=False):
    """out[rows] = a[rows] @ b (+ a2[rows] @ b2) over the backup rows; a, a2 [M, K]; b, b2 [K, N]
    contiguous."""
    order, count = backup
    M, K = a.shape
    N = b.shape[1]
    nprog, bm, bn, bk = _backup_launch(a.device, M, N)
    _rows_mm_kernel[(nprog,)](order, count, a, a if a2 is None else a2, b, b if b2 is None else b2, out, N, K,
                              a.stride(0), b.stride(0), b.stride(1), out.stride(0), TWO=a2 is not None,
                              RELU_A=relu_a, DOT=_dot(a), NPROG=nprog, BM=bm, BN=bn, BK=bk, num_warps=4)


def _rows_wgrad(backup, a, b, grad):
    """grad [N, K] (fp32) += a[rows]^T @ b[rows] over the backup rows; a [M, N], b [M, K]."""
    order, count = backup
    N, K = grad.shape
    bm, bn, bk = _blocks(a.device)["BACKUP"]
    _rows_wgrad_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](order, count, a, b, grad, N, K, a.stride(0),
                                                                 b.stride(0), DOT=_dot(a), BR=bm, BN=bn,
                                                                 BK=bk, num_warps=4)


def _compute_dtype(x):
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


class _HybridGatedMLP(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, gate_w, up_w, down_w, max_nnz, hot):
        dt = _compute_dtype(x)
        ctx.dtypes = (x.dtype, gate_w.dtype, up_w.dtype, down_w.dtype)
        ctx.x_shape = x.shape
        D = x.shape[-1]
        E = int(max_nnz)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, D).to(dt).contiguous()
            gate, up, down = (w.to(dt).contiguous() for w in (gate_w, up_w, down_w))
            M, I = x2.shape[0], gate.shape[0]
            pre = x2 @ gate.t()  # [M, I] dense, transient
            cold = None
            if hot is not None:  # dense columns: kept out of the ELL and the backup
                g_hot = pre[:, hot]
                cold = torch.ones(I, dtype=torch.int8, device=x.device).index_fill_(0, hot, 0)
            idx, g, nnz, _, fired = _pack(pre, E, cold)
            u = _empty((M, E), dtype=torch.float32, device=x.device)
            downT = _transpose(down, dt)  # [I, D]: rows gathered per active unit
            *backup, n_backup = _backup_list(nnz, E)
            l1_backup = _rows_units(ROWS_FORWARD, backup, x2, up, pre=pre, cold=cold)  # pre's backup rows: h
            rowsum = _sddmm(x2, up, idx, nnz, g, u, backward=False)
            out = _spmm(idx, nnz, g, downT, u, dtype=dt)
            _rows_mm(backup, pre, downT, out)
            del pre
            csc = _csc(idx, I, _blocks(x.device)["SEG"]) if any(ctx.needs_input_grad[1:4]) else ()
            l1_sum, n_active, fired = rowsum.sum() + l1_backup, nnz.sum(), fired.long()
            if hot is not None:
                u_hot = x2 @ up[hot].t()
                h_hot = torch.relu(g_hot) * u_hot
                out.addmm_(h_hot, downT[hot])
                l1_sum = l1_sum + h_hot.float().abs().sum()
                on = g_hot > 0
                n_active = n_active + on.sum()
                fired = fired.index_add(0, hot, on.sum(0))
                hot_state = (hot, cold, g_hot, u_hot)
            else:
                hot_state = ()
            l1 = l1_sum / M
            active = n_active.float() / M
        ctx.save_for_backward(x2, gate, up, down, idx, nnz, g, u, *backup, *hot_state, *csc)
        ctx.n_hot = len(hot_state)
        ctx.E = E
        ctx.mark_non_differentiable(active, fired, n_backup)
        return out.reshape(*ctx.x_shape[:-1], down.shape[0]), l1, active, fired, n_backup

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout, dl1, *_):
        saved = ctx.saved_tensors  # unpacked once: activation checkpointing allows no second time
        x2, gate, up, down = saved[:4]
        key = _block_key(x2, gate)
        if key not in _BEYOND_THE_DEVICE["backward"]:
            try:
                return _HybridGatedMLP.sparse_backward(ctx, saved, dout, dl1)
            except OutOfResources as error:
                _beyond_the_device(error, key, "backward", stacklevel=1)
        return (*_reference_grads(ctx, x2, gate, up, down, dout, dl1), None, None)

    @staticmethod
    def sparse_backward(ctx, saved, dout, dl1):
        x2, gate, up, down, idx, nnz, g, u, *saved = saved
        backup, hot_state, csc = saved[:2], saved[2:2 + ctx.n_hot], saved[2 + ctx.n_hot:]
        E = ctx.E
        M, D = x2.shape
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        with torch.autocast(x2.device.type, enabled=False):
            dout2, c, downT, csc = _backward_inputs(x2, down, idx, gate.shape[0], csc, dout, dl1)
            ddownT = None
            if _fused_dh(D, x2.device):  # dh rides in the d_down kernel (one gather of dout rows)
                dgp = _empty((M, E), dtype=torch.float32, device=x2.device)
                du = _empty((M, E), dtype=torch.float32, device=x2.device)
                ddownT, _ = _wgrad(csc, E, g, u, dout2, mode=DH_GATED, w=downT, c=c, o1=dgp, o2=du)
            else:
                dgp, du = _sddmm(dout2, downT, idx, nnz, g, u, backward=True, c=c)
            # the backup rows' dense [rows, I] gradients (other rows of these buffers are never written)
            hot, cold, g_hot, u_hot = hot_state or (None,) * 4
            dgpb, dub, hb = _rows_units(ROWS_BACKWARD, backup, x2, gate, w2=up, dout=dout2, down=down, c=c,
                                        cold=cold)
            if hot_state:  # the hot columns' gradients, dense for every row
                dgp_hot, du_hot, h_hot = _hot_grads(g_hot, u_hot, dout2 @ down[:, hot], c)
            dx = dgate = dup = ddown = None
            if need_x:
                dx = _spmm(idx, nnz, dgp, gate, du, up, dtype=x2.dtype)
                _rows_mm(backup, dgpb, gate, dx, dub, up)
                if hot_state:
                    dx.addmm_(dgp_hot, gate[hot]).addmm_(du_hot, up[hot])
                dx = dx.reshape(ctx.x_shape).to(ctx.dtypes[0])
            if need_gate or need_up:
                dgate, dup = _wgrad(csc, E, dgp, du, x2, mode=A_AND_B)
                _rows_wgrad(backup, dgpb, x2, dgate)
                _rows_wgrad(backup, dub, x2, dup)
                if hot_state:
                    dgate.index_add_(0, hot, (dgp_hot.t() @ x2).float())
                    dup.index_add_(0, hot, (du_hot.t() @ x2).float())
                dgate, dup = dgate.to(ctx.dtypes[1]), dup.to(ctx.dtypes[2])
            if need_down:
                if ddownT is None:
                    ddownT, _ = _wgrad(csc, E, g, u, dout2, mode=A_TIMES_B)
                _rows_wgrad(backup, hb, dout2, ddownT)
                if hot_state:
                    ddownT.index_add_(0, hot, (h_hot.t() @ dout2).float())
                ddown = _transpose(ddownT, ctx.dtypes[3])
        return dx, (dgate if need_gate else None), (dup if need_up else None), ddown, None, None


def _reference_grads(ctx, x2, gate, up, down, dout, dl1):
    """The gradients of x and the weights (None where not needed) through the reference's dense math."""
    needed = ctx.needs_input_grad[:4]
    with torch.enable_grad(), torch.autocast(x2.device.type, enabled=False):
        leaves = [t.detach().requires_grad_(need) for t, need in zip((x2, gate, up, down), needed)]
        out, stats = hybrid_gated_mlp_reference(*leaves)
        grads = iter(torch.autograd.grad((out, stats.l1), [t for t in leaves if t.requires_grad],
                                         (dout.reshape(out.shape).to(out.dtype), dl1.to(stats.l1.dtype))))
    return tuple(next(grads).reshape(ctx.x_shape if i == 0 else w.shape).to(ctx.dtypes[i]) if need else None
                 for i, (need, w) in enumerate(zip(needed, (x2, gate, up, down))))


# _block_key of the blocks whose forward or backward launches the GPU cannot run (OutOfResources): that pass
# runs the reference's math. Kept apart: a failed backward leaves the forward on the kernels, so that
# activation checkpointing recomputes a forward that saves what the original one saved.
_BEYOND_THE_DEVICE = {"forward": set(), "backward": set()}


def _block_key(x, gate_weight):
    """What the launches depend on: device, compute dtype, D and I."""
    return x.device, _compute_dtype(x), x.shape[-1], gate_weight.shape[0]


def _beyond_the_device(error, key, stage: str, stacklevel: int):
    _BEYOND_THE_DEVICE[stage].add(key)
    device, dtype, d, width = key
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    warnings.warn(f"twell: {error} ({name}): the {stage} of hybrid training blocks of D {d} / I {width} in {dtype} "
                  "runs the dense reference on this device", stacklevel=stacklevel + 1)


def _backward_inputs(x2, down, idx, width, csc, dout, dl1):
    """What both backwards start from: dout as [M, D] in the compute dtype, the L1 term's gradient scale
    (dl1 / M), the transposed down weight, and the pattern's CSC (rebuilt when the forward did not save it)."""
    m, d = x2.shape
    dout2 = dout.reshape(-1, d).to(x2.dtype).contiguous()
    c = (dl1.float() / m).reshape(1)
    return dout2, c, _transpose(down, x2.dtype), csc or _csc(idx, width, _blocks(x2.device)["SEG"])


def hybrid_gated_mlp(x, gate_weight, up_weight, down_weight, *, max_nnz=128, hot_units=None):
    """down(relu(gate(x)) * up(x)) on the hybrid sparse format; HF layouts gate/up [I, D], down [D, I].
    Returns (out [..., D], HybridStats). Rows with more than max_nnz active units run dense.
    `hot_units` (distinct int64 unit indices, e.g. from `hot_units(stats.fired, tokens)` of an earlier
    step) run as dense columns for every row, outside the ELL and the row budget max_nnz."""
    if hot_units is not None:
        _check_hot_units(hot_units, x, gate_weight.shape[0])
    if use_triton(x) and (key := _block_key(x, gate_weight)) not in _BEYOND_THE_DEVICE["forward"]:
        try:
            with on_device(x):  # the backward runs on the autograd engine's thread of x's device
                out, l1, active, fired, backup = _HybridGatedMLP.apply(x, gate_weight, up_weight, down_weight,
                                                                       max_nnz, hot_units)
            return out, HybridStats(l1, active, fired, backup)
        except OutOfResources as error:
            _beyond_the_device(error, key, "forward", stacklevel=2)
    return hybrid_gated_mlp_reference(x, gate_weight, up_weight, down_weight, max_nnz=max_nnz, hot_units=hot_units)


def _check_hot_units(hot, x, width):
    if not isinstance(hot, torch.Tensor) or hot.dim() != 1 or hot.dtype != torch.int64 or hot.device != x.device:
        raise ValueError(f"hot_units must be a 1-D int64 tensor on {x.device}, got "
                         f"{type(hot).__name__ if not isinstance(hot, torch.Tensor) else (hot.dtype, tuple(hot.shape), hot.device)}")
    if hot.numel():  # a repeated unit would count twice: checked on the device, without a host sync
        ok = (hot[0] >= 0) & (hot[-1] < width) & (hot[1:] > hot[:-1]).all()
        torch._assert_async(ok, "hot_units must be sorted, distinct unit indices in [0, I)")


# A unit that fires in a share r of M tokens costs, in the sparse passes, about r M x 6 gathers of 2 D
# bytes (6 TB/s from L2); as a dense column, 8 matmul columns of 2 M D FLOPs (about 600 TFLOP/s): equal
# at r = (16 / 600e12) / (12 / 6e12), about 1.3% on an H100, whatever D and M.
HOT_RATE = 0.013


def hot_units(fired: torch.Tensor, tokens, rate: float = HOT_RATE):
    """The busiest units among those that fired in more than `rate` of `tokens` tokens (int64 indices,
    sorted), as many as the largest multiple of 64 (of 8 below 64) that fits, so that the dense columns'
    matmuls keep aligned shapes (cuBLAS runs far below its FLOP rate at unaligned widths); or None."""
    n = int((fired > rate * tokens).sum())
    n = n - n % (64 if n >= 64 else 8)
    return torch.topk(fired, n).indices.sort().values if n else None


def _stats(pre, l1, max_nnz, hot_units=None):
    pos = (pre > 0).reshape(-1, pre.shape[-1])
    per_row = pos.sum(1)
    cold = per_row if hot_units is None else per_row - pos[:, hot_units].sum(1)  # the backup's row budget
    return HybridStats(l1, (per_row.sum().float() / pos.shape[0]).detach(), pos.sum(0).long(),
                       (cold > max_nnz).sum())


def hybrid_gated_mlp_reference(x, gate_weight, up_weight, down_weight, *, max_nnz=128, hot_units=None):
    """Plain PyTorch (dense) block with the same outputs and stats as hybrid_gated_mlp."""
    pre = x @ gate_weight.t()
    h = torch.relu(pre) * (x @ up_weight.t())
    l1 = h.abs().sum(-1).mean()
    return h @ down_weight.t(), _stats(pre.detach(), l1, max_nnz, hot_units)
