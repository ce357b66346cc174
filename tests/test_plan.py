"""The per-layer plan on synthetic statistics at the paper's shape (D = 2048, I = 5632)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparsify.report import describe
from sparsify.plan import (TOKEN_GRID, choose_measure, measured_by_default, plan_layer, plan_layers,
                           predicted_speedup, token_ranges)
from twell.layer_plan import ALL_TOKENS, Mode

D, I = 2048, 5632


def stats(mean_active, overflow=None):
    """`measure`-like statistics; overflow: {tile: {compression: fraction}}, none by default."""
    overflow = overflow or {t: {c: 0.0 for c in (2, 4, 8, 16)} for t in (64, 128, 256)}
    return {
        "units": I, "mean_active": mean_active, "p99_active": 3 * mean_active, "dead_frac": 0.3,
        "tiles": {str(t): {"max": 40, "p999": 9, "overflow_frac": {str(c): f for c, f in o.items()}}
                  for t, o in overflow.items()},
    }


def test_sparse_at_29_active_without_overflow():
    layer = plan_layer(stats(29), hidden_size=D)
    # no overflow anywhere: tile 128 (the fastest gate kernels); compressions cost the same, and the
    # narrowest packing wins the tie (least memory)
    assert (layer.mode, layer.tile, layer.compression) == (Mode.SPARSE, 128, 16)
    assert layer.stats["predicted_speedup"] > 1.2
    assert layer.stats["overflow_frac"] == 0 and layer.stats["max_tile_active_p999"] == 9
    # sparse at every token count, 65-512 tokens included, where the H100 grids show the thinnest margin
    assert layer.sparse_tokens == ALL_TOKENS and describe(layer) == "T128 C16"


def test_heavy_tokens_overflow_costs_nothing_in_batched_calls():
    """Overflow only from tokens heavy enough for the dense block (overflow_frac_light 0): batched it costs
    nothing, so the plan packs as narrowly as without it; in decode, the overflowing pairs count."""
    layer_stats = stats(29, {t: {c: 0.02 for c in (2, 4, 8, 16)} for t in (64, 128, 256)})
    for t in layer_stats["tiles"].values():
        t["overflow_frac_light"] = {c: 0.0 for c in t["overflow_frac"]}
    light = plan_layer(layer_stats, hidden_size=D)
    plain = plan_layer(stats(29), hidden_size=D)
    assert light.stats["predicted_speedup"] == plain.stats["predicted_speedup"]
    assert light.stats["overflow_frac"] == 0.02
    assert predicted_speedup(29, 0.02, 128, D, I, tokens=1) < predicted_speedup(29, 0.0, 128, D, I, tokens=1)


def test_decode_only_overflow_moves_to_a_smaller_compression():
    """A busy layer whose narrowest packing overflows only in decode (its heavy pairs go to the dense block in
    batched calls, so the 16k-token prediction ties): the packing that does not overflow there wins the tie."""
    overflow = {t: {2: 0.0, 4: 0.0, 8: 0.0015, 16: 0.24} for t in (64, 128, 256)}
    layer_stats = stats(300, overflow)
    for t in layer_stats["tiles"].values():
        t["overflow_frac_light"] = {c: 0.0 for c in t["overflow_frac"]}
    layer = plan_layer(layer_stats, hidden_size=D)
    assert (layer.mode, layer.tile, layer.compression) == (Mode.SPARSE, 128, 8)
    assert layer.sparse_tokens[0][0] == 1  # the decode window stays


def test_decode_overflow_priced_at_the_decode_slots():
    """A decode tile holds at most DECODE_SLOTS units at any compression, so compressions 2 and 4 overflow in
    decode as 8 does: no packing wins the tie for decode pairs it would not keep, and the narrowest stays."""
    overflow = {t: {2: 0.0, 4: 0.0, 8: 0.05, 16: 0.05} for t in (64, 128, 256)}
    layer_stats = stats(29, overflow)
    for t in layer_stats["tiles"].values():
        t["overflow_frac_light"] = {c: 0.0 for c in t["overflow_frac"]}
    assert plan_layer(layer_stats, hidden_size=D).compression == 16


def test_narrow_layers_leave_a_dense_window():
    # decode and long prefills on the kernels, a dense window between (D 896 / I 4864: latency-bound at a few
    # hundred tokens, where the H100 window grid has the kernels about even with dense and the model predicts a loss)
    layer = plan_layer(stats(29) | {"units": 4864}, hidden_size=896)
    (lo, hi), (lo2, hi2) = layer.sparse_tokens
    assert lo == 1 and 64 <= hi < lo2 <= 1024 and hi2 is None
    assert describe(layer) == f"T128 C16 at 1-{hi}, {lo2}+"


def test_wide_layers_run_sparse_at_every_token_count():
    layer = plan_layer(stats(29) | {"units": 14336}, hidden_size=4096)
    assert layer.sparse_tokens == ALL_TOKENS and describe(layer) == "T128 C16"


def test_busy_layers_run_sparse_only_at_decode_sizes():
    for active in (98, 300):
        layer = plan_layer(stats(active), hidden_size=D)
        assert layer.stats["predicted_speedup"] < 1  # at 16k tokens
        # decode is memory-bound: reading 2/3 fewer weights wins even at 300 active units
        assert layer.mode is Mode.SPARSE and layer.sparse_tokens == ((1, layer.sparse_tokens[0][1]),)
        assert 4 <= layer.sparse_tokens[0][1] < 64


def test_token_ranges():
    assert token_ranges([(1, True), (4, True), (16, False), (64, True)]) == [[1, 8], [33, None]]
    assert token_ranges([(1, False), (4, True), (16, True)]) == [[3, None]]
    assert token_ranges([(64, True), (65, False)]) == [[1, 64]]  # adjacent points: the exact boundary
    assert token_ranges([(1, False), (16, False)]) == []


def test_heavy_overflow_moves_to_a_smaller_compression():
    overflow = {t: {2: 0.0, 4: 0.0, 8: 0.02, 16: 0.3} for t in (64, 128, 256)}
    layer = plan_layer(stats(29, overflow), hidden_size=D)
    assert (layer.mode, layer.compression) == (Mode.SPARSE, 4)


def test_overflow_at_one_tile_width_picks_another():
    overflow = {64: {2: 0, 4: 0, 8: 0, 16: 0}, 128: {2: 0.1, 4: 0.1, 8: 0.1, 16: 0.1},
                256: {2: 0.1, 4: 0.1, 8: 0.1, 16: 0.1}}
    assert plan_layer(stats(29, overflow), hidden_size=D).tile == 64


def test_dense_when_every_packing_overflows():
    everywhere = {t: {c: 0.5 for c in (2, 4, 8, 16)} for t in (64, 128, 256)}
    layer = plan_layer(stats(5, everywhere), hidden_size=D)
    assert layer.stats["predicted_speedup"] < 1 and layer.stats["overflow_frac"] == 0.5
    # prefills recompute the overflowing tiles and lose; decode still reads under half the dense bytes
    assert layer.sparse_tokens == ((1, layer.sparse_tokens[0][1]),) and layer.sparse_tokens[0][1] < 64
    # asked for more than its best token count is predicted to give, it runs dense
    best = max(predicted_speedup(5, 0.5, layer.tile, D, I, n) for n in TOKEN_GRID)
    assert plan_layer(stats(5, everywhere), hidden_size=D, min_speedup=best).mode is Mode.DENSE
    assert plan_layer(stats(5, everywhere), hidden_size=D, min_speedup=0.99 * best).mode is Mode.SPARSE


def test_prediction_matches_the_h100_runs():
    """Within 12% of benchmarks/results/inference_h100.json's blocks at T128 C8 and 16384 tokens, each at its
    measured mean of active units (29 and about 98); one token (decode): between the eager calls of
    inference_h100.json and the CUDA-graph replays of robustness_h100.json."""
    rows = json.loads((Path(__file__).parents[1] / "benchmarks/results/inference_h100.json").read_text())["rows"]
    blocks = [row for row in rows if (row["D"], row["I"], row["M"], row["skew"], row["tile"], row["compression"])
              == (D, I, 16384, 0.0, 128, 8)]
    assert len(blocks) == 2
    for row in blocks:
        assert predicted_speedup(row["mean_active"], 0, 128, D, I) == pytest.approx(row["speedup"], rel=0.12)
    assert 2.09 < predicted_speedup(29, 0, 128, D, I, tokens=1) < 2.54


def test_tile_width_ranks_as_measured():
    """benchmarks/results/inference_tiles_h100.json at 4096 and 16384 tokens: tile 128 fastest (on an H100
    the Hopper gate kernel), then 256, then 64, whose gate kernel is the slowest."""
    for tokens in (4096, 16384):
        t64, t128, t256 = (predicted_speedup(29, 0, tile, D, I, tokens) for tile in (64, 128, 256))
        assert t128 > t256 > t64


def test_min_speedup_and_hidden_size_default():
    best = max(predicted_speedup(29, 0, tile, D, I, n) for n in TOKEN_GRID for tile in (64, 128, 256))
    assert plan_layer(stats(29), hidden_size=D, min_speedup=best).mode is Mode.DENSE
    assert plan_layer(stats(29), hidden_size=D, min_speedup=0.99 * best).mode is Mode.SPARSE
    # without the hidden size the paper's I / D ratio stands in: same plan at this shape
    assert plan_layer(stats(29)) == plan_layer(stats(29), hidden_size=D)


def test_layers_narrower_than_the_fitted_shapes_are_dense():
    """The cost model is fitted from D 896 / I 4864 up: a narrower layer (the 192-wide demo, I 528) is not
    planned by extrapolation, however sparse, while the fitted shapes keep their plan."""
    assert plan_layer(stats(29) | {"units": 4864}, hidden_size=896).mode is Mode.SPARSE
    for units, hidden in ((4864, 768), (2816, 1024), (528, 192)):
        layer = plan_layer(stats(2) | {"units": units}, hidden_size=hidden)
        assert layer.mode is Mode.DENSE and "narrower than the cost model's shapes" in layer.stats["reason"]
    narrow = {"units": 48, "mean_active": 2, "p99_active": 5, "dead_frac": 0.0, "tiles": {}}
    assert plan_layer(narrow).mode is Mode.DENSE


def test_plan_layers_keeps_order():
    plans = plan_layers([stats(5), stats(300)], hidden_size=D)
    assert plans == [plan_layer(stats(5), hidden_size=D), plan_layer(stats(300), hidden_size=D)]
    assert plans[0].sparse_tokens != plans[1].sparse_tokens


def test_heavy_tokens_cost_the_dense_block_of_heavy_rows():
    """A token with 1000-2000 active units goes to the dense block of heavy rows at every batched size, one
    such row a call in the plan's prediction: decode and long prefills stay sparse, and the window's lower
    end of prefills moves up (the block's fixed cost weighs most in short calls). Below HEAVY_UNITS the row
    walks itself, in the fitted terms."""
    light = plan_layer(stats(29) | {"max_active": 60}, hidden_size=D)  # about twice the mean: ordinary
    assert light.sparse_tokens == plan_layer(stats(29), hidden_size=D).sparse_tokens
    for heaviest in (1000, 2000):
        heavy = plan_layer(stats(29) | {"max_active": heaviest}, hidden_size=D)
        assert heavy.stats["max_active"] == heaviest
        assert 0.9 * light.stats["predicted_speedup"] < heavy.stats["predicted_speedup"] \
            < light.stats["predicted_speedup"]  # 16384 tokens
        assert 0.7 * predicted_speedup(29, 0.0, 128, D, I, 4096, 60) < predicted_speedup(29, 0.0, 128, D, I, 4096,
                                                                                            heaviest) \
            < predicted_speedup(29, 0.0, 128, D, I, 4096, 60)
        assert heavy.sparse_tokens[0][0] == 1 and heavy.sparse_tokens[-1][1] is None
        assert light.sparse_tokens[-1][0] < heavy.sparse_tokens[-1][0] <= 4096


def test_convert_times_the_kernels_unasked_only_where_the_cost_model_does_not_reach(monkeypatch):
    """`convert` without --measure / --no-measure times the kernels on a GPU for layers narrower than the
    fitted shapes (the cost model would plan them dense), and never off a GPU."""
    import torch

    narrow, wide = (SimpleNamespace(hidden_size=1024, intermediate_size=2816),
                    SimpleNamespace(hidden_size=D, intermediate_size=I))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert measured_by_default(1024, 2816, None) and measured_by_default(896, 4000, "cuda:1")
    assert not measured_by_default(D, I, None) and not measured_by_default(1024, 2816, "cpu")
    assert choose_measure(None, narrow, None, False) and not choose_measure(None, wide, None, False)
    assert not choose_measure(False, narrow, None, False) and choose_measure(True, wide, None, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not choose_measure(None, narrow, None, False)


def test_a_narrow_layers_reason_says_that_timing_its_kernels_needs_a_gpu():
    plan = plan_layer({"units": 528, "mean_active": 19.4, "p99_active": 60, "max_active": 300}, hidden_size=192)
    assert not plan.is_sparse
    assert plan.stats["reason"].endswith(": on a GPU, convert and analyze time the kernels at any width instead "
                                         "(--measure)")
