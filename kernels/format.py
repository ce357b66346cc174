"""TwELL packed layout of a ReLU activation, packing in Triton, and a plain PyTorch reference; also the
launch rules that the kernels, their reference and the cost model (cost_model.py) share (decode_rows,
HEAVY_UNITS, UNIT_SAMPLE, ...).

A dense activation g [M, I] is cut along I into tiles of T columns (T = the gate matmul's column tile,
so each matmul program packs its own output tile in its epilogue). Each (row, tile) keeps its positives
(strict > 0) in S = T // compression slots, in column order. This project stores three arrays instead
of the authors' packed uint32 words (no bit unpacking in the consumer, any I, fp32 values possible):

    values  [M, NT, S]  the positive values (activation dtype, or fp32 in "highest" precision)
    indices [M, NT, S]  int32 column index, global within I
    counts  [M, NT]     int32 number of positives in the tile; counts > S means the tile overflowed

NT = ceil(I / T). Only the first min(count, S) slots of a tile are written; the rest are undefined and
never read. An overflowing tile keeps its first S positives here and is marked by its count: the compute
kernels handle such tiles densely (never drop data: recomputed, or at decode size read from the partial
output rows the gate kernel wrote), and `pack` users can see it in `counts`.
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


# Most slots a (row, tile) of the decode path holds, whatever the compression: a busier tile (a heavy row's,
# such as a sequence's first token) takes the gate programs' dense partial rows, spread over every tile,
# instead of a serial walk of all its units by the row's out programs
DECODE_SLOTS = 8


def decode_slots(tile: int, compression: int) -> int:
    """Slots per (row, tile) on the decode path: slots(tile, compression), at most DECODE_SLOTS."""
    return min(slots(tile, compression), DECODE_SLOTS)


DECODE_ROWS = 64  # at most this many tokens take the decode path (16 for large layers: decode_rows)
LARGE_LAYER = 1 << 24  # D * I above which the decode path ends at 16 rows


def decode_rows(d: int, width: int) -> int:
    """Most tokens that take the decode path. Above 16 rows its gate kernel runs one program per SM, each
    streaming I / #SMs gate rows and then reading its active columns' up rows, which at D * I > 2^24 loses
    to the batched path from about 24 rows: such layers end the decode path at 16 rows, giving up the few
    rows above it where decode still wins. Smaller layers take it up to 64 rows, where it is faster."""
    return DECODE_ROWS if d * width <= LARGE_LAYER else 16


# A batched row with more units than this to walk (list entries, plus T per overflowing tile) is not walked
# by its own program: it posts its index, and a dense block computes every posted row (heavy.py's
# heavy_launches). A row walk is a serial chain of dependent gathers beside the other rows, and a dense row
# costs about as much as this many gathered units (6 * D * I flops at the dense block's rate, against two
# D-wide weight rows a unit from L2).
HEAVY_UNITS = 128
UNIT_SAMPLE = 64  # with a four-element overflow counter, one batched row in this many reports its units


HOPPER_TILES_PER_SM = 4  # gate_hopper.py runs from this many output tiles an SM (hopper_gate_launch): ~1500
#                          tokens at I 5632


def out_units_per_step(m: int) -> int:
    """Units the batched out kernel takes a step (batched.out_config): with few rows in flight, more
    units a step, fewer dependent steps a row; with many, fewer, to keep more rows in flight."""
    return 8 if m <= 256 else 4 if m <= 512 else 2


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
