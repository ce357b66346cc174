"""The dense backup of the hybrid training block: the rows with more active units than the ELL holds, as
persistent tensor-core tiles over a device-side row list (`backup_list`; nothing dropped, no host
synchronization): h and its penalty forward, the gradients backward (`rows_units`), the backup rows' share of
out and dx (`rows_mm`) and of the weight gradients (`rows_wgrad`); and the hot units' gradients (`hot_grads`),
dense columns of every row. Reference: training/reference.py."""
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

# Modes of _rows_units_kernel, over the backup rows
ROWS_FORWARD = constexpr(0)  # h over the gate pre-activation, its penalty (sum |h| for L1)
ROWS_BACKWARD = constexpr(1)  # d_gate_pre, d_up, h


if triton is not None:

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
                           o3_ptr, l1_ptr, c_ptr, cold_ptr, eps, N, K, stride_x, stride_dout, stride_o, stride_w3k,
                           stride_w3n, MODE: tl.constexpr, LOG: tl.constexpr, HOT: tl.constexpr, DOT: tl.constexpr,
                           NPROG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # Dense [backup rows, units] tiles. ROWS_FORWARD: h = relu(o1) * (x @ up^T) over o1 = the gate
        # pre-activation, in place, and the program's penalty (sum |h| for L1) into l1_ptr. ROWS_BACKWARD: g, u
        # recomputed (w1 = gate, w2 = up), dh = dout @ down (w3) + the penalty's term (c sign(h) for L1):
        # o1 = dh u [g > 0], o2 = dh relu(g), o3 = h.
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
                l1 += penalty_of(tl.abs(h.to(tl.float32)), eps, LOG)
            else:
                c = tl.load(c_ptr)
                pre = tl.where(on, acc1.to(dt).to(tl.float32), 0.0)  # as the forward's matmul output
                g = tl.maximum(pre, 0.0)
                u = acc2.to(dt).to(tl.float32)
                h = (g * u).to(dt).to(tl.float32)
                dh = acc3 + penalty_grad(h, c, eps, LOG)
                tl.store(o1_ptr + offs, (dh * u * (pre > 0.0)).to(dt), mask=m)
                tl.store(o2_ptr + offs, (dh * g).to(dt), mask=m)
                tl.store(o3_ptr + offs, h.to(dt), mask=m)
        if MODE == ROWS_FORWARD:
            tl.store(l1_ptr + tl.program_id(0), tl.sum(tl.sum(l1, 1), 0))

    @triton.jit
    def _hot_grads_kernel(g_ptr, u_ptr, dh_ptr, c_ptr, dgp_ptr, du_ptr, h_ptr, eps, n, LOG: tl.constexpr,
                          BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        dt = h_ptr.dtype.element_ty
        g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + i, mask=m, other=0.0).to(tl.float32)
        h = (tl.maximum(g, 0.0) * u).to(dt).to(tl.float32)  # as the forward's h
        dh = tl.load(dh_ptr + i, mask=m, other=0.0).to(tl.float32) + penalty_grad(h, tl.load(c_ptr), eps, LOG)
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


def backup_list(nnz, E):
    """The dense backup's rows (nnz > E) first, in row order (int32 [M]), and their count (int32 [1]),
    both on the device: no host sync; and the count as the int64 scalar of the stats."""
    over = nnz > E
    order = torch.argsort((~over).to(torch.uint8), stable=True).to(torch.int32)
    count = over.sum()
    return order, count.to(torch.int32).reshape(1), count


def hot_grads(g, u, dh, c, eps=0.0):
    """d_gate_pre, d_up and h of the hot columns from g, u and dout @ down[:, hot], one pass (the penalty L1, or
    the log penalty with eps > 0)."""
    outs = [torch.empty(g.shape, dtype=g.dtype, device=g.device) for _ in range(3)]
    n = g.numel()
    block = 1024 if g.is_cuda else 64
    _hot_grads_kernel[(triton.cdiv(n, block),)](g, u, dh, c, *outs, float(eps), n, LOG=eps > 0, BLOCK=block,
                                                 num_warps=4)
    return outs


def _dot(t):
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _backup_launch(device, M, N):
    """Persistent programs of a backup kernel over at most [M, N] (the count decides the tiles they
    take): (programs, tile rows, tile columns, K step)."""
    bl = blocks(device)
    bm, bn, bk = bl["BACKUP"]
    return min(bl["NPROG"], triton.cdiv(M, bm) * triton.cdiv(N, bn)), bm, bn, bk


def rows_units(mode, backup, x, w1, *, pre=None, w2=None, dout=None, down=None, c=None, cold=None, eps=0.0):
    """_rows_units_kernel over the backup rows (the penalty L1, or the log penalty with eps > 0). ROWS_FORWARD
    writes h over `pre` and returns the backup's penalty; ROWS_BACKWARD returns [M, I] buffers with only the
    backup rows written: (d_gate_pre, d_up, h).
    (Transient, dense-sized: the backup's size is known only on the device.)"""
    order, count = backup
    M, K = x.shape
    N = w1.shape[0]
    nprog, bm, bn, bk = _backup_launch(x.device, M, N)
    if mode == ROWS_FORWARD:
        o1 = o2 = o3 = pre
        l1 = torch.empty(nprog, dtype=torch.float32, device=x.device)
    else:
        o1, o3 = (torch.empty((M, N), dtype=x.dtype, device=x.device) for _ in range(2))
        o2 = torch.empty((M, N), dtype=x.dtype, device=x.device)
        l1 = o1
    _rows_units_kernel[(nprog,)](order, count, x, x if dout is None else dout, w1, w1 if w2 is None else w2,
                                 x if down is None else down, o1, o2, o3, l1, l1 if c is None else c,
                                 order if cold is None else cold, float(eps), N, K,
                                 x.stride(0), x.stride(0) if dout is None else dout.stride(0), o1.stride(0),
                                 0 if down is None else down.stride(0), 0 if down is None else down.stride(1),
                                 MODE=mode, LOG=eps > 0, HOT=cold is not None, DOT=_dot(x), NPROG=nprog, BM=bm,
                                 BN=bn, BK=bk, num_warps=4)
    return l1.sum() if mode == ROWS_FORWARD else (o1, o2, o3)


def rows_mm(backup, a, b, out, a2=None, b2=None, relu_a=False):
    """out[rows] = a[rows] @ b (+ a2[rows] @ b2) over the backup rows; a, a2 [M, K]; b, b2 [K, N]
    contiguous."""
    order, count = backup
    M, K = a.shape
    N = b.shape[1]
    nprog, bm, bn, bk = _backup_launch(a.device, M, N)
    _rows_mm_kernel[(nprog,)](order, count, a, a if a2 is None else a2, b, b if b2 is None else b2, out, N, K,
                              a.stride(0), b.stride(0), b.stride(1), out.stride(0), TWO=a2 is not None,
                              RELU_A=relu_a, DOT=_dot(a), NPROG=nprog, BM=bm, BN=bn, BK=bk, num_warps=4)


def rows_wgrad(backup, a, b, grad):
    """grad [N, K] (fp32) += a[rows]^T @ b[rows] over the backup rows; a [M, N], b [M, K]."""
    order, count = backup
    N, K = grad.shape
    bm, bn, bk = blocks(a.device)["BACKUP"]
    _rows_wgrad_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](order, count, a, b, grad, N, K, a.stride(0),
                                                                 b.stride(0), DOT=_dot(a), BR=bm, BN=bn,
                                                                 BK=bk, num_warps=4)
