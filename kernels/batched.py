"""Batched path: the gate kernel packs relu(x @ gate^T) into TwELL (format.py) in its matmul epilogue; the out
kernel, one program a row, walks the row's compact list of active units and accumulates
out += (g * x . up_j) * down_j in fp32 registers. A (row, tile) beyond its slots is recomputed densely from
the gate and up weights and counted into `overflow`; a row with more than HEAVY_UNITS units to walk posts
its index for the dense block of heavy rows (heavy.py) instead. Decode runs the same two kernels with
decode.py's options; batched on an sm_90 GPU the gate kernel is gate_hopper.py's (the same TwELL).
Reference: reference.gated_mlp_reference."""
from typing import Optional

import torch

from .decode import (HELD_ROWS, HELD_SLOTS, PART_BYTES, PART_STAGES, WHOLE_UP_ROWS, decode_gate_config,
                     decode_out_config)
from .format import HEAVY_UNITS, UNIT_SAMPLE, cdiv, out_units_per_step, tma_ok
from .gate_hopper import hopper_gate_launch
from .heavy import HeavyBlock, heavy_launches
from .launch import Launch

try:
    import triton
    import triton.language as tl
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # older Triton: pointer loads only
        TensorDescriptor = None

    from .epilogues import pack_store, partial_rows, tile_out, up_columns, up_whole_rows
except ImportError:  # CPU-only machines run the reference path
    triton = None

COMPACT_SLOTS = 2048  # TwELL slots a list pre-pass program holds at once (16 a thread): a chunk of tiles
# Batched up to this many rows each out program compacts its own row's list, without the pre-pass launch;
# above it the dependent loads this adds at each row's start cost more than the launch they save
FUSED_COMPACT_ROWS = 1024


def gate_config(m: int, tile: int, element_size: int, decode: bool, crowded: bool = False) -> dict:
    """Gate-matmul launch configuration per shape class (tile is the matmul's column block; `crowded`: a decode
    grid of more programs than the GPU has SMs, decode_gate_config)."""
    block_k = 64 if element_size <= 2 else 32
    if decode:
        return decode_gate_config(m, block_k, crowded)
    if tile == 128:  # 4 warps: two programs share an SM, one's packing epilogue beside the other's matmul
        if m <= 256:  # few row blocks: half-height ones, twice the programs, a deeper pipeline
            return dict(BM=64, BK=block_k, GROUP_M=8, num_warps=4, num_stages=4)
        return dict(BM=128, BK=block_k, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BM=128, BK=block_k, GROUP_M=8, num_warps=8, num_stages=3)


