"""The per-layer plan rule on synthetic statistics."""
from sparsify.plan import describe, plan_layer, plan_layers


def stats(mean_active, overflow):
    """overflow: {tile: {compression: fraction}}."""
    return {
        "mean_active": mean_active, "p99_active": 3 * mean_active, "dead_frac": 0.3,
        "tiles": {str(t): {"max": 40, "p999": 9, "overflow_frac": {str(c): f for c, f in o.items()}} for t, o in overflow.items()},
    }


CLEAN = {64: {2: 0, 4: 0, 8: 0.01, 16: 0.2}, 128: {2: 0, 4: 0, 8: 0.0005, 16: 0.05}, 256: {2: 0, 4: 0, 8: 0.002, 16: 0.3}}


def test_largest_compression_under_the_overflow_threshold():
    layer = plan_layer(stats(10, CLEAN))
    assert (layer["mode"], layer["tile"], layer["compression"]) == ("sparse", 128, 8)
    assert layer["stats"] == {"mean_active": 10, "p99_active": 30, "dead_frac": 0.3, "max_tile_active_p999": 9, "overflow_frac": 0.0005}
    assert describe(layer) == "T128 C8"


def test_wider_tile_on_ties():
    layer = plan_layer(stats(10, CLEAN), max_overflow=0.01)
    assert (layer["tile"], layer["compression"]) == (256, 8)


def test_dense_when_too_active_or_overflowing():
    assert plan_layer(stats(50, CLEAN)) == {"mode": "dense", "stats": {"mean_active": 50, "p99_active": 150, "dead_frac": 0.3}}
    everywhere = {t: {c: 0.5 for c in (2, 4, 8, 16)} for t in (64, 128, 256)}
    assert plan_layer(stats(5, everywhere))["mode"] == "dense"
    assert describe(plan_layer(stats(5, everywhere))) == "dense"
    assert plan_layer(stats(60, CLEAN), max_active=100)["mode"] == "sparse"


def test_plan_layers_keeps_order():
    assert [p["mode"] for p in plan_layers([stats(5, CLEAN), stats(80, CLEAN)])] == ["sparse", "dense"]
