"""Decode path (at most format.decode_rows tokens): the rules that configure it and the parts of its launches
that batched calls do not run. The gate kernel (batched.py) runs with tiles of at most DECODE_TILE units and
computes u = x . up for its tile's active units only (`_up_whole_rows`, `_up_k_loop`), so that it packs
h = g * u and the out kernel only gathers down rows; an overflowing (row, tile) writes the tile's share of
the row's output as an fp32 partial row (`_partial_rows`) for the out kernel to add. One gated token
(`tile_out_launch`) packs nothing: each gate program writes its tile's share of the output (`_tile_out`)
and `_twell_tile_sum_kernel` adds the shares. Reference: reference.tile_shares."""

from .format import cdiv
from .launch import Launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference path
    triton = None

DECODE_TILE = 64   # gate-matmul column tile in decode: I / 64 programs stream the gate matrix
# Up to this many active columns a decode gate program reads their up rows compacted, UC at a time; a denser
# tile (a heavy row's, such as a sequence's first token) streams the tile's up rows in one pipelined K loop
# like the gate's, instead of a pipeline fill and drain for every UC columns
UP_COMPACT_COLS = 16
WHOLE_UP_ROWS = 16384  # elements of up rows a decode gate program loads at once (128 a thread of 4 warps)
# TwELL slots of a row that a decode out program (up to HELD_ROWS rows) holds in registers, loaded beside the
# row's counts: one round of dependent loads instead of two
HELD_SLOTS, HELD_ROWS = 4096, 32
# Partial rows of overflowing decode tiles (a sequence's first token): 512 bytes of each down row a step, three
# steps in flight, so that a dense row's stream of down rows takes few, overlapping steps (1024 bytes a step
# do not fit in shared memory at three)
PART_BYTES, PART_STAGES = 512, 3
# One-token decode through tile_out_launch up to this D; above it the output's shares (4 * D bytes a tile)
# and their sum cost more than the hand-over to the out kernel that they save
TILE_OUT_MAX_D = 2048
TILE_SUM_BD = 32  # output columns a program of the one-token decode's tile sum adds
# (program, TwELL tile) pairs a held-list decode out launch may walk: each of a row's output-chunk programs
# walks the row's whole TwELL, so narrow chunks multiply that walk (decode_out_config)
DECODE_WALK_BUDGET = 48 * 1024


def decode_gate_config(m: int, block_k: int) -> dict:
    """Decode gate-matmul launch configuration (batched.gate_config): streams the gate matrix, deep K blocks,
    few rows."""
    bm = max(16, triton.next_power_of_2(m))
    if bm <= 16:
        # up rows of the active columns read 8 * block_k deep, 3 blocks in flight; up to 4 rows, tiles
        # with up to 8 active columns read whole rows instead, 4 at a time, where they fit (gate_launch)
        cfg = dict(BM=bm, BK=4 * block_k, GROUP_M=1, num_warps=4, num_stages=4, UP_BK=8 * block_k,
                   UP_STAGES=3, UP_COMPACT_COLS=UP_COMPACT_COLS)
        return dict(cfg, UP_ROWS=triton.next_power_of_2(m), ROWS_UC=4) if m <= 4 else cfg
    if bm <= 32:  # up rows of the active columns compacted too, 4 * block_k deep, 4 blocks in flight: fewer
        # dependent loads than the masked K loop, which pays a memory latency for every K block
        return dict(BM=bm, BK=4 * block_k, GROUP_M=1, num_warps=4, num_stages=3, UP_BK=4 * block_k,
                    UP_STAGES=4, UP_COMPACT_COLS=UP_COMPACT_COLS)
    return dict(BM=bm, BK=2 * block_k, GROUP_M=1, num_warps=4, num_stages=4)


def decode_out_config(m: int, d: int, tiles: int) -> dict:
    """Decode out launch configuration (batched.out_config): CH units a step, BD output columns a program.
    The row is split over output chunks of BD columns so that many SMs share its few units. Up to HELD_ROWS
    rows each chunk's program holds and walks its row's whole TwELL (`tiles` tiles), so BD is the narrowest
    of 64-256 whose launch walks at most DECODE_WALK_BUDGET tiles; above, 128 columns and 16 units a step
    with 2 warps instead of 32 with 4: more programs in flight, and a heavy row's sum of partial rows
    spread over twice as many programs as at 256 columns."""
    if m > HELD_ROWS:
        return dict(CH=16, BD=128, num_warps=2)
    bd = 64
    while bd < 256 and m * cdiv(d, bd) * tiles > DECODE_WALK_BUDGET:
        bd *= 2
    return dict(CH=32, BD=bd, num_warps=4)