def out_config(m: int, d: int, decode: bool, tiles: int = 1) -> dict:
    """TwELL-to-dense launch configuration: CH units per step, BD output columns per program (decode:
    decode_out_config, `tiles` TwELL tiles a row). Batched: one row per program, small CH and one or two
    warps where many rows are in flight to hide the gather latency; with few rows (<= 512) more units a
    step instead, fewer dependent steps a row. Warps grow with CH * D (the step's up and down rows sit in
    registers), twice as many up to 128 rows, and are at least 4 up to 512 rows."""
    if decode:
        return decode_out_config(m, d, tiles)
    block_d = 1 << (d - 1).bit_length()  # triton.next_power_of_2 (walk_row_bytes runs without Triton too)
    ch = min(out_units_per_step(m), max(2, 32768 // block_d))
    per_warp = 2048 if m <= 128 else 4096  # fewer rows than SMs: one program an SM, so more warps each
    return dict(CH=ch, BD=block_d, num_warps=min(8, max(4 if m <= 512 else 1, ch * block_d // per_warp)))


def walk_row_bytes(m: int, d: int) -> int:
    """Contiguous bytes of each e4m3 row that a thread of the batched out kernel loads in its walk: the row's
    BLOCK_D elements over the program's threads (out_config)."""
    return (1 << (d - 1).bit_length()) // (32 * out_config(m, d, decode=False)["num_warps"])


def _tile_stride(tile: int, tile_stride) -> int:
    if tile_stride is None:
        return tile
    if not 0 < tile_stride <= tile:
        raise ValueError(f"tile_stride must be in 1..tile ({tile}), got {tile_stride}")
    return tile_stride


def gate_launch(x2, w, up, tile, s, vals_dtype, cfg, h_fp32=False, partials=False, tile_stride=None,
                pdl=False, tile_out=False, fp8=False) -> Launch:
    """Launch of relu(x2 @ w^T) packed into TwELL, for x2 [M, D], w [I, D] (any strides). With `up`, the
    stored values are h = relu(x2 @ w^T) * (x2 @ up^T) at the same entries (up rows read only for active
    columns). With `partials`, each overflowing (row, tile) also gets the tile's share of the row's output,
    its stored values (h, or g without up) times their rows of down_t [I, D], written as an fp32 row into
    an [M, NT, D] buffer (NT tiles a row). Tiles are `tile_stride` units wide (default `tile`; less spreads
    a decode over more programs). With whole tiles, the main loop reads x and w through TMA descriptors
    where tma_ok; batched on an sm_90 GPU the Gluon kernel of gate_hopper.py runs instead (same TwELL).
    With `tile_out` (one-token gated decode: tile_out_launch) nothing is packed: every tile writes its share
    of the output to the partials buffer and its count of active units; values and indices are unused.
    With `fp8`, w is the gate's e4m3 copy (fp8_gate.quantize_weight) and the matmul reads x quantized, as
    fp8_gate.gate_reference computes g; called with (..., x quantized, its scales, w's scales) appended.
    Called with (x2, w, up or w, down_t or w, values, indices, counts, partials buffer or values)."""
    m, d = x2.shape
    width = w.shape[0]
    cfg = dict(cfg)
    bm, bk, up_bk = cfg.pop("BM"), cfg.pop("BK"), cfg.pop("UP_BK", 0)
    up_stages, up_rows, rows_uc = cfg.pop("UP_STAGES", 1), cfg.pop("UP_ROWS", 0), cfg.pop("ROWS_UC", 1)
    up_compact_cols = cfg.pop("UP_COMPACT_COLS", 0)
    if tile_out:  # whole down rows beside the up rows
        rows_uc = min(rows_uc, WHOLE_UP_ROWS // (2 * triton.next_power_of_2(d)))
    if triton.next_power_of_2(d) * rows_uc > WHOLE_UP_ROWS or rows_uc == 0:  # would not fit in registers
        up_rows = 0
    if tile_out and up_rows == 0:
        raise ValueError(f"the tile-out decode path takes one row whose units' up and down rows fit in registers "
                         f"(M {m}, D {d})")
    ts = _tile_stride(tile, tile_stride)
    if fp8 and (x2.element_size() != 2 or h_fp32):
        raise ValueError(f"the fp8 gate takes 16-bit x at the default precision, got {x2.dtype}"
                         + (" at precision 'highest'" if h_fp32 else ""))
    hopper = (hopper_gate_launch(x2, w, tile, s, vals_dtype, fp8) if up is None and not partials and ts == tile
              else None)
    if hopper is not None:
        return Launch(*hopper)
    upw = up if up is not None else w
    dot = "ieee" if vals_dtype == torch.float32 and x2.dtype == torch.float32 else "tf32"
    if fp8:  # a K block of the same bytes; the quantized x is made contiguous at each call
        bk *= x2.element_size()
        tma = ts == tile and TensorDescriptor is not None and tma_ok(w) and d % 16 == 0
    else:
        tma = ts == tile and TensorDescriptor is not None and tma_ok(x2, w)

    def extra(x2, w, up, down, values, indices, counts, partials, *quantized):
        # without fp8: the gate's x is x2 and the scales are unused placeholders; then the TMA descriptors
        # (without TMA: placeholders)
        head = () if fp8 else (x2, x2, x2)
        gate_x = quantized[0] if fp8 else x2
        if tma:
            return *head, TensorDescriptor.from_tensor(gate_x, [bm, bk]), TensorDescriptor.from_tensor(w, [tile, bk])
        return *head, gate_x, w
    return Launch(_gate_pack_kernel, (cdiv(m, bm) * cdiv(width, ts), 1, 1), dict(
        M=m, N=width, K=d, stride_xm=x2.stride(0), stride_xk=x2.stride(1),
        stride_gm=d if fp8 else x2.stride(0), stride_gk=1 if fp8 else x2.stride(1), stride_wn=w.stride(0),
        stride_wk=w.stride(1), stride_un=upw.stride(0), stride_uk=upw.stride(1), T=tile, S=s, BM=bm, BK=bk,
        EVEN_K=d % bk == 0, GROUP_M=cfg.pop("GROUP_M"), DOT_PRECISION=dot, FUSE_UP=up is not None,
        H_FP32=h_fp32, PARTIALS=partials, PART_STAGES=PART_STAGES,
        PART_BD=max(16, min(PART_BYTES // x2.element_size(), triton.next_power_of_2(d))),
        PART_DOT="ieee" if vals_dtype == torch.float32 else "tf32",
        UP_BK=min(up_bk, triton.next_power_of_2(d)), UC=16, TS=ts,
        PDL=pdl, USE_TMA=tma, UP_STAGES=up_stages, UP_ROWS=up_rows, ROWS_UC=rows_uc,
        ROWS_BK=triton.next_power_of_2(d), TILE_OUT=tile_out, UP_COMPACT_COLS=up_compact_cols, FP8=fp8), cfg, extra)


def out_launch(x2, width, tile, s, h_fp32, has_overflow, cfg, packed_h=False, tile_stride=None,
               pdl=False, count_units=False, fp8_up_down=False) -> "_OutLaunches":
    """Launches of out [M, D] = sum over active units j of h_j * down_t[j], h_j = g_j * (x . up[j]). With
    packed_h (decode path), the TwELL already holds h and overflowing tiles read their partial rows from
    the buffer that gate_launch(partials=True) wrote; otherwise they are recomputed from gate and up.
    `tile_stride` and `pdl` as in gate_launch (the out kernel then waits for the gate kernel on the
    device). Called with (x2, values, indices, counts, partials or values, gate, up, down_t, out, overflow
    or counts); gate, up and down_t contiguous.
    Batched (one program a whole row), a heavy row posts its index for the dense block (heavy_launches), and
    with count_units every UNIT_SAMPLE-th row it walks adds its units and itself to overflow[1] and [2], and
    each posted row adds itself to overflow[3].
    With `fp8_up_down` (batched only), the walk reads the up and down rows' e4m3 copies
    (fp8_gate.quantize_up_down), passed at each call; the dense fallbacks read up and down_t."""
    m, d = x2.shape
    ts = _tile_stride(tile, tile_stride)
    nt = cdiv(width, ts)
    cfg = dict(cfg, launch_pdl=True) if pdl else dict(cfg)
    block_d = triton.next_power_of_2(d)
    bd = min(cfg.pop("BD", block_d), block_d)
    ch = cfg.pop("CH")
    # fallback units a step: recomputing reduces [FB_CH, BLOCK_D] gate/up tiles, so few
    fb_ch = min(ch, 4)
    split = not packed_h and bd == block_d
    if fp8_up_down and not split:
        raise ValueError("e4m3 up and down rows are read by the batched path's out kernel alone")
    nt_pad, s_pad = max(2, triton.next_power_of_2(nt)), triton.next_power_of_2(s)
    row_slots = triton.next_power_of_2(nt * s)
    held = row_slots if packed_h and m <= HELD_ROWS and row_slots <= HELD_SLOTS else 0
    # without the held TwELL the walk reads each row's list compacted in place first: by the row's own
    # program (batched up to FUSED_COMPACT_ROWS, where a program walks a whole row) or by a pre-pass
    tc = min(nt_pad, max(2, COMPACT_SLOTS // s_pad))
    fused = split and m <= FUSED_COMPACT_ROWS
    compact = None if held or fused else Launch(_compact_list_kernel, (m, 1, 1), dict(
        NT=nt, S=s, TC=tc, S_PAD=s_pad, PDL=pdl), dict(num_warps=4, launch_pdl=True) if pdl else dict(num_warps=4))
    out = Launch(_twell_out_kernel, (m, cdiv(d, bd), 1), dict(
        D=d, I=width, NT=nt, HEAVY=HEAVY_UNITS, stride_xm=x2.stride(0),
        stride_xk=x2.stride(1), T=tile, S=s, NT_PAD=nt_pad, CH=ch, FB_CH=fb_ch,
        OT=max(1, min(nt_pad, 4096 // bd)), BLOCK_D=block_d, BD=bd, LIST_UP=not packed_h, H_FP32=h_fp32,
        HAS_OVF=has_overflow, PARTIALS=packed_h, TS=ts, PDL=pdl, POST=split,
        COUNT_UNITS=UNIT_SAMPLE if count_units and split else 0,
        HELD=held, COMPACT_TC=tc if fused else 0, S_PAD=s_pad, FP8_UD=fp8_up_down), cfg,
        None if fp8_up_down else _no_up_down_fp8)
    return _OutLaunches(compact, out, heavy_launches(x2, width, h_fp32) if split else None)


def _no_up_down_fp8(x2, values, indices, counts, partials, gate, up, down_t, out, overflow, workspace):
    """The rows the out kernel walks where it has no e4m3 copies: up and down_t themselves (the scales'
    places hold placeholders, never read)."""
    return up, down_t, gate, gate


class _OutLaunches:
    """The list pre-pass (where the out kernel neither holds the TwELL nor compacts its own rows), the out
    kernel and, batched, the dense block of the rows it posts (heavy_launches), with the workspace
    [rows posted, row of each slot] allocated at each call (it cannot be shared across streams), room for
    every row."""

    def __init__(self, compact: Optional[Launch], out: Launch, heavy: Optional[HeavyBlock]):
        self.compact, self.out, self.heavy = compact, out, heavy

    def __call__(self, x2, values, indices, counts, partials, gate, up, down_t, out, overflow, up_down_fp8=None):
        if self.compact is not None:
            self.compact(indices, values, counts)
        fp8 = () if up_down_fp8 is None else tuple(up_down_fp8)  # the walk's e4m3 rows and scales
        if self.heavy is None:
            self.out(x2, values, indices, counts, partials, gate, up, down_t, out, overflow, counts, *fp8)
            return
        workspace = torch.zeros(1 + x2.shape[0], dtype=torch.int32, device=x2.device)
        self.out(x2, values, indices, counts, partials, gate, up, down_t, out, overflow, workspace, *fp8)
        self.heavy(x2, gate, up, down_t, workspace, out)


if triton is not None:

    @triton.jit
    def _gate_pack_kernel(x_ptr, w_ptr, up_ptr, down_ptr, vals_ptr, idx_ptr, cnt_ptr, part_ptr, xg_ptr, xs_ptr,
                          ws_ptr, x_desc, w_desc, M, N, K, stride_xm, stride_xk, stride_gm, stride_gk, stride_wn,
                          stride_wk, stride_un, stride_uk,
                          T: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                          EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          FUSE_UP: tl.constexpr, H_FP32: tl.constexpr, PARTIALS: tl.constexpr,
                          PART_BD: tl.constexpr, PART_DOT: tl.constexpr, PART_STAGES: tl.constexpr,
                          UP_BK: tl.constexpr, UC: tl.constexpr, TS: tl.constexpr, PDL: tl.constexpr,
                          USE_TMA: tl.constexpr, UP_STAGES: tl.constexpr, UP_ROWS: tl.constexpr,
                          ROWS_UC: tl.constexpr, ROWS_BK: tl.constexpr, TILE_OUT: tl.constexpr,
                          UP_COMPACT_COLS: tl.constexpr, FP8: tl.constexpr):
        # x as the gate reads it (xg: x itself, or its e4m3 copy with FP8, whose scales are xs and ws)
        if PDL:  # let the out kernel launch now; it waits for this grid before reading its results
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, TS)
        # grouped order: GROUP_M row blocks sweep the columns together so x blocks stay in L2
        in_group = GROUP_M * n_n
        first_m = (pid // in_group) * GROUP_M
        group_m = min(n_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_m
        pid_n = (pid % in_group) // group_m
        rows = pid_m * BM + tl.arange(0, BM)
        # the tile is TS units wide (TS < T: the block's last T - TS columns are not part of it, marked N)
        local = tl.arange(0, T)
        cols = tl.where(local < TS, pid_n * TS + local, N)
        rk = tl.arange(0, BK)
        # wrapped indices keep the main loop free of row/column masks; the epilogue masks instead
        x_rows = x_ptr + (rows % M)[:, None].to(tl.int64) * stride_xm
        a_ptrs = xg_ptr + (rows % M)[:, None].to(tl.int64) * stride_gm + rk[None, :] * stride_gk
        b_ptrs = w_ptr + (cols % N)[None, :].to(tl.int64) * stride_wn + rk[:, None] * stride_wk
        in_tile = (local < TS)[None, :]
        acc = tl.zeros((BM, T), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            if USE_TMA:  # bulk copies, zero-filled out of bounds; frees the registers of the addresses
                a = x_desc.load([pid_m * BM, k * BK])
                b = w_desc.load([pid_n * T, k * BK]).T
            elif EVEN_K:
                a = tl.load(a_ptrs)
                if TS < T:
                    b = tl.load(b_ptrs, mask=in_tile, other=0.0)
                else:
                    b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BK, other=0.0)
                b = tl.load(b_ptrs, mask=(rk[:, None] < K - k * BK) & in_tile, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BK * stride_gk
            b_ptrs += BK * stride_wk
        if FP8:
            acc = acc * tl.load(xs_ptr + rows % M)[:, None] * tl.load(ws_ptr + cols % N)[None, :]
        if TILE_OUT:
            tile_out(acc, rows, cols, local, x_rows, pid_n, n_n, M, N, K, x_ptr, up_ptr, down_ptr, cnt_ptr,
                     part_ptr, stride_xk, stride_un, stride_uk, TS, UC, UP_BK, UP_STAGES, DOT_PRECISION, H_FP32,
                     ROWS_UC, ROWS_BK, PART_BD, PART_DOT, PART_STAGES, BK, UP_COMPACT_COLS)
        else:
            vals = acc
            if FUSE_UP:
                # u = x @ up^T on this tile, loading up rows only for columns active in some row of the block
                col_on = tl.max(((acc > 0) & (rows < M)[:, None] & (cols < N)[None, :]).to(tl.int32), axis=0) > 0
                u = tl.zeros((BM, T), dtype=tl.float32)
                n_on = tl.sum(col_on.to(tl.int32), axis=0)
                whole_rows = False
                if UP_ROWS > 0:  # up to two rounds; the K loop below takes denser tiles in fewer latencies
                    whole_rows = n_on <= 2 * ROWS_UC
                if whole_rows:
                    u = up_whole_rows(u, col_on, n_on, local, pid_m * BM, pid_n * TS, x_ptr, up_ptr, M, K,
                                      stride_xm, stride_xk, stride_un, stride_uk, UP_ROWS, ROWS_UC, ROWS_BK)
                elif n_on > 0:
                    u = up_columns(u, col_on, n_on, local, cols, pid_n * TS, N, K, x_rows, up_ptr, stride_xk,
                                   stride_un, stride_uk, UC, UP_BK, UP_STAGES, BK, UP_COMPACT_COLS, DOT_PRECISION)
                g = tl.maximum(acc, 0.0)
                if not H_FP32:  # g as the packed gate value would be; h rounds when stored
                    g = g.to(vals_ptr.dtype.element_ty).to(tl.float32)
                vals = g * u
            count = pack_store(acc, vals, rows, cols, pid_n, pid_n * TS, M, N, vals_ptr, idx_ptr, cnt_ptr, n_n, S)
            if PARTIALS:
                # overflowing rows of this tile: the tile's share of their output, h . down_t[tile's units], as
                # fp32 partial rows (h as the packed values would be); nothing is written for tiles that fit
                over = (count > S) & (rows < M)
                if tl.max(over.to(tl.int32), axis=0) > 0:
                    h = tl.where(over[:, None] & (acc > 0) & (cols < N)[None, :], vals, 0.0)
                    h = h.to(vals_ptr.dtype.element_ty)  # fp32 with H_FP32
                    if not H_FP32:  # in the weights' precision, like dense
                        h = h.to(down_ptr.dtype.element_ty)
                    partial_rows(h, over, cols, (rows.to(tl.int64) * n_n + pid_n) * K, K, down_ptr, part_ptr,
                                 PART_BD, PART_DOT, PART_STAGES)

    @triton.jit
    def _accumulate_units(acc, x, j, g, active, d, dmask, do, omask, up_ptr, down_ptr, D,
                          TIMES_UP: tl.constexpr, H_FP32: tl.constexpr, FP8_UD: tl.constexpr = False,
                          h_dtype_ptr=None, su_ptr=None, sd_ptr=None):
        """acc += sum over the CH units j (where active) of h_j * down_t[j, do]: h_j = g_j * (x . up[j, :])
        with TIMES_UP, else g_j (the decode path packs h). With FP8_UD, up and down_t are the e4m3 copies and
        su_ptr and sd_ptr their scales a unit: h_j = g_j * su_j * (x . q(up[j])), rounded to h_dtype_ptr's dtype
        (x's), then acc += h_j * sd_j * q(down_t[j])."""
        rows = j[:, None].to(tl.int64) * D
        dw = tl.load(down_ptr + rows + do[None, :], mask=active[:, None] & omask[None, :], other=0.0,
                     eviction_policy="evict_last")
        if FP8_UD:
            su = tl.load(su_ptr + j, mask=active, other=0.0)
            sd = tl.load(sd_ptr + j, mask=active, other=0.0)
        if TIMES_UP:  # the down rows above are already in flight while this reduction waits
            uw = tl.load(up_ptr + rows + d[None, :], mask=active[:, None] & dmask[None, :], other=0.0,
                         eviction_policy="evict_last")
            h = g * tl.sum(uw.to(tl.float32) * x[None, :], axis=1)
        else:
            h = g
        if FP8_UD:
            h = (h * su).to(h_dtype_ptr.dtype.element_ty).to(tl.float32) * sd
        elif not H_FP32:
            h = h.to(down_ptr.dtype.element_ty).to(tl.float32)  # h in the weights' precision, like dense
        return acc + tl.sum(h[:, None] * dw.to(tl.float32), axis=0)

    @triton.jit
    def _list_entries(e, incl, fits, total, row, NT, S: tl.constexpr, idx_ptr, vals_ptr, row_j, row_g,
                      HELD: tl.constexpr):
        """Units and gate values of entries e of a row's compact list (tiles that fit, in order): with HELD,
        taken from the row's whole TwELL already in registers (row_j, row_g); else loaded from the list
        compacted over the start of the row's TwELL (by _compact_list_kernel or the row's own program)."""
        active = e < total
        if HELD:  # entry e lies in the first tile whose inclusive prefix exceeds e
            before = incl[None, :] <= e[:, None]
            tile_id = tl.sum(before.to(tl.int32), axis=1)
            slot = e - tl.sum(tl.where(before, fits[None, :], 0), axis=1)
            at = tl.where(active, tile_id * S + slot, 0)
            j = tl.gather(row_j, at, 0)
            g = tl.where(active, tl.gather(row_g, at, 0).to(tl.float32), 0.0)
        else:
            off = row * NT * S + e
            j = tl.load(idx_ptr + off, mask=active, other=0, eviction_policy="evict_first")
            g = tl.load(vals_ptr + off, mask=active, other=0.0, eviction_policy="evict_first").to(tl.float32)
        return j, g, active

    @triton.jit
    def _row_list(row, cnt_ptr, NT, S: tl.constexpr, NT_PAD: tl.constexpr):
        """A row's tile counts as its compact list: (inclusive prefix of the fitting tiles' counts, fitting
        counts, list length, overflowing tiles' mask)."""
        t = tl.arange(0, NT_PAD)
        cnt = tl.load(cnt_ptr + row * NT + t, mask=t < NT, other=0, eviction_policy="evict_first")
        fits = tl.where(cnt <= S, cnt, 0)  # overflowed tiles go through the dense fallback
        return tl.cumsum(fits, axis=0), fits, tl.sum(fits, axis=0), cnt > S

    @triton.jit
    def _walk_list(acc, x, lo, hi, incl, fits, row, NT, S: tl.constexpr, CH: tl.constexpr, idx_ptr, vals_ptr,
                   row_j, row_g, HELD: tl.constexpr,
                   d, dmask, do, omask, up_ptr, down_ptr, D, TIMES_UP: tl.constexpr, H_FP32: tl.constexpr,
                   FP8_UD: tl.constexpr, h_dtype_ptr, su_ptr, sd_ptr):
        """acc += the units of list entries lo..hi - 1, CH a step; the next step's units are fetched before
        this step's weights are consumed."""
        e = tl.arange(0, CH)
        j, g, active = _list_entries(e + lo, incl, fits, hi, row, NT, S, idx_ptr, vals_ptr, row_j, row_g, HELD)
        for e0 in range(lo, hi, CH):
            j_next, g_next, active_next = _list_entries(e + e0 + CH, incl, fits, hi, row, NT, S, idx_ptr,
                                                        vals_ptr, row_j, row_g, HELD)
            acc = _accumulate_units(acc, x, j, g, active, d, dmask, do, omask, up_ptr, down_ptr, D, TIMES_UP,
                                    H_FP32, FP8_UD, h_dtype_ptr, su_ptr, sd_ptr)
            j, g, active = j_next, g_next, active_next
        return acc

    @triton.jit
    def _recompute_tile(acc, x, tile, d, dmask, do, omask, vals_ptr, gate_ptr, up_ptr, down_ptr, D, I,
                        T: tl.constexpr, TS: tl.constexpr, FB_CH: tl.constexpr, H_FP32: tl.constexpr):
        """acc += an overflowing tile's units, recomputed densely from the gate and up weights."""
        for u0 in range(0, T, FB_CH):
            in_tile = u0 + tl.arange(0, FB_CH)
            unit = tile * TS + in_tile
            inside = (in_tile < TS) & (unit < I)
            gw = tl.load(gate_ptr + unit[:, None].to(tl.int64) * D + d[None, :],
                         mask=inside[:, None] & dmask[None, :], other=0.0)
            gate = tl.sum(gw.to(tl.float32) * x[None, :], axis=1)
            gate = gate.to(vals_ptr.dtype.element_ty).to(tl.float32)  # as the packed value
            acc = _accumulate_units(acc, x, unit, gate, inside & (gate > 0), d, dmask, do, omask, up_ptr,
                                    down_ptr, D, True, H_FP32)
        return acc

    @triton.jit
    def _compact_chunk(idx_ptr, vals_ptr, cnt_ptr, row, t0, start, NT, S: tl.constexpr, TC: tl.constexpr,
                       S_PAD: tl.constexpr):
        """Tiles t0 .. t0 + TC of a row: their fitting entries moved to offset `start` of the row's TwELL.
        Returns how many moved."""
        t = t0 + tl.arange(0, TC)
        slot = tl.arange(0, S_PAD)
        cnt = tl.load(cnt_ptr + row * NT + t, mask=t < NT, other=0)
        fits = tl.where(cnt <= S, cnt, 0)  # overflowed tiles go through the dense fallback
        live = slot[None, :] < fits[:, None]
        src = row * NT * S + t[:, None] * S + slot[None, :]
        j = tl.load(idx_ptr + src, mask=live)
        g = tl.load(vals_ptr + src, mask=live)
        tl.debug_barrier()  # every thread's reads of the chunk before any write
        dst = row * NT * S + start + (tl.cumsum(fits, axis=0) - fits)[:, None] + slot[None, :]
        tl.store(idx_ptr + dst, j, mask=live)
        tl.store(vals_ptr + dst, g, mask=live)
        return tl.sum(fits, axis=0)

    @triton.jit
    def _compact_list_kernel(idx_ptr, vals_ptr, cnt_ptr, NT: tl.constexpr, S: tl.constexpr,
                             TC: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr):
        """A row's entries of the tiles that fit, in tile then slot order, moved to the start of the row's
        TwELL, in place, TC tiles at a time: an entry only moves to an earlier slot, so no write reaches a
        later chunk, and within a chunk every read precedes every write. The out kernel's walk then reads
        list entries at consecutive offsets, instead of finding each entry's tile and slot from the counts
        with a [units, tiles] comparison and two reductions at every step."""
        if PDL:  # launched before the gate kernel finished: wait for it, and let the out kernel launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        _compact_row(idx_ptr, vals_ptr, cnt_ptr, tl.program_id(0).to(tl.int64), NT, S, NT, TC, S_PAD)

    @triton.jit
    def _compact_row(idx_ptr, vals_ptr, cnt_ptr, row, NT, S: tl.constexpr, NT_BOUND: tl.constexpr,
                     TC: tl.constexpr, S_PAD: tl.constexpr):
        """A row's fitting entries moved to the start of its TwELL, TC tiles at a time (NT_BOUND >= NT)."""
        if NT_BOUND <= TC:  # one chunk: without the loop and the running total
            _compact_chunk(idx_ptr, vals_ptr, cnt_ptr, row, 0, 0, NT, S, TC, S_PAD)
        else:
            start = tl.full((), 0, tl.int32)  # entries of the row's earlier chunks
            for t0 in range(0, NT, TC):
                start += _compact_chunk(idx_ptr, vals_ptr, cnt_ptr, row, t0, start, NT, S, TC, S_PAD)

    @triton.jit
    def _twell_out_kernel(x_ptr, vals_ptr, idx_ptr, cnt_ptr, part_ptr, gate_ptr, up_ptr, down_ptr, out_ptr,
                          ovf_ptr, ws_ptr, walk_up_ptr, walk_down_ptr, su_ptr, sd_ptr, D, I, NT, HEAVY, stride_xm,
                          stride_xk,
                          T: tl.constexpr, S: tl.constexpr, NT_PAD: tl.constexpr, CH: tl.constexpr,
                          FB_CH: tl.constexpr, OT: tl.constexpr, BLOCK_D: tl.constexpr, BD: tl.constexpr,
                          LIST_UP: tl.constexpr, H_FP32: tl.constexpr, HAS_OVF: tl.constexpr,
                          PARTIALS: tl.constexpr, TS: tl.constexpr, PDL: tl.constexpr, POST: tl.constexpr,
                          HELD: tl.constexpr, COMPACT_TC: tl.constexpr, S_PAD: tl.constexpr,
                          COUNT_UNITS: tl.constexpr, FP8_UD: tl.constexpr):
        # program (row, output chunk): u needs the whole row of x and up, down only BD output columns. The walk
        # reads walk_up and walk_down: with FP8_UD the e4m3 rows (scales su and sd), else up and down_t
        # themselves; the dense fallbacks read up and down_t
        row = tl.program_id(0).to(tl.int64)
        if COMPACT_TC > 0:  # the row's program compacts its list itself (no pre-pass launch), then a barrier:
            # every thread's moves land before any thread's walk reads them
            _compact_row(idx_ptr, vals_ptr, cnt_ptr, row, NT, S, NT_PAD, COMPACT_TC, S_PAD)
            tl.debug_barrier()
        pid_d = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        do = pid_d * BD + tl.arange(0, BD)
        omask = do < D
        x = tl.load(x_ptr + row * stride_xm + d * stride_xk, mask=dmask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if PDL:  # launched before the gate kernel finished: wait for its results
            tl.extra.cuda.gdc_wait()
        if HELD > 0:  # the row's whole TwELL, loaded beside its counts rather than after them
            q = tl.arange(0, HELD)
            row_j = tl.load(idx_ptr + row * NT * S + q, mask=q < NT * S, other=0)
            row_g = tl.load(vals_ptr + row * NT * S + q, mask=q < NT * S, other=0.0)
        else:
            row_j, row_g = d, d  # placeholders, unused
        incl, fits, total, over = _row_list(row, cnt_ptr, NT, S, NT_PAD)
        n_over = tl.sum(over.to(tl.int32), axis=0)
        own = total >= 0  # whether this program walks its row (a heavy one may post it instead)
        if POST:
            # a heavy row (more than HEAVY units to walk) would bound the launch with its serial walk: it posts
            # its index for the dense block ([rows posted, row of each slot (M)]), which writes it next
            if total + n_over * TS > HEAVY:
                tl.store(ws_ptr + 1 + tl.atomic_add(ws_ptr, 1), row.to(tl.int32))
                if COUNT_UNITS > 0:  # the heavy rows' count, beside the sample (what ActivityRouter reads)
                    tl.atomic_add(ovf_ptr + 3, tl.full((), 1, ovf_ptr.dtype.element_ty))
                own = False
        if COUNT_UNITS > 0:  # a sample of the rows' activity, one row in COUNT_UNITS (few atomics on one address)
            if own & (row % COUNT_UNITS == 0):
                tl.atomic_add(ovf_ptr + 1, total.to(ovf_ptr.dtype.element_ty))
                tl.atomic_add(ovf_ptr + 2, tl.full((), 1, ovf_ptr.dtype.element_ty))
        acc = tl.zeros((BD,), dtype=tl.float32)
        if own:
            acc = _walk_list(acc, x, 0, total, incl, fits, row, NT, S, CH, idx_ptr, vals_ptr, row_j, row_g,
                             HELD > 0, d, dmask, do, omask, walk_up_ptr, walk_down_ptr, D, LIST_UP, H_FP32, FP8_UD,
                             up_ptr, su_ptr, sd_ptr)
        if n_over > 0:
            if HAS_OVF:
                tl.atomic_add(ovf_ptr, n_over.to(ovf_ptr.dtype.element_ty), mask=pid_d == 0)
            if PARTIALS:  # the overflowing tiles' partial rows, OT tiles a step, in tile order
                for t0 in range(0, NT, OT):
                    t = t0 + tl.arange(0, OT)
                    ov = tl.load(cnt_ptr + row * NT + t, mask=t < NT, other=0) > S
                    p = tl.load(part_ptr + (row * NT + t)[:, None] * D + do[None, :],
                                mask=ov[:, None] & omask[None, :], other=0.0)
                    acc += tl.sum(p, axis=0)
            elif own:  # recompute the tiles densely from the gate and up weights
                for tile in range(0, NT):
                    if tl.load(cnt_ptr + row * NT + tile) > S:
                        acc = _recompute_tile(acc, x, tile, d, dmask, do, omask, vals_ptr, gate_ptr, up_ptr,
                                              down_ptr, D, I, T, TS, FB_CH, H_FP32)
        if own:  # else the dense block writes the row
            tl.store(out_ptr + row * D + do, acc.to(out_ptr.dtype.element_ty), mask=omask,
                     eviction_policy="evict_first")
