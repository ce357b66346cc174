"""TwELL packed layout of a ReLU activation, packing in Triton, and a plain PyTorch reference.

A dense activation g [M, I] is cut along I into tiles of T columns (T = the gate matmul's column tile,
so each matmul program packs its own output tile in its epilogue). Each (row, tile) keeps its positives
(strict > 0) in S = T // compression slots, in column order. This project stores three arrays instead
of the authors' packed uint32 words (no bit unpacking in the consumer, any I, fp32 values possible):

    values  [M, NT, S]  the positive values (activation dtype, or fp32 in "highest" precision)
    indices [M, NT, S]  int32 column index, global within I
    counts  [M, NT]     int32 number of positives in the tile; counts > S means the tile overflowed

NT = ceil(I / T). Only the first min(count, S) slots of a tile are written; the rest are undefined and
never read. An overflowing tile keeps its first S positives here and is marked by its count: the compute
kernels handle such tiles densely (never drop data: recomputed, or at decode size read from a dense copy
the gate kernel wrote), and `pack` users can see it in `counts`.
Slot s of a row holds its s-th positive column (found by a row-wise min after slot s-1): deterministic
and sorted.
"""
import contextlib
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines load checkpoints through the reference path
    triton = None


class TwELL(NamedTuple):
    values: torch.Tensor   # [M, NT, S]
    indices: torch.Tensor  # [M, NT, S] int32
    counts: torch.Tensor   # [M, NT] int32
    tile: int
    width: int             # I, the dense column count


TILES = (16, 32, 64, 128, 256)


