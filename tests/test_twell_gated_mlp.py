"""Gated TwELL block against its fp32 reference. CPU: Triton interpreter, tiny shapes, fp32/fp16.
GPU (-m gpu): bf16 at real sizes, CUDA graphs, torch.compile, no host synchronization."""
import math
import random
import sys
import warnings
from statistics import NormalDist

import pytest
import torch
import triton

import twell
import twell.gated_mlp  # noqa: F401  (the module, beside the function of the same name)
from twell import batched as batched_module
from twell.batched import gate_config, gate_launch, out_config, out_launch
from twell.cost_model import twell_time
from twell.decode import HELD_ROWS, TILE_OUT_MAX_D, decode_tile_stride, tile_out_launch, tile_sum_launch
from twell.format import DECODE_SLOTS, HEAVY_UNITS, TILES, UNIT_SAMPLE, decode_slots, empty_twell, slots, tma_ok
from twell.heavy import HEAVY_FEW_ROWS
from twell.launch import op_name, sm_count
from twell.paths import PATHS, DecodeLaunches, PackedLaunches, TileOutLaunches, launch_path
from twell.reference import forward_reference, tile_counts, tile_shares

from helpers import poison, poison_allocations

gm = sys.modules["twell.gated_mlp"]
gh = sys.modules["twell.gate_hopper"]

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def row_errs(out, ref):
    """Each row's relative error (rows along the last dimension), fp32: |out - ref| / |ref|; a row whose
    reference is exactly zero gets 0 if its output row is exactly zero too, else inf; NaN where out holds NaN.
    A whole-tensor error would hide ordinary rows beside a fully dense one, which holds nearly all the norm."""
    out, ref = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    diff, norm = (out - ref).norm(dim=1), ref.norm(dim=1)
    return torch.where(norm > 0, diff / norm, torch.where(diff == 0, 0.0, float("inf")))


def assert_rows_close(out, ref, tol, slack=None):
    """Every row within `tol` (a number, or one bound a row) of its reference row's norm, plus `slack` (a
    row's absolute allowance for fp32 rounding, fp32_slack) where given: a row whose reference is exactly
    zero, without allowance, must be exactly zero. NaN fails."""
    out, ref = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    diff, norm = (out - ref).norm(dim=1), ref.norm(dim=1)
    bound = torch.as_tensor(tol, dtype=norm.dtype, device=norm.device) * norm
    if slack is not None:
        bound = bound + slack
    bad = ~(diff <= bound)
    rows = bad.nonzero().flatten()[:8].tolist()
    assert not bad.any(), (f"{bad.sum().item()} rows beyond {tol} of their norm: rows {rows}, relative errors "
                           f"{row_errs(out, ref)[rows].tolist()}")


# fp32 blocks that sum in other orders differ by up to about 2e-7 of a row's sums of absolute terms (measured
# on this file's shapes), where the row's own norm can be 1e-5 of those sums (terms that cancel): a row's
# allowance is this share of them (about 1e-5 to 1e-4 of the norm of a typical row; a zeroed row still fails)
FP32_SLACK = 2e-6


def fp32_slack(x, gate, up, down):
    """Each output row's allowance [M] for fp32 rounding: FP32_SLACK times the norm of the row's sums of the
    absolute terms that g = x . gate_j, u = x . up_j and the down sum add up (active units only), in fp64."""
    x, gate, up, down = (t.double() for t in (x.reshape(-1, x.shape[-1]), gate, up, down))
    g, u = x @ gate.t(), x @ up.t()
    g_abs, u_abs = x.abs() @ gate.abs().t(), x.abs() @ up.abs().t()
    terms = torch.where(g > 0, g_abs * u.abs() + g * u_abs + g * u.abs(), 0.0)
    return FP32_SLACK * (terms @ down.abs().t()).norm(dim=1).float()


def assert_block_close(out, x, gate, up, down, tol):
    """The block's output against reference(), row by row: each within `tol` of its reference row's norm plus
    its fp32 allowance (fp32_slack; none for a row without active units: exactly zero)."""
    assert_rows_close(out, reference(x, gate, up, down), tol, fp32_slack(x, gate, up, down))


# A bf16 row's error, the reference in fp32 (as `reference` gives it): the TwELL kernels round g and h
# (2^-9 each, relative) and the output (2^-9 an element), about 6e-3 of a row's norm at most over its
# near-orthogonal down columns, so BF16_ROW_FLOOR leaves room above that. The dense bf16 block (g, u, h and
# the output rounded) is the yardstick beyond the floor: each row within 1.25 times its error on the row.
BF16_ROW_FLOOR = 1e-2


def bf16_row_bounds(dense, ref):
    """Per-row bounds of a bf16 block's output: max(1.25 * the dense bf16 block's error on the row, floor)."""
    return (1.25 * row_errs(dense, ref)).clamp(min=BF16_ROW_FLOOR)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every buffer that the block's kernels write starts as NaN (integers: 987654), so an element left
    unwritten fails instead of holding whatever the allocator returned: torch.empty as paths.py (TwELL,
    counts, partial rows), format.py (empty_twell: pack and the tests' own TwELL) and heavy.py (h, partial
    sums) call it, and Tensor.new_empty (the block's output). Yields the allocations poisoned (their shapes)."""
    allocations = poison_allocations(monkeypatch, "twell.paths", "twell.format", "twell.heavy")
    new_empty = torch.Tensor.new_empty

    def poisoned_new_empty(self, *args, **kwargs):
        return poison(new_empty(self, *args, **kwargs), allocations)

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned_new_empty)
    yield allocations


def block(m, d, i, k, dtype=torch.float32, device=DEV):
    """Bias-channel recipe (docs/performance.md): x[:, 0] = 1 and gate[:, 0] set so each unit fires with
    probability k / i."""
    x = torch.randn(m, d, device=device)
    x[:, 0] = 1.0
    gate = torch.randn(i, d, device=device) / math.sqrt(d)
    gate[:, 0] = -NormalDist().inv_cdf(1 - k / i) if k < i else 10.0
    up = torch.randn(i, d, device=device) / math.sqrt(d)
    down = torch.randn(d, i, device=device) / math.sqrt(max(k, 1))
    return [t.to(dtype) for t in (x, gate, up, down)]


def reference(x, gate, up, down):
    return twell.gated_mlp_reference(x.float(), gate, up, down).float()


