"""`bench_inference.py --decode-paths` and `--decode-rules`: the decode path against the batched one at 8-64
tokens, and the kernels' decode launch rules against what they replace, in one process (CUDA-graph replays over
the layer copies, per layer; each checked against fp32)."""
import torch

from twell.decode import DECODE_TILE, HELD_ROWS, PART_BYTES, PART_STAGES, decode_gate_config, decode_out_config
from twell.format import DECODE_ROWS, LARGE_LAYER, cdiv, slots

from synthetic_mlp import (HEAVY_FIRST, HEAVY_K, LAYERS, dense, launch_rules, make_heavy, make_layer, make_x,
                           per_layer_us, print_row, reference, rel_err, sparse)

SHAPES = ((896, 4864), (2048, 5632), (2048, 8192), (3584, 18944), (4096, 14336))  # the benchmark and real shapes


def under_rules(row, x, layers, ref, rules, compression=8):
    """`row` with the block of x at tile 128 and `compression` under each of `rules` (name -> launch_rules
    arguments): its error against `ref` (NAME_err) and its time per layer over the layer copies (NAME_us);
    printed."""
    for name, rule_args in rules.items():
        with launch_rules(**rule_args):
            row[name + "_err"] = rel_err(sparse(x, layers[0], 128, compression), ref)
            row[name + "_us"] = per_layer_us(lambda lw: sparse(x, lw, 128, compression), layers)
    print_row(row)
    return row


def decode_paths():
    """Decode path against batched path at 8-64 tokens on the benchmark and real shapes, each forced through
    `decode_rows` (CUDA-graph replays over the layer copies, per layer; each checked against fp32): the
    measurements behind `twell.format.decode_rows` and the decode rows of the cost model's fit."""
    # each path forced at every token count
    paths = {"decode": dict(decode_rows=lambda d, width: 64), "batched": dict(decode_rows=lambda d, width: 0)}
    rows = []
    for d, i in SHAPES:
        layers = [make_layer(d, i, 29) for _ in range(LAYERS)]
        for m in (8, 16, 24, 32, 48, 64):
            x = make_x(m, d)
            ref = reference(x, layers[0])
            row = dict(D=d, I=i, M=m, dense_us=per_layer_us(lambda lw: dense(x, lw), layers))
            rows.append(under_rules(row, x, layers, ref, paths))
        del layers
    return rows


def decode_rules(rules=None):
    """Decode launch rules of the kernels against what they replace, in one process (CUDA-graph replays over
    the layer copies, per layer; each checked against fp32); `rules`: the names of DECODE_RULES to run (all)."""
    return [row for name, rows in DECODE_RULES.items() if not rules or name in rules for row in rows()]


def tile_out_rows():
    """One token, the gate programs write the output's shares and a small kernel adds them (tile_out_launch,
    here whatever TILE_OUT_MAX_D says), against packing TwELL for the out kernel; every shape of SHAPES, 29
    active units."""
    rows = []
    for d, i in SHAPES:
        layers = [make_layer(d, i, HEAVY_K) for _ in range(LAYERS)]
        x = make_x(1, d)
        ref = reference(x, layers[0])
        row = dict(rule="tile_out", D=d, I=i, M=1, dense_us=per_layer_us(lambda lw: dense(x, lw), layers))
        # the path at every D whose rows fit, and never
        rows.append(under_rules(row, x, layers, ref, {"new": dict(TILE_OUT_MAX_D=d), "old": dict(TILE_OUT_MAX_D=0)}))
        del layers
    return rows


