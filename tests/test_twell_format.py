"""TwELL packing (Triton kernel; interpreter on CPU) against the PyTorch reference."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import twell
import twell.format
from twell.format import pack_reference, slots


def activation(m, width, density):
    """ReLU-like activation with a chosen density, plus an empty row and a fully dense row."""
    g = torch.rand(m, width) - (1 - density)
    g[0] = -1.0
    g[-1] = torch.rand(width) + 0.1
    return torch.relu(g)


def valid_mask(tw):
    return torch.arange(tw.values.shape[2]) < tw.counts.clamp(max=tw.values.shape[2])[..., None]


@pytest.mark.parametrize("m,width,tile,compression,dtype", [
    (5, 100, 32, 8, torch.float32),
    (19, 64, 16, 2, torch.float32),
    (9, 300, 128, 8, torch.float16),  # 16-bit values: the epilogue's one-min-a-slot keys
    (6, 80, 64, 4, torch.bfloat16),
])
def test_pack_matches_reference(m, width, tile, compression, dtype):
    g = activation(m, width, 0.1).to(dtype)
    tw, ref = twell.pack(g, tile, compression), pack_reference(g, tile, compression)
    assert torch.equal(tw.counts, ref.counts)
    valid = valid_mask(ref)
    assert torch.equal(tw.indices[valid], ref.indices[valid])
    assert torch.equal(tw.values[valid], ref.values[valid])
    # the dense row overflows every full tile, the empty row has no entries
    assert (ref.counts[-1, :width // tile] > slots(tile, compression)).all() and (ref.counts[0] == 0).all()


def test_unpack_roundtrip_and_reads_only_valid_slots():
    g = activation(7, 50, 0.05)[1:-1]  # no overflow at these slots
    tw = pack_reference(g, 16, 2)
    assert (tw.counts <= 8).all()
    poisoned = tw._replace(values=torch.where(valid_mask(tw), tw.values, float("nan")),
                           indices=torch.where(valid_mask(tw), tw.indices, 10**6))
    assert torch.equal(twell.unpack(poisoned), g)


def test_slot_count_validation():
    assert slots(256, 8) == 32 and slots(16, 32) == 1
    with pytest.raises(ValueError):
        slots(100, 8)


def test_choose_setting():
    low = twell.choose_setting(29, 6, 2048, 5632, tokens=16384)
    high = twell.choose_setting(300, 20, 2048, 5632, tokens=16384)
    assert low["mode"] == "sparse" and low["compression"] == 8  # 16 slots hold 6
    assert high["mode"] == "dense" and high["compression"] == 4  # 32 slots hold 20
    assert twell.choose_setting(29, 3, 2048, 5632, tokens=1)["mode"] == "sparse"


def test_cost_model_predicts_the_committed_h100_measurements():
    """The fitted constants against the block benchmark's results (every shape and token count): a wrong
    constant, or a kernel change that moves the timings without a refit, fails here."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    rows = [r for name in ("inference_window_h100.json", "inference_h100.json", "inference_tiles_h100.json")
            for r in json.loads((results / name).read_text())["rows"] if r["overflow_tiles"] == 0]
    errors = []
    for r in rows:
        measured = r["dense_ms"] / r["twell_ms"]
        predicted = (twell.format.dense_time(r["D"], r["I"], r["M"])
                     / twell.format.twell_time(r["mean_active"], r["D"], r["I"], r["M"], tile=r["tile"]))
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
        per_unit = (twell.format.ROW_WALK[0] + twell.format.ROW_WALK[1] * r["D"]) / 2
        assert abs(math.log(r["out_ms"] * 1e-3 / r["heavy_units"] / per_unit)) < 0.1, r
    rows = json.loads((results / "heavy_block_h100.json").read_text())["rows"]
    errors = [math.log(twell.format.heavy_time(r["D"], r["I"], r["rows"]) / (r["heavy_ms"] * 1e-3)) for r in rows]
    assert len(rows) == 27 and max(map(abs, errors)) < math.log(1.6)
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) < 0.3
    assert twell.format.heavy_time(2048, 5632, 0) == 0.0
    # a posted row costs the block; the heaviest walked row is then up to HEAVY_UNITS
    walked = twell.format.twell_time(29, 2048, 5632, 4096, twell.format.HEAVY_UNITS)
    assert twell.format.twell_time(29, 2048, 5632, 4096, 2000) == pytest.approx(
        walked + twell.format.heavy_time(2048, 5632, 1))
    assert twell.format.twell_time(29, 2048, 5632, 4096, heavy_rows=64) == pytest.approx(
        twell.format.twell_time(29, 2048, 5632, 4096) + twell.format.heavy_time(2048, 5632, 64))


def test_package_runs_without_triton():
    """Without triton (CPU-only installs) the package imports and falls back to the reference path."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, twell\n"
        "x, g, u, d = torch.randn(3, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)\n"
        "g[:, 0] = 5.0; x[:, 0] = 1.0\n"  # every unit active: the one tile of each row overflows
        "ov = torch.zeros(1, dtype=torch.int64)\n"
        "out = twell.gated_mlp(x, g, u, d, tile=16, compression=8, overflow=ov)\n"
        "assert torch.allclose(out, twell.gated_mlp_reference(x, g, u, d), atol=1e-5)\n"
        "assert ov.item() == 3, ov\n"
        "assert torch.equal(twell.unpack(twell.pack(torch.relu(x), 16, 2)), torch.relu(x))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