@pytest.mark.parametrize("m,d,i,tile,dtype,precision", [
    (1, 40, 100, 32, torch.float32, "highest"),
    (6, 33, 70, 16, torch.float16, "default"),
    (13, 150, 200, 64, torch.float16, "default"),  # 9-16 decode rows: 64-column output chunks, the last partial
    (3, 300, 330, 64, torch.float16, "default"),  # 6 decode tiles, more than the interpreter's SMs: 128-deep K
    (70, 24, 80, 64, torch.float32, "default"),  # > 64 rows: batched configuration
    (100, 40, 300, 128, torch.float16, "default"),  # tile 128, up to 256 rows: 64-row gate blocks
    # D a power of two (no partial column block) at the decode and batched sizes
    (20, 64, 150, 64, torch.float16, "default"),  # 17-32 decode rows: held TwELL, compacted up pass
    (40, 32, 200, 64, torch.float32, "highest"),  # 33-64 decode rows: 16 units a step
    (70, 64, 90, 32, torch.float16, "default"),  # batched
])
def test_gated_mlp_matches_reference(m, d, i, tile, dtype, precision, poisoned_outputs):
    """Every row against the reference (the dense row holds nearly all of the output's norm), the empty row
    exactly zero; NaN-poisoned buffers."""
    torch.manual_seed(1000 * m + i)
    x, gate, up, down = block(m, d, i, k=8, dtype=dtype)
    empty = slice(m // 2, m // 2 + 1 if m > 1 else 0)
    x[empty, 0] = 50.0  # the bias channel is negative: one row with no active unit
    x[-1, 0] = -40.0  # and one with every unit active: every tile overflows
    out = twell.gated_mlp(x, gate, up, down, tile=tile, compression=4, precision=precision)
    assert out.shape == x.shape and out.dtype == dtype and (m, d) in poisoned_outputs  # the output was poisoned
    ref = reference(x, gate, up, down)
    assert_rows_close(out, ref, 1e-5 if dtype == torch.float32 else 3e-3, fp32_slack(x, gate, up, down))
    assert (ref[empty] == 0).all() and (out[empty] == 0).all()


def test_dense_rows_overflow_without_losing_data(poisoned_outputs):
    torch.manual_seed(0)
    x, gate, up, down = block(5, 24, 40, k=40)  # every unit active: every tile overflows
    overflow = torch.zeros(1, dtype=torch.int32, device=DEV)
    for _ in range(2):
        out = twell.gated_mlp(x, gate, up, down, tile=16, compression=8, overflow=overflow)
    assert_block_close(out, x, gate, up, down, 1e-5)
    assert overflow.item() == 2 * 5 * 3  # two calls x 5 rows x ceil(40 / 16) tiles


def test_kernels_write_every_output_and_read_only_valid_slots():
    torch.manual_seed(0)
    x, gate, up, down = block(70, 20, 48, k=6)
    x[3, 0] = -40.0  # a row that overflows
    tw = empty_twell(70, 48, 16, 4, x.dtype, x.device)
    tw.values.fill_(float("nan"))
    tw.counts.fill_(-1)
    s = slots(16, 4)
    gate_launch(x, gate, None, 16, s, x.dtype, gate_config(70, 16, 4, decode=False))(
        x, gate, gate, gate, *tw[:3], tw.values)
    assert (tw.counts >= 0).all()
    out = torch.full_like(x, float("nan"))
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    # 8 output columns per program: each row split over 3 programs, the overflow counted once
    out_launch(x, 48, 16, s, False, True, dict(CH=4, BD=8))(
        x, *tw[:3], tw.values, gate, up, down.t().contiguous(), out, overflow)
    assert_block_close(out, x, gate, up, down, 1e-5)
    assert overflow.item() == (tw.counts > slots(16, 4)).sum().item() > 0


def heavy_rows_block(m, d, i, dtype=torch.float32):
    """block() with rows far above the mean (k = 8): about 45% and 30% of the units active, one row with
    every unit (all of its tiles overflow), one empty."""
    x, gate, up, down = block(m, d, i, k=8, dtype=dtype)
    bias = NormalDist().inv_cdf(1 - 8 / i)
    x[3, 0] = NormalDist().inv_cdf(0.55) / bias
    x[m // 2, 0] = NormalDist().inv_cdf(0.7) / bias
    x[m - 1, 0] = -40.0
    x[m - 2, 0] = 50.0
    return x, gate, up, down


@pytest.mark.parametrize("mode", ["fused", "batched pre-pass", "decode pre-pass"])
@pytest.mark.parametrize("chunk_slots", [2048, 32])  # 32: 2 tiles of 16 slots a chunk, several a row
def test_list_compaction_in_place(chunk_slots, mode, monkeypatch, poisoned_outputs):
    """Where the out kernel walks compact lists, each row's entries of fitting tiles end up in tile then slot
    order at the start of its TwELL (an overflowing tile's entries left out): moved by the batched out
    kernel's own program for its row (up to FUSED_COMPACT_ROWS rows), or by the pre-pass launched before
    the out kernel (more batched rows; decode, where a row spans several output-chunk programs). NaN-poisoned
    TwELL: only the valid slots are written."""
    monkeypatch.setattr(batched_module, "COMPACT_SLOTS", chunk_slots)
    monkeypatch.setattr(batched_module, "FUSED_COMPACT_ROWS", 1024 if mode == "fused" else 0)
    batched = mode != "decode pre-pass"
    torch.manual_seed(5)
    m, d, i, tile, comp = (9 if batched else HELD_ROWS + 8), 16, 200, 32, 2  # 7 tiles of 15 slots
    x, gate, up, down = block(m, d, i, k=12)
    x[2, 0] = -40.0  # every unit active: row 2's six full tiles overflow, its last (8 units) fits
    s = slots(tile, comp)
    tw = empty_twell(m, i, tile, comp, x.dtype, x.device)
    gate_launch(x, gate, None, tile, s, x.dtype, gate_config(m, tile, 4, decode=False))(
        x, gate, gate, gate, *tw[:3], tw.values)
    fitting = torch.arange(s, device=DEV) < torch.where(tw.counts <= s, tw.counts, 0)[..., None]
    expected = [(tw.indices[r][fitting[r]].clone(), tw.values[r][fitting[r]].clone()) for r in range(m)]
    launches = out_launch(x, i, tile, s, False, True, out_config(m, d, decode=not batched),
                          packed_h=not batched)
    assert (launches.compact is None) == (mode == "fused")
    if batched:
        out = torch.full_like(x, float("nan"))
        overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
        launches(x, *tw[:3], tw.values, gate, up, down.t().contiguous(), out, overflow)
        assert_block_close(out, x, gate, up, down, 1e-5)
    else:
        launches.compact(tw.indices, tw.values, tw.counts)
    assert (tw.counts[2] > s).sum() == 6 and (tw.counts <= s).all(1).sum() == m - 1  # 6 full tiles overflow
    for r, (units, values) in enumerate(expected):
        n = len(units)
        assert torch.equal(tw.indices[r].flatten()[:n], units)
        assert torch.equal(tw.values[r].flatten()[:n], values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pack_writes_every_count_and_valid_slot(dtype, poisoned_outputs):
    """twell.pack into poisoned buffers (NaN values, 987654 indices and counts): every count and every valid
    slot written, as pack_reference has them. Rows in two blocks of 16 (the second partial), I not a multiple
    of the tile, an empty row, a dense row (every tile overflows), a tile of exactly S units and one of S + 1."""
    torch.manual_seed(4)
    m, width, tile, comp = 19, 100, 32, 4
    s = slots(tile, comp)
    g = torch.relu(torch.randn(m, width, device=DEV) - 1.0)
    g[0] = 0.0
    g[-1] = torch.rand(width, device=DEV) + 0.1
    g[1] = 0.0
    g[1, torch.randperm(tile)[:s]] = 1.0 + torch.rand(s, device=DEV)
    g[1, tile + torch.randperm(tile)[:s + 1]] = 1.0 + torch.rand(s + 1, device=DEV)
    g = g.to(dtype)
    tw, ref = twell.pack(g, tile, comp), twell.pack_reference(g, tile, comp)
    assert torch.equal(tw.counts, ref.counts)
    assert tw.counts[1, :2].tolist() == [s, s + 1] and (tw.counts[-1, :3] > s).all() and (tw.counts[0] == 0).all()
    valid = torch.arange(s, device=DEV) < ref.counts.clamp(max=s)[..., None]
    assert torch.equal(tw.indices[valid], ref.indices[valid]) and torch.equal(tw.values[valid], ref.values[valid])
    assert poisoned_outputs[:3] == [(m, 4, s), (m, 4, s), (m, 4)]  # pack's values, indices and counts


def counted_rows(m, d, i, units):
    """x, gate, up, down where row r has exactly units[r] active units (the first ones): gate[:, 0] = 1,
    gate[j, 1] = -(j + 0.5), the rest of gate zero, x[r, 0] = units[r], x[r, 1] = 1."""
    x, _, up, down = block(m, d, i, k=8)
    gate = torch.zeros(i, d, device=DEV)
    gate[:, 0] = 1.0
    gate[:, 1] = -(torch.arange(i, device=DEV) + 0.5)
    x[:, 0] = torch.as_tensor(units, dtype=torch.float32, device=DEV)
    x[:, 1] = 1.0
    return x, gate, up, down


@pytest.mark.parametrize("h_fp32", [False, True])
def test_heavy_rows_through_the_dense_block(h_fp32):
    """Batched: the out kernel leaves the rows with more than HEAVY_UNITS units to walk unwritten and posts
    their indices (rows at HEAVY_UNITS - 1, HEAVY_UNITS stay, HEAVY_UNITS + 1 and every unit go); the
    dense block writes exactly those. NaN-poisoned."""
    torch.manual_seed(3)
    m, d, i, tile = 70, 24, 300, 64
    heavy_units = HEAVY_UNITS
    units = [n % 40 for n in range(m)]
    units[3:7] = heavy_units - 1, heavy_units, heavy_units + 1, i
    units[8] = 0
    x, gate, up, down = counted_rows(m, d, i, units)
    s = slots(tile, 1)  # no tile overflows: a row walks exactly its units
    tw = empty_twell(m, i, tile, 1, torch.float32 if h_fp32 else x.dtype, x.device)
    gate_launch(x, gate, None, tile, s, tw.values.dtype, gate_config(m, tile, 4, decode=False))(
        x, gate, gate, gate, *tw[:3], tw.values)
    assert tw.counts.sum(1).tolist() == units
    heavy = torch.tensor(units, device=DEV) > heavy_units
    launches = out_launch(x, i, tile, s, h_fp32, True, out_config(m, d, decode=False))
    out = torch.full_like(x, float("nan"))
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    down_t = down.t().contiguous()
    workspace = torch.zeros(1 + m, dtype=torch.int32, device=DEV)
    launches.out(x, *tw[:3], tw.values, gate, up, down_t, out, overflow, workspace)
    assert out[heavy].isnan().all() and not out[~heavy].isnan().any()
    assert workspace[0].item() == 2 and sorted(workspace[1:3].tolist()) == [5, 6]
    h = torch.full((m, i), float("nan"), dtype=tw.values.dtype, device=DEV)
    partials = torch.full((launches.heavy.splits, HEAVY_FEW_ROWS, d), float("nan"), device=DEV)
    launches.heavy(x, gate, up, down_t, workspace, out, h=h, part=partials)
    # the block wrote the buffers given, at the two posted slots only
    assert h[:2].isfinite().all() and h[2:].isnan().all()
    assert partials[:, :2].isfinite().all() and partials[:, 2:].isnan().all()
    ref = (torch.relu(x @ gate.t()) * (x @ up.t())) @ down.t()
    slack = fp32_slack(x, gate, up, down)
    assert_rows_close(out, ref, 1e-5, slack)  # the rows the dense block wrote (5, 6) and those walked
    full = gm.forward(x, gate, up, down, tile, 1, "default", None)
    assert_rows_close(full, ref, 1e-5, slack)


def test_heavy_rows_with_overflowing_tiles_and_many_of_them(poisoned_outputs):
    """Half the rows heavy, with overflowing tiles (which count toward a row's walk): more than
    HEAVY_FEW_ROWS, so the dense block takes them in square tiles (its programs loop over several blocks of
    rows) instead of the few-row split; overflow is counted for every row. NaN-poisoned buffers."""
    torch.manual_seed(6)
    m, d, i, tile, comp = 80, 24, 300, 64, 4
    x, gate, up, down = heavy_rows_block(m, d, i)
    x[: m // 2, 0] = x[3, 0]  # half the rows about 45% active: 4-5 overflowing tiles each
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    out = twell.gated_mlp(x, gate, up, down, tile=tile, compression=comp, overflow=overflow)
    assert_block_close(out, x, gate, up, down, 1e-5)
    counts = twell.pack(torch.relu(x @ gate.t()), tile=tile, compression=comp).counts
    assert overflow.item() == (counts > slots(tile, comp)).sum().item() > m // 2
    assert m // 2 > HEAVY_FEW_ROWS


def test_four_element_counter_samples_the_activity_of_the_rows_walked(poisoned_outputs):
    """With a four-element counter the batched path also adds the active units of every UNIT_SAMPLE-th row
    it walks (a heavy row is posted, not walked: not counted), those rows' count and the heavy rows' count,
    as the reference does; decode-sized calls count overflow only."""
    torch.manual_seed(7)
    m, d, i, tile, comp = 2 * UNIT_SAMPLE + 2, 24, 300, 64, 4
    x, gate, up, down = heavy_rows_block(m, d, i)
    x[UNIT_SAMPLE, 0] = x[3, 0]  # a sampled row heavy: left out
    x[0, 0] = NormalDist().inv_cdf(0.9) / NormalDist().inv_cdf(1 - 8 / i)  # one sampled row busier than the rest
    counters = torch.zeros(4, dtype=torch.int64, device=DEV)
    out = twell.gated_mlp(x, gate, up, down, tile=tile, compression=comp, overflow=counters)
    assert_block_close(out, x, gate, up, down, 1e-5)
    expected = torch.zeros(4, dtype=torch.int64)
    forward_reference(x.cpu(), gate.cpu(), up.cpu(), down.cpu(), tile, comp, expected)
    active = (x @ gate.t() > 0).sum(1)
    assert counters.tolist() == expected.tolist()
    assert expected[2] == 2 and expected[1] == active[0] + active[2 * UNIT_SAMPLE] > 0
    assert expected[3] == 4  # rows 3, m // 2, m - 1 (heavy_rows_block) and UNIT_SAMPLE
    decode = torch.zeros(4, dtype=torch.int64, device=DEV)
    twell.gated_mlp(x[:8], gate, up, down, tile=tile, compression=comp, overflow=decode)
    assert decode[1:].tolist() == [0, 0, 0]


def overflow_count(g, tile, compression):
    """Overflowing (row, tile) pairs of a gate pre-activation [M, I], at the kernels' decode tiles (blocks of
    min(tile, 64), each holding a tile of decode_tile_stride units: narrower on a GPU above 16 rows)."""
    tile = min(tile, 64)
    ts = decode_tile_stride(g.shape[1], tile, g.shape[0], sm_count(g.device) if g.is_cuda else None)
    return (tile_counts(g, ts) > decode_slots(tile, compression)).sum().item()


# 20: the compacted up loop 4 blocks deep and the held TwELL; 40: the T-wide up loop, TwELL read after counts
@pytest.mark.parametrize("m,dense_rows", [(1, [0]), (3, [0, 2]), (20, [5]), (40, [0, 39])])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "highest"), (torch.float16, "default")])
def test_decode_dense_rows(m, dense_rows, dtype, precision, poisoned_outputs):
    """Decode sizes: fully dense rows overflow every tile (their output from partial rows), others fit. Every
    row against the reference; NaN-poisoned buffers."""
    torch.manual_seed(m)
    x, gate, up, down = block(m, 37, 151, k=6, dtype=dtype)  # odd D and I, I not a multiple of the tile
    x[dense_rows, 0] = -40.0  # every unit of these rows active
    ref = reference(x, gate, up, down)
    expected = overflow_count(x.float() @ gate.float().t(), 128, 8)
    assert expected >= len(dense_rows) * 3
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    out = twell.gated_mlp(x, gate, up, down, tile=128, compression=8, precision=precision, overflow=overflow)
    assert_rows_close(out, ref, 1e-5 if dtype == torch.float32 else 3e-3, fp32_slack(x, gate, up, down))
    assert overflow.item() == expected
    assert torch.equal(twell.gated_mlp(x, gate, up, down, tile=128, precision=precision), out)  # cached plan


@pytest.mark.parametrize("m", [3, 20, 40])
def test_decode_heavy_row_overflows_at_any_compression(m, poisoned_outputs):
    """At compression 2 a 64-unit decode tile would hold 32 units: a row with half its units active would fit
    and be walked unit by unit. Decode tiles hold at most DECODE_SLOTS units, so its tiles overflow into the
    partial rows; the output matches the reference."""
    torch.manual_seed(m)
    x, gate, up, down = block(m, 37, 300, k=4)
    x[1, 0] = 0.0  # row 1 without the bias: about half its units active, like a sequence's first token
    ref = reference(x, gate, up, down)
    g = x.float() @ gate.float().t()
    expected = overflow_count(g, 128, 2)
    assert decode_slots(64, 2) == DECODE_SLOTS < slots(64, 2) and expected >= 4
    assert (tile_counts(g[1:2], 64) <= slots(64, 2)).any()  # tiles that 32 slots would have held
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    out = twell.gated_mlp(x, gate, up, down, tile=128, compression=2, overflow=overflow)
    assert_rows_close(out, ref, 1e-5, fp32_slack(x, gate, up, down))
    assert overflow.item() == expected


# Launch paths (paths.PATHS) and the token counts each draws from: one token (tile-out); decode with 16-row
# gate blocks and the compacted up pass; decode above 16 rows; batched
RANDOM_PATHS = {"tile-out": (1, 1), "decode 3-16": (3, 16), "decode 17-64": (17, 64), "batched": (65, 160)}


@pytest.mark.parametrize("d,i", [(1536, 8960), (2048, 11008), (4096, 14336)])  # decode to 64, to 16; no tile-out
def test_every_launch_path_states_its_contract(d, i):
    """Each entry of paths.PATHS: random shapes drawn for it here, the token counts of its range take it (the
    first path whose max_tokens holds them), its reference lives in reference.py, and the cost model predicts
    its calls by its cost term."""
    assert {name.split()[0] for name in RANDOM_PATHS} == {path.name for path in PATHS}
    first = 1
    for path in PATHS:
        most = path.max_tokens(d, i)
        tokens = range(first, (most if most is not None else first + 300) + 1)
        assert all(launch_path(m, d, i) is path for m in tokens)
        assert path.reference.__module__ == "twell.reference"
        assert all(twell_time(27.5, d, i, m, tile=64) == path.cost(27.5, d, i, m, tile=64) for m in tokens)
        first = max(first, tokens.stop)
    assert first > 300 and PATHS[-1].max_tokens(d, i) is None  # the last path takes every count above


def random_case(path, draw):
    """(m, d, i, tile, compression, slots, units a row fires on average, dtype, precision) of a random block
    of `path` (random.Random seeded by the path and the draw): D and I not multiples of the blocks (I spans at
    least two of the path's tiles), any tile, compression 2-8, fp32 or fp16, either precision."""
    rng = random.Random(f"{path} {draw}")
    m = rng.randint(*RANDOM_PATHS[path])
    tile = rng.choice(TILES)
    batched = path == "batched"
    t = tile if batched else min(tile, 64)
    # a decode tile on a GPU may be t / 2 wide (decode_tile_stride): it must hold S + 1 units
    comp = rng.choice([c for c in (2, 4, 8) if batched or t // 2 > decode_slots(tile, c)])
    s = slots(tile, comp) if batched else decode_slots(tile, comp)
    d = rng.choice([n for n in range(17, 80) if n % 16])
    i = rng.choice([n for n in range(t + s + 2, 3 * t) if n % t])
    return (m, d, i, tile, comp, s, rng.choice([3, 8]), rng.choice([torch.float32, torch.float16]),
            rng.choice(["default", "highest"]))


def random_rows_block(m, d, i, ts, s, k):
    """block() (fp32) with the rows every path must handle, picked through channels 1 and 2 of x and the
    gate: row 0 empty and the last fully dense (every tile overflows) where m > 1; row 1 with exactly S active
    units in its first tile of ts units and no other (at most 128 units: batched, its own program walks it);
    row 2 with S + 1 in its second tile and 3 beyond (rows 1 and 2 are one row where m < 4). Random units."""
    x, gate, up, down = block(m, d, i, k=k)
    x[:, 1:3] = 0.0
    gate[:, 1:3] = 0.0
    over_by_one = torch.cat([ts + torch.randperm(min(i, 2 * ts) - ts)[:s + 1],
                             2 * ts + torch.randperm(i - 2 * ts)[:3] if i > 2 * ts else torch.arange(0)])
    gate[torch.randperm(ts)[:s].to(DEV), 1] = 20.0
    gate[over_by_one.to(DEV), 2] = 20.0
    exact, over = min(1, m - 1), 2 if m > 3 else min(1, m - 1)
    x[exact, 1] = x[over, 2] = 1.0
    x[[exact, over], 0] = 5.0  # the bias channel 5 times over: only the picked units, by about 10
    if m > 1:
        x[0, 0] = 50.0
        x[-1, 0] = -40.0
    return x, gate, up, down


@pytest.mark.parametrize("draw", [0, 1, 2])
@pytest.mark.parametrize("path", RANDOM_PATHS)
def test_random_shapes(path, draw, poisoned_outputs):
    """Random shapes of each launch path (random_case): every row against the reference, the empty row exactly
    zero, a tile of exactly S units (it fits) beside one of S + 1 and the dense row's overflowing tiles, the
    overflow counted as the path counts it (batched: the four counters of forward_reference). NaN-poisoned."""
    m, d, i, tile, comp, s, k, dtype, precision = random_case(path, draw)
    torch.manual_seed(draw)
    batched = path == "batched"
    t = tile if batched else min(tile, 64)
    assert launch_path(m, d, i).name == path.split()[0] and d % 16 and i % t
    ts = t if batched else decode_tile_stride(i, t, m, sm_count(torch.device(DEV)) if DEV == "cuda" else None)
    x, gate, up, down = (v.to(dtype) for v in random_rows_block(m, d, i, ts, s, k))
    counts = tile_counts(x.float() @ gate.float().t(), ts)
    assert counts[min(1, m - 1), 0] == s and counts[2 if m > 3 else min(1, m - 1), 1] == s + 1
    overflow = torch.zeros(4 if batched else 1, dtype=torch.int64, device=DEV)
    out = twell.gated_mlp(x, gate, up, down, tile=tile, compression=comp, precision=precision, overflow=overflow)
    assert out.shape == x.shape and out.dtype == dtype and (m, d) in poisoned_outputs  # the output was poisoned
    assert_block_close(out, x, gate, up, down, 1e-5 if dtype == torch.float32 else 3e-3)
    if m > 1:
        assert (out[0] == 0).all() and (counts[0] == 0).all() and (counts[-1, :i // ts] > s).all()  # full tiles
    if batched:
        expected = torch.zeros(4, dtype=torch.int64)
        forward_reference(x.cpu(), gate.cpu(), up.cpu(), down.cpu(), tile, comp, expected)
        assert overflow.tolist() == expected.tolist()
    else:
        assert overflow.item() == (counts > s).sum().item()


def tile_partials(h, down, over, ts):
    """Expected partial rows [M, NT, D]: the tile shares of the (row, tile) pairs in `over`, NaN elsewhere."""
    return torch.where(over[..., None], tile_shares(h, down, ts), float("nan"))


def test_decode_kernels_read_partials_only_where_written():
    """Decode launches on NaN-poisoned buffers: the partial rows hold exactly the overflowing (row, tile)
    pairs' share of the output (from the stored values, rounded as packed) and are read nowhere else."""
    torch.manual_seed(1)
    m, d, i, tile, comp = 3, 20, 72, 16, 4
    x, gate, up, down = block(m, d, i, k=5, dtype=torch.float16)
    x[1, 0] = -40.0  # a fully dense row
    tw = empty_twell(m, i, tile, comp, x.dtype, x.device)
    tw.values.fill_(float("nan"))
    nt, s = tw.counts.shape[1], slots(tile, comp)
    partials = torch.full((m, nt, d), float("nan"), device=DEV)
    down_t = down.t().contiguous()
    gate_launch(x, gate, up, tile, s, x.dtype, gate_config(m, tile, 2, decode=True), partials=True)(
        x, gate, up, down_t, *tw[:3], partials)
    over = tw.counts > s
    assert over[1].all() and over.sum() < over.numel()
    g = torch.relu(x.float() @ gate.float().t())
    h = (g * (x.float() @ up.float().t())).to(x.dtype)  # as packed
    expected = tile_partials(h, down, over, tile)
    assert torch.equal(partials.isnan(), expected.isnan())
    written = ~expected.isnan()
    assert rel_err(partials[written], expected[written]) < 2e-3  # h rounded to fp16 on both sides
    out = torch.full_like(x, float("nan"))
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    out_launch(x, i, tile, s, False, True, dict(CH=4, BD=8), packed_h=True)(
        x, *tw[:3], partials, gate, up, down_t, out, overflow)
    assert_rows_close(out, h.float() @ down.float().t(), 3e-3)
    assert overflow.item() == over.sum().item()


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "highest"), (torch.float16, "default")])
def test_tile_out_decode_writes_every_tile_share(dtype, precision):
    """One-token gated decode: no TwELL; every tile's share of the output lands in the NaN-poisoned partials
    buffer (zeros for a tile with no active unit), through whole up and down rows for tiles of 1-4 and 5-8
    active units (one and two rounds) and the K loop above; nothing is written past the token's row. The
    sum kernel adds the shares and counts the tiles beyond the slots (a tile of exactly S units fits)."""
    torch.manual_seed(0)
    d, i, tile, comp = 37, 151, 32, 8
    x, gate, up, down = block(1, d, i, k=20, dtype=dtype)
    active = torch.cat([torch.tensor([33, 40, 60]), torch.arange(64, 70), torch.arange(96, 116),
                        torch.tensor([128, 139, 149, 150])])
    gate[:, 0] = -10.0
    gate[active, 0] = 10.0  # tiles of 32: none, 3, 6, 20 and 4 (= S, the last tile's 23 units) active units
    h_fp32 = precision == "highest"
    s = slots(tile, comp)
    nt = math.ceil(i / tile)
    assert tile_out_launch(1, d, decode=True)
    counts = torch.full((2, nt), -1, dtype=torch.int32, device=DEV)  # a second row to catch stray writes
    partials = torch.full((2, nt, d), float("nan"), device=DEV)
    down_t = down.t().contiguous()
    gate_launch(x, gate, up, tile, s, dtype, gate_config(1, tile, x.element_size(), decode=True), h_fp32,
                partials=True, tile_out=True)(x, gate, up, down_t, counts, counts, counts, partials)
    assert counts[0].tolist() == [0, 3, 6, 20, s] and (counts[1] == -1).all() and partials[1].isnan().all()
    g = torch.relu(x.float() @ gate.float().t())
    h = g * (x.float() @ up.float().t())
    h = h if h_fp32 else h.to(dtype)  # as packed by the other decode paths
    expected = tile_partials(h, down, torch.ones(1, nt, dtype=torch.bool, device=DEV), tile)
    assert not partials[0].isnan().any() and torch.equal(partials[0, 0], torch.zeros(d, device=DEV))
    assert rel_err(partials[:1], expected) < (1e-5 if h_fp32 else 2e-3)
    out = torch.full_like(x, float("nan"))
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    tile_sum_launch(1, d, nt, s, True)(partials, counts, out, overflow, out)
    assert rel_err(out, partials[0].sum(0)) < (1e-6 if h_fp32 else 1e-3)  # fp32 sums in another order, rounded
    assert overflow.item() == (counts[0] > s).sum().item() == 2  # 4 slots: the tiles of 6 and 20, not that of 4
    assert_block_close(out, x, gate, up, down, 1e-5 if h_fp32 else 3e-3)


@pytest.mark.parametrize("m,d,nt", [(3, 40, 5), (2, 20, 300)])  # 300 tiles: more than OT (256) a step
def test_tile_sum_adds_each_rows_shares_and_counts_its_tiles_beyond_the_slots(m, d, nt):
    """The tile-out path's sum kernel on several rows (gated_mlp calls it with one): each row's output is the
    sum of its own tiles' partial rows, in every output chunk (D not a multiple of its 32 columns), and each
    row adds its tiles of more than S units to the counter once, however many chunks it spans; a tile of
    exactly S units is not counted. Nothing is written past the M rows; without a counter nothing is counted.
    With a residual, each row is the residual's row plus its sum rounded to the output's dtype, as torch adds."""
    torch.manual_seed(nt)
    s = 4
    partials = torch.randn(m, nt, d, device=DEV)
    counts = torch.randint(0, 2 * s, (m, nt), dtype=torch.int32, device=DEV)
    counts[:, 0], counts[:, -1] = s, s + 1  # exactly S (fits) and one more (beyond the slots)
    counts[-1] = 0  # a row of empty tiles
    partials[-1] = 0
    assert d % 32 and (counts == s).any() and (counts > s).any()
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    for has_overflow in (True, False):
        out = torch.full((m + 1, d), float("nan"), device=DEV)  # a row past the last to catch stray writes
        tile_sum_launch(m, d, nt, s, has_overflow)(partials, counts, out, overflow if has_overflow else counts, out)
        assert_rows_close(out[:m], partials.sum(1), 1e-5)
        assert out[m].isnan().all() and (out[m - 1] == 0).all()
        assert overflow.item() == (counts > s).sum().item() > 0
    residual = torch.randn(m, d, device=DEV).half()
    summed = torch.full((m + 1, d), float("nan"), device=DEV).half()
    tile_sum_launch(m, d, nt, s, False, has_residual=True)(partials, counts, summed, counts, residual)
    assert torch.equal(summed[:m], residual + sum_out(partials, summed[:m]))
    assert summed[m].isnan().all()


def sum_out(partials, out):
    """The tile sum's output of `partials` without a residual, in out's dtype (computed by the kernel)."""
    m, nt, d = partials.shape
    plain = torch.full_like(out, float("nan"))
    tile_sum_launch(m, d, nt, 4, False)(partials, torch.zeros(m, nt, dtype=torch.int32, device=DEV), plain, plain,
                                        plain)
    return plain


@pytest.mark.parametrize("m,path", [(1, "tile-out"), (5, "decode"), (70, "batched")])
def test_a_residual_is_added_to_the_block_on_every_path(m, path, poisoned_outputs):
    """gated_mlp(..., residual=r) gives r + gated_mlp(...) in x's dtype with equal bits (torch's add, or the
    one-token path's tile sum adding it), a row with every unit active and one with none among them, NaN-poisoned
    buffers; a residual of another shape is refused."""
    torch.manual_seed(m)
    x, gate, up, down = block(m, 48, 96, k=8, dtype=torch.float16)
    x[-1, 0] = -40.0  # the bias channel is negative: every unit active, every tile beyond its slots
    if m > 1:
        x[0, 0] = 50.0  # no unit active
    assert launch_path(m, 48, 96).name == path
    residual = torch.randn(m, 48, device=DEV).half()
    kernel = dict(tile=32, compression=4)
    assert torch.equal(twell.gated_mlp(x, gate, up, down, residual=residual, **kernel),
                       residual + twell.gated_mlp(x, gate, up, down, **kernel))
    with pytest.raises(ValueError, match="residual"):
        twell.gated_mlp(x, gate, up, down, residual=residual[:, :40], **kernel)


def test_a_launch_beyond_the_device_runs_the_dense_block(monkeypatch):
    """A launch configuration the GPU cannot run (Triton's OutOfResources, e.g. shared memory on a smaller GPU)
    makes calls of that shape run the dense block, with one warning: the reference's output, and no second
    attempt at the launch."""
    from triton.runtime.errors import OutOfResources

    torch.manual_seed(0)
    x, gate, up, down = block(5, 24, 80, k=8)
    attempts = []

    def beyond_the_device(*_):
        attempts.append(1)
        raise OutOfResources(233472, 232448, "shared memory")

    real = PackedLaunches.__init__  # the decode path's too

    def launches(self, *args):
        real(self, *args)
        self.gate = beyond_the_device

    monkeypatch.setattr(PackedLaunches, "__init__", launches)
    gm.LAUNCH_CACHE.clear()
    try:
        with pytest.warns(UserWarning, match="out of resource: shared memory.*run the dense block"):
            out = twell.gated_mlp(x, gate, up, down, tile=32, compression=4)
        assert_block_close(out, x, gate, up, down, 1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = twell.gated_mlp(x, gate, up, down, tile=32, compression=4)
        assert torch.equal(again, out) and len(attempts) == 1
    finally:
        gm.LAUNCH_CACHE.clear()


def launch_scalar(launch, name):
    """A compile-time argument of a launch (its scalars follow the tensors, in signature order)."""
    names = launch.kernel.arg_names[len(launch.kernel.arg_names) - len(launch.scalars):]
    return dict(zip(names, launch.scalars))[name]


@pytest.mark.parametrize("m", [1, 2, 4])
def test_decode_whole_up_rows_match_the_k_loop(m):
    """Up to 4 decode rows, a gate program whose tile has at most 8 active columns reads their whole up rows
    in one round of loads per 4 columns (UP_ROWS) instead of the K loop; both store the same TwELL and
    partial rows. Tiles of 64: 6 active columns (two rounds), all 64 (the K loop, overflowing), 3 (one round).
    NaN-poisoned buffers; D and I not multiples of the blocks."""
    torch.manual_seed(m)
    d, i, tile, comp = 37, 151, 64, 8
    x, gate, up, down = block(m, d, i, k=20)
    active = torch.cat([torch.tensor([3, 9, 10, 30, 31, 63]), torch.arange(64, 128), torch.tensor([130, 140, 150])])
    gate[:, 0] = -40.0
    gate[active, 0] = 40.0  # x[:, 0] = 1: the same units are active in every row
    s = slots(tile, comp)
    cfg = gate_config(m, tile, 4, decode=True)
    k_loop = {k: v for k, v in cfg.items() if k not in ("UP_ROWS", "ROWS_UC")}
    compact = dict(k_loop, UP_COMPACT_COLS=tile)  # the dense tile's up rows compacted too, not one stream
    assert k_loop["UP_COMPACT_COLS"] < 64
    results = []
    for c in (cfg, k_loop, compact):
        tw = empty_twell(m, i, tile, comp, x.dtype, x.device)
        tw.values.fill_(float("nan"))
        tw.indices.fill_(-1)
        partials = torch.full((*tw.counts.shape, d), float("nan"), device=DEV)
        launch = gate_launch(x, gate, up, tile, s, x.dtype, c, partials=True)
        launch(x, gate, up, down.t().contiguous(), *tw[:3], partials)
        results.append((launch_scalar(launch, "UP_ROWS"), tw, partials))
    (rows_a, a, parts_a), (rows_b, b, parts_b), (_, c, parts_c) = results
    assert (rows_a, rows_b) == (triton.next_power_of_2(m), 0)
    assert torch.equal(a.counts, b.counts) and torch.equal(a.counts, c.counts)
    assert a.counts.tolist() == [[6, 64, 3]] * m
    stored = torch.arange(s, device=DEV) < a.counts.clamp(max=s)[..., None]
    assert torch.equal(a.indices[stored], b.indices[stored])
    h = torch.relu(x @ gate.t()) * (x @ up.t())
    for tw in (a, b, c):
        assert torch.allclose(tw.values[stored], h.gather(1, tw.indices.clamp(min=0).flatten(1).long())
                              .view_as(tw.values)[stored], rtol=1e-5, atol=1e-6)
    expected = tile_partials(h, down, a.counts > s, tile)
    assert all(torch.equal(parts.isnan(), expected.isnan()) for parts in (parts_a, parts_b, parts_c))
    written = ~expected.isnan()
    assert written.sum() == d * m  # the middle tile of each row
    # fp32 dot products summed in another order than torch's: rounding of the order of 1e-7 of the largest
    # terms (|g| is 40 here), so the absolute tolerance scales with them, not with each value
    scale = 1e-6 * (h.abs().max() * down.abs().max()).item() * 64
    for partials in (parts_a, parts_b, parts_c):
        assert torch.allclose(partials[written], expected[written], rtol=1e-5, atol=scale)


def test_a_crowded_decode_grid_halves_the_gate_k_blocks():
    """Up to 16 rows, a decode gate grid of more tiles than SMs (sm_count: 4 under the interpreter) takes K blocks
    half as deep, so that two programs share an SM; above 16 rows the configuration does not change."""
    for m in (1, 16):
        assert 2 * gate_config(m, 64, 2, True, crowded=True)["BK"] == gate_config(m, 64, 2, True)["BK"]
    assert gate_config(17, 64, 2, True, crowded=True) == gate_config(17, 64, 2, True)
    for i, crowded in ((4 * 64, False), (4 * 64 + 1, True)):
        x, gate = torch.zeros(1, 256, dtype=torch.float16), torch.zeros(i, 256, dtype=torch.float16)
        for launches in (DecodeLaunches, TileOutLaunches):
            launched = launches(x, gate, gate, 64, 8, "default", None).gate
            assert launch_scalar(launched, "BK") == (2 if crowded else 4) * 64


def test_whole_up_rows_only_where_they_fit_in_registers():
    """Past WHOLE_UP_ROWS elements (D above 4096 at 4 columns a round) the decode gate keeps the K loop."""
    for d, expected in ((4096, 1), (4097, 0)):
        x, gate = torch.zeros(1, d), torch.zeros(8, d)
        launch = gate_launch(x, gate, gate, 64, 8, x.dtype, gate_config(1, 64, 2, decode=True), partials=True)
        assert launch_scalar(launch, "UP_ROWS") == expected


def test_tile_out_only_for_one_decode_token_that_fits():
    """The tile-out path takes one-token decode calls up to TILE_OUT_MAX_D; a gate program reads fewer
    units' whole up and down rows a round where D is larger (D 8192: one)."""
    assert tile_out_launch(1, TILE_OUT_MAX_D, decode=True)
    assert not tile_out_launch(1, TILE_OUT_MAX_D + 1, decode=True)
    assert not tile_out_launch(2, 64, decode=True)
    assert not tile_out_launch(1, 64, decode=False)
    x, gate = torch.zeros(1, 8192), torch.zeros(8, 8192)
    launch = gate_launch(x, gate, gate, 64, 8, x.dtype, gate_config(1, 64, 2, decode=True), partials=True,
                         tile_out=True)
    assert (launch_scalar(launch, "UP_ROWS"), launch_scalar(launch, "ROWS_UC")) == (1, 1)


def test_decode_out_holds_the_row_twell_only_where_it_fits():
    """Up to 32 decode rows and HELD_SLOTS slots a row, the out kernel loads a row's whole TwELL with its
    counts (HELD, a power of two covering the row's slots); otherwise it reads list entries after them."""
    for m, width, expected in ((1, 151, 32), (32, 4096, 512), (33, 4096, 0), (1, 64 * 513, 0)):
        x = torch.zeros(m, 8)
        launch = out_launch(x, width, 64, 8, False, True, out_config(m, 8, True), packed_h=True).out
        assert launch_scalar(launch, "HELD") == expected, (m, width)


def test_decode_tiles_narrower_than_the_block():
    """Decode spread over more programs: tiles of tile_stride units inside T-wide blocks (the block's
    last columns belong to the next tile). NaN-poisoned buffers, a dense row, I not a multiple."""
    torch.manual_seed(2)
    m, d, i, tile, ts, comp = 20, 24, 130, 32, 20, 4
    x, gate, up, down = block(m, d, i, k=6)
    x[4, 0] = -40.0  # every unit active: all of the row's tiles overflow
    nt, s = math.ceil(i / ts), slots(tile, comp)
    vals = torch.full((m, nt, s), float("nan"), device=DEV)
    idx = torch.full((m, nt, s), -1, dtype=torch.int32, device=DEV)
    cnt = torch.full((m, nt), -1, dtype=torch.int32, device=DEV)
    partials = torch.full((m, nt, d), float("nan"), device=DEV)
    down_t = down.t().contiguous()
    gate_launch(x, gate, up, tile, s, x.dtype, gate_config(m, tile, 4, decode=True), partials=True, tile_stride=ts)(
        x, gate, up, down_t, vals, idx, cnt, partials)
    g = torch.relu(x @ gate.t())
    per_tile = tile_counts(g, ts)
    assert torch.equal(cnt, per_tile.int()) and (cnt[4] > s).all()
    h = g * (x @ up.t())
    expected = tile_partials(h, down, cnt > s, ts)
    assert torch.equal(partials.isnan(), expected.isnan())
    out = torch.full_like(x, float("nan"))
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    out_launch(x, i, tile, s, False, True, dict(CH=4, BD=8), packed_h=True, tile_stride=ts)(
        x, vals, idx, cnt, partials, gate, up, down_t, out, overflow)
    assert_rows_close(out, h @ down.t(), 1e-5, fp32_slack(x, gate, up, down))
    assert overflow.item() == (per_tile > s).sum().item()


def test_tma_and_pointer_main_loops_pack_alike():
    """The batched gate kernel reads x and the weight through TMA descriptors when they allow it (the
    interpreter emulates them), else through pointers: both must give the same TwELL."""
    torch.manual_seed(0)
    x, gate, up, down = block(70, 32, 96, k=8)
    x[7, 0] = -40.0  # a dense row: overflowing tiles
    wide = torch.zeros(70, 33, device=DEV)
    wide[:, :32] = x
    x_unaligned = wide[:, :32]  # row stride of 33 floats: no TMA descriptor
    assert tma_ok(x, gate) == (DEV == "cpu" or torch.cuda.get_device_capability()[0] >= 9)
    assert not tma_ok(x_unaligned, gate)
    packed = []
    for xx in (x, x_unaligned):
        tw = empty_twell(70, 96, 32, 4, x.dtype, x.device)
        tw.values.fill_(float("nan"))
        gate_launch(xx, gate, None, 32, slots(32, 4), x.dtype, gate_config(70, 32, 4, decode=False))(
            xx, gate, gate, gate, *tw[:3], tw.values)
        packed.append(tw)
    a, b = packed
    valid = torch.arange(a.values.shape[2], device=DEV) < a.counts.clamp(max=a.values.shape[2])[..., None]
    assert torch.equal(a.counts, b.counts) and (a.counts[7] > slots(32, 4)).all()
    assert torch.equal(a.indices[valid], b.indices[valid]) and torch.equal(a.values[valid], b.values[valid])


def test_noncontiguous_and_batched_input(poisoned_outputs):
    torch.manual_seed(0)
    x, gate, up, down = block(6, 32, 64, k=10)
    x3 = torch.stack([x, x], dim=2).reshape(6, 64)[:, ::2].reshape(2, 3, 32)  # strided, 3-D
    assert not x3.is_contiguous()
    out = twell.gated_mlp(x3, gate, up, twell.prepare_down(down), tile=16, compression=2)
    assert out.shape == (2, 3, 32)
    assert_block_close(out.reshape(6, 32), x, gate, up, down, 1e-5)


def test_custom_op_schema_and_fake():
    torch.manual_seed(0)
    x, gate, up, down = block(3, 16, 32, k=5)
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    torch.library.opcheck(getattr(torch.ops.twell, op_name("gated_mlp_overflow")),
                          (x, gate, up, down, 16, 4, "default", overflow),
                          test_utils=("test_schema", "test_faketensor"))


def test_eager_calls_skip_the_custom_op_and_traced_calls_use_it():
    torch.manual_seed(0)
    x, gate, up, down = block(3, 16, 32, k=5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        first = twell.gated_mlp(x, gate, up, down, tile=16)
        second = twell.gated_mlp(x, gate, up, down, tile=16)  # from the cached plan
    assert not [e.name for e in prof.events() if e.name.startswith("twell::")]
    assert torch.equal(first, second)
    assert torch.equal(first, getattr(torch.ops.twell, op_name("gated_mlp"))(x, gate, up, down, 16, 8, "default"))
    with torch._subclasses.FakeTensorMode() as mode:  # a dispatch mode must see the op (fake kernel)
        fake = twell.gated_mlp(*map(mode.from_tensor, (x, gate, up, down)), tile=16)
    assert fake.shape == x.shape


def _too_wide(x, gate, up, down):
    """gated_mlp at I = 65537 (zero weights: the check comes before any launch)."""
    wide = torch.zeros(65537, x.shape[1], device=DEV)
    return twell.gated_mlp(x, wide, wide, wide.t(), tile=16)


def _overflow(n, dtype=torch.int64):
    return torch.zeros(n, dtype=dtype, device=DEV)


def _tile_out_gate(m, d):
    """The tile-out gate launch of m rows of width d (one row whose units' up and down rows fit only)."""
    x, w = torch.zeros(m, d, device=DEV), torch.zeros(8, d, device=DEV)
    return gate_launch(x, w, w, 64, 8, x.dtype, gate_config(m, 64, 4, decode=True), partials=True, tile_out=True)


ONE_OR_FOUR = r"overflow must be a one- or four-element int32 or int64 tensor"
# case: (the call, given block(2, 16, 32)'s x, gate, up, down; its ValueError's message, a regular expression)
ARGUMENT_ERRORS = {
    "down [I, D]": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d.t(), tile=16),
                    r"shape mismatch: x \(2, 16\), gate and up \[I, D\] = \(32, 16\) and \(32, 16\), down \(32, 16\)"),
    "x narrower": (lambda x, g, u, d: twell.gated_mlp(x[:, :15], g, u, d, tile=16), r"shape mismatch: x \(2, 15\)"),
    "up of other shape": (lambda x, g, u, d: twell.gated_mlp(x, g, u[:16], d, tile=16),
                          r"shape mismatch: .* \(32, 16\) and \(16, 16\)"),
    "precision": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=16, precision="fast"),
                  r"precision must be one of \('default', 'highest'\), got 'fast'"),
    "devices": (lambda x, g, u, d: twell.gated_mlp(x, g, u.to("meta"), d, tile=16),
                r"x, the weights and overflow must be on one device, got \[.*'meta'.*\]"),
    "overflow device": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=16, overflow=_overflow(1).to("meta")),
                        "must be on one device"),
    "tile": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=100),
             r"tile must be one of \(16, 32, 64, 128, 256\), got 100"),
    "compression 3": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=16, compression=3),
                      "compression must be a power of two, got 3"),
    "compression 0": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=16, compression=0),
                      "compression must be a power of two, got 0"),
    "I > 65536": (_too_wide, r"I = 65537 > 65536 is not supported"),
    "overflow of 2": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=16, overflow=_overflow(2)), ONE_OR_FOUR),
    "overflow of 8": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=16, overflow=_overflow(8)), ONE_OR_FOUR),
    "float overflow": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=16, overflow=_overflow(1, torch.float32)),
                       ONE_OR_FOUR),
    "int16 overflow": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=16, overflow=_overflow(4, torch.int16)),
                       ONE_OR_FOUR),
    "strided overflow": (lambda x, g, u, d: twell.gated_mlp(x, g, u, d, tile=16, overflow=_overflow(8)[::2]),
                         "overflow must be contiguous"),  # the kernels add to its elements by offset
    "pack 3-D": (lambda x, g, u, d: twell.pack(torch.relu(x).view(2, 2, 8), tile=16),
                 r"pack expects \[M, I\], got \(2, 2, 8\)"),
    "pack 1-D": (lambda x, g, u, d: twell.pack(torch.relu(x[0]), tile=16), r"pack expects \[M, I\], got \(16,\)"),
    "gate tile_stride 0": (lambda x, g, u, d: gate_launch(x, g, u, 32, 4, x.dtype, gate_config(2, 32, 4, decode=True),
                                                          partials=True, tile_stride=0),
                           r"tile_stride must be in 1..tile \(32\), got 0"),
    "out tile_stride above the tile": (lambda x, g, u, d: out_launch(x, 32, 16, 4, False, True, out_config(2, 16, True),
                                                                     packed_h=True, tile_stride=17),
                                       r"tile_stride must be in 1..tile \(16\), got 17"),
    "tile-out of 5 rows": (lambda *_: _tile_out_gate(5, 16), r"the tile-out decode path takes one row .*\(M 5, D 16\)"),
    "tile-out too wide": (lambda *_: _tile_out_gate(1, 16384),
                          r"the tile-out decode path takes one row .*\(M 1, D 16384\)"),
}


