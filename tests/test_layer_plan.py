"""LayerPlan, the per-layer contract of config.json's "twell" section: reading the format checkpoints carry,
writing it back, and the errors for entries the runtime cannot run."""
import pytest

from twell.layer_plan import ALL_TOKENS, FORMAT_VERSION, LayerPlan, Mode, layer_plans

# A "twell" section as checkpoints of format version 1 hold it, written out literally: a sparse layer with
# token windows, one written before windows existed (none: every token count), a dense layer with the reason
# the cost model gave, and a dense entry with nothing but its mode.
VERSION_1 = {
    "format_version": 1,
    "family": "llama",
    "mlp": {"layers": "model.layers", "mlp": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
            "gate_up": None, "act_key": "hidden_act"},
    "layers": [
        {"mode": "sparse", "tile": 128, "compression": 16, "sparse_tokens": [[1, 90], [513, None]],
         "stats": {"mean_active": 27.1, "p99_active": 90, "max_active": 400, "dead_frac": 0.31,
                   "predicted_speedup": 1.52, "max_tile_active_p999": 12, "overflow_frac": 0.0001}},
        {"mode": "sparse", "tile": 256, "compression": 8,
         "stats": {"mean_active": 20.0, "p99_active": 70, "max_tile_active_p999": 14, "overflow_frac": 0.0}},
        {"mode": "dense", "stats": {"mean_active": 19.3, "p99_active": 51, "max_active": 140, "dead_frac": 0.05,
                                    "reason": "D 192 / I 528 is narrower than the cost model's shapes"}},
        {"mode": "dense"},
    ],
    "training": {"base_model": "demo", "tokens": 819200, "steps": 400, "l1": 0.08},
}


def test_version_1_section_loads_as_it_always_ran():
    assert layer_plans(VERSION_1) == [
        LayerPlan(Mode.SPARSE, 128, 16, ((1, 90), (513, None)), VERSION_1["layers"][0]["stats"]),
        LayerPlan(Mode.SPARSE, 256, 8, ALL_TOKENS, VERSION_1["layers"][1]["stats"]),
        LayerPlan(Mode.DENSE, stats=VERSION_1["layers"][2]["stats"]),
        LayerPlan(Mode.DENSE),
    ]
    without_version = {key: value for key, value in VERSION_1.items() if key != "format_version"}
    assert layer_plans(without_version) == layer_plans(VERSION_1)
    plans = layer_plans(VERSION_1)
    assert plans[0].is_sparse and plans[0].mean_active == 27.1
    assert not plans[3].is_sparse and plans[3].mean_active is None


def test_json_round_trip():
    for plan in layer_plans(VERSION_1):
        assert LayerPlan.from_json(plan.to_json()) == plan
    assert layer_plans(VERSION_1)[0].to_json() == VERSION_1["layers"][0]
    # a plan written before windows gets them written out: every token count
    assert layer_plans(VERSION_1)[1].to_json() == {**VERSION_1["layers"][1], "sparse_tokens": [[1, None]]}
    assert LayerPlan().to_json() == {"mode": "dense", "stats": {}}
    # built in code without windows, a sparse plan runs at every token count, as an entry without them does
    assert LayerPlan(Mode.SPARSE, 128, 8) == LayerPlan.from_json({"mode": "sparse", "tile": 128, "compression": 8})
    assert FORMAT_VERSION == 1


@pytest.mark.parametrize("entry, message", [
    ({"mode": "sparse", "tile": 128, "compression": 8, "sparse_tokens": [[0, 4]]},
     r"sparse_tokens must be \[lo, hi\] ranges \(1 <= lo <= hi, hi null for no bound\), got \[\[0, 4\]\]"),
    ({"mode": "sparse", "tile": 128, "compression": 8, "sparse_tokens": [[8, 4]]}, r"sparse_tokens must be"),
    ({"mode": "sparse", "tile": 128, "compression": 8, "sparse_tokens": [1, None]}, r"sparse_tokens must be"),
    ({"mode": "sparse", "tile": 128, "compression": 8, "sparse_tokens": None}, r"sparse_tokens must be"),
    ({"mode": "Sparse", "tile": 128, "compression": 8}, r"mode must be 'sparse' or 'dense', got 'Sparse'"),
    ({"mode": "sparse", "compression": 8}, r"a sparse layer needs an int tile and compression, got tile None"),
    ({"mode": "sparse", "tile": 100, "compression": 8}, r"tile must be one of"),
    ({"mode": "sparse", "tile": 128, "compression": 3}, r"compression must be a power of two"),
])
def test_entries_the_runtime_cannot_run_are_errors(entry, message):
    with pytest.raises(ValueError, match=message):
        LayerPlan.from_json(entry)


def test_a_newer_format_version_is_an_error():
    with pytest.raises(ValueError, match="format_version 2, but this runtime reads only version 1"):
        layer_plans(VERSION_1 | {"format_version": 2})
    with pytest.raises(ValueError, match='no "layers" list'):
        layer_plans({"format_version": 1})