def rule_rows(rule, cells, rules, compression=16, heavy_units=HEAVY_FIRST, shape=(2048, 5632)):
    """Rows of `rule` at `shape` (D, I), 29 active units: for each (tokens, heavy rows) of `cells`, heavy rows
    of `heavy_units` units (None: half of them) spread over the tokens from the first, the block under each
    of `rules` (name -> launch_rules arguments) against dense."""
    d, i = shape
    layers = [make_layer(d, i, HEAVY_K) for _ in range(LAYERS)]
    rows = []
    for m, heavy in cells:
        x = make_x(m, d)
        if heavy:
            make_heavy(x, torch.linspace(0, m - 1, heavy).round().long().tolist(), heavy_units or i // 2, i)
        ref = reference(x, layers[0])
        row = dict(rule=rule, D=d, I=i, M=m, heavy_rows=heavy, compression=compression,
                   dense_us=per_layer_us(lambda lw: dense(x, lw), layers),
                   first_token_units=int((x[:1].float() @ layers[0]["gate"].float().t() > 0).sum()))
        rows.append(under_rules(row, x, layers, ref, rules, compression))
    return rows


def partial_rows_rows():
    """The overflowing tiles of heavy rows (HEAVY_FIRST units: a first token among 1-64 tokens, and every row
    of 8 and 64), their partial rows PART_BYTES a step with PART_STAGES in flight, against two in flight
    and against 128 bytes one step at a time."""
    return rule_rows("partial_rows", [(1, 1), (16, 1), (64, 1), (8, 8), (64, 64)], {
        "new": dict(PART_BYTES=PART_BYTES, PART_STAGES=PART_STAGES), "two_stages": dict(PART_STAGES=2),
        "old": dict(PART_BYTES=128, PART_STAGES=1)})


def heavy_tile_rows():
    """A first token with half the units active among 1-64 tokens, and the same calls without it, under the
    decode rules for busy tiles against the ones they replace: a tile of more than UP_COMPACT_COLS active
    columns streams its up rows in one K loop (old: compacted, 16 columns a loop), above HELD_ROWS rows the
    out programs take 128 output columns (old: 256), and at compression 2 a decode tile holds DECODE_SLOTS
    units (old: 32, so that the heavy row's tiles fit and its out programs walk all its units)."""
    def wide_out(m, d, tiles):
        return dict(CH=16, BD=256, num_warps=2) if m > HELD_ROWS else decode_out_config(m, d, tiles)

    old = dict(UP_COMPACT_COLS=DECODE_TILE, decode_out_config=wide_out, decode_slots=slots)
    cells = [(m, heavy) for m in (1, 8, 16, 64) for heavy in (0, 1)]
    return [row for compression in (16, 2) for row in rule_rows(
        "heavy_tiles", cells, {"new": {}, "old": old}, compression, heavy_units=None)]


def tile_stride_rows():
    """Decode calls of 1-16 rows, whose gate programs stream a whole decode tile each (decode_tile_stride: I / 64
    programs, 88 at I = 5632), against I / #SMs units a program (one program an SM, as above 16 rows) and
    I / (2 #SMs); at one token each program writes a partial output row, so narrower tiles write more of them."""
    def stride(programs_per_sm):
        return lambda width, tile, m, sms: tile if sms is None else min(tile, cdiv(width, programs_per_sm * sms))

    return rule_rows("tile_stride", [(m, 0) for m in (1, 2, 8, 16)], {
        "new": {}, "one_a_sm": dict(decode_tile_stride=stride(1)), "two_a_sm": dict(decode_tile_stride=stride(2))})


def gate_rounds_rows():
    """Decode calls of 1-16 rows whose gate grid has more tiles than the GPU has SMs (1536 / 8960: 140 tiles,
    4096 / 14336: 224, against 132 SMs on an H100 or H200) and one whose grid does not (2048 / 5632: 88): K blocks
    of 2 * block_k where crowded, so that two programs share an SM (decode_gate_config), against 4 * block_k
    at every grid; also with a heavy first token (its tiles overflow: the worst case)."""
    def uncrowded(m, block_k, crowded=False):
        return decode_gate_config(m, block_k)

    cells = [(m, 0) for m in (1, 2, 8, 16)] + [(1, 1), (16, 1)]
    return [row for shape in ((1536, 8960), (4096, 14336), (2048, 5632)) for row in rule_rows(
        "gate_rounds", cells, {"new": {}, "old": dict(decode_gate_config=uncrowded)}, shape=shape)]


def wide_layer_rows():
    """Calls of 24-64 rows at a layer wider than a decode tile an SM (1536 / 8960: 140 tiles against 132 SMs),
    whose decode path ends at 32 rows (format.decode_rows), against the decode path up to 64 rows, and the
    same at narrower layers (2048 / 8192, 1024 / 3072), which the rule leaves alone; also with a heavy token."""
    def old(d, width):
        return DECODE_ROWS if d * width <= LARGE_LAYER else 16

    cells = [(m, 0) for m in (24, 32, 48, 64)] + [(64, 1)]
    return [row for shape in ((1536, 8960), (2048, 8192), (1024, 3072)) for row in rule_rows(
        "wide_layers", cells, {"new": {}, "old": dict(decode_rows=old)}, shape=shape)]


DECODE_RULES = {"tile_out": tile_out_rows, "partial_rows": partial_rows_rows, "heavy_tiles": heavy_tile_rows,
                "tile_stride": tile_stride_rows, "gate_rounds": gate_rounds_rows, "wide_layers": wide_layer_rows}
