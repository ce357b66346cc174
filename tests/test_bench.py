"""bench and --measure on CPU (clear errors), bench's pure helpers, and tune's choice rule."""
import json

import pytest
import torch
from rich.console import Console

from sparsify.bench import bench_checkpoint, bench_table, logits_agreement, plan_summary, write_json
from sparsify.errors import ConfigError
from sparsify.families import spec_for
from sparsify.tune import WINDOW, layer_plan, measure_plan

from helpers import tiny_model

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")


@cpu_only
def test_bench_and_measure_need_a_gpu(tmp_path):
    with pytest.raises(ConfigError, match="sparsify bench needs a CUDA GPU"):
        bench_checkpoint(tmp_path)
    model, _ = tiny_model("llama")
    with pytest.raises(ConfigError, match="--measure needs a CUDA GPU"):
        measure_plan(model, spec_for(model.config), [torch.arange(8)], device="cpu")


def test_logits_agreement():
    ref = torch.randn(3, 50)
    dense_tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    twell_tokens = torch.tensor([[1, 2, 9, 4], [5, 6, 7, 8]])
    check = logits_agreement(ref, ref * 1.01, dense_tokens, twell_tokens)
    assert check["logits_rel_err"] == pytest.approx(0.01, rel=1e-4)
    assert check["greedy_match"] == 7 / 8
    assert check["greedy_common_prefix"] == (2 + 4) / 2
    assert check["greedy_tokens"] == 8


def result():
    figures = {"dense": {"prefill_ms": 100.0, "prefill_tokens_per_s": 1.3e6, "decode_step_ms": 2.0,
                         "decode_step_tokens_per_s": 500.0, "decode_s": 1.0, "decode_tokens_per_s": 128.0},
               "twell": {"prefill_ms": 80.0, "prefill_tokens_per_s": 1.6e6, "decode_step_ms": 1.25,
                         "decode_step_tokens_per_s": 800.0, "decode_s": 0.8, "decode_tokens_per_s": 160.0},
               "prefill_speedup": 1.25, "decode_step_speedup": 1.6, "decode_speedup": 1.25}
    return {"checkpoint": "ckpt", "device": "GPU", "versions": {}, "batch": 64, "seq_len": 2048, "decode_tokens": 128,
            "decode_batch": 1, "decode_context": 512, "figures": figures, "mean_active_all_layers": 29.3,
            "check": {"logits_rel_err": 4e-3, "decode_step_logits_rel_err": 5e-3, "greedy_match": 1.0, "greedy_common_prefix": 32.0, "greedy_tokens": 128},
            "plan": {"layers": ["T128 C8", "dense"], "sparse_layers": 1, "predicted_speedup": [1.3, 0.6]}}


def test_table_and_json(tmp_path):
    console = Console(record=True, width=200)
    console.print(bench_table(result()))
    text = console.export_text()
    assert "1.25x" in text and "1.60x" in text and "29.3" in text and "1/2 layers sparse" in text and "4.0e-03" in text
    assert "after 512 tokens" in text and "5.0e-03" in text
    path = write_json(result(), tmp_path / "sub" / "bench.json")
    assert json.loads(path.read_text()) == result()


def test_plan_summary():
    class Config:
        twell = {"layers": [{"mode": "sparse", "tile": 128, "compression": 8, "stats": {"predicted_speedup": 1.3}},
                            {"mode": "dense", "stats": {}}]}
    assert plan_summary(Config) == {"layers": ["T128 C8", "dense"], "sparse_layers": 1, "predicted_speedup": [1.3, None]}