def slots(tile: int, compression: int) -> int:
    """Slots per (row, tile): T // compression (at least one)."""
    if tile not in TILES:
        raise ValueError(f"tile must be one of {TILES}, got {tile}")
    if compression < 1 or compression & (compression - 1):
        raise ValueError(f"compression must be a power of two, got {compression}")
    return max(tile // compression, 1)


DECODE_ROWS = 64  # at most this many tokens take the decode path (16 for large layers: decode_rows)
LARGE_LAYER = 1 << 24  # D * I above which the decode path ends at 16 rows


def decode_rows(d: int, width: int) -> int:
    """Most tokens that take the decode path. Above 16 rows its gate kernel runs one program per SM, each
    streaming I / #SMs gate rows and then reading its active columns' up rows, which at D * I > 2^24 loses
    to the batched path from about 24 rows (H100: 3584 / 18944 5-10% slower at 24-32 rows, 4096 / 14336
    2-8% faster up to 32, both 1.2-1.4x slower at 48-64; both 5% faster at 17, where ending at 16 gives
    that up; benchmarks/results/decode_mid_rows_h100.json, decode_rows_h100.json). Smaller layers are
    faster up to 64."""
    return DECODE_ROWS if d * width <= LARGE_LAYER else 16


# A batched row with more units than this to walk (list entries, plus T per overflowing tile) is not walked
# by its own program: it posts its index, and a dense block computes every posted row (gated_mlp's
# heavy_launches). A row walk is a serial chain of dependent gathers beside the other rows, and a dense row
# costs about as much as this many gathered units (6 * D * I flops at the dense block's rate, against two
# D-wide weight rows a unit from L2).
HEAVY_UNITS = 128


# The narrowest layer shape of the block benchmarks the cost model below was fitted to (D 896 / I 4864):
# narrower layers are outside it, and a plan by the model runs them dense.
FITTED_MIN_HIDDEN, FITTED_MIN_INTERMEDIATE = 896, 4864

# Cost model of one block on an H100 in bf16, fitted by benchmarks/fit_cost_model.py to the block
# benchmark's window, main and tiles grids and its --decode-paths rows (5 shapes, 1-65536 tokens, 29-300
# active units, tiles 64-256; fit quality in docs/performance.md). A launch costs a smooth
# maximum of its compute and its weight-streaming time plus a fixed latency; compute runs at
# peak * D / (D + D_half) (narrow matmuls are less efficient).
DENSE = (726e12, 660, 2.74e12, 14.3e-6)  # cuBLAS block: peak flop/s, D_half, weight bytes/s, latency s
# the dense block of heavy rows (gated_mlp's heavy_launches: Triton, rows gathered), same terms, fitted to
# bench_inference.py --heavy-block
HEAVY = (454e12, 0, 2.30e12, 35.7e-6)
# Gate matmul with its packing epilogue, same terms, per batched gate kernel (gate_kernel): the Triton
# kernel at each planned tile width, and gate_hopper.py's kernel (tile 128 from HOPPER_TILES_PER_SM tiles an SM)
GATE = {64: (411e12, 255, 4.00e12, 6.0e-6), 128: (621e12, 257, 2.56e12, 7.1e-6),
        256: (681e12, 471, 4.00e12, 15.6e-6), "hopper": (691e12, 400, 1.71e12, 4.9e-6)}
H100_SMS = 132
HOPPER_TILES_PER_SM = 4  # gate_hopper.py runs from this many output tiles an SM (hopper_gate_launch): ~1500
#                          tokens at I 5632
GATHER = (6.27e12, 2.76e12, 0.000e-9, 17.6e-6)  # up + down rows of the active pairs: bytes/s from L2 and
#                                                 from HBM, seconds per pair, latency of the out kernel
DECODE = (2.54e12, 3.8e-9, 9.1e-6)  # decode: bytes/s (gate matrix, active up/down rows), s per pair, latency
L2_BYTES = 50e6
# Batched, the out kernel walks each row in one program, a few units a step, beside the other rows: a row
# heavier than the rest (a sequence's first token often activates hundreds of units) is a serial chain.
# Seconds per step of that walk at 2 units a step: fixed + per hidden column, fitted to the
# block with one heavy row before the split (benchmarks/results/heavy_row_h100.json: 1.1 us a unit at D 2048,
# 1.7 us at D 4096). A row above HEAVY_UNITS posts itself to the dense block of heavy rows instead.
ROW_WALK = (9.8e-7, 6.0e-10)


def out_units_per_step(m: int) -> int:
    """Units the batched out kernel takes a step (gated_mlp.out_config): with few rows in flight, more
    units a step, fewer dependent steps a row; with many, fewer, to keep more rows in flight."""
    return 8 if m <= 256 else 4 if m <= 512 else 2


def _roofline(flops: float, nbytes: float, rates: tuple, d: int) -> float:
    peak, d_half, bandwidth, latency = rates
    return ((flops * (d + d_half) / (peak * d)) ** 4 + (nbytes / bandwidth) ** 4) ** 0.25 + latency


def gate_kernel(tile: int, tokens: int, i: int):
    """Which batched gate kernel an H100 runs, as a key of GATE: "hopper" for gate_hopper.py's (tile 128,
    enough tiles), else the Triton kernel's tile width (tiles below 64, never planned, cost as 64)."""
    if tile == 128 and cdiv(tokens, 128) * cdiv(i, 128) >= HOPPER_TILES_PER_SM * H100_SMS:
        return "hopper"
    return min(max(tile, 64), 256)


def dense_time(d: int, i: int, tokens: int) -> float:
    """Predicted seconds of the dense bf16 block (gate and up as one matmul, ReLU product, down)."""
    return _roofline(6 * tokens * d * i, 6 * d * i, DENSE, d)


def heavy_time(d: int, i: int, rows: int) -> float:
    """Predicted seconds of the dense block of `rows` heavy rows (gated_mlp's heavy_launches); none: nothing."""
    return _roofline(6 * rows * d * i, 6 * d * i, HEAVY, d) if rows else 0.0


def twell_time(mean_active: float, d: int, i: int, tokens: int, max_active: float | None = None,
               tile: int = 128, heavy_rows: int | None = None) -> float:
    """Predicted seconds of `gated_mlp` at `mean_active` units per token (no overflow) with `tile`-wide
    tiles (batched: the gate kernel's rates depend on it; decode uses its own); `max_active`, the
    heaviest token's count: up to HEAVY_UNITS its serial walk bounds the batched out kernel from below (a
    smooth maximum with the throughput term: the row runs beside the others); above, the row goes to the
    dense block of heavy rows, whose time is added for `heavy_rows` rows (default: one, the heaviest)."""
    pairs = tokens * mean_active
    if tokens <= decode_rows(d, i):  # decode spreads a row's units over the gate programs' tiles
        bandwidth, per_pair, latency = DECODE
        return (2 * d * i + 4 * d * pairs) / bandwidth + pairs * per_pair + latency
    l2, hbm, per_pair, latency = GATHER
    from_hbm = max(0.0, 1 - L2_BYTES / (4 * d * i))  # share of the row reads that miss L2
    gather = pairs * (4 * d * ((1 - from_hbm) / l2 + from_hbm / hbm) + per_pair) + latency
    heaviest = max_active or 0.0
    if heavy_rows is None:
        heavy_rows = int(heaviest > HEAVY_UNITS)
    # the fitted terms already hold ordinary rows (a batch's heaviest is about twice the mean): only the
    # walk beyond that counts
    excess = max(0.0, min(heaviest, HEAVY_UNITS) - 2 * mean_active)
    walk = excess / out_units_per_step(tokens) * (ROW_WALK[0] + ROW_WALK[1] * d)
    gate = _roofline(2 * tokens * d * i, 2 * d * i, GATE[gate_kernel(tile, tokens, i)], d)
    return gate + (gather ** 4 + walk ** 4) ** 0.25 + heavy_time(d, i, heavy_rows)


def choose_setting(mean_active: float, tile_active_max: float, d: int, i: int, tokens: int = 16384,
                   tile: int = 128) -> dict:
    """Per-layer plan from measured activity: `mean_active` units per token, `tile_active_max` a high
    quantile (e.g. p99.9) of active units per (token, tile) at this tile width. Returns
    {"mode": "sparse"|"dense", "tile", "compression", "predicted_speedup"} (speed-up of the MLP block
    over dense bf16 at this token count, from the model above; sparse when it exceeds 1)."""
    compression = next((c for c in (8, 4, 2) if slots(tile, c) >= tile_active_max), 1)
    speedup = dense_time(d, i, tokens) / twell_time(mean_active, d, i, tokens)
    return dict(mode="sparse" if speedup > 1 else "dense", tile=tile, compression=compression,
                predicted_speedup=round(speedup, 3))


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (the test setup)."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def tma_ok(*tensors) -> bool:
    """Whether TMA descriptors can address these 2-D tensors: Hopper or newer (or the interpreter, which
    emulates them), unit inner stride, 16-byte aligned base and row stride."""
    t0 = tensors[0]
    if t0.is_cuda:
        if torch.cuda.get_device_capability(t0.device)[0] < 9:
            return False
    elif os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return all(t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0
               for t in tensors)


def on_device(t: torch.Tensor):
    """Context in which Triton launches on t's GPU. Triton launches on the current CUDA device, which is not
    always the tensors' (a model spread over GPUs by device_map runs each layer on its own GPU without
    setting it). A no-op on CPU and when t's GPU is already current."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def empty_twell(m: int, width: int, tile: int, compression: int, dtype, device) -> TwELL:
    nt, s = cdiv(width, tile), slots(tile, compression)
    return TwELL(torch.empty(m, nt, s, dtype=dtype, device=device),
                 torch.empty(m, nt, s, dtype=torch.int32, device=device),
                 torch.empty(m, nt, dtype=torch.int32, device=device), tile, width)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pack_reference(g: torch.Tensor, tile: int = 128, compression: int = 8) -> TwELL:
    """Plain PyTorch packing; slots beyond a tile's count are zero (values) and 0 (indices)."""
    m, width = g.shape
    s, nt = slots(tile, compression), cdiv(width, tile)
    gp = torch.nn.functional.pad(g, (0, nt * tile - width)).view(m, nt, tile)
    pos = gp > 0
    slot = pos.to(torch.int64).cumsum(-1) - 1
    keep = pos & (slot < s)
    cols = torch.arange(nt * tile, device=g.device).view(1, nt, tile).expand(m, nt, tile)
    # scatter the kept entries; everything else goes to a spare slot s that is cut off afterwards
    dst = torch.where(keep, slot, torch.full_like(slot, s))
    values = torch.zeros(m, nt, s + 1, dtype=g.dtype, device=g.device).scatter_(2, dst, gp * keep)
    indices = torch.zeros(m, nt, s + 1, dtype=torch.int64, device=g.device).scatter_(2, dst, cols * keep)
    return TwELL(values[..., :s].contiguous(), indices[..., :s].to(torch.int32).contiguous(),
                 pos.sum(-1).to(torch.int32), tile, width)


def unpack(tw: TwELL) -> torch.Tensor:
    """Dense [M, I] from TwELL (reads only valid slots; an overflowed tile yields its first S positives)."""
    m, nt, s = tw.values.shape
    valid = torch.arange(s, device=tw.values.device) < tw.counts.clamp(max=s)[..., None]
    cols = torch.where(valid, tw.indices.long(), tw.width).view(m, nt * s)
    vals = torch.where(valid, tw.values, 0).view(m, nt * s)
    dense = torch.zeros(m, tw.width + 1, dtype=tw.values.dtype, device=tw.values.device)
    return dense.scatter_(1, cols, vals)[:, :tw.width]


def pack(g: torch.Tensor, tile: int = 128, compression: int = 8) -> TwELL:
    """Pack the positives of a dense [M, I] activation (Triton on GPU / interpreter, else reference)."""
    if g.dim() != 2:
        raise ValueError(f"pack expects [M, I], got {tuple(g.shape)}")
    if not use_triton(g):
        return pack_reference(g, tile, compression)
    m, width = g.shape
    tw = empty_twell(m, width, tile, compression, g.dtype, g.device)
    block_m = 16
    grid = (triton.cdiv(m, block_m), triton.cdiv(width, tile))
    with on_device(g):
        _pack_kernel[grid](g, tw.values, tw.indices, tw.counts, m, width, g.stride(0), g.stride(1),
                           T=tile, S=tw.values.shape[2], BM=block_m)
    return tw


if triton is not None:

    @triton.jit
    def pack_store(g, vals, rows, cols, tile_id, col0, M, N, vals_ptr, idx_ptr, cnt_ptr, NT, S: tl.constexpr):
        """Epilogue shared by every packing kernel: the positives of g [BM, T] (fp32, at rows x cols)
        decide the entries; `vals` (g itself, or h in the decode path) is what is stored; local column c of
        the tile is unit col0 + c (columns marked >= N are not part of it). Returns the
        per-row counts [BM] (0 for rows >= M), so that a caller can tell overflowing rows.
        gate_hopper._pack is the 16-bit branch again in Gluon (which cannot call Triton functions): a
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
    def _pack_kernel(g_ptr, vals_ptr, idx_ptr, cnt_ptr, M, N, stride_gm, stride_gn,
                     T: tl.constexpr, S: tl.constexpr, BM: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * T + tl.arange(0, T)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        g = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_gm + cols[None, :] * stride_gn,
                    mask=mask, other=0.0).to(tl.float32)
        pack_store(g, g, rows, cols, pid_n, pid_n * T, M, N, vals_ptr, idx_ptr, cnt_ptr, tl.cdiv(N, T), S)