@pytest.mark.parametrize("case", ARGUMENT_ERRORS)
def test_argument_validation(case):
    """Each argument error of gated_mlp, pack and the launches, by its message."""
    torch.manual_seed(0)
    call, message = ARGUMENT_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call(*block(2, 16, 32, k=5))


def test_kernels_take_one_dtype_of_three():
    """Mixed or unsupported dtypes are a ValueError naming them, not a Triton compile error or fp64 inputs
    run at fp32 accuracy."""
    torch.manual_seed(0)
    x, gate, up, down = block(3, 16, 32, k=5)
    with pytest.raises(ValueError, match="x torch.float16, gate torch.float32"):
        twell.gated_mlp(x.half(), gate, up, down, tile=16)
    for m in (3, 70):  # decode and batched paths
        x, gate, up, down = block(m, 16, 32, k=5, dtype=torch.float64)
        with pytest.raises(ValueError, match="torch.float64"):
            twell.gated_mlp(x, gate, up, down, tile=16)


def test_launches_specialize_on_each_pointer_alignment(poisoned_outputs):
    """A call whose x is misaligned after one whose up alone was shares no launch with it: Triton specializes
    on every pointer's 16-byte alignment (and TMA descriptors need aligned bases)."""
    torch.manual_seed(0)
    m, d, i = 70, 32, 64
    x, gate, up, down = block(m, d, i, k=5)
    store = torch.empty(i * d + 1, device=DEV)
    misaligned_up = store[1:].view(i, d)
    misaligned_up.copy_(up)
    down_t = twell.prepare_down(down)
    ref, slack = reference(x, gate, up, down), fp32_slack(x, gate, up, down)
    assert_rows_close(twell.gated_mlp(x, gate, misaligned_up, down_t, tile=32), ref, 1e-5, slack)
    store_x = torch.empty(m * d + 1, device=DEV)
    misaligned_x = store_x[1:].view(m, d)
    misaligned_x.copy_(x)
    assert_rows_close(twell.gated_mlp(misaligned_x, gate, misaligned_up, down_t, tile=32), ref, 1e-5, slack)


