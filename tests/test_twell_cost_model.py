"""The H100 cost model (twell.cost_model) against the committed block-benchmark results."""
import json
import math
from pathlib import Path

import pytest

from twell import cost_model
from twell.format import HEAVY_UNITS


def test_cost_model_predicts_the_committed_h100_measurements():
    """The fitted constants against the block benchmark's results (every shape and token count): a wrong
    constant, or a kernel change that moves the timings without a refit, fails here."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    rows = [r for name in ("inference_window_h100.json", "inference_h100.json", "inference_tiles_h100.json")
            for r in json.loads((results / name).read_text())["rows"] if r["overflow_tiles"] == 0]
    errors = []
    for r in rows:
        measured = r["dense_ms"] / r["twell_ms"]
        predicted = cost_model.speedup(r["mean_active"], r["D"], r["I"], r["M"], r["tile"])
        errors.append(math.log(predicted / measured))
        if abs(math.log(measured)) > 0.15:  # clear wins and losses are predicted on the right side of 1
            assert (predicted > 1) == (measured > 1), r
    assert len(rows) > 150 and math.sqrt(sum(e * e for e in errors) / len(errors)) < 0.12


def test_cost_model_row_walk_and_heavy_block():
    """Heavy rows. ROW_WALK: the serial walk of a row in one program, against the H100 probe run before
    heavy rows left the walk (heavy_row_h100.json: the rows whose walk outlasted everything else). HEAVY: the
    dense block of heavy rows, against its benchmark (heavy_block_h100.json, three shapes, 1-16384 rows):
    within 60% everywhere (one roofline for its few-row and square-tile modes), 0.3 in rms of log time."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    walked = json.loads((results / "heavy_row_h100.json").read_text())["rows"]
    base = {r["D"]: r["out_ms"] for r in walked if r["heavy_units"] < 100}
    tail = [r for r in walked if r["out_ms"] > 2 * base[r["D"]] and r["overflowing_pairs"] == 0]
    assert {r["D"] for r in tail} == {2048, 4096}
    for r in tail:  # seconds per unit: a step's time over its 2 units
        per_unit = (cost_model.ROW_WALK[0] + cost_model.ROW_WALK[1] * r["D"]) / 2
        assert abs(math.log(r["out_ms"] * 1e-3 / r["heavy_units"] / per_unit)) < 0.1, r
    rows = json.loads((results / "heavy_block_h100.json").read_text())["rows"]
    errors = [math.log(cost_model.heavy_time(r["D"], r["I"], r["rows"]) / (r["heavy_ms"] * 1e-3)) for r in rows]
    assert len(rows) == 27 and max(map(abs, errors)) < math.log(1.6)
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) < 0.3
    assert cost_model.heavy_time(2048, 5632, 0) == 0.0
    # a posted row costs the block; the heaviest walked row is then up to HEAVY_UNITS
    walked = cost_model.twell_time(29, 2048, 5632, 4096, HEAVY_UNITS)
    assert cost_model.twell_time(29, 2048, 5632, 4096, 2000) == pytest.approx(
        walked + cost_model.heavy_time(2048, 5632, 1))
    assert cost_model.twell_time(29, 2048, 5632, 4096, heavy_rows=64) == pytest.approx(
        cost_model.twell_time(29, 2048, 5632, 4096) + cost_model.heavy_time(2048, 5632, 64))
