"""Predicted time of one MLP block on an H100 in bf16, dense and on the TwELL kernels: routing.py decides eager
calls by it, and the sparsify toolkit's planner plans layers by it.

Each launch costs a smooth maximum of its compute and its weight-streaming time plus a fixed latency;
compute runs at peak * D / (D + D_half) (narrow matmuls are less efficient). The constants are fitted to
H100 block benchmarks of 5 shapes, 1-65536 tokens, 29-300 active units and tiles 64-256.
"""
from .decode import DECODE_TILE, decode_tile_stride
from .format import HEAVY_UNITS, HOPPER_TILES_PER_SM, cdiv, decode_rows, out_units_per_step

# The narrowest layer shape the constants were fitted to: narrower layers are outside the model, and a plan
# by it runs them dense.
FITTED_MIN_HIDDEN, FITTED_MIN_INTERMEDIATE = 896, 4864

DENSE = (726e12, 660, 2.74e12, 14.3e-6)  # cuBLAS block: peak flop/s, D_half, weight bytes/s, latency s
HEAVY = (454e12, 0, 2.30e12, 35.7e-6)  # the dense block of heavy rows (Triton, rows gathered), same terms
# Gate matmul with its packing epilogue, same terms, per batched gate kernel (gate_kernel): the Triton
# kernel at each planned tile width, and gate_hopper.py's kernel (tile 128 from HOPPER_TILES_PER_SM tiles an SM)
GATE = {64: (411e12, 255, 4.00e12, 6.0e-6), 128: (621e12, 257, 2.56e12, 7.1e-6),
        256: (681e12, 471, 4.00e12, 15.6e-6), "hopper": (691e12, 400, 1.71e12, 4.9e-6)}
H100_SMS = 132
GATHER = (6.27e12, 2.76e12, 0.000e-9, 17.6e-6)  # up + down rows of the active pairs: bytes/s from L2 and
#                                                 from HBM, seconds per pair, latency of the out kernel
# Decode: bytes/s (gate matrix, active up/down rows), seconds per active column of a gate program's tile (its
# rows' union: each is a serial step of the program, computing u and reading the unit's rows), latency
DECODE = (2.47e12, 0.85e-6, 7.1e-6)
L2_BYTES = 50e6
# Batched, the out kernel walks each row in one program, a few units a step, beside the other rows: a row
# heavier than the rest (a sequence's first token often activates hundreds of units) is a serial chain.
# Seconds per step of that walk at 2 units a step: fixed + per hidden column. A row above HEAVY_UNITS posts
# itself to the dense block of heavy rows instead.
ROW_WALK = (9.8e-7, 6.0e-10)


def roofline(flops: float, nbytes: float, rates: tuple, d: int) -> float:
    """Seconds of a launch at `rates` (peak flop/s, D_half, bytes/s, latency s, as DENSE)."""
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
    return roofline(6 * tokens * d * i, 6 * d * i, DENSE, d)


def heavy_time(d: int, i: int, rows: int) -> float:
    """Predicted seconds of the dense block of `rows` heavy rows (heavy.heavy_launches); none: nothing."""
    return roofline(6 * rows * d * i, 6 * d * i, HEAVY, d) if rows else 0.0


def decode_time(mean_active: float, d: int, i: int, tokens: int, tile: int = 128, rates: tuple = DECODE) -> float:
    """Predicted seconds of a decode-path call (twell_time's decode part; `rates` as DECODE): the gate matrix and
    the active units' up and down rows at the bandwidth, each gate program's active columns (the union of its
    rows' units in its tile) as serial steps, and a latency."""
    bandwidth, per_column, latency = rates
    stride = decode_tile_stride(i, min(tile, DECODE_TILE), tokens, H100_SMS)
    columns = stride * (1 - (1 - min(mean_active / i, 1.0)) ** tokens)
    return (2 * d * i + 4 * d * tokens * mean_active) / bandwidth + columns * per_column + latency


def batched_time(mean_active: float, d: int, i: int, tokens: int, max_active: float | None = None,
                 tile: int = 128, heavy_rows: int | None = None) -> float:
    """Predicted seconds of a batched-path call (twell_time's batched part): the gate kernel at `tile`'s
    rates, the out kernel's gather of the active units' up and down rows (from L2 and HBM); `max_active`, the
    heaviest token's count: up to HEAVY_UNITS its serial walk bounds the out kernel from below (a smooth
    maximum with the gather term: the row runs beside the others); above, the row goes to the dense block of
    heavy rows, whose time is added for `heavy_rows` rows (default: one, the heaviest)."""
    pairs = tokens * mean_active
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
    gate = roofline(2 * tokens * d * i, 2 * d * i, GATE[gate_kernel(tile, tokens, i)], d)
    return gate + (gather ** 4 + walk ** 4) ** 0.25 + heavy_time(d, i, heavy_rows)


def twell_time(mean_active: float, d: int, i: int, tokens: int, max_active: float | None = None,
               tile: int = 128, heavy_rows: int | None = None) -> float:
    """Predicted seconds of `gated_mlp` at `mean_active` units per token (no overflow) with `tile`-wide
    tiles: the term of the launch path that takes `tokens` tokens (paths.PATHS), decode_time up to
    decode_rows (tiles of at most DECODE_TILE units), batched_time above (`max_active` and `heavy_rows` as
    there)."""
    if tokens <= decode_rows(d, i):  # decode spreads a row's units over the gate programs' tiles
        return decode_time(mean_active, d, i, tokens, tile)
    return batched_time(mean_active, d, i, tokens, max_active, tile, heavy_rows)


def speedup(mean_active: float, d: int, i: int, tokens: int, tile: int = 128) -> float:
    """Predicted dense time over `gated_mlp`'s time (twell_time, no overflow) at `mean_active` units per token."""
    return dense_time(d, i, tokens) / twell_time(mean_active, d, i, tokens, tile=tile)