def decode_tile_stride(width: int, tile: int, m: int, sms: int | None) -> int:
    """Decode tile width (units a gate program streams) on a GPU of `sms` SMs (None: not a GPU, the tile).
    Above 16 rows: I / #SMs where that fits in the tile, one program per SM (I / 64 programs leave SMs
    idle: 88 of 132 at I = 5632); at 1-16 rows the tile. At least half the
    tile, so that a narrow layer does not pay for mostly empty T-wide blocks."""
    if sms is None or m <= 16:
        return tile
    return min(tile, max(cdiv(width, sms), tile // 2))


def tile_out_launch(m: int, d: int, decode: bool) -> bool:
    """Whether a call takes the tile-out decode path: one token, D up to TILE_OUT_MAX_D (and small enough
    for one unit's whole up and down rows in a gate program's registers). There the gate programs write the
    output's shares and a small kernel adds them, instead of packing TwELL for the out kernel's gather of
    down rows."""
    return decode and m == 1 and d <= TILE_OUT_MAX_D and 2 * triton.next_power_of_2(d) <= WHOLE_UP_ROWS


def tile_sum_launch(m: int, d: int, nt: int, s: int, has_overflow: bool, pdl: bool = False) -> Launch:
    """Launch of out [M, D] = the sum over tiles of the partial rows [M, NT, D] that a tile-out gate launch
    wrote. Called with (partials, counts, out, overflow or counts)."""
    nt_pad = max(2, triton.next_power_of_2(nt))
    bd = min(TILE_SUM_BD, triton.next_power_of_2(d))
    return Launch(_twell_tile_sum_kernel, (m, cdiv(d, bd), 1), dict(
        D=d, NT=nt, S=s, NT_PAD=nt_pad, OT=min(nt_pad, 8192 // bd), BD=bd, HAS_OVF=has_overflow, PDL=pdl),
        dict(num_warps=4, launch_pdl=True) if pdl else dict(num_warps=4))


if triton is not None:

    @triton.jit
    def _active_columns(col_on, pos, n_on, c0, local, col0, UC: tl.constexpr):
        """Active columns c0 .. c0 + UC - 1 of a tile (in column order; pos: inclusive prefix of col_on,
        minus one): their [UC, T] one-hot selection, their units, and which of the UC exist."""
        cu = tl.arange(0, UC)
        sel = col_on[None, :] & (pos[None, :] == (c0 + cu)[:, None])
        return sel, col0 + tl.sum(tl.where(sel, local[None, :], 0), axis=1), (c0 + cu) < n_on

    @triton.jit
    def _up_whole_rows(u, col_on, n_on, local, row0, col0, x_ptr, up_ptr, M, K, stride_xm, stride_xk, stride_un,
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
    def _up_columns(u, col_on, n_on, local, cols, col0, N, K, x_rows, up_ptr, stride_xk, stride_un, stride_uk,
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
    def _partial_rows(h, over, cols, part_rows, K, down_ptr, part_ptr, PART_BD: tl.constexpr,
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
    def _tile_out(acc, rows, cols, local, x_rows, pid_n, n_n, M, N, K, x_ptr, up_ptr, down_ptr, cnt_ptr, part_ptr,
                  stride_xk, stride_un, stride_uk, TS: tl.constexpr, UC: tl.constexpr, UP_BK: tl.constexpr,
                  UP_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, H_FP32: tl.constexpr,
                  ROWS_UC: tl.constexpr, ROWS_BK: tl.constexpr, PART_BD: tl.constexpr, PART_DOT: tl.constexpr,
                  PART_STAGES: tl.constexpr, BK: tl.constexpr, UP_COMPACT_COLS: tl.constexpr):
        """One-token decode, epilogue of the gate program: the tile's share of the token's output, h over the
        tile's units times their down rows, stored as an fp32 row of the [1, NT, D] buffer (zeros where no
        unit of the tile is active), and the tile's count of active units. Up to 2 * ROWS_UC active units
        (the common case) their whole up and down rows are loaded together, one round of loads a ROWS_UC of
        them, so that the only dependent read left after this kernel is the sum of the shares, from L2
        (_twell_tile_sum_kernel)."""
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
            u = _up_columns(tl.zeros(acc.shape, dtype=tl.float32), col_on, n_on, local, cols, pid_n * TS, N, K,
                            x_rows, up_ptr, stride_xk, stride_un, stride_uk, UC, UP_BK, UP_STAGES, BK,
                            UP_COMPACT_COLS, DOT_PRECISION)
            h = g * u
            if not H_FP32:
                h = h.to(x_ptr.dtype.element_ty)
            _partial_rows(h, rows < M, cols, (rows.to(tl.int64) * n_n + pid_n) * K, K, down_ptr, part_ptr,
                          PART_BD, PART_DOT, PART_STAGES)

    @triton.jit
    def _twell_tile_sum_kernel(part_ptr, cnt_ptr, out_ptr, ovf_ptr, D, NT, S: tl.constexpr,
                               NT_PAD: tl.constexpr, OT: tl.constexpr, BD: tl.constexpr, HAS_OVF: tl.constexpr,
                               PDL: tl.constexpr):
        """out[row, chunk] = the sum over tiles, in tile order, of the partial rows that _tile_out wrote;
        one program per (row, BD output columns). Counts the row's tiles beyond the slots into ovf_ptr, as the
        other decode paths do (here no tile has slots: none needs a fallback)."""
        row = tl.program_id(0).to(tl.int64)
        pid_d = tl.program_id(1)
        do = pid_d * BD + tl.arange(0, BD)
        if PDL:  # launched before the gate kernel finished: wait for its results
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros((BD,), dtype=tl.float32)
        for t0 in range(0, NT, OT):
            t = t0 + tl.arange(0, OT)
            p = tl.load(part_ptr + (row * NT + t)[:, None] * D + do[None, :],
                        mask=(t < NT)[:, None] & (do < D)[None, :], other=0.0)
            acc += tl.sum(p, axis=0)
        tl.store(out_ptr + row * D + do, acc.to(out_ptr.dtype.element_ty), mask=do < D)
        if HAS_OVF:
            if pid_d == 0:
                t = tl.arange(0, NT_PAD)
                cnt = tl.load(cnt_ptr + row * NT + t, mask=t < NT, other=0)
                n_over = tl.sum((cnt > S).to(tl.int32), axis=0)
                if n_over > 0:
                    tl.atomic_add(ovf_ptr, n_over.to(ovf_ptr.dtype.element_ty))
