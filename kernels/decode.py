"""Decode path (at most format.decode_rows tokens): the rules that configure it and the one launch of its own.
The gate kernel (batched.py) runs with tiles of at most DECODE_TILE units and computes u = x . up for its
tile's active units only (epilogues.py: `up_whole_rows`, `up_columns`), so that it packs h = g * u and the
out kernel only gathers down rows; an overflowing (row, tile) writes the tile's share of the row's output as
an fp32 partial row (`partial_rows`) for the out kernel to add. One gated token (`tile_out_launch`) packs
nothing: each gate program writes its tile's share of the output (`tile_out`) and `_twell_tile_sum_kernel`
adds the shares. Reference: reference.tile_shares."""

from .format import cdiv
from .launch import Launch, pdl_start

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


def decode_gate_config(m: int, block_k: int, crowded: bool = False) -> dict:
    """Decode gate-matmul launch configuration (batched.gate_config): streams the gate matrix, deep K blocks,
    few rows. `crowded`: the grid has more programs than the GPU has SMs; up to 16 rows its K blocks are then
    half as deep, so that two programs' pipelines share an SM's shared memory and the grid runs in one round
    instead of leaving a second round's few programs alone on the GPU."""
    bm = max(16, triton.next_power_of_2(m))
    if bm <= 16:
        # up rows of the active columns read 8 * block_k deep, 3 blocks in flight; up to 4 rows, tiles
        # with up to 8 active columns read whole rows instead, 4 at a time, where they fit (gate_launch)
        cfg = dict(BM=bm, BK=(2 if crowded else 4) * block_k, GROUP_M=1, num_warps=4, num_stages=4,
                   UP_BK=8 * block_k, UP_STAGES=3, UP_COMPACT_COLS=UP_COMPACT_COLS)
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


def tile_sum_launch(m: int, d: int, nt: int, s: int, has_overflow: bool, pdl: bool = False,
                    has_residual: bool = False) -> Launch:
    """Launch of out [M, D] = the sum over tiles of the partial rows [M, NT, D] that a tile-out gate launch
    wrote, rounded to out's dtype; with has_residual, residual + that sum, as torch adds them. Called with
    (partials, counts, out, overflow or counts, residual or out)."""
    nt_pad = max(2, triton.next_power_of_2(nt))
    bd = min(TILE_SUM_BD, triton.next_power_of_2(d))
    return Launch(_twell_tile_sum_kernel, (m, cdiv(d, bd), 1), dict(
        D=d, NT=nt, S=s, NT_PAD=nt_pad, OT=min(nt_pad, 8192 // bd), BD=bd, HAS_OVF=has_overflow,
        HAS_RESIDUAL=has_residual, PDL=pdl), dict(num_warps=4, launch_pdl=True) if pdl else dict(num_warps=4))


if triton is not None:

    @triton.jit
    def _twell_tile_sum_kernel(part_ptr, cnt_ptr, out_ptr, ovf_ptr, res_ptr, D, NT, S: tl.constexpr,
                               NT_PAD: tl.constexpr, OT: tl.constexpr, BD: tl.constexpr, HAS_OVF: tl.constexpr,
                               HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
        """out[row, chunk] = the sum over tiles, in tile order, of the partial rows that epilogues.tile_out wrote
        (with HAS_RESIDUAL, res[row, chunk] + that sum in out's dtype); one program per (row, BD output columns).
        Counts the row's tiles beyond the slots into ovf_ptr, as the other decode paths do (here no tile has
        slots: none needs a fallback)."""
        row = tl.program_id(0).to(tl.int64)
        pid_d = tl.program_id(1)
        do = pid_d * BD + tl.arange(0, BD)
        # launched before the gate kernel finished: wait for its results, then let the next kernel launch
        pdl_start(PDL)
        acc = tl.zeros((BD,), dtype=tl.float32)
        for t0 in range(0, NT, OT):
            t = t0 + tl.arange(0, OT)
            p = tl.load(part_ptr + (row * NT + t)[:, None] * D + do[None, :],
                        mask=(t < NT)[:, None] & (do < D)[None, :], other=0.0)
            acc += tl.sum(p, axis=0)
        out = acc.to(out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:  # the decoder layer's residual add, rounded as torch rounds it
            residual = tl.load(res_ptr + row * D + do, mask=do < D, other=0.0)
            out = (residual.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * D + do, out, mask=do < D)
        if HAS_OVF:
            if pid_d == 0:
                t = tl.arange(0, NT_PAD)
                cnt = tl.load(cnt_ptr + row * NT + t, mask=t < NT, other=0)
                n_over = tl.sum((cnt > S).to(tl.int32), axis=0)
                if n_over > 0:
                    tl.atomic_add(ovf_ptr, n_over.to(ovf_ptr.dtype.element_ty))
