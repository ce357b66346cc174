"""benchmarks/roofline.py: the bytes and FLOPs it counts, against a hand count, and its table of a model_bench JSON."""
import json

import pytest

from helpers import load_benchmark

roofline = load_benchmark("roofline.py")
SHAPE = {"hidden": 4, "intermediate": 8, "layers": 2}


def test_decode_counts_by_hand():
    dense = roofline.counts(SHAPE, vocab=10, batch=1, seq=1, context=3, active=2, twell=False, lm_head=True)
    # attention: q, k, v, o weights (4 * 16 values) + the context's keys and values (2 * 3 * 4) + 4 activations
    assert dense["attention"] == (2 * 2 * (64 + 24 + 16), 2 * (8 * 16 + 4 * 4 * (3 + 0.5)))
    assert dense["mlp"] == (2 * 2 * (3 * 32 + 2 * 12), 2 * 6 * 32)
    assert dense["lm_head"] == (2 * 40, 2 * 40)
    twell = roofline.counts(SHAPE, vocab=10, batch=1, seq=1, context=3, active=2, twell=True, lm_head=False)
    # the gate whole, the up and down rows of 2 active units, the input and output rows
    assert twell["mlp"] == (2 * 2 * (32 + 2 * 2 * 4 + 2 * 4), 2 * (2 * 32 + 4 * 2 * 4))
    assert twell["lm_head"] == (0.0, 0.0)
    many = roofline.counts(SHAPE, vocab=10, batch=64, seq=16, context=0, active=2, twell=True, lm_head=False)
    assert many["mlp"][0] == 2 * 2 * (32 + 2 * 8 * 4 + 2 * 1024 * 4)  # up and down at most whole


def test_table_of_a_bench_json(tmp_path):
    breakdown = {"wall_ms": 2.0, "attention_ms": 1.0, "mlp_ms": 0.5, "norm_ms": 0.1, "lm_head_ms": 0.05}
    bench = {"device": "NVIDIA H100 80GB HBM3", "shape": SHAPE, "decode_context": 3, "mean_active_all_layers": 2.0,
             "rows": [{"path": "decode_step_graph", "batch": 1, "breakdown": {"dense": breakdown, "twell": breakdown}},
                      {"path": "generate_eager", "batch": 1, "breakdown": {}}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    result = roofline.main([str(tmp_path / "bench.json"), "--vocab", "10", "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads(json.dumps(result))
    [row] = result["rows"]
    attention = row["dense"]["components"]["attention"]
    assert attention["bound_ms"] == pytest.approx(1e3 * 416 / 3.35e12, abs=1e-3)
    assert attention["bandwidth_tb_s"] == pytest.approx(416 / 1e-3 / 1e12, abs=0.01)
    with pytest.raises(SystemExit, match="no peak figures"):
        roofline.peaks("a GPU without figures")
