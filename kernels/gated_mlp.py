"""TwELL inference kernels for a ReLU-gated MLP: out = down(relu(gate(x)) * up(x)).

Two kernels (a small pre-pass between them in decode above HELD_ROWS rows and batched above FUSED_COMPACT_ROWS;
batched, the dense block of heavy rows after them), no host synchronization:
1. `_gate_pack_kernel`: tiled x @ gate^T (fp32 accumulation, tensor cores; x and the weight read through
   TMA descriptors on Hopper when their strides allow); its epilogue applies ReLU and packs each program's
   [BM, T] output tile into TwELL (format.py), so the dense gate activation never reaches device memory.
   Batched on an sm_90 GPU with enough tiles, gate_hopper.py's warp-specialized Gluon kernel does the same
   (same bits) with the packing hidden behind the other half of the program's matmuls.
2. `_twell_out_kernel`: one program per token row. Each row's entries are first moved to the start of its
   TwELL as one compact list of active units (prefix sum over the tile counts), by the row's own program
   up to FUSED_COMPACT_ROWS rows, above by a small pre-pass (`_compact_list_kernel`); the program walks
   the list CH units at a time, gathers those rows of up and of the transposed down ([I, D], both
   contiguous rows), and accumulates out += (g * x.up_j) * down_j in fp32 registers: h never reaches
   device memory. A (row, tile) whose count exceeds the slots is
   recomputed densely from the gate and up weights (never dropped) and counted into `overflow`.
   A heavy row (more than HEAVY_UNITS units to walk, like a sequence's first token) would bound the launch
   with its serial walk: it posts its index instead, and a dense block computes every posted row
   (heavy_launches: two Triton matmuls over the rows gathered through that device-side list, persistent
   programs that read the count on the device), so a call costs what its heavy rows need at any token
   count, nothing without them, and no host synchronization.
Decode (M <= 64 tokens, 16 for layers with D * I > 2^24: decode_rows) is memory-bound and latency-bound
instead: the gate kernel runs with a narrower tile (I / 64 programs stream the gate matrix; above 16 rows
I / #SMs, one program per SM) and, in the same program, computes u for its tile's active units only (up to
4 rows, for a tile with up to 8 active columns and D up to 4096: whole up rows of the active columns in one
round of loads, dot products on CUDA cores; else up to 32 rows: the active columns compacted and read deep,
512 with three such blocks in flight up to 16 rows, 256 with four above; above 32: a K loop whose loads are
masked to active columns), so it packs h = g * u instead of g; kernel 2 then only gathers down rows, split
over output chunks of BD columns so that many SMs share the few rows, and is launched as a programmatic
dependent launch (Hopper): it starts while the gate kernel runs and waits for it on the device. Up to 32
rows it loads its row's whole TwELL together with the counts (one round of loads, not two).
One token (gated, D up to TILE_OUT_MAX_D: tile_out_launch) skips TwELL: each gate program reads its active
units' whole up and down rows in one round and writes its tile's share of the output, an fp32 row of a
[1, NT, D] buffer (zeros where no unit is active), and `_twell_tile_sum_kernel` adds the shares from L2:
one dependent read after the gate kernel instead of the TwELL and then the down rows.
`overflow` counts the narrower tiles.
Decode overflow: the gate program already holds its tile's h densely, so for an overflowing (row, tile)
it reads the tile's active down rows itself and writes the tile's share of the row's output, an fp32
partial row, to a side buffer [M, NT, D]; kernel 2 adds the row's partials (in tile order) to its walk of
the tiles that fit. A dense row (a sequence's first token: about 2000 of 5632 units at the 1.5B shape) is
thus spread over every gate program, where kernel 2's output-chunk programs would each walk all of its
tiles one after another, several times the dense block's time. The buffer is written and read only at
overflowing (row, tile) pairs, and allocated at each call (0.7 MB a token at D 2048 / I 5632 with 64-unit
tiles, 1.1 MB above 16 rows where the tiles are 43 wide; 15 MB at D 8192 / I 28672); the batched path keeps recomputing such tiles (a partial row per (row, tile) would be
large there).
The down weight is read transposed: pass `prepare_down(down)` (made once at load time) to avoid a
per-call transpose copy.
"""
from collections import OrderedDict
from typing import Optional

import torch

from .format import (HEAVY_UNITS, cdiv, decode_rows, on_device, out_units_per_step, slots, tma_ok,
                     use_triton)
from .gate_hopper import hopper_gate_launch

try:
    import triton
    import triton.language as tl
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # older Triton: pointer loads only
        TensorDescriptor = None

    from .format import pack_store
except ImportError:  # CPU-only machines run the reference path
    triton = None

PRECISIONS = ("default", "highest")
DECODE_TILE = 64   # gate-matmul column tile in decode: I / 64 programs stream the gate matrix
WHOLE_UP_ROWS = 16384  # elements of up rows a decode gate program loads at once (128 a thread of 4 warps)
# TwELL slots of a row a decode out program (up to HELD_ROWS rows) holds in registers: one round of loads,
# not two (0.3-2.8 us faster at 1-16 rows, 1.3-2.1 at 17-32 at D 2048, results/decode_mid_rows_h100.json;
# at 64 rows, 100 active units, 53 -> 57 us)
HELD_SLOTS, HELD_ROWS = 4096, 32
# Partial rows of overflowing decode tiles (a sequence's first token): 512 bytes of each down row a step, two
# steps in flight, against 128 bytes one step at a time (H100, D 2048 / I 5632, a first token of about 2000
# units, us a layer of 8 in a CUDA graph, decode_rules_h100.json: alone 48.3 -> 33.1 (dense 33.5), among 16
# tokens 55.9 -> 41.3, among 64 69.5 -> 54.3)
PART_BYTES, PART_STAGES = 512, 2
# One-token decode through tile_out_launch up to this D (H100, 29 active units, 8 layers in a CUDA graph,
# benchmarks/results/decode_rules_h100.json: D 896 / 4864 10.7 -> 9.1 us a layer, 2048 / 5632 15.5 -> 14.3,
# 2048 / 8192 19.2 -> 18.3; slower at 3584 / 18944 and 4096 / 14336, 56.6 -> 58.8 and 47.3 -> 49.8, where
# the output's shares (4 * D bytes a tile) and their sum cost more than the hand-over they save)
TILE_OUT_MAX_D = 2048
TILE_SUM_BD = 32  # output columns a program of the one-token decode's tile sum adds
# (program, TwELL tile) pairs a held-list decode out launch may walk: each of a row's output-chunk programs
# walks the row's whole TwELL, so narrow chunks multiply that walk (out_config)
DECODE_WALK_BUDGET = 48 * 1024
COMPACT_SLOTS = 2048  # TwELL slots a list pre-pass program holds at once (16 a thread): a chunk of tiles
# Batched up to this many rows each out program compacts its own row's list, without the pre-pass launch:
# at 96-1024 tokens 2-17% faster at D 896 and 2048, 1-3% at D 4096 up to 512 tokens (1% slower at 1024);
# above, 1-3.5% slower for D 896 / I 4864 and D 4096 / I 14336, where the added dependent loads at each
# row's start cost more than the launch (H100, benchmarks/results/fused_compaction_ab_h100.json)
FUSED_COMPACT_ROWS = 1024
HEAVY_PROGRAMS_PER_SM = 4  # persistent programs of the dense block of heavy rows
HEAVY_FEW_ROWS = 16  # up to this many heavy rows the dense block streams its weights over narrow tiles
HEAVY_KSPLIT = 8  # and splits its down product's reduction this many ways
UNIT_SAMPLE = 64  # with a four-element overflow counter, one batched row in this many reports its units