@pytest.mark.gpu
@pytest.mark.parametrize("m,d,i", [(m, 2048, 5632) for m in (1, 8, 24, 64, 96, 300, 4096)]  # 24: the compacted
                         + [(m, 1536, 8960) for m in (1, 16)])  # up pass, held TwELL; 140 decode tiles, crowded on 132 SMs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_real_shape_precision(m, d, i, dtype):
    torch.manual_seed(0)
    x, gate, up, down = block(m, d, i, k=29, dtype=dtype)
    ref = reference(x, gate, up, down)
    dense = (torch.relu(x @ gate.t()) * (x @ up.t())) @ down.t()
    err_dense = rel_err(dense, ref)
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    out = twell.gated_mlp(x, gate, up, twell.prepare_down(down), overflow=overflow)
    # the second call of a decode size runs the compiled kernels directly (cached plan)
    assert torch.equal(twell.gated_mlp(x, gate, up, twell.prepare_down(down), overflow=overflow), out)
    err = rel_err(out, ref)
    err_hi = rel_err(twell.gated_mlp(x, gate, up, down, precision="highest"), ref)
    assert err < max(1.25 * err_dense, 4e-3), (err, err_dense)
    assert err_hi <= err * 1.1
    assert overflow.item() == 0


@pytest.mark.gpu
def test_gpu_dense_rows_and_odd_shapes():
    torch.manual_seed(0)
    x, gate, up, down = block(130, 1000, 3000, k=40, dtype=torch.bfloat16)
    x[::7, 0] = -30.0  # every 7th row fully dense
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    out = twell.gated_mlp(x, gate, up, down, tile=256, overflow=overflow)
    ref = reference(x, gate, up, down)
    dense = (torch.relu(x @ gate.t()) * (x @ up.t())) @ down.t()
    assert_rows_close(out, ref, bf16_row_bounds(dense, ref))
    ordinary = x[:, 0] != -30.0  # beside the dense rows, which hold nearly all of the norm
    assert rel_err(out[ordinary], ref[ordinary]) < max(1.25 * rel_err(dense[ordinary], ref[ordinary]), 4e-3)
    assert overflow.item() == 19 * math.ceil(3000 / 256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                    or gh.gluon is None, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("m,d,i,compression,dtype", [
    (4096, 2048, 5632, 8, torch.bfloat16),
    (1000, 1000, 3000, 4, torch.float16),  # row, column and K tails
    (300, 136, 200, 8, torch.bfloat16),  # fewer tiles than SMs: the second consumer has none
    (20000, 512, 1536, 8, torch.bfloat16),  # ~14 tiles a program: both consumers, the ring wraps
])
def test_gpu_hopper_gate_kernel_packs_like_the_triton_kernel(m, d, i, compression, dtype, monkeypatch):
    """The Gluon gate kernel (gate_hopper.py, sm_90 only) against the Triton kernel that CI tests: the same
    counts and the same values and indices in every valid slot, NaN- and -1-poisoned buffers. Small cases
    too: the product uses it from TILES_PER_SM tiles an SM only."""
    torch.manual_seed(0)
    monkeypatch.setattr(gh, "TILES_PER_SM", 0)
    x, gate, _, _ = block(m, d, i, k=29, dtype=dtype)
    x[5, 0] = -30.0  # a dense row: every tile overflows
    x[7, 0] = 50.0  # an empty row
    s = slots(128, compression)
    packed = []
    for hopper in (True, False):
        if not hopper:
            monkeypatch.setattr(batched_module, "hopper_gate_launch", lambda *args: None)
        launch = gate_launch(x, gate, None, 128, s, dtype, gate_config(m, 128, 2, decode=False))
        assert (launch.kernel is gh.gate_pack_kernel) == hopper
        tw = empty_twell(m, i, 128, compression, dtype, x.device)
        tw.values.fill_(float("nan"))
        tw.indices.fill_(-1)
        tw.counts.fill_(-1)
        launch(x, gate, gate, gate, *tw[:3], tw.values)
        packed.append(tw)
    a, b = packed
    valid = torch.arange(s, device=DEV) < a.counts.clamp(max=s)[..., None]
    assert torch.equal(a.counts, b.counts) and (a.counts[5] > s).all() and (a.counts[7] == 0).all()
    assert torch.equal(a.indices[valid], b.indices[valid]) and torch.equal(a.values[valid], b.values[valid])
    assert not a.values[valid].isnan().any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                    or gh.gluon is None, reason="needs an sm_90 GPU and Gluon")