def test_measured_plan_takes_the_fastest_correct_candidate():
    activity = {"mean_active": 29.0, "p99_active": 60.0, "dead_frac": 0.1}
    results = {"dense": {"ms": 2.0, "rel_err": 3.3e-3},
               (128, 8): {"ms": 1.5, "rel_err": 2.9e-3, "overflow_frac": 0.0, "ok": True},
               (256, 16): {"ms": 1.0, "rel_err": 0.5, "overflow_frac": 0.0, "ok": False},  # fast but wrong
               (64, 4): {"ms": 1.7, "rel_err": 2.9e-3, "overflow_frac": 0.0, "ok": True}}
    # the chosen setting at fewer tokens: wins at decode sizes, loses at 128-256, one wrong result at 4096
    window = [{"tokens": n, "dense_ms": 0.04, "sparse_ms": s, "ok": n != 4096}
              for n, s in ((1, 0.02), (64, 0.03), (128, 0.05), (256, 0.05), (1024, 0.03), (4096, 0.01))]
    layer = layer_plan(activity, results, window)
    assert (layer["mode"], layer["tile"], layer["compression"]) == ("sparse", 128, 8)
    assert layer["stats"]["measured_speedup"] == pytest.approx(2.0 / 1.5, abs=1e-3)
    assert layer["sparse_tokens"] == [[1, 90], [513, 2048], [8193, None]]
    assert layer["stats"]["window"][0] == [1, 0.04, 0.02]
    slower = {"dense": {"ms": 1.0, "rel_err": 3.3e-3}, (128, 8): {"ms": 1.5, "rel_err": 2.9e-3, "overflow_frac": 0.0, "ok": True}}
    dense = layer_plan(activity, slower, window[2:4])
    assert dense["mode"] == "dense" and dense["stats"]["measured_speedup"] == pytest.approx(0.667, abs=1e-3)
    decode_only = layer_plan(activity, slower, window[:3])
    assert decode_only["sparse_tokens"] == [[1, 90]]
    wrong = {"dense": results["dense"], (256, 16): results[(256, 16)]}
    assert layer_plan(activity, wrong, []) == {"mode": "dense", "stats": {**activity, "dense_ms": 2.0, "dense_rel_err": 3.3e-3}}


@pytest.mark.gpu
def test_measure_plan_times_the_window_on_gpu():
    model, _ = tiny_model("llama", hidden_size=256, intermediate_size=1024)
    model = model.cuda().to(torch.bfloat16)
    blocks = [torch.randint(0, 256, (64,)) for _ in range(4)]
    plan = measure_plan(model, spec_for(model.config), blocks, candidates=[(128, 8), (64, 4)], tokens=2048)
    assert len(plan) == model.config.num_hidden_layers
    for layer in plan:
        assert layer["stats"]["dense_ms"] > 0 and layer["stats"]["dense_rel_err"] < 1e-2
        if "window" in layer["stats"]:  # a correct candidate was timed at every window size below 2048
            assert [w[0] for w in layer["stats"]["window"]] == [n for n in WINDOW if n < 2048]
        for lo, hi in layer.get("sparse_tokens", []):
            assert 1 <= lo and (hi is None or lo <= hi)


def load_model_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "model_bench.py"
    spec = importlib.util.spec_from_file_location("model_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synthetic_model_has_the_requested_activity_and_exports(tmp_path):
    from sparsify.measure import measure

    model_bench = load_model_bench()
    model = model_bench.build_model(hidden=64, intermediate=512, layers=2, heads=4, vocab=300, active=12,
                                    calibration_tokens=512)
    fresh = list(torch.randint(0, 300, (4, 128), generator=torch.Generator().manual_seed(5)))
    stats = measure(model, spec_for(model.config), fresh)
    for layer in stats["layers"]:  # measured on tokens the calibration never saw
        assert layer["mean_active"] == pytest.approx(12, rel=0.25)
    path = model_bench.export(model, tmp_path / "ckpt", active=12, eval_tokens=256)
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_act"] == "relu" and len(config["twell"]["layers"]) == 2
    assert all(layer["stats"]["mean_active"] == pytest.approx(12, rel=0.25) for layer in config["twell"]["layers"])


@pytest.mark.gpu
def test_bench_checkpoint_on_gpu(tmp_path):
    model_bench = load_model_bench()
    model = model_bench.build_model(hidden=256, intermediate=2048, layers=2, heads=4, vocab=300, active=12,
                                    calibration_tokens=512, device="cuda")
    path = model_bench.export(model, tmp_path / "ckpt", active=12, eval_tokens=512)
    result = bench_checkpoint(path, batch=2, seq_len=64, decode_tokens=8, decode_context=32, decode_batch=2)
    f, c = result["figures"], result["check"]
    for name in ("dense", "twell"):
        assert f[name]["decode_step_ms"] > 0 and f[name]["prefill_ms"] > 0 and f[name]["decode_tokens_per_s"] > 0
    assert f["decode_step_speedup"] == pytest.approx(f["dense"]["decode_step_ms"] / f["twell"]["decode_step_ms"])
    assert c["logits_rel_err"] < 2e-2 and c["decode_step_logits_rel_err"] < 2e-2
    assert result["decode_context"] == 32 and result["decode_batch"] == 2