def prepare_down(down_weight: torch.Tensor) -> torch.Tensor:
    """Load-time layout for the down weight: same [D, I] shape, stored transposed (its .t() is contiguous)."""
    return down_weight.t().contiguous().t()


def gated_mlp_reference(x, gate_weight, up_weight, down_weight):
    """fp32 reference of the block, returned in x's dtype."""
    xf = x.float()
    h = torch.relu(xf @ gate_weight.float().t()) * (xf @ up_weight.float().t())
    return (h @ down_weight.float().t()).to(x.dtype)


def gate_config(m: int, tile: int, element_size: int, decode: bool) -> dict:
    """Gate-matmul launch configuration per shape class (tile is the matmul's column block)."""
    block_k = 64 if element_size <= 2 else 32
    if decode:  # streams the gate matrix: deep K blocks, few rows
        bm = max(16, triton.next_power_of_2(m))
        if bm <= 16:
            # up rows of the active columns read 8 * block_k deep, 3 blocks in flight; up to 4 rows, tiles
            # with up to 8 active columns read whole rows instead, 4 at a time, where they fit (gate_launch)
            cfg = dict(BM=bm, BK=4 * block_k, GROUP_M=1, num_warps=4, num_stages=4, UP_BK=8 * block_k,
                       UP_STAGES=3)
            return dict(cfg, UP_ROWS=triton.next_power_of_2(m), ROWS_UC=4) if m <= 4 else cfg
        if bm <= 32:  # up rows of the active columns compacted too, 4 * block_k deep, 4 blocks in flight
            # (17-32 rows, H100, 29 active units: D 2048 / I 5632 2.9-3.2 us faster than the masked K loop,
            # D 4096 / I 14336 10-12 us; at 100 units 1-2 us slower alone, faster with the out kernel's held
            # TwELL at these rows; results/decode_mid_rows_h100.json)
            return dict(BM=bm, BK=4 * block_k, GROUP_M=1, num_warps=4, num_stages=3, UP_BK=4 * block_k,
                        UP_STAGES=4)
        return dict(BM=bm, BK=2 * block_k, GROUP_M=1, num_warps=4, num_stages=4)
    if tile == 128:  # 4 warps: two programs share an SM, one's packing epilogue beside the other's matmul
        if m <= 256:  # few row blocks: half-height ones, twice the programs, a deeper pipeline
            return dict(BM=64, BK=block_k, GROUP_M=8, num_warps=4, num_stages=4)
        return dict(BM=128, BK=block_k, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BM=128, BK=block_k, GROUP_M=8, num_warps=8, num_stages=3)