def test_gpu_hopper_gate_kernel_that_does_not_compile_falls_back(monkeypatch):
    """Gluon's API moves between Triton releases: a kernel that fails to compile warns once and leaves the
    batched gate to the Triton kernel; the block stays right."""
    torch.manual_seed(0)

    class Broken:
        def warmup(self, *args, **kwargs):
            raise RuntimeError("tma.async_copy_global_to_shared has been removed")

    monkeypatch.setattr(gh, "gate_pack_kernel", Broken())
    monkeypatch.setattr(gh, "_failures", {})
    monkeypatch.setattr(gh, "TILES_PER_SM", 0)
    monkeypatch.setattr(gm, "LAUNCH_CACHE", type(gm.LAUNCH_CACHE)())
    x, gate, up, down = block(1000, 256, 768, k=29, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="does not compile"):
        assert gh.hopper_gate_launch(x, gate, 128, 16, torch.bfloat16) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second attempt, no second warning
        assert gh.hopper_gate_launch(x, gate, 128, 16, torch.bfloat16) is None
        out = twell.gated_mlp(x, gate, up, down)
    assert rel_err(out, reference(x, gate, up, down)) < 4e-3


@pytest.mark.gpu
def test_gpu_no_sync_cuda_graph_and_compile():
    torch.manual_seed(0)
    x, gate, up, down = block(64, 512, 1536, k=20, dtype=torch.bfloat16)
    down = twell.prepare_down(down)
    overflow = torch.zeros(1, dtype=torch.int64, device=DEV)
    fn = lambda: twell.gated_mlp(x, gate, up, down, overflow=overflow)
    expected = fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    assert torch.equal(out, expected)
    compiled = torch.compile(lambda a: twell.gated_mlp(a, gate, up, down), fullgraph=True)
    assert torch.equal(compiled(x), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [512, 4096, 16384])
