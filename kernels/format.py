"""TwELL packed layout of a ReLU activation (packed by the gate kernels' epilogue, epilogues.pack_store; its
reference: reference.pack_reference), and the launch rules that the kernels, their reference and the cost model
(cost_model.py) share (decode_rows, HEAVY_UNITS, UNIT_SAMPLE, ...).

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
output rows the gate kernel wrote), and a TwELL's readers see it in `counts`.
Slot s of a row holds its s-th positive column (found by a row-wise min after slot s-1): deterministic
and sorted.
"""
import contextlib
import os
from typing import NamedTuple

import torch

try:
    import triton
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


DECODE_ROWS = 64  # at most this many tokens take the decode path (16 or 32 for large or wide layers: decode_rows)
LARGE_LAYER = 1 << 24  # D * I above which the decode path ends at 16 rows
# I above which the decode path ends at 32 rows: a decode tile (decode.DECODE_TILE, 64 units) a program on each
# of an H100's or H200's 132 SMs
WIDE_LAYER = 64 * 132


def decode_rows(d: int, width: int) -> int:
    """Most tokens that take the decode path. Above 16 rows its gate kernel runs one program per SM, each
    streaming I / #SMs gate rows (at most a decode tile) and then reading its active columns' up rows, which
    at D * I > 2^24 loses to the batched path from about 24 rows: such layers end the decode path at 16 rows,
    giving up the few rows above it where decode still wins. A layer wider than a decode tile an SM
    (WIDE_LAYER) runs a second round of a few programs, which loses from about 48 rows: it ends at 32.
    Smaller layers take it up to 64 rows, where it is faster."""
    if d * width > LARGE_LAYER:
        return 16
    return 32 if width > WIDE_LAYER else DECODE_ROWS


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


def unpack(tw: TwELL) -> torch.Tensor:
    """Dense [M, I] from TwELL (reads only valid slots; an overflowed tile yields its first S positives)."""
    m, nt, s = tw.values.shape
    valid = torch.arange(s, device=tw.values.device) < tw.counts.clamp(max=s)[..., None]
    cols = torch.where(valid, tw.indices.long(), tw.width).view(m, nt * s)
    vals = torch.where(valid, tw.values, 0).view(m, nt * s)
    dense = torch.zeros(m, tw.width + 1, dtype=tw.values.dtype, device=tw.values.device)
    return dense.scatter_(1, cols, vals)[:, :tw.width]