def out_config(m: int, d: int, decode: bool, tiles: int = 1) -> dict:
    """TwELL-to-dense launch configuration: CH units per step, BD output columns per program.
    Batched: one row per program, small CH and one or two warps where many rows are in flight to hide the
    gather latency; with few rows (<= 512) more units a step instead, fewer dependent steps a row (D 2048,
    96 tokens: 71 -> 48 us). Warps grow with CH * D (the step's up and down rows sit in registers), twice
    as fast up to 128 rows, and are at least 4 up to 512 rows (D 896, 384 tokens: 47 us at 1 warp, 24 at 4;
    benchmarks/results/mid_sweep_h100.json).
    Decode: the row is split over output chunks of BD columns so that many SMs share its few units. Up to
    HELD_ROWS rows each chunk's program holds and walks its row's whole TwELL (`tiles` tiles), so BD is the
    narrowest of 64-256 whose launch walks at most DECODE_WALK_BUDGET tiles (H100, 12-16 rows: D 2048 /
    I 5632 8.1 -> 5.4-5.9 us at BD 64 instead of 256; 8 rows at D 4096 / I 14336 8.5 -> 6.2 us at 256
    instead of 64; benchmarks/results/decode_out_chunks_h100.json); above, 256, and 16 units a step with 2
    warps instead of 32 with 4, more programs in flight (33-64 rows, measured before the list pre-pass:
    D 2048 / I 5632 33.6-36.6 -> 31.5-32.4 us for the block, D 896 / I 4864 and D 2048 / I 8192 4-8%
    faster; slower up to 32 rows; benchmarks/results/decode_out_warps_h100.json)."""
    block_d = triton.next_power_of_2(d)
    if decode:
        if m > HELD_ROWS:
            return dict(CH=16, BD=256, num_warps=2)
        bd = 64
        while bd < 256 and m * cdiv(d, bd) * tiles > DECODE_WALK_BUDGET:
            bd *= 2
        return dict(CH=32, BD=bd, num_warps=4)
    ch = min(out_units_per_step(m), max(2, 32768 // block_d))
    per_warp = 2048 if m <= 128 else 4096  # fewer rows than SMs: one program an SM, so more warps each
    return dict(CH=ch, BD=block_d, num_warps=min(8, max(4 if m <= 512 else 1, ch * block_d // per_warp)))


class _Launch:
    """One kernel at a fixed grid, scalar arguments and options; called with its tensor arguments. The
    first call goes through Triton's JIT (compiling if needed); later ones run the compiled kernel directly,
    skipping Triton's per-call argument binding and cache lookup. That is sound while the tensors keep the
    dtypes and 16-byte alignment of the first call, which the plan key (_plan_key) guarantees: Triton
    specializes on nothing else (the scalars are fixed here)."""

    def __init__(self, kernel, grid, scalars: dict, options: dict, extra=None):
        names = kernel.arg_names[len(kernel.arg_names) - len(scalars):]
        self.kernel, self.grid, self.options, self.extra = kernel, grid, options, extra
        self.scalars = tuple(scalars[n] for n in names)  # tensors first, then these, in signature order
        self.run = None

    def __call__(self, *tensors):
        if self.extra is not None:  # arguments made from the tensors at each call (TMA descriptors)
            tensors = tensors + self.extra(*tensors)
        if self.run is not None:
            self.run(*tensors, *self.scalars)
            return
        compiled = self.kernel[self.grid](*tensors, *self.scalars, **self.options)
        if compiled is not None:  # None under the interpreter
            self.run = compiled[self.grid]


def _tile_stride(tile: int, tile_stride) -> int:
    if tile_stride is None:
        return tile
    if not 0 < tile_stride <= tile:
        raise ValueError(f"tile_stride must be in 1..tile ({tile}), got {tile_stride}")
    return tile_stride


def gate_launch(x2, w, up, tile, s, vals_dtype, cfg, h_fp32=False, partials=False, tile_stride=None,
                pdl=False, tile_out=False) -> _Launch:
    """Launch of relu(x2 @ w^T) packed into TwELL, for x2 [M, D], w [I, D] (any strides). With `up`, the
    stored values are h = relu(x2 @ w^T) * (x2 @ up^T) at the same entries (up rows read only for active
    columns). With `partials`, each overflowing (row, tile) also gets the tile's share of the row's output,
    its stored values (h, or g without up) times their rows of down_t [I, D], written as an fp32 row into
    an [M, NT, D] buffer (NT tiles a row). Tiles are `tile_stride` units wide (default `tile`; less spreads
    a decode over more programs). With whole tiles, the main loop reads x and w through TMA descriptors
    where tma_ok; batched on an sm_90 GPU the Gluon kernel of gate_hopper.py runs instead (same TwELL).
    With `tile_out` (one-token gated decode: tile_out_launch) nothing is packed: every tile writes its share
    of the output to the partials buffer and its count of active units; values and indices are unused.
    Called with (x2, w, up or w, down_t or w, values, indices, counts, partials buffer or values)."""
    m, d = x2.shape
    width = w.shape[0]
    cfg = dict(cfg)
    bm, bk, up_bk = cfg.pop("BM"), cfg.pop("BK"), cfg.pop("UP_BK", 0)
    up_stages, up_rows, rows_uc = cfg.pop("UP_STAGES", 1), cfg.pop("UP_ROWS", 0), cfg.pop("ROWS_UC", 1)
    if tile_out:  # whole down rows beside the up rows
        rows_uc = min(rows_uc, WHOLE_UP_ROWS // (2 * triton.next_power_of_2(d)))
    if triton.next_power_of_2(d) * rows_uc > WHOLE_UP_ROWS or rows_uc == 0:  # would not fit in registers
        up_rows = 0
    if tile_out and up_rows == 0:
        raise ValueError(f"the tile-out decode path takes one row whose units' up and down rows fit in registers "
                         f"(M {m}, D {d})")
    ts = _tile_stride(tile, tile_stride)
    hopper = hopper_gate_launch(x2, w, tile, s, vals_dtype) if up is None and not partials and ts == tile else None
    if hopper is not None:
        return _Launch(*hopper)
    upw = up if up is not None else w
    dot = "ieee" if vals_dtype == torch.float32 and x2.dtype == torch.float32 else "tf32"
    tma = ts == tile and TensorDescriptor is not None and tma_ok(x2, w)
    if tma:
        def extra(x2, w, *_):
            return TensorDescriptor.from_tensor(x2, [bm, bk]), TensorDescriptor.from_tensor(w, [tile, bk])
    else:
        def extra(x2, w, *_):
            return x2, w  # placeholders of the descriptor arguments, unused
    return _Launch(_gate_pack_kernel, (cdiv(m, bm) * cdiv(width, ts), 1, 1), dict(
        M=m, N=width, K=d, stride_xm=x2.stride(0), stride_xk=x2.stride(1), stride_wn=w.stride(0),
        stride_wk=w.stride(1), stride_un=upw.stride(0), stride_uk=upw.stride(1), T=tile, S=s, BM=bm, BK=bk,
        EVEN_K=d % bk == 0, GROUP_M=cfg.pop("GROUP_M"), DOT_PRECISION=dot, FUSE_UP=up is not None,
        H_FP32=h_fp32, PARTIALS=partials, PART_STAGES=PART_STAGES,
        PART_BD=max(16, min(PART_BYTES // x2.element_size(), triton.next_power_of_2(d))),
        PART_DOT="ieee" if vals_dtype == torch.float32 else "tf32",
        UP_BK=min(up_bk, triton.next_power_of_2(d)), UC=16, TS=ts,
        PDL=pdl, USE_TMA=tma, UP_STAGES=up_stages, UP_ROWS=up_rows, ROWS_UC=rows_uc,
        ROWS_BK=triton.next_power_of_2(d), TILE_OUT=tile_out), cfg, extra)


def tile_out_launch(m: int, d: int, gated: bool, decode: bool) -> bool:
    """Whether a call takes the tile-out decode path: one token, gated, D up to TILE_OUT_MAX_D (and small
    enough for one unit's whole up and down rows in a gate program's registers). There the gate programs
    write the output's shares and a small kernel adds them, instead of packing TwELL for the out kernel's
    gather of down rows."""
    return (decode and gated and m == 1 and d <= TILE_OUT_MAX_D
            and 2 * triton.next_power_of_2(d) <= WHOLE_UP_ROWS)


def tile_sum_launch(m: int, d: int, nt: int, s: int, has_overflow: bool, pdl: bool = False) -> _Launch:
    """Launch of out [M, D] = the sum over tiles of the partial rows [M, NT, D] that a tile-out gate launch
    wrote. Called with (partials, counts, out, overflow or counts)."""
    nt_pad = max(2, triton.next_power_of_2(nt))
    bd = min(TILE_SUM_BD, triton.next_power_of_2(d))
    return _Launch(_twell_tile_sum_kernel, (m, cdiv(d, bd), 1), dict(
        D=d, NT=nt, S=s, NT_PAD=nt_pad, OT=min(nt_pad, 8192 // bd), BD=bd, HAS_OVF=has_overflow, PDL=pdl),
        dict(num_warps=4, launch_pdl=True) if pdl else dict(num_warps=4))


def out_launch(x2, width, tile, s, gated, h_fp32, has_overflow, cfg, packed_h=False, tile_stride=None,
               pdl=False, count_units=False) -> "_OutLaunches":
    """Launches of out [M, D] = sum over active units j of h_j * down_t[j], h_j = g_j * (x . up[j]) (or g_j
    when not gated). With packed_h (decode path), the TwELL already holds h and overflowing tiles read
    their partial rows from the buffer that gate_launch(partials=True) wrote; otherwise they are recomputed
    from w_dec and up. `tile_stride` and `pdl` as in gate_launch (the out kernel then waits for the gate
    kernel on the device). Called with (x2, values, indices, counts, partials or values, w_dec, up or
    down_t, down_t, out, overflow or counts); w_dec, up and down_t contiguous.
    Batched (one program a whole row), a heavy row posts its index for the dense block (heavy_launches), and
    with count_units every UNIT_SAMPLE-th row it walks adds its units and itself to overflow[1] and [2], and
    the posted rows' count goes to overflow[3]."""
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
    nt_pad, s_pad = max(2, triton.next_power_of_2(nt)), triton.next_power_of_2(s)
    row_slots = triton.next_power_of_2(nt * s)
    held = row_slots if packed_h and m <= HELD_ROWS and row_slots <= HELD_SLOTS else 0
    # without the held TwELL the walk reads each row's list compacted in place first: by the row's own
    # program (batched up to FUSED_COMPACT_ROWS, where a program walks a whole row) or by a pre-pass
    tc = min(nt_pad, max(2, COMPACT_SLOTS // s_pad))
    fused = split and m <= FUSED_COMPACT_ROWS
    compact = None if held or fused else _Launch(_compact_list_kernel, (m, 1, 1), dict(
        NT=nt, S=s, TC=tc, S_PAD=s_pad, PDL=pdl), dict(num_warps=4, launch_pdl=True) if pdl else dict(num_warps=4))
    heavy_rows = m if split else 0  # room for every row: none is ever left to walk its heavy list
    out = _Launch(_twell_out_kernel, (m, cdiv(d, bd), 1), dict(
        D=d, I=width, NT=nt, HEAVY=HEAVY_UNITS, stride_xm=x2.stride(0),
        stride_xk=x2.stride(1), T=tile, S=s, NT_PAD=nt_pad, CH=ch, FB_CH=fb_ch,
        OT=max(1, min(nt_pad, 4096 // bd)), BLOCK_D=block_d, BD=bd, LIST_UP=gated and not packed_h,
        FALLBACK_UP=gated, H_FP32=h_fp32,
        HAS_OVF=has_overflow, PARTIALS=packed_h, TS=ts, PDL=pdl, POST=heavy_rows > 0,
        COUNT_UNITS=UNIT_SAMPLE if count_units and split else 0,
        HELD=held, COMPACT_TC=tc if fused else 0, S_PAD=s_pad), cfg)
    heavy = heavy_launches(x2, width, gated, h_fp32, heavy_rows) if heavy_rows else None
    return _OutLaunches(compact, out, heavy, heavy_rows, torch.float32 if h_fp32 else x2.dtype,
                        count_units and split)


class _OutLaunches:
    """The list pre-pass (where the out kernel neither holds the TwELL nor compacts its own rows), the out
    kernel and, batched, the dense block of the rows it posts (heavy_launches), with the workspace
    [rows posted, row of each slot] and the block's h rows allocated at each call (they cannot be shared
    across streams)."""

    def __init__(self, compact: Optional[_Launch], out: _Launch, heavy, heavy_rows: int, h_dtype, count_units: bool):
        self.compact, self.out, self.heavy, self.heavy_rows, self.h_dtype = compact, out, heavy, heavy_rows, h_dtype
        self.count_units = count_units

    def __call__(self, x2, values, indices, counts, partials, w_dec, up_or_down, down_t, out, overflow):
        if self.compact is not None:
            self.compact(indices, values, counts)
        if self.heavy is None:
            self.out(x2, values, indices, counts, partials, w_dec, up_or_down, down_t, out, overflow, counts)
            return
        workspace = torch.zeros(1 + self.heavy_rows, dtype=torch.int32, device=x2.device)
        self.out(x2, values, indices, counts, partials, w_dec, up_or_down, down_t, out, overflow, workspace)
        if self.count_units:
            overflow[3:] += workspace[:1]
        gate_up, down, finish, splits = self.heavy
        h = torch.empty(self.heavy_rows, w_dec.shape[0], dtype=self.h_dtype, device=x2.device)
        part = torch.empty(splits, HEAVY_FEW_ROWS, x2.shape[1], dtype=torch.float32, device=x2.device)
        gate_up(x2, w_dec, up_or_down, workspace, h)
        down(h, down_t, workspace, out, part)
        finish(part, workspace, out)


def heavy_launches(x2, width, gated, h_fp32, capacity) -> tuple:
    """Launches of the dense block over the rows that the out kernel posted to the workspace [count, row
    of each slot (capacity)]: h[slot] = relu(x2[row] @ w_dec^T) (* x2[row] @ up^T), then out[row] =
    h[slot] @ down_t. Persistent programs (HEAVY_PROGRAMS_PER_SM an SM) loop over the tiles of the posted
    rows, whose count they read on the device: the block costs what its posted rows need, nothing without
    them, and no host synchronization (CUDA graphs hold it). Up to HEAVY_FEW_ROWS rows (a call's first
    tokens) the weights are streamed over narrow tiles and the down product's reduction is split, its fp32
    partial sums added by a third launch. Called with (x2, w_dec, up or down_t, workspace, h),
    (h, down_t, workspace, out, partials) and (partials, workspace, out); partials: fp32 [splits,
    HEAVY_FEW_ROWS, D], the splits returned fourth."""
    d = x2.shape[1]
    # block sizes (rows, columns, reduction): gate/up product, down product, few rows of each
    if x2.device.type == "cuda":
        h_tiles, down_tiles, h_few, down_few, ksplit = (128, 64, 64), (128, 128, 64), (32, 128), (64, 128), HEAVY_KSPLIT
        options = dict(num_warps=8, num_stages=3)
    else:  # the interpreter: small blocks, several tiles and splits at test sizes
        h_tiles, down_tiles, h_few, down_few, ksplit = (16, 32, 32), (16, 32, 32), (16, 32), (16, 32), 2
        options = dict(num_warps=4, num_stages=1)
    dot = "ieee" if h_fp32 else "tf32"
    programs = HEAVY_PROGRAMS_PER_SM * sm_count(x2.device)
    most_tiles = max(cdiv(capacity, h_tiles[0]) * cdiv(width, h_tiles[1]), cdiv(width, h_few[0]),
                     cdiv(capacity, down_tiles[0]) * cdiv(d, down_tiles[1]), cdiv(d, down_few[0]) * ksplit)
    grid = (min(programs, most_tiles), 1, 1)
    gate_up = _Launch(_heavy_h_kernel, grid, dict(
        D=d, I=width, CAP=capacity, stride_xm=x2.stride(0), stride_xk=x2.stride(1), BM=h_tiles[0], BN=h_tiles[1],
        BM_FEW=HEAVY_FEW_ROWS, BN_FEW=h_few[0], BK=h_tiles[2], BK_FEW=h_few[1], GATED=gated, H_FP32=h_fp32,
        DOT_PRECISION=dot), options)
    down = _Launch(_heavy_out_kernel, grid, dict(
        D=d, I=width, CAP=capacity, BM=down_tiles[0], BN=down_tiles[1], BM_FEW=HEAVY_FEW_ROWS, BN_FEW=down_few[0],
        KSPLIT=ksplit, BK=down_tiles[2], BK_FEW=down_few[1], H_FP32=h_fp32, DOT_PRECISION=dot), options)
    finish = _Launch(_heavy_finish_kernel, (min(8, cdiv(d, 256)), 1, 1), dict(
        D=d, CAP=capacity, BM_FEW=HEAVY_FEW_ROWS, KSPLIT=ksplit, BD=256), dict(num_warps=4))
    return gate_up, down, finish, ksplit


def decode_tile_stride(width: int, tile: int, m: int, device: torch.device) -> int:
    """Decode tile width (units a gate program streams). Above 16 rows: I / #SMs where that fits in the
    tile, one program per SM (I / 64 programs leave SMs idle: 88 of 132 at I = 5632); measured faster at
    64 rows, slower at 1 and 8 (H100). At least half the tile, so
    that a narrow layer does not pay for mostly empty T-wide blocks."""
    if device.type != "cuda" or m <= 16:
        return tile
    return min(tile, max(cdiv(width, sm_count(device)), tile // 2))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (4 under the interpreter: a few programs, each taking several items)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and newer): the out kernel is launched while the gate kernel
    runs and waits for it on the device, which hides its launch latency (decode)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and hasattr(tl.extra.cuda, "gdc_wait"))  # Triton >= 3.4


class _Plan:
    """Everything a call derives from its plan key: checked arguments, buffer shapes and both launches."""

    def __init__(self, x2, w_dec, up, tile, compression, precision, overflow):
        m, d = x2.shape
        width = w_dec.shape[0]
        self.decode = m <= decode_rows(d, width)
        self.tile_out = tile_out_launch(m, d, up is not None, self.decode)
        tile = min(tile, DECODE_TILE) if self.decode else tile
        ts = decode_tile_stride(width, tile, m, x2.device) if self.decode else tile
        pdl = self.decode and use_pdl(x2.device)
        s = slots(tile, compression)
        h_fp32 = precision == "highest"
        self.vals_dtype = torch.float32 if h_fp32 else x2.dtype
        self.twell_shape = (m, cdiv(width, ts), s)
        # decode: overflowing (row, tile) pairs' partial output rows, written only there
        self.partials_shape = (m, cdiv(width, ts), d) if self.decode else None
        self.gate = gate_launch(x2, w_dec, up if self.decode else None, tile, s, self.vals_dtype,
                                gate_config(m, tile, x2.element_size(), self.decode), h_fp32,
                                partials=self.decode, tile_stride=ts, pdl=pdl, tile_out=self.tile_out)
        if self.tile_out:
            self.out = tile_sum_launch(m, d, cdiv(width, ts), s, overflow is not None, pdl)
            return
        self.out = out_launch(x2, width, tile, s, up is not None, h_fp32, overflow is not None,
                              out_config(m, d, self.decode, cdiv(width, ts)), packed_h=self.decode,
                              tile_stride=ts, pdl=pdl, count_units=overflow is not None and overflow.numel() == 4)


PLAN_CACHE = 256  # plans kept (layers of one shape share them; a new prompt length adds one)
_PLANS = OrderedDict()  # recent plans by _plan_key, least recently used first


def _plan_key(x2, w_dec, up, down_t, tile, compression, precision, overflow):
    """Shapes, strides, dtypes, devices and pointer alignment: what the launches depend on."""
    tensors = [t for t in (x2, w_dec, down_t, up, overflow) if t is not None]
    return (tile, compression, precision, up is not None, overflow is not None,
            all(t.data_ptr() % 16 == 0 for t in tensors),
            *((t.shape, t.stride(), t.dtype, t.device) for t in tensors))


def check_args(x, w_dec, up, down, tile, compression, precision, overflow):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    devices = {str(t.device) for t in (x, w_dec, up, down, overflow) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"x, the weights and overflow must be on one device, got {sorted(devices)}")
    width, d = w_dec.shape
    if x.shape[-1] != d or down.shape != (d, width) or (up is not None and up.shape != w_dec.shape):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weights [I, D] = {tuple(w_dec.shape)}, "
                         f"down {tuple(down.shape)} (expected [D, I])")
    if width > 65536:
        raise ValueError(f"I = {width} > 65536 is not supported")
    if overflow is not None and (overflow.numel() not in (1, 4) or overflow.dtype not in (torch.int32, torch.int64)):
        raise ValueError("overflow must be a one- or four-element int32 or int64 tensor")
    slots(tile, compression)


def forward(x, w_dec, up, down, tile, compression, precision, overflow):
    """Shared body of the gated (up given) and non-gated (up None) blocks; w_dec decides activity.
    Calls look their checked arguments and launches up by _plan_key instead of rebuilding them: building
    costs about 50 us of host time and a first launch through Triton's JIT about 150 more (H100 host), more
    than the GPU time of a whole block below about 1000 tokens."""
    if not use_triton(x):
        check_args(x, w_dec, up, down, tile, compression, precision, overflow)
        return _forward_reference(x, w_dec, up, down, tile, compression, overflow)
    with on_device(x):
        return _forward_triton(x, w_dec, up, down, tile, compression, precision, overflow)


def _forward_triton(x, w_dec, up, down, tile, compression, precision, overflow):
    if x.shape[-1] != w_dec.shape[1]:  # before the reshape, so that it fails as a ValueError
        check_args(x, w_dec, up, down, tile, compression, precision, overflow)
    x2 = x.reshape(-1, x.shape[-1])
    down_t = down.t().contiguous()  # no copy when the weight came from prepare_down
    up = up.contiguous() if up is not None else None
    w_dec = w_dec.contiguous()  # the overflow fallback reads contiguous rows; one copy serves both kernels
    key = _plan_key(x2, w_dec, up, down_t, tile, compression, precision, overflow)
    plan = _PLANS.get(key)
    if plan is None:
        check_args(x, w_dec, up, down, tile, compression, precision, overflow)
        if x2.shape[0] == 0:
            return x.new_empty(x.shape)
        plan = _PLANS[key] = _Plan(x2, w_dec, up, tile, compression, precision, overflow)
        if len(_PLANS) > PLAN_CACHE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    device = x.device
    if plan.tile_out:
        counts = torch.empty(plan.twell_shape[:2], dtype=torch.int32, device=device)
        partials = torch.empty(plan.partials_shape, dtype=torch.float32, device=device)
        out = x.new_empty(x2.shape)
        plan.gate(x2, w_dec, up, down_t, counts, counts, counts, partials)  # nothing packed: no values, indices
        plan.out(partials, counts, out, overflow if overflow is not None else counts)
        return out.view(x.shape)
    tw = (torch.empty(plan.twell_shape, dtype=plan.vals_dtype, device=device),
          torch.empty(plan.twell_shape, dtype=torch.int32, device=device),
          torch.empty(plan.twell_shape[:2], dtype=torch.int32, device=device))
    # decode: partial rows of overflowing (row, tile) pairs, written only there (so never initialized)
    partials = tw[0] if plan.partials_shape is None else torch.empty(
        plan.partials_shape, dtype=torch.float32, device=device)
    out = x.new_empty(x2.shape)
    plan.gate(x2, w_dec, up if up is not None else w_dec, down_t, *tw, partials)
    plan.out(x2, *tw, partials, w_dec, up if up is not None else down_t, down_t, out,
             overflow if overflow is not None else tw[2])
    return out.view(x.shape)


def _forward_reference(x, w_dec, up, down, tile, compression, overflow):
    """PyTorch path for CPU tensors without the interpreter; counts overflow at the caller's tile."""
    width, d = w_dec.shape
    x2 = x.reshape(-1, d)
    xf = x2.float()
    g = torch.relu(xf @ w_dec.float().t())
    if overflow is not None:
        nt, s = cdiv(width, tile), slots(tile, compression)
        per_tile = torch.nn.functional.pad(g > 0, (0, nt * tile - width)).view(x2.shape[0], nt, tile).sum(-1)
        over = per_tile > s
        overflow[0] += over.sum().to(overflow.dtype)
        if overflow.numel() == 4 and x2.shape[0] > decode_rows(d, width):  # the batched path's activity counts
            units = per_tile.masked_fill(over, 0).sum(-1)
            heavy = units + over.sum(-1) * tile > HEAVY_UNITS
            sampled = (torch.arange(x2.shape[0]) % UNIT_SAMPLE == 0) & ~heavy
            overflow[1:] += torch.stack([units[sampled].sum(), sampled.sum(), heavy.sum()]).to(overflow.dtype)
    h = g * (xf @ up.float().t()) if up is not None else g
    return (h @ down.float().t()).to(x.dtype).view(x.shape)


def register_ops(name, forward_fn, args_schema):
    """Custom ops twell::<name> (pure) and twell::<name>_overflow (adds into `overflow`), and the entry
    point `call(*args, overflow)` that runs forward_fn directly in eager mode: the custom-op dispatch costs
    tens of microseconds a call, as much as the decode kernels. The ops serve whatever traces the call
    (torch.compile, export, fake tensors and other dispatch modes, tensor subclasses). An exported
    checkpoint may carry a second copy of these files: then the ops registered first are reused."""
    def impl(*args):
        return forward_fn(*args)

    def fake(x, *args):
        return x.new_empty(x.shape)

    ops = []
    for op_name, with_overflow in ((name, False), (f"{name}_overflow", True)):
        try:
            ops.append(getattr(torch.ops.twell, op_name).default)
            continue
        except (AttributeError, RuntimeError):
            pass
        schema = f"({args_schema}" + (", Tensor(a!) overflow) -> Tensor" if with_overflow else ") -> Tensor")
        lib_op = torch.library.custom_op(f"twell::{op_name}", impl, schema=schema,
                                         mutates_args=("overflow",) if with_overflow else ())
        lib_op.register_fake(fake)
        ops.append(lib_op)
    pure_op, overflow_op = ops

    def call(x, *args, overflow=None):
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or type(x) is not torch.Tensor:
            return pure_op(x, *args) if overflow is None else overflow_op(x, *args, overflow)
        return forward_fn(x, *args, overflow)

    return call


def _gated_mlp_forward(x, gate_weight, up_weight, down_weight, tile, compression, precision, overflow=None):
    return forward(x, gate_weight, up_weight, down_weight, tile, compression, precision, overflow)


_gated_mlp_call = register_ops(
    "gated_mlp", _gated_mlp_forward, "Tensor x, Tensor gate_weight, Tensor up_weight, Tensor down_weight, "
    "int tile, int compression, str precision")


def gated_mlp(x, gate_weight, up_weight, down_weight, *, tile: int = 128, compression: int = 8,
              precision: str = "default", overflow: Optional[torch.Tensor] = None) -> torch.Tensor:
    """down(relu(gate(x)) * up(x)) through TwELL. HF layouts: gate/up [I, D], down [D, I]; x [..., D].

    `overflow`, if given (int32/int64), gets the number of overflowing (row, tile) pairs added to its first
    element; a four-element one also gets, where the call takes the batched path, the active units of every
    UNIT_SAMPLE-th row that is not heavy added to the second, those rows' count to the third and the heavy
    rows' count to the fourth.
    """
    return _gated_mlp_call(x, gate_weight, up_weight, down_weight, tile, compression, precision, overflow=overflow)


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
        dot products on CUDA cores. (The K loop pays a memory latency a step; that chain, after the gate
        stream, bounded a one-token decode: 4.6 us of 19.)"""
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
    def _gate_pack_kernel(x_ptr, w_ptr, up_ptr, down_ptr, vals_ptr, idx_ptr, cnt_ptr, part_ptr, x_desc, w_desc,
                          M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_un, stride_uk,
                          T: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                          EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          FUSE_UP: tl.constexpr, H_FP32: tl.constexpr, PARTIALS: tl.constexpr,
                          PART_BD: tl.constexpr, PART_DOT: tl.constexpr, PART_STAGES: tl.constexpr,
                          UP_BK: tl.constexpr, UC: tl.constexpr, TS: tl.constexpr, PDL: tl.constexpr,
                          USE_TMA: tl.constexpr, UP_STAGES: tl.constexpr, UP_ROWS: tl.constexpr,
                          ROWS_UC: tl.constexpr, ROWS_BK: tl.constexpr, TILE_OUT: tl.constexpr):
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
        a_ptrs = x_rows + rk[None, :] * stride_xk
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
            a_ptrs += BK * stride_xk
            b_ptrs += BK * stride_wk
        if TILE_OUT:
            _tile_out(acc, rows, cols, local, x_rows, pid_n, n_n, M, N, K, x_ptr, up_ptr, down_ptr, cnt_ptr,
                      part_ptr, stride_xk, stride_un, stride_uk, TS, UC, UP_BK, UP_STAGES, DOT_PRECISION, H_FP32,
                      ROWS_UC, ROWS_BK, PART_BD, PART_DOT, PART_STAGES)
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
                    u = _up_whole_rows(u, col_on, n_on, local, pid_m * BM, pid_n * TS, x_ptr, up_ptr, M, K,
                                       stride_xm, stride_xk, stride_un, stride_uk, UP_ROWS, ROWS_UC, ROWS_BK)
                elif UP_BK > 0:
                    u = _up_k_loop(u, col_on, n_on, local, pid_n * TS, x_rows, up_ptr, K, stride_xk, stride_un,
                                   stride_uk, UC, UP_BK, UP_STAGES, DOT_PRECISION)
                elif n_on > 0:
                    a_ptrs = x_rows + rk[None, :] * stride_xk
                    u_ptrs = up_ptr + (cols % N)[None, :].to(tl.int64) * stride_un + rk[:, None] * stride_uk
                    for k in range(0, tl.cdiv(K, BK)):
                        kin = rk < K - k * BK
                        a = tl.load(a_ptrs, mask=kin[None, :], other=0.0)
                        b = tl.load(u_ptrs, mask=kin[:, None] & col_on[None, :], other=0.0)
                        u = tl.dot(a, b, u, input_precision=DOT_PRECISION)
                        a_ptrs += BK * stride_xk
                        u_ptrs += BK * stride_uk
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
                    _partial_rows(h, over, cols, (rows.to(tl.int64) * n_n + pid_n) * K, K, down_ptr, part_ptr,
                                  PART_BD, PART_DOT, PART_STAGES)

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
                  PART_STAGES: tl.constexpr):
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
            u = _up_k_loop(tl.zeros(acc.shape, dtype=tl.float32), col_on, n_on, local, pid_n * TS, x_rows,
                           up_ptr, K, stride_xk, stride_un, stride_uk, UC, UP_BK, UP_STAGES, DOT_PRECISION)
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

    @triton.jit
    def _accumulate_units(acc, x, j, g, active, d, dmask, do, omask, up_ptr, down_ptr, D,
                          GATED: tl.constexpr, H_FP32: tl.constexpr):
        """acc += sum over the CH units j (where active) of h_j * down_t[j, do], h_j = g_j * (x . up[j, :])."""
        rows = j[:, None].to(tl.int64) * D
        dw = tl.load(down_ptr + rows + do[None, :], mask=active[:, None] & omask[None, :], other=0.0,
                     eviction_policy="evict_last")
        if GATED:  # the down rows above are already in flight while this reduction waits
            uw = tl.load(up_ptr + rows + d[None, :], mask=active[:, None] & dmask[None, :], other=0.0,
                         eviction_policy="evict_last")
            h = g * tl.sum(uw.to(tl.float32) * x[None, :], axis=1)
        else:
            h = g
        if not H_FP32:
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
                   d, dmask, do, omask, up_ptr, down_ptr, D, GATED: tl.constexpr, H_FP32: tl.constexpr):
        """acc += the units of list entries lo..hi - 1, CH a step; the next step's units are fetched before
        this step's weights are consumed."""
        e = tl.arange(0, CH)
        j, g, active = _list_entries(e + lo, incl, fits, hi, row, NT, S, idx_ptr, vals_ptr, row_j, row_g, HELD)
        for e0 in range(lo, hi, CH):
            j_next, g_next, active_next = _list_entries(e + e0 + CH, incl, fits, hi, row, NT, S, idx_ptr,
                                                        vals_ptr, row_j, row_g, HELD)
            acc = _accumulate_units(acc, x, j, g, active, d, dmask, do, omask, up_ptr, down_ptr, D, GATED,
                                    H_FP32)
            j, g, active = j_next, g_next, active_next
        return acc

    @triton.jit
    def _recompute_tile(acc, x, tile, d, dmask, do, omask, vals_ptr, wdec_ptr, up_ptr, down_ptr, D, I,
                        T: tl.constexpr, TS: tl.constexpr, FB_CH: tl.constexpr, GATED: tl.constexpr,
                        H_FP32: tl.constexpr):
        """acc += an overflowing tile's units, recomputed densely from the gate (and up) weights."""
        for u0 in range(0, T, FB_CH):
            in_tile = u0 + tl.arange(0, FB_CH)
            unit = tile * TS + in_tile
            inside = (in_tile < TS) & (unit < I)
            gw = tl.load(wdec_ptr + unit[:, None].to(tl.int64) * D + d[None, :],
                         mask=inside[:, None] & dmask[None, :], other=0.0)
            gate = tl.sum(gw.to(tl.float32) * x[None, :], axis=1)
            gate = gate.to(vals_ptr.dtype.element_ty).to(tl.float32)  # as the packed value
            acc = _accumulate_units(acc, x, unit, gate, inside & (gate > 0), d, dmask, do, omask, up_ptr,
                                    down_ptr, D, GATED, H_FP32)
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
        list entries at consecutive offsets, where finding each entry's tile and slot from the counts took a
        [units, tiles] comparison and two reductions at every step (a step of the batched walk at D 2048 /
        128 rows: 1326 PTX instructions before, 750 after)."""
        if PDL:  # launched before the gate kernel finished: wait for it, and let the out kernel launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        _compact_row(idx_ptr, vals_ptr, cnt_ptr, tl.program_id(0).to(tl.int64), NT, S, NT, TC, S_PAD)

    @triton.jit
    def _compact_row(idx_ptr, vals_ptr, cnt_ptr, row, NT, S: tl.constexpr, NT_BOUND: tl.constexpr,
                     TC: tl.constexpr, S_PAD: tl.constexpr):
        """A row's fitting entries moved to the start of its TwELL, TC tiles at a time (NT_BOUND >= NT)."""
        if NT_BOUND <= TC:  # one chunk, without the loop and the running total (1-2% of the block, H100)
            _compact_chunk(idx_ptr, vals_ptr, cnt_ptr, row, 0, 0, NT, S, TC, S_PAD)
        else:
            start = tl.full((), 0, tl.int32)  # entries of the row's earlier chunks
            for t0 in range(0, NT, TC):
                start += _compact_chunk(idx_ptr, vals_ptr, cnt_ptr, row, t0, start, NT, S, TC, S_PAD)

    @triton.jit
    def _twell_out_kernel(x_ptr, vals_ptr, idx_ptr, cnt_ptr, part_ptr, wdec_ptr, up_ptr, down_ptr, out_ptr,
                          ovf_ptr, ws_ptr, D, I, NT, HEAVY, stride_xm, stride_xk,
                          T: tl.constexpr, S: tl.constexpr, NT_PAD: tl.constexpr, CH: tl.constexpr,
                          FB_CH: tl.constexpr, OT: tl.constexpr, BLOCK_D: tl.constexpr, BD: tl.constexpr,
                          LIST_UP: tl.constexpr,
                          FALLBACK_UP: tl.constexpr, H_FP32: tl.constexpr, HAS_OVF: tl.constexpr,
                          PARTIALS: tl.constexpr, TS: tl.constexpr, PDL: tl.constexpr, POST: tl.constexpr,
                          HELD: tl.constexpr, COMPACT_TC: tl.constexpr, S_PAD: tl.constexpr,
                          COUNT_UNITS: tl.constexpr):
        # program (row, output chunk): u needs the whole row of x and up, down only BD output columns
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
                own = False
        if COUNT_UNITS > 0:  # a sample of the rows' activity, one row in COUNT_UNITS (few atomics on one address)
            if own & (row % COUNT_UNITS == 0):
                tl.atomic_add(ovf_ptr + 1, total.to(ovf_ptr.dtype.element_ty))
                tl.atomic_add(ovf_ptr + 2, tl.full((), 1, ovf_ptr.dtype.element_ty))
        acc = tl.zeros((BD,), dtype=tl.float32)
        if own:
            acc = _walk_list(acc, x, 0, total, incl, fits, row, NT, S, CH, idx_ptr, vals_ptr, row_j, row_g,
                             HELD > 0, d, dmask, do, omask, up_ptr, down_ptr, D, LIST_UP, H_FP32)
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
            elif own:  # recompute the tiles densely from the gate (and up) weights
                for tile in range(0, NT):
                    if tl.load(cnt_ptr + row * NT + tile) > S:
                        acc = _recompute_tile(acc, x, tile, d, dmask, do, omask, vals_ptr, wdec_ptr, up_ptr,
                                              down_ptr, D, I, T, TS, FB_CH, FALLBACK_UP, H_FP32)
        if own:  # else the dense block writes the row
            tl.store(out_ptr + row * D + do, acc.to(out_ptr.dtype.element_ty), mask=omask,
                     eviction_policy="evict_first")

    @triton.jit
    def _posted_rows(ws_ptr, block, n, BM: tl.constexpr):
        """A block of BM slots of the posted rows: (slots, their rows, mask of the posted ones)."""
        slot = block * BM + tl.arange(0, BM)
        live = slot < n
        return slot, tl.load(ws_ptr + 1 + slot, mask=live, other=0).to(tl.int64), live

    @triton.jit
    def _heavy_h_tiles(x_ptr, wdec_ptr, up_ptr, ws_ptr, h_ptr, n, D, I, stride_xm, stride_xk, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, H_FP32: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
        """h[slot, cols] of the posted rows, [BM, BN] tiles strided over the programs."""
        n_cols = tl.cdiv(I, BN)
        for t in range(tl.program_id(0), tl.cdiv(n, BM) * n_cols, tl.num_programs(0)):
            slot, rows, live = _posted_rows(ws_ptr, t // n_cols, n, BM)
            cols = (t % n_cols) * BN + tl.arange(0, BN)
            cmask = cols < I
            g = tl.zeros((BM, BN), dtype=tl.float32)
            u = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, D, BK):
                k = k0 + tl.arange(0, BK)
                kmask = k < D
                xa = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                             mask=live[:, None] & kmask[None, :], other=0.0)
                w_off = cols[None, :].to(tl.int64) * D + k[:, None]
                w_mask = cmask[None, :] & kmask[:, None]
                g = tl.dot(xa, tl.load(wdec_ptr + w_off, mask=w_mask, other=0.0), g, input_precision=DOT_PRECISION)
                if GATED:
                    u = tl.dot(xa, tl.load(up_ptr + w_off, mask=w_mask, other=0.0), u,
                               input_precision=DOT_PRECISION)
            if not H_FP32:  # g and u rounded to the weights' precision before their product, as dense
                g = g.to(h_ptr.dtype.element_ty).to(tl.float32)
                u = u.to(h_ptr.dtype.element_ty).to(tl.float32)
            h = tl.maximum(g, 0.0) * u if GATED else tl.maximum(g, 0.0)
            tl.store(h_ptr + slot[:, None].to(tl.int64) * I + cols[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=live[:, None] & cmask[None, :])

    @triton.jit
    def _heavy_h_kernel(x_ptr, wdec_ptr, up_ptr, ws_ptr, h_ptr, D, I, CAP, stride_xm, stride_xk,
                        BM: tl.constexpr, BN: tl.constexpr, BM_FEW: tl.constexpr, BN_FEW: tl.constexpr,
                        BK: tl.constexpr, BK_FEW: tl.constexpr, GATED: tl.constexpr, H_FP32: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
        # up to BM_FEW posted rows the weights are streamed once, in narrow column tiles over many programs;
        # more rows take square tiles
        n = tl.minimum(tl.load(ws_ptr), CAP)
        if n <= BM_FEW:
            _heavy_h_tiles(x_ptr, wdec_ptr, up_ptr, ws_ptr, h_ptr, n, D, I, stride_xm, stride_xk, BM_FEW, BN_FEW,
                           BK_FEW, GATED, H_FP32, DOT_PRECISION)
        else:
            _heavy_h_tiles(x_ptr, wdec_ptr, up_ptr, ws_ptr, h_ptr, n, D, I, stride_xm, stride_xk, BM, BN, BK,
                           GATED, H_FP32, DOT_PRECISION)

    @triton.jit
    def _heavy_out_dot(acc, h_ptr, down_ptr, slot, live, cols, cmask, k_lo, k_hi, D, I, BK: tl.constexpr,
                       H_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """acc += h[slot, k_lo:k_hi] @ down_t[k_lo:k_hi, cols]."""
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < k_hi
            ha = tl.load(h_ptr + slot[:, None].to(tl.int64) * I + k[None, :], mask=live[:, None] & kmask[None, :],
                         other=0.0)
            dw = tl.load(down_ptr + k[:, None].to(tl.int64) * D + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                         other=0.0)
            if H_FP32:  # h stays fp32: the weights widened (exactly) instead
                acc = tl.dot(ha, dw.to(tl.float32), acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(ha, dw, acc, input_precision=DOT_PRECISION)
        return acc

    @triton.jit
    def _heavy_out_kernel(h_ptr, down_ptr, ws_ptr, out_ptr, part_ptr, D, I, CAP, BM: tl.constexpr,
                          BN: tl.constexpr, BM_FEW: tl.constexpr, BN_FEW: tl.constexpr, KSPLIT: tl.constexpr,
                          BK: tl.constexpr, BK_FEW: tl.constexpr, H_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # out[row, cols] = h[slot] @ down_t[:, cols] for the posted rows. Up to BM_FEW rows the reduction over
        # I is split KSPLIT ways (a long serial loop over few programs otherwise) into fp32 partial sums
        # (part, [KSPLIT, BM_FEW, D]), which _heavy_finish_kernel adds in order (deterministic); more rows
        # take square tiles
        n = tl.minimum(tl.load(ws_ptr), CAP)
        if n == 0:  # the split's tiles do not depend on n: without posted rows, nothing to stream
            return
        if n <= BM_FEW:
            n_cols = tl.cdiv(D, BN_FEW)
            k_chunk = tl.cdiv(tl.cdiv(I, KSPLIT), BK_FEW) * BK_FEW
            slot = tl.arange(0, BM_FEW)
            live = slot < n
            for t in range(tl.program_id(0), n_cols * KSPLIT, tl.num_programs(0)):
                cols = (t // KSPLIT) * BN_FEW + tl.arange(0, BN_FEW)
                cmask = cols < D
                k_lo = (t % KSPLIT) * k_chunk
                acc = _heavy_out_dot(tl.zeros((BM_FEW, BN_FEW), dtype=tl.float32), h_ptr, down_ptr, slot, live,
                                     cols, cmask, k_lo, tl.minimum(k_lo + k_chunk, I), D, I, BK_FEW, H_FP32,
                                     DOT_PRECISION)
                part = part_ptr + ((t % KSPLIT) * BM_FEW + slot[:, None]) * D + cols[None, :]
                tl.store(part, acc, mask=live[:, None] & cmask[None, :])
        else:
            n_cols = tl.cdiv(D, BN)
            for t in range(tl.program_id(0), tl.cdiv(n, BM) * n_cols, tl.num_programs(0)):
                slot, rows, live = _posted_rows(ws_ptr, t // n_cols, n, BM)
                cols = (t % n_cols) * BN + tl.arange(0, BN)
                cmask = cols < D
                acc = _heavy_out_dot(tl.zeros((BM, BN), dtype=tl.float32), h_ptr, down_ptr, slot, live, cols,
                                     cmask, 0, I, D, I, BK, H_FP32, DOT_PRECISION)
                tl.store(out_ptr + rows[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=live[:, None] & cmask[None, :])

    @triton.jit
    def _heavy_finish_kernel(part_ptr, ws_ptr, out_ptr, D, CAP, BM_FEW: tl.constexpr, KSPLIT: tl.constexpr,
                             BD: tl.constexpr):
        # the few-row split's partial sums, added in split order, to the posted rows of out (more rows were
        # written directly)
        n = tl.minimum(tl.load(ws_ptr), CAP)
        if 0 < n and n <= BM_FEW:
            slot, rows, live = _posted_rows(ws_ptr, 0, n, BM_FEW)
            for c0 in range(tl.program_id(0) * BD, D, tl.num_programs(0) * BD):
                cols = c0 + tl.arange(0, BD)
                mask = live[:, None] & (cols < D)[None, :]
                acc = tl.zeros((BM_FEW, BD), dtype=tl.float32)
                for split in range(KSPLIT):
                    acc += tl.load(part_ptr + (split * BM_FEW + slot[:, None]) * D + cols[None, :], mask=mask)
                tl.store(out_ptr + rows[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