def test_gpu_heavy_rows_deterministic_and_capturable(m):
    """Batched bf16 with heavy tokens (1000-2000 units, a dense one, one of 2000 every 2048 tokens) through
    the dense block of heavy rows: within the dense block's error, bit-equal across calls, replayable as a
    CUDA graph."""
    torch.manual_seed(0)
    x, gate, up, down = block(m, 2048, 5632, k=29, dtype=torch.bfloat16)
    bias = NormalDist().inv_cdf(1 - 29 / 5632)
    x[::2048, 0] = NormalDist().inv_cdf(1 - 2000 / 5632) / bias
    x[m // 4, 0] = NormalDist().inv_cdf(1 - 1000 / 5632) / bias
    x[m // 2, 0] = -30.0
    down = twell.prepare_down(down)
    ref = reference(x, gate, up, down)
    dense = (torch.relu(x @ gate.t()) * (x @ up.t())) @ down.t()
    fn = lambda: twell.gated_mlp(x, gate, up, down, compression=2)
    expected = fn()
    for row in (0, m // 4, m // 2):  # the heavy rows (many units: errors averaged) as close as before
        assert rel_err(expected[row], ref[row]) < max(1.25 * rel_err(dense[row], ref[row]), 4e-3), row
    assert_rows_close(expected, ref, bf16_row_bounds(dense, ref))
    assert rel_err(expected, ref) < 4e-3
    ordinary = torch.ones(m, dtype=torch.bool, device=DEV)
    ordinary[::2048] = ordinary[m // 4] = ordinary[m // 2] = False
    assert rel_err(expected[ordinary], ref[ordinary]) < max(1.25 * rel_err(dense[ordinary], ref[ordinary]), 4e-3)
    assert all(torch.equal(fn(), expected) for _ in range(3))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 64, 512, 4096])
def test_gpu_fp32_stays_fp32_with_heavy_rows(m):
    """fp32 inputs at the default precision take fp32 products on every path, the decode tiles' partial rows
    and the dense block of heavy rows included: within fp32's error of an fp64 block (TF32 is ~100x off)."""
    torch.manual_seed(0)
    x, gate, up, down = block(m, 2048, 5632, k=29)
    x[m // 2, 0] = NormalDist().inv_cdf(1 - 2000 / 5632) / NormalDist().inv_cdf(1 - 29 / 5632)
    x[-1, 0] = -30.0  # every unit active
    x64, gate64, up64, down64 = (t.double() for t in (x, gate, up, down))
    ref = (torch.relu(x64 @ gate64.t()) * (x64 @ up64.t())) @ down64.t()
    out = twell.gated_mlp(x, gate, up, twell.prepare_down(down), precision="default")
    assert rel_err(out, ref) < 1e-5
    for row in (m // 2, m - 1):
        assert rel_err(out[row], ref[row]) < 1e-5, row
    assert_rows_close(out, ref, 1e-5, fp32_slack(x, gate, up, down))  # every row: TF32 products are far beyond


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_tensors_on_a_gpu_that_is_not_current():
    """A model spread over GPUs (device_map) runs each layer on its GPU without making it current: the
    kernels launch on the tensors' GPU (decode, batched, graphed, hybrid forward and backward, pack)."""
    torch.manual_seed(0)
    assert torch.cuda.current_device() == 0
    for m in (1, 8, 4096):
        x, gate, up, down = block(m, 512, 1536, k=20, dtype=torch.bfloat16, device="cuda:1")
        down_t = twell.prepare_down(down)
        with torch.cuda.device(1):
            expected = twell.gated_mlp(x, gate, up, down_t)
            packed = twell.unpack(twell.pack(torch.relu(x @ gate.t()), tile=64, compression=4))
        assert rel_err(expected, reference(x, gate, up, down)) < 4e-3
        assert torch.equal(twell.gated_mlp(x, gate, up, down_t), expected)
        graphs = twell.DecodeGraphs()
        for _ in range(3):
            assert torch.equal(graphs(twell.gated_mlp, x, gate, up, down_t), expected)
        assert len(graphs) == (1 if m <= 64 else 0)
        assert torch.equal(twell.unpack(twell.pack(torch.relu(x @ gate.t()), tile=64, compression=4)), packed)

    def hybrid_grads(current):
        leaves = [t.clone().requires_grad_() for t in (x, gate, up, down)]
        with torch.cuda.device(current):
            out, stats = twell.hybrid_gated_mlp(*leaves, max_nnz=32)
            (out.float().square().mean() + stats.l1).backward()
        return [out] + [t.grad for t in leaves]

    assert all(torch.equal(a, b) for a, b in zip(hybrid_grads(0), hybrid_grads(1)))
