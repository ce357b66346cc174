"""The gate kernel's epilogues, as @triton.jit functions that more than one kernel or launch path calls:
`pack_store` packs a tile's positives into TwELL (the batched and decode gate kernels); the decode paths' gate
programs compute u = x . up at their tile's active columns only (`up_whole_rows`, `up_columns`), write an
overflowing (row, tile)'s share of the row's output as an fp32 partial row (`partial_rows`), and on the one-token
tile-out path write every tile's share (`tile_out`).
References: reference.pack_reference, reference.tile_shares."""

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference path
    triton = None


if triton is not None:

    @triton.jit
    def pack_store(g, vals, rows, cols, tile_id, col0, M, N, vals_ptr, idx_ptr, cnt_ptr, NT, S: tl.constexpr):
        """Epilogue shared by every packing kernel: the positives of g [BM, T] (fp32, at rows x cols)
        decide the entries; `vals` (g itself, or h in the decode path) is what is stored; local column c of
        the tile is unit col0 + c (columns marked >= N are not part of it). Returns the
        per-row counts [BM] (0 for rows >= M), so that a caller can tell overflowing rows.
        gate_hopper.py's _pack is the 16-bit branch again in Gluon (which cannot call Triton functions): a
        change here goes there too (a GPU test compares their output bit for bit)."""
        T: tl.constexpr = g.shape[1]
        local = tl.arange(0, T)
        live = (rows < M)[:, None] & (cols < N)[None, :]
        count = tl.sum(((g > 0) & live).to(tl.int32), axis=1)
        # slot s of each row = its next positive column after slot s-1 (a min over the row), for s up to
        # the fullest row of the block: deterministic and in column order. No [BM, T] scatter, prefix or
        # slot tensor stays live, so the tile fits in registers (a scatter would spill its addresses).
        s_id = tl.arange(0, S)
        vt: tl.constexpr = vals_ptr.dtype.element_ty
        if vt.primitive_bitwidth == 16:
            # one min a slot: key = column << 16 | the stored value's 16 bits, so the smallest key past
            # the previous slot's gives the column and its value at once (no second pass for the value)
            bits = vals.to(vt).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            key = tl.where((g > 0) & live, (local[None, :] << 16) | bits, 0x7FFFFFFF)
            out_key = tl.zeros((g.shape[0], S), dtype=tl.int32)
            prev = tl.full((g.shape[0],), -1, dtype=tl.int32)
            for s in range(0, tl.minimum(tl.max(count, axis=0), S)):
                nxt = tl.min(tl.where(key > prev[:, None], key, 0x7FFFFFFF), axis=1)
                out_key = tl.where(s_id[None, :] == s, nxt[:, None], out_key)
                prev = nxt
            out_j = out_key >> 16
            out_v = (out_key & 0xFFFF).to(tl.int16).to(vt, bitcast=True)
        else:
            out_v = tl.zeros((g.shape[0], S), dtype=tl.float32)
            out_j = tl.zeros((g.shape[0], S), dtype=tl.int32)
            prev = tl.full((g.shape[0],), -1, dtype=tl.int32)
            for s in range(0, tl.minimum(tl.max(count, axis=0), S)):
                nxt = tl.min(tl.where((g > 0) & live & (local[None, :] > prev[:, None]), local[None, :], T), axis=1)
                v = tl.sum(tl.where(local[None, :] == nxt[:, None], vals, 0.0), axis=1)
                out_v = tl.where(s_id[None, :] == s, v[:, None], out_v)
                out_j = tl.where(s_id[None, :] == s, nxt[:, None], out_j)
                prev = nxt
        row_tile = rows.to(tl.int64) * NT + tile_id
        off = row_tile[:, None] * S + s_id[None, :]
        keep = (s_id[None, :] < count[:, None]) & (rows < M)[:, None]
        tl.store(vals_ptr + off, out_v.to(vt), mask=keep)
        tl.store(idx_ptr + off, out_j + col0, mask=keep)
        tl.store(cnt_ptr + row_tile, count, mask=rows < M)
        return count

    @triton.jit
    def _active_columns(col_on, pos, n_on, c0, local, col0, UC: tl.constexpr):
        """Active columns c0 .. c0 + UC - 1 of a tile (in column order; pos: inclusive prefix of col_on,
        minus one): their [UC, T] one-hot selection, their units, and which of the UC exist."""
        cu = tl.arange(0, UC)
        sel = col_on[None, :] & (pos[None, :] == (c0 + cu)[:, None])
        return sel, col0 + tl.sum(tl.where(sel, local[None, :], 0), axis=1), (c0 + cu) < n_on

    @triton.jit
    def up_whole_rows(u, col_on, n_on, local, row0, col0, x_ptr, up_ptr, M, K, stride_xm, stride_xk, stride_un,
                      stride_uk, UP_ROWS: tl.constexpr, ROWS_UC: tl.constexpr, ROWS_BK: tl.constexpr):
        """u [BM, T] += x @ up^T at the tile's active columns (col_on, n_on of them), for the block's first
        UP_ROWS rows: the columns' whole up rows, ROWS_UC at a time, and x's rows in one round of loads, the
        dot products on CUDA cores. (The K loop pays a memory latency a step, a chain after the gate stream
        that bounds a one-token decode.)"""
        pos = tl.cumsum(col_on.to(tl.int32), axis=0) - 1
        kk = tl.arange(0, ROWS_BK)
        for c0 in range(0, n_on, ROWS_UC):
            sel, ucol, uvalid = _active_columns(col_on, pos, n_on, c0, local, col0, ROWS_UC)
            uw = tl.load(up_ptr + ucol[:, None].to(tl.int64) * stride_un + kk[None, :] * stride_uk,
                         mask=uvalid[:, None] & (kk < K)[None, :], other=0.0)
            for r in tl.static_range(UP_ROWS):
                xr = tl.load(x_ptr + (row0 + r) * stride_xm + kk * stride_xk,
                             mask=kk < tl.where(row0 + r < M, K, 0), other=0.0)
                ur = tl.sum(uw.to(tl.float32) * xr.to(tl.float32)[None, :], axis=1)  # [ROWS_UC]
                # back to the tile's columns by a select, not a product summed over ROWS_UC: Triton 3.6
                # turns that into a dot, which comes out 8 / ROWS_UC times too large
                u_r = tl.sum(tl.where(sel, ur[:, None], 0.0), axis=0)
                u += tl.where((tl.arange(0, u.shape[0]) == r)[:, None], u_r[None, :], 0.0)
        return u

    @triton.jit
    def _up_k_loop(u, col_on, n_on, local, col0, x_rows, up_ptr, K, stride_xk, stride_un, stride_uk,
                   UC: tl.constexpr, UP_BK: tl.constexpr, UP_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """u [BM, T] += x @ up^T at the tile's active columns: compacted UC at a time and read UP_BK deep, few
        wide loads instead of a K loop of T-wide masked loads (the latency of the dependent loads is what
        costs here)."""
        pos = tl.cumsum(col_on.to(tl.int32), axis=0) - 1
        rkk = tl.arange(0, UP_BK)
        for c0 in range(0, n_on, UC):
            sel, ucol, uvalid = _active_columns(col_on, pos, n_on, c0, local, col0, UC)
            uc = tl.zeros((u.shape[0], UC), dtype=tl.float32)
            for k in tl.range(0, tl.cdiv(K, UP_BK), num_stages=UP_STAGES):
                kin = rkk < K - k * UP_BK
                a = tl.load(x_rows + (k * UP_BK + rkk)[None, :] * stride_xk, mask=kin[None, :], other=0.0)
                b = tl.load(up_ptr + ucol[None, :].to(tl.int64) * stride_un
                            + (k * UP_BK + rkk)[:, None] * stride_uk, mask=kin[:, None] & uvalid[None, :], other=0.0)
                uc = tl.dot(a, b, uc, input_precision=DOT_PRECISION)
            u += tl.dot(uc, sel.to(tl.float32), input_precision="ieee")  # back to tile columns, exact
        return u

    @triton.jit
    def _up_tile_loop(u, col_on, cols, N, K, x_rows, up_ptr, stride_xk, stride_un, stride_uk, BK: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
        """u [BM, T] += x @ up^T over the whole tile, BK deep a step, up rows loaded for the active columns
        (col_on) only: one pipelined stream like the gate's, for tiles with many active columns."""
        rk = tl.arange(0, BK)
        a_ptrs = x_rows + rk[None, :] * stride_xk
        u_ptrs = up_ptr + (cols % N)[None, :].to(tl.int64) * stride_un + rk[:, None] * stride_uk
        for k in range(0, tl.cdiv(K, BK)):
            kin = rk < K - k * BK
            a = tl.load(a_ptrs, mask=kin[None, :], other=0.0)
            b = tl.load(u_ptrs, mask=kin[:, None] & col_on[None, :], other=0.0)
            u = tl.dot(a, b, u, input_precision=DOT_PRECISION)
            a_ptrs += BK * stride_xk
            u_ptrs += BK * stride_uk
        return u

    @triton.jit
    def up_columns(u, col_on, n_on, local, cols, col0, N, K, x_rows, up_ptr, stride_xk, stride_un, stride_uk,
                   UC: tl.constexpr, UP_BK: tl.constexpr, UP_STAGES: tl.constexpr, BK: tl.constexpr,
                   UP_COMPACT_COLS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """u [BM, T] += x @ up^T at the tile's n_on active columns: with UP_BK, up to UP_COMPACT_COLS of them
        compacted (_up_k_loop); a denser tile (a heavy row's), or any without UP_BK, in one stream over the
        tile (_up_tile_loop)."""
        if UP_BK > 0:
            if n_on <= UP_COMPACT_COLS:
                u = _up_k_loop(u, col_on, n_on, local, col0, x_rows, up_ptr, K, stride_xk, stride_un, stride_uk,
                               UC, UP_BK, UP_STAGES, DOT_PRECISION)
            else:
                u = _up_tile_loop(u, col_on, cols, N, K, x_rows, up_ptr, stride_xk, stride_un, stride_uk, BK,
                                  DOT_PRECISION)
        else:
            u = _up_tile_loop(u, col_on, cols, N, K, x_rows, up_ptr, stride_xk, stride_un, stride_uk, BK,
                              DOT_PRECISION)
        return u

    @triton.jit
    def partial_rows(h, over, cols, part_rows, K, down_ptr, part_ptr, PART_BD: tl.constexpr,
                     PART_DOT: tl.constexpr, PART_STAGES: tl.constexpr):
        """A tile's share of its `over` rows' output, h [BM, T] times the down rows of its units (cols),
        stored as fp32 rows at part_rows (offsets into the [M, NT, D] buffer), PART_BD columns a step."""
        unit_on = tl.max((h != 0).to(tl.int32), axis=0) > 0  # down rows read only where needed
        for k0 in tl.range(0, K, PART_BD, num_stages=PART_STAGES):
            dcol = k0 + tl.arange(0, PART_BD)
            dw = tl.load(down_ptr + cols[:, None].to(tl.int64) * K + dcol[None, :],
                         mask=unit_on[:, None] & (dcol < K)[None, :], other=0.0)
            part = tl.dot(h, dw.to(h.dtype), input_precision=PART_DOT)
            tl.store(part_ptr + part_rows[:, None] + dcol[None, :], part, mask=over[:, None] & (dcol < K)[None, :])

    @triton.jit
    def tile_out(acc, rows, cols, local, x_rows, pid_n, n_n, M, N, K, x_ptr, up_ptr, down_ptr, cnt_ptr, part_ptr,
                 stride_xk, stride_un, stride_uk, TS: tl.constexpr, UC: tl.constexpr, UP_BK: tl.constexpr,
                 UP_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, H_FP32: tl.constexpr,
                 ROWS_UC: tl.constexpr, ROWS_BK: tl.constexpr, PART_BD: tl.constexpr, PART_DOT: tl.constexpr,
                 PART_STAGES: tl.constexpr, BK: tl.constexpr, UP_COMPACT_COLS: tl.constexpr):
        """One-token decode, epilogue of the gate program: the tile's share of the token's output, h over the
        tile's units times their down rows, stored as an fp32 row of the [1, NT, D] buffer (zeros where no
        unit of the tile is active), and the tile's count of active units. Up to 2 * ROWS_UC active units
        (the common case) their whole up and down rows are loaded together, one round of loads a ROWS_UC of
        them, so that the only dependent read left after this kernel is the sum of the shares, from L2
        (decode.py's tile sum)."""
        live = (acc > 0) & (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(cnt_ptr + rows * n_n + pid_n, tl.sum(live.to(tl.int32), axis=1), mask=rows < M)
        col_on = tl.max(live.to(tl.int32), axis=0) > 0
        n_on = tl.sum(col_on.to(tl.int32), axis=0)
        g = tl.where(live, acc, 0.0)
        if not H_FP32:  # g and h rounded as the packed values of the other decode paths
            g = g.to(x_ptr.dtype.element_ty).to(tl.float32)
        if n_on <= 2 * ROWS_UC:
            pos = tl.cumsum(col_on.to(tl.int32), axis=0) - 1
            kk = tl.arange(0, ROWS_BK)
            kin = kk < K
            x = tl.load(x_ptr + kk * stride_xk, mask=kin, other=0.0).to(tl.float32)
            g0 = tl.sum(tl.where((rows == 0)[:, None], g, 0.0), axis=0)  # the token's row of the block
            part = tl.zeros((ROWS_BK,), dtype=tl.float32)
            for c0 in range(0, n_on, ROWS_UC):
                sel, unit, valid = _active_columns(col_on, pos, n_on, c0, local, pid_n * TS, ROWS_UC)
                wmask = valid[:, None] & kin[None, :]
                uw = tl.load(up_ptr + unit[:, None].to(tl.int64) * stride_un + kk[None, :] * stride_uk, mask=wmask,
                             other=0.0)
                dw = tl.load(down_ptr + unit[:, None].to(tl.int64) * K + kk[None, :], mask=wmask, other=0.0)
                h = tl.sum(tl.where(sel, g0[None, :], 0.0), axis=1) * tl.sum(uw.to(tl.float32) * x[None, :], axis=1)
                if not H_FP32:
                    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
                part += tl.sum(h[:, None] * dw.to(tl.float32), axis=0)
            tl.store(part_ptr + pid_n * K + kk, part, mask=kin)
        else:  # a dense tile (a sequence's first token): u in a K loop, then the down rows PART_BD at a time
            u = up_columns(tl.zeros(acc.shape, dtype=tl.float32), col_on, n_on, local, cols, pid_n * TS, N, K,
                           x_rows, up_ptr, stride_xk, stride_un, stride_uk, UC, UP_BK, UP_STAGES, BK,
                           UP_COMPACT_COLS, DOT_PRECISION)
            h = g * u
            if not H_FP32:
                h = h.to(x_ptr.dtype.element_ty)
            partial_rows(h, rows < M, cols, (rows.to(tl.int64) * n_n + pid_n) * K, K, down_ptr, part_ptr,
                         PART_BD, PART_DOT, PART_STAGES)
