"""The launch paths of gated_mlp, each with its contract in one place (its `LaunchPath` entry in PATHS): the
token counts it takes, its launches, the plain PyTorch reference of what its kernels write beside the block's
output (which every path matches to reference.gated_mlp_reference) and its term of the cost model. PATHS are
in order of token count: a call takes the first whose `max_tokens(D, I)` holds its tokens. A path's launches
are built once per launch-cache key (gated_mlp.py) and called with each call's tensors; they allocate the
call's buffers (they cannot be shared across streams). A new path is a file of its kernels and an entry here.
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .batched import gate_config, gate_launch, out_config, out_launch, walk_row_bytes
from .cost_model import batched_time, decode_time
from .decode import DECODE_TILE, decode_tile_stride, tile_out_launch, tile_sum_launch
from .format import cdiv, decode_rows, decode_slots, slots
from .fp8_gate import quantize_rows
from .launch import sm_count, use_pdl
from .reference import forward_reference, tile_shares

# A path that can (LaunchPath.fp8_up_down) walks the e4m3 up and down rows a call gives where each thread of its
# out kernel loads at least this many bytes of a row (batched.walk_row_bytes): every call measured below it
# walked them slower than the bf16 rows, every one at or above it as fast or faster
UP_DOWN_FP8_MIN_ROW_BYTES = 16


def _geometry(x2, width, tile, compression, decode: bool):
    """(tile, tile stride, slots, programmatic dependent launch) of a call: decode takes tiles of at most
    DECODE_TILE units, spread over the GPU (decode_tile_stride), at most DECODE_SLOTS slots a (row, tile), and
    launches its out kernel while the gate kernel runs on GPUs that allow it."""
    if not decode:
        return tile, tile, slots(tile, compression), False
    tile = min(tile, DECODE_TILE)
    sms = sm_count(x2.device) if x2.is_cuda else None
    return tile, decode_tile_stride(width, tile, x2.shape[0], sms), decode_slots(tile, compression), use_pdl(x2.device)


def _crowded(x2, width, ts) -> bool:
    """Whether a decode gate launch has more tiles (programs, up to 16 rows) than the device has SMs (sm_count: a
    few under the interpreter, so that its tests take both of decode_gate_config's configurations)."""
    return cdiv(width, ts) > sm_count(x2.device)


class Launches:
    """A path's launches for one launch-cache key: built from (x2, gate, up, tile, compression, precision,
    overflow, gate_fp8, up_down_fp8, residual), called with (x, x2, gate, up, down_t, overflow, gate_fp8,
    up_down_fp8, residual), returning the block's output, plus the residual where `adds_residual` (else the
    caller adds it). With the fp8 gate (paths whose LaunchPath.fp8_gate is set), the gate launch reads its e4m3
    copy and x quantized at each call; with e4m3 up and down rows (LaunchPath.fp8_up_down), the out launch walks
    them."""

    unsupported = None  # why this GPU cannot run them (gated_mlp then runs the calls dense), once seen
    adds_residual = False

    @staticmethod
    def gate_inputs(x2, gate, gate_fp8) -> tuple:
        """(the gate launch's weight, the tensors its call appends): the e4m3 copy, x quantized and the two
        scales with the fp8 gate; else the gate, nothing."""
        if gate_fp8 is None:
            return gate, ()
        weight, scale = gate_fp8
        return weight, (*quantize_rows(x2), scale)


class PackedLaunches(Launches):
    """Batched (and decode, as DecodeLaunches): the gate kernel packs TwELL, the out kernel walks it (batched.py;
    a batched row beyond HEAVY_UNITS units goes to heavy.py's dense block). Decode packs h = g * u and writes
    the fp32 partial rows of overflowing (row, tile) pairs for the out kernel to add."""

    decode = False

    def __init__(self, x2, gate, up, tile, compression, precision, overflow, gate_fp8=None, up_down_fp8=None,
                 residual=None):
        m, d = x2.shape
        width = gate.shape[0]
        tile, ts, s, pdl = _geometry(x2, width, tile, compression, self.decode)
        h_fp32 = precision == "highest"
        self.vals_dtype = torch.float32 if h_fp32 else x2.dtype
        self.twell_shape = (m, cdiv(width, ts), s)
        self.partials_shape = (m, cdiv(width, ts), d) if self.decode else None  # written only where overflowing
        self.gate = gate_launch(x2, gate if gate_fp8 is None else gate_fp8[0], up if self.decode else None, tile,
                                s, self.vals_dtype, gate_config(m, tile, x2.element_size(), self.decode,
                                                                self.decode and _crowded(x2, width, ts)), h_fp32,
                                partials=self.decode, tile_stride=ts, pdl=pdl, fp8=gate_fp8 is not None)
        self.out = out_launch(x2, width, tile, s, h_fp32, overflow is not None,
                              out_config(m, d, self.decode, cdiv(width, ts)), packed_h=self.decode,
                              tile_stride=ts, pdl=pdl, count_units=overflow is not None and overflow.numel() == 4,
                              fp8_up_down=up_down_fp8 is not None)

    def __call__(self, x, x2, gate, up, down_t, overflow, gate_fp8=None, up_down_fp8=None, residual=None):
        device = x.device
        gate_weight, quantized = self.gate_inputs(x2, gate, gate_fp8)
        tw = (torch.empty(self.twell_shape, dtype=self.vals_dtype, device=device),
              torch.empty(self.twell_shape, dtype=torch.int32, device=device),
              torch.empty(self.twell_shape[:2], dtype=torch.int32, device=device))
        partials = tw[0] if self.partials_shape is None else torch.empty(
            self.partials_shape, dtype=torch.float32, device=device)
        out = x.new_empty(x2.shape)
        self.gate(x2, gate_weight, up, down_t, *tw, partials, *quantized)
        self.out(x2, *tw, partials, gate, up, down_t, out, overflow if overflow is not None else tw[2], up_down_fp8)
        return out.view(x.shape)


class DecodeLaunches(PackedLaunches):
    """Up to decode_rows tokens: PackedLaunches with decode.py's tiles, slots and configurations."""

    decode = True


class TileOutLaunches(Launches):
    """One gated token (decode.tile_out_launch): no TwELL; each gate program writes its tile's share of the
    output and its count of active units (epilogues.tile_out), and decode.py's tile sum adds the shares (and the
    residual, where the call gives one)."""

    adds_residual = True

    def __init__(self, x2, gate, up, tile, compression, precision, overflow, gate_fp8=None, up_down_fp8=None,
                 residual=None):
        m, d = x2.shape
        width = gate.shape[0]
        tile, ts, s, pdl = _geometry(x2, width, tile, compression, decode=True)
        h_fp32 = precision == "highest"
        self.partials_shape = (m, cdiv(width, ts), d)
        self.gate = gate_launch(x2, gate, up, tile, s, torch.float32 if h_fp32 else x2.dtype,
                                gate_config(m, tile, x2.element_size(), True, _crowded(x2, width, ts)), h_fp32,
                                partials=True, tile_stride=ts, pdl=pdl, tile_out=True)
        self.out = tile_sum_launch(m, d, cdiv(width, ts), s, overflow is not None, pdl, residual is not None)

    def __call__(self, x, x2, gate, up, down_t, overflow, gate_fp8=None, up_down_fp8=None, residual=None):
        counts = torch.empty(self.partials_shape[:2], dtype=torch.int32, device=x.device)
        partials = torch.empty(self.partials_shape, dtype=torch.float32, device=x.device)
        out = x.new_empty(x2.shape)
        # nothing packed: counts stand in for the values and indices
        self.gate(x2, gate, up, down_t, counts, counts, counts, partials)
        self.out(partials, counts, out, overflow if overflow is not None else counts,
                 out if residual is None else residual)
        return out.view(x.shape)


@dataclass(frozen=True)
class LaunchPath:
    """A launch path's contract."""

    name: str
    max_tokens: Callable[[int, int], Optional[int]]  # (D, I) -> the most tokens it takes (None: no bound)
    launches: type  # its Launches
    reference: Callable  # what its kernels write beside the output, in plain PyTorch (reference.py)
    cost: Callable  # its term of cost_model.twell_time, called as (mean_active, D, I, tokens, tile=tile)
    # whether its gate pass reads the fp8 gate where a call gives one (gated_mlp's gate_fp8): where it was measured
    # to win; elsewhere the gate itself
    fp8_gate: bool = False
    # whether its out pass reads e4m3 up and down rows where a call gives them (gated_mlp's up_down_fp8); elsewhere
    # up and down themselves
    fp8_up_down: bool = False


def _one_token(d: int, width: int) -> int:
    """1 where a one-token call takes the tile-out path (D small enough), else 0."""
    return int(tile_out_launch(1, d, decode=True))


def _decode_tokens(d: int, width: int) -> int:
    """format.decode_rows, read at each call (a benchmark may replace the rule in this module)."""
    return decode_rows(d, width)


PATHS = (
    # every tile's share of the output (fp32, from h as the decode paths round it)
    LaunchPath("tile-out", _one_token, TileOutLaunches, tile_shares, decode_time),
    # the partial rows of the overflowing (row, tile) pairs
    LaunchPath("decode", _decode_tokens, DecodeLaunches, tile_shares, decode_time),
    # the four-element `overflow` counter's figures (overflowing pairs, the sampled rows' units, heavy rows)
    LaunchPath("batched", lambda d, width: None, PackedLaunches, forward_reference, batched_time, fp8_gate=True,
               fp8_up_down=True),
)


def launch_path(tokens: int, d: int, width: int) -> LaunchPath:
    """The path of a call of `tokens` tokens at D and I."""
    return next(path for path in PATHS if (most := path.max_tokens(d, width)) is None or tokens <= most)


def reads_fp8_gate(tokens: int, d: int, width: int) -> bool:
    """Whether a call of `tokens` tokens at D and I computes its gate with the fp8 gate it is given."""
    return launch_path(tokens, d, width).fp8_gate


def reads_fp8_up_down(tokens: int, d: int, width: int) -> bool:
    """Whether a call of `tokens` tokens at D and I walks the e4m3 up and down rows it is given (read at each
    call: a benchmark or test may replace UP_DOWN_FP8_MIN_ROW_BYTES in this module)."""
    return (launch_path(tokens, d, width).fp8_up_down
            and walk_row_bytes(tokens, d) >= UP_DOWN_FP8_MIN_ROW_BYTES)
