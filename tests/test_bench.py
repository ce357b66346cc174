"""bench and --measure on CPU (clear errors), bench's pure helpers, and the measured planner's choice rule."""
import json

import pytest
import torch
from rich.console import Console

from sparsify import bench
from sparsify.bench import (MAX_ROUNDS, MIN_TIMED_S, PATHS, SWITCHED_OFF, _median_seconds, bench_checkpoint,
                            bench_table, logits_agreement, path_row, plan_summary, write_json)
from sparsify.profiling import (COMPONENTS, RANGE, _range_of, busy_us, component_split, device_kernels,
                                kernel_component, launch_ids, mlp_layers, module_component, module_ranges,
                                profile_split)
from sparsify.errors import ConfigError, DataError
from sparsify.families import spec_for
from sparsify.plan import measure_plan, timed_layer_plan
from sparsify.tune import WINDOW, capture_mlp_inputs
from twell.layer_plan import ALL_TOKENS, LayerPlan, Mode

from helpers import batched_from, load_benchmark, tiny_input_ids, tiny_model, tiny_tokenizer

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


def split(**ms):
    return {"wall_ms": 10.0, "gpu_busy_ms": 8.0, "gpu_idle_ms": 2.0, **{f"{c}_ms": ms.get(c, 0.0) for c in COMPONENTS}}


def result():
    prefill = path_row("prefill", 64, 131072, {"dense": 1.0, "twell": 0.8},
                       breakdown={"dense": split(mlp=6.0), "twell": split(mlp=4.0)})
    compiled = path_row("generate_compiled", 1, 64, {"dense": 0.4, "twell": 0.25},
                        {"dense": [0.4, 0.5, 0.4], "twell": [0.25, 0.25, 0.2]}, greedy_match=1.0,
                        compile_s={"dense": 61.0, "twell": 58.0}, breakdown={"dense": split(), "twell": split()})
    step = path_row("decode_step_graph", 8, 8, {"dense": 0.002, "twell": 0.00125, "twell_torch_projections": 0.00175,
                                                "twell_sdpa_attention": 0.0015},
                    logits_rel_err=5e-3, small_linear_speedup=1.4, torch_projections_rel_err=2e-3,
                    decode_attention_speedup=1.2, sdpa_attention_rel_err=1e-3,
                    breakdown={"dense": split(), "twell": split()})
    return {"checkpoint": "ckpt", "device": "GPU", "versions": {}, "seq_len": 2048, "decode_tokens": 64,
            "decode_context": 512, "rows": [prefill, compiled, step], "mean_active_all_layers": 29.3,
            "check": {"logits_rel_err": 4e-3, "greedy_match": 1.0, "greedy_common_prefix": 32.0, "greedy_tokens": 128},
            "plan": {"layers": ["T128 C8", "dense"], "sparse_layers": 1, "predicted_speedup": [1.3, 0.6]}}


def test_path_row():
    row = path_row("generate_eager", 8, 512, {"dense": 2.0, "twell": 1.6}, greedy_match=0.9)
    assert row["dense"] == {"ms": 2000.0, "tokens_per_s": 256.0} and row["twell"]["tokens_per_s"] == 320.0
    assert row["speedup"] == pytest.approx(1.25) and row["greedy_match"] == 0.9 and "eager" in row["what"]
    sampled = path_row("generate_eager", 1, 64, {"dense": 2.0, "twell": 1.6},
                       {"dense": [2.0, 3.1, 1.9], "twell": [1.6, 1.5, 2.4]})
    assert sampled["dense"]["samples_ms"] == [2000.0, 3100.0, 1900.0] and sampled["dense"]["ms"] == 2000.0
    assert sampled["paired_speedup"] == pytest.approx(1.25)  # rounds: 2.0/1.6, 3.1/1.5, 1.9/2.4
    assert "paired_speedup" not in row


@pytest.mark.parametrize("call_ms, rounds", [(40.0, 13), (400.0, 3), (1.0, MAX_ROUNDS)])
def test_calls_are_timed_for_at_least_min_timed_s(monkeypatch, call_ms, rounds):
    """`repeats` rounds, more until each call has MIN_TIMED_S of timed calls (0.5 s: 13 calls of 40 ms), at
    most MAX_ROUNDS."""
    class Event:  # every call takes call_ms
        def __init__(self, enable_timing):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            return call_ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    seconds, samples, outputs = _median_seconds({"dense": lambda: 1, "twell": lambda: 2}, repeats=3)
    assert [len(samples["dense"]), len(samples["twell"])] == [rounds, rounds]
    assert seconds == {"dense": call_ms / 1e3, "twell": call_ms / 1e3} and outputs == {"dense": 1, "twell": 2}


def test_table_and_json(tmp_path):
    console = Console(record=True, width=400)
    console.print(bench_table(result()))
    text = console.export_text()
    assert "1.25x" in text and "1.60x (2.00x)" in text and "29.3" in text and "1/2 layers sparse" in text
    assert "4.0e-03" in text and "rel. err 5.0e-03" in text and "compile 61/58 s" in text and "greedy 100%" in text
    assert "131072" in text and "6.00" in text  # the dense prefill's MLP ms in the breakdown
    assert "projections on small_linear 1.40x (rel. err 2.0e-03)" in text  # the step's third and fourth loads
    assert "attention on its kernel 1.20x (rel. err 1.0e-03)" in text
    path = write_json(result(), tmp_path / "sub" / "bench.json")
    assert json.loads(path.read_text()) == result()


def test_component_classification():
    assert module_component("LlamaMLP", is_mlp=True) == "mlp" and module_component("Linear", is_head=True) == "lm_head"
    assert module_component("Qwen3Attention") == "attention" and module_component("LlamaRMSNorm") == "norm"
    assert module_component("LlamaDecoderLayer") is None
    names = {"_gate_pack_kernel": "mlp", "_twell_out_kernel": "mlp", "triton_poi_fused_mul_relu_0": "mlp",
             "flash_fwd_kernel": "attention", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
             "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "norm",
             "nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT": "matmul", "sm90_xmma_gemm_bf16bf16_bf16f32": "matmul",
             "_small_linear_kernel": "matmul", "void at::native::elementwise_kernel<128, 2>": "other"}
    assert {name: kernel_component(name) for name in names} == names


def test_component_split_counts_each_kernel_once():
    # the out kernel, launched while the gate kernel runs (programmatic dependent launch), overlaps it
    kernels = [("mlp", "_gate_pack_kernel", 0.0, 8.0), ("mlp", "_twell_out_kernel", 2.0, 10.0),
               ("attention", "nvjet_gemm", 5.0, 25.0), (None, "elementwise", 30.0, 31.0),
               (None, "nvjet_gemm", 40.0, 50.0), (None, "_twell_out_kernel", 60.0, 64.0)]
    # the range tied the first GEMM to attention; the unranged ones count by their names
    out = component_split(kernels)
    assert out["mlp_ms"] == pytest.approx(0.014)  # 0-10 once, not 8 + 8; and 60-64
    assert out["attention_ms"] == pytest.approx(0.020)
    assert out["matmul_ms"] == pytest.approx(0.010) and out["other_ms"] == pytest.approx(0.001)
    assert out["norm_ms"] == out["lm_head_ms"] == 0
    assert out["gpu_busy_ms"] == pytest.approx(0.040)  # 0-25, 30-31, 40-50, 60-64: overlaps counted once
    assert busy_us([]) == 0 and busy_us([(0, 4), (1, 2), (3, 6)]) == 6


def test_device_kernels_find_the_range_that_launched_them():
    """A kernel belongs to the range around the op whose correlation id it carries (the range's own GPU
    annotation is not a kernel); a kernel whose op ran outside any range has no component."""
    from types import SimpleNamespace as Event

    from torch.autograd import DeviceType

    def cpu(id, name, parent=None, kernels=()):
        return Event(id=id, name=name, device_type=DeviceType.CPU, cpu_parent=parent, kernels=list(kernels))

    def gpu(name, linked, start, end, annotation=False, id=0):
        return Event(id=id, name=name, device_type=DeviceType.CUDA, linked_correlation_id=linked,
                     is_user_annotation=annotation, time_range=Event(start=start, end=end))

    mlp = cpu(1, RANGE + "mlp.1")
    events = [mlp, cpu(2, "twell::gated_mlp", mlp, ["_gate_pack_kernel", "_twell_out_kernel"]),
              cpu(3, "aten::add", None, ["elementwise"]), gpu(RANGE + "mlp.1", 1, 0.0, 12.0, annotation=True),
              gpu("_gate_pack_kernel", 2, 0.0, 8.0), gpu("_twell_out_kernel", 2, 2.0, 10.0),
              gpu("elementwise", 3, 11.0, 12.0)]
    expected = [("mlp.1", "_gate_pack_kernel", 0.0, 8.0), ("mlp.1", "_twell_out_kernel", 2.0, 10.0),
                (None, "elementwise", 11.0, 12.0)]
    assert device_kernels(events) == expected
    assert component_split(expected)["mlp_ms"] == pytest.approx(0.010)  # a layer's range counts for "mlp"
    mlp.time_range = Event(start=-1.0, end=13.0)  # the range's CPU interval: 14 us issuing layer 1's MLP
    assert mlp_layers(expected, events) == [{"gpu_ms": 0.0, "host_ms": 0.0}, {"gpu_ms": 0.010, "host_ms": 0.014}]
    # torch before 2.12: the link comes from the raw events, by the activity's interval
    for e in events:
        if e.device_type == DeviceType.CUDA:
            del e.linked_correlation_id
    assert device_kernels(events, {(0.0, 8.0): 2, (2.0, 10.0): 2, (11.0, 12.0): 3}) == expected
    assert [k[0] for k in device_kernels(events)] == [None, None, None]
    # a Triton kernel links to no op (linked id 0), only to its driver launch call by its own id, in the
    # range; an op with the same number (ids of ops and API calls overlap) does not claim it
    layer0 = cpu(4, RANGE + "mlp.0")
    triton_events = [layer0, cpu(7, "cuLaunchKernelEx", layer0), cpu(7, "aten::empty"),
                     gpu("_twell_out_kernel", 0, 20.0, 26.0, id=7)]
    assert device_kernels(triton_events) == [("mlp.0", "_twell_out_kernel", 20.0, 26.0)]
    triton_events[1] = cpu(7, "aten::empty", layer0)
    assert device_kernels(triton_events) == [(None, "_twell_out_kernel", 20.0, 26.0)]


def test_module_ranges_cover_each_component_once():
    """Ranges around MLPs, attention (not its own q/k norms: they count within it), norms and the head;
    hooks gone afterwards; an op inside an MLP finds its range."""
    model, _ = tiny_model("qwen3")
    layers = model.config.num_hidden_layers
    with torch.no_grad(), module_ranges(model), \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.arange(8)[None])
    events = prof.events()
    counts = {c: sum(e.name.partition(".")[0] == RANGE + c for e in events) for c in COMPONENTS}
    assert counts == {"mlp": layers, "attention": layers, "norm": 2 * layers + 1, "lm_head": 1, "matmul": 0, "other": 0}
    assert (sorted(e.name for e in events if e.name.startswith(RANGE + "mlp"))
            == [f"{RANGE}mlp.{i}" for i in range(layers)])
    inside = [_range_of(e) for e in events if e.name == "aten::mul" and _range_of(e) in ("mlp.0", "attention", "norm")]
    assert {"mlp.0", "norm"} <= set(inside)
    per_layer = mlp_layers([], events)  # host time from the CPU ranges (no device activity here)
    assert len(per_layer) == layers and all(l["host_ms"] > 0 and l["gpu_ms"] == 0 for l in per_layer)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert launch_ids(prof) == {}  # the raw-event API answers (no device activity on the CPU)


def test_plan_summary():
    class Config:
        twell = {"layers": [{"mode": "sparse", "tile": 128, "compression": 8, "stats": {"predicted_speedup": 1.3}},
                            {"mode": "dense", "stats": {}}]}
    assert plan_summary(Config) == {"layers": ["T128 C8", "dense"], "sparse_layers": 1,
                                    "predicted_speedup": [1.3, None]}


def test_measured_plan_takes_the_fastest_correct_candidate():
    activity = {"mean_active": 29.0, "p99_active": 60.0, "dead_frac": 0.1}
    results = {"dense": {"ms": 2.0, "rel_err": 3.3e-3},
               (128, 8): {"ms": 1.5, "rel_err": 2.9e-3, "overflow_frac": 0.0, "ok": True},
               (256, 16): {"ms": 1.0, "rel_err": 0.5, "overflow_frac": 0.0, "ok": False},  # fast but wrong
               (64, 4): {"ms": 1.7, "rel_err": 2.9e-3, "overflow_frac": 0.0, "ok": True}}
    # the chosen setting at fewer tokens: wins at decode sizes, loses at 128-256, one wrong result at 4096
    window = [{"tokens": n, "dense_ms": 0.04, "sparse_ms": s, "ok": n != 4096}
              for n, s in ((1, 0.02), (64, 0.03), (128, 0.05), (256, 0.05), (1024, 0.03), (4096, 0.01))]
    layer = timed_layer_plan(activity, results, window)
    assert (layer.mode, layer.tile, layer.compression) == (Mode.SPARSE, 128, 8)
    assert layer.stats["measured_speedup"] == pytest.approx(2.0 / 1.5, abs=1e-3)
    assert layer.sparse_tokens == ((1, 90), (513, 2048), (8193, None))
    assert layer.stats["window"][0] == [1, 0.04, 0.02]
    slower = {"dense": {"ms": 1.0, "rel_err": 3.3e-3},
              (128, 8): {"ms": 1.5, "rel_err": 2.9e-3, "overflow_frac": 0.0, "ok": True}}
    dense = timed_layer_plan(activity, slower, window[2:4])
    assert dense.mode is Mode.DENSE and dense.stats["measured_speedup"] == pytest.approx(0.667, abs=1e-3)
    decode_only = timed_layer_plan(activity, slower, window[:3])
    assert decode_only.sparse_tokens == ((1, 90),)
    wrong = {"dense": results["dense"], (256, 16): results[(256, 16)]}
    assert timed_layer_plan(activity, wrong, []) == LayerPlan(stats={**activity, "dense_ms": 2.0,
                                                                     "dense_rel_err": 3.3e-3})


def test_capture_mlp_inputs_keeps_or_only_runs():
    """Each layer's MLP input rows, cut (or repeated) to `tokens`, in CPU memory; keep=False runs the same
    forwards (collective under FSDP) and keeps nothing."""
    model, _ = tiny_model("llama")
    spec = spec_for(model.config)
    blocks = [torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    seen = []
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0].clone()))
    xs = capture_mlp_inputs(model, spec, blocks, tokens=20)
    assert len(xs) == model.config.num_hidden_layers and all(x.shape == (20, 64) and x.device.type == "cpu" for x in xs)
    torch.testing.assert_close(xs[0], torch.cat(seen)[:20], rtol=0, atol=0)  # 3 blocks of 8 rows, cut to 20
    assert capture_mlp_inputs(model, spec, blocks, tokens=20, keep=False) == [] and len(seen) == 6
    assert capture_mlp_inputs(model, spec, blocks[:1], tokens=20)[0].shape == (20, 64)  # 8 rows repeated
    hook.remove()


@pytest.mark.gpu
def test_measure_plan_times_the_window_on_gpu():
    model, _ = tiny_model("llama", hidden_size=256, intermediate_size=1024)
    model = model.cuda().to(torch.bfloat16)
    blocks = [torch.randint(0, 256, (64,)) for _ in range(4)]
    plan = measure_plan(model, spec_for(model.config), blocks, candidates=[(128, 8), (64, 4)], tokens=2048)
    assert len(plan) == model.config.num_hidden_layers
    for layer in plan:
        assert layer.stats["dense_ms"] > 0 and layer.stats["dense_rel_err"] < 1e-2
        if "window" in layer.stats:  # a correct candidate was timed at every window size below 2048
            assert [w[0] for w in layer.stats["window"]] == [n for n in WINDOW if n < 2048]
    # the main process of an FSDP run: the whole model in CPU memory, inputs captured on the sharded one
    inputs = capture_mlp_inputs(model, spec_for(model.config), blocks, tokens=2048)
    on_cpu = measure_plan(model.cpu(), spec_for(model.config), blocks, candidates=[(128, 8)], tokens=2048,
                          mlp_inputs=inputs)
    assert len(on_cpu) == model.config.num_hidden_layers and all(l.stats["dense_ms"] > 0 for l in on_cpu)


def load_model_bench():
    return load_benchmark("model_bench.py")


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


def test_model_bench_rejects_counts_below_one_before_any_work(tmp_path, capsys):
    model_bench = load_model_bench()
    with pytest.raises(SystemExit):
        model_bench.main(["--out", str(tmp_path), "--generate-repeats", "0"])
    assert "--generate-repeats must be positive, got 0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.gpu
def test_mlp_layers_find_the_triton_kernels_on_gpu(tmp_path):
    """A converted model whose layers all run the kernels: each layer's MLP range gets its Triton kernels
    (launched through the driver, outside any op), and the layers add up to the MLP total."""
    from transformers import AutoModelForCausalLM

    from sparsify.export import export_checkpoint
    from sparsify.relufy import relufy

    model, tokenizer = tiny_model("llama")
    relufy(model)
    plan = [LayerPlan(Mode.SPARSE, 64, 2, ALL_TOKENS)] * model.config.num_hidden_layers
    path = export_checkpoint(model, tokenizer, tmp_path / "ckpt", spec=spec_for(model.config), plan=plan,
                             training={"base_model": "someone/tiny-base", "tokens": 0, "steps": 0})
    twell_model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).cuda().eval()
    ids = tiny_input_ids(2, 40).cuda()  # 80 tokens: the batched kernels, launched directly
    with torch.inference_mode():
        split = profile_split(lambda: twell_model.get_decoder()(input_ids=ids, use_cache=False), twell_model)
    layers = split["mlp_layers"]
    assert len(layers) == model.config.num_hidden_layers and all(l["gpu_ms"] > 0 for l in layers)
    assert sum(l["gpu_ms"] for l in layers) == pytest.approx(split["mlp_ms"], rel=1e-3)


def test_text_inputs_are_consecutive_held_out_blocks(tmp_path):
    from sparsify.bench import text_inputs
    from sparsify.data import TextData

    (tmp_path / "text.txt").write_text("".join(f"line {i}: some text to read\n" for i in range(400)))
    tokenizer = tiny_tokenizer()
    ids = text_inputs(str(tmp_path / "text.txt"), tokenizer)
    batch = ids(3, 16)
    expected = TextData(str(tmp_path / "text.txt"), tokenizer, 16, eval_tokens=48).eval_blocks
    assert batch.shape == (3, 16) and torch.equal(batch, torch.stack(expected[:3]))
    assert ids(5, 32).shape == (5, 32) and ids(1, 16).shape == (1, 16)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 100)  # fewer blocks than the batch: cycled
    assert torch.equal(text_inputs(str(tiny), tokenizer)(4, 16)[0], text_inputs(str(tiny), tokenizer)(4, 16)[1])
    rows = tmp_path / "rows.jsonl"  # the same text in another column of .jsonl rows
    rows.write_text("".join(json.dumps({"id": i, "body": f"line {i}: some text to read\n"}) + "\n" for i in range(400)))
    assert text_inputs(str(rows), tokenizer, text_column="body")(3, 16).shape == (3, 16)
    with pytest.raises(DataError, match="body"):
        text_inputs(str(rows), tokenizer)(3, 16)


@pytest.mark.gpu
def test_bench_checkpoint_on_gpu(tmp_path):
    model_bench = load_model_bench()
    model = model_bench.build_model(hidden=256, intermediate=2048, layers=2, heads=4, vocab=300, active=12,
                                    calibration_tokens=512, device="cuda")
    path = model_bench.export(model, tmp_path / "ckpt", active=12, eval_tokens=512)
    config = json.loads((path / "config.json").read_text())  # narrower than the cost model's shapes: force sparse
    for layer in config["twell"]["layers"]:
        layer.update(mode="sparse", tile=128, compression=8, sparse_tokens=[[1, None]])
    (path / "config.json").write_text(json.dumps(config))
    result = bench_checkpoint(path, seq_len=64, prefill_batches=(2,), generate_batches=(2,), compiled_batches=(1,),
                              compiled_prefill_batches=(2,), decode_tokens=8, decode_context=32, repeats=1,
                              generate_repeats=3)
    rows = {row["path"]: row for row in result["rows"]}
    for path, least in (("prefill", 1), ("generate_eager", 3), ("generate_compiled", 3), ("generate_graphed", 3)):
        samples = rows[path]["twell"]["samples_ms"]
        assert len(samples) == len(rows[path]["dense"]["samples_ms"]) >= least
        assert sum(samples) >= 1e3 * MIN_TIMED_S or len(samples) == MAX_ROUNDS
    assert set(rows) == {"prefill", "prefill_compiled", "generate_eager", "generate_compiled", "decode_step_graph",
                         "decode_step_compiled_graph", "generate_graphed"}
    assert result["component_time"] == "union"
    generate = rows["generate_eager"]  # beside it, the dense load through the TwELL load's loop
    assert generate["loop_speedup"] == pytest.approx(generate["dense_loop"]["ms"] / generate["twell"]["ms"])
    assert set(generate["first_call_s"]) == {"dense", "twell", "dense_loop"}
    for row in rows.values():
        assert row["speedup"] == pytest.approx(row["dense"]["ms"] / row["twell"]["ms"])
        for load in ("dense", "twell"):
            b = row["breakdown"][load]
            assert row[load]["ms"] > 0 and 0 < b["gpu_busy_ms"] and b["wall_ms"] == pytest.approx(row[load]["ms"])
        assert row["breakdown"]["twell"]["mlp_ms"] > 0
    for load in ("dense", "twell"):  # eager norms run as elementwise kernels: only their module range finds them
        assert rows["prefill"]["breakdown"][load]["norm_ms"] > 0 and rows["prefill"]["breakdown"][load]["mlp_ms"] > 0
        layers = rows["prefill"]["breakdown"][load]["mlp_layers"]  # each layer's MLP: its GPU and host time
        assert len(layers) == 2 and all(l["gpu_ms"] > 0 and l["host_ms"] > 0 for l in layers)
        assert sum(l["gpu_ms"] for l in layers) == pytest.approx(rows["prefill"]["breakdown"][load]["mlp_ms"], rel=1e-3)
    assert "mlp_layers" not in rows["prefill_compiled"]["breakdown"]["twell"]
    assert result["check"]["logits_rel_err"] < 2e-2 and rows["decode_step_graph"]["logits_rel_err"] < 2e-2
    assert rows["decode_step_compiled_graph"]["logits_rel_err"] < 2e-2
    assert max(rows["decode_step_compiled_graph"]["graph_vs_eager_rel_err"].values()) < 1e-2
    step = rows["decode_step_graph"]  # beside it, the TwELL load with the projections on torch's linear, on sdpa
    for name, switch in SWITCHED_OFF.items():
        assert step[switch.speedup] == pytest.approx(step[name]["ms"] / step["twell"]["ms"])
        assert step[switch.error] < 2e-2
        assert name not in rows["decode_step_compiled_graph"]
    assert set(step["eager_step_ms"]) == set(step["breakdown"]) == {"dense", "twell"}
    assert max(step["graph_vs_eager_rel_err"].values()) < 1e-3
    assert rows["generate_compiled"]["compile_s"]["twell"] > 0 and rows["generate_compiled"]["greedy_match"] > 0
    assert rows["prefill_compiled"]["compile_s"]["twell"] > 0
    graphed = rows["generate_graphed"]
    assert (graphed["compile_s"]["twell"] > 0 and graphed["greedy_match"] > 0
            and min(graphed["matches_generate"].values()) > 0)
    assert graphed["tokens"] == 8 and set(PATHS) == set(rows)


def test_prefill_shapes_take_a_batch_or_batch_x_length():
    from sparsify.bench import prefill_shapes

    assert prefill_shapes([1, "8", "64x64", "16x256"], 2048) == [(1, 2048), (8, 2048), (64, 64), (16, 256)]
    for bad in ("64x", "x64", "8y2", "0x64", "4x0"):
        with pytest.raises(ConfigError, match="prefill row"):
            prefill_shapes([bad], 2048)


def test_fp8_gate_mean_active_counts_g_as_the_fp8_load_computes_it(tmp_path, monkeypatch):
    """fp8_gate_mean_active: each layer's mean active units a token from g as its kernel call computes it
    (reference.gate_values: the fp8 gate, bf16 where the dense fallbacks recompute) on the MLP inputs of the
    fp8 load's own forward; a layer the kernels never serve counts its bf16 gate."""
    from transformers import AutoModelForCausalLM

    from sparsify.export import export_checkpoint
    from sparsify.relufy import relufy
    from twell.fp8_gate import quantize_weight
    from twell.reference import gate_values

    model, tokenizer = tiny_model("llama")
    relufy(model)
    spec = spec_for(model.config)
    plan = [LayerPlan(Mode.SPARSE, 64, 2, ALL_TOKENS, {"mean_active": 70.5}), LayerPlan(stats={"mean_active": 80.0})]
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt", spec=spec, plan=plan,
                            training={"base_model": "tiny", "tokens": 1, "steps": 1})
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float16).eval()
    remote.use_fp8_gate()
    mlps = [layer.mlp for layer in remote.model.layers]
    inputs = []
    handles = [m.register_forward_pre_hook(lambda m, a: inputs.append(a[0].reshape(-1, a[0].shape[-1]))) for m in mlps]
    batched_from(monkeypatch, type(remote).__module__, 9)  # the batched path, which reads the fp8 gate
    ids = tiny_input_ids(2, 8)
    active = bench.fp8_gate_mean_active(remote, ids)
    for handle in handles:
        handle.remove()
    gates = [m.gate_proj.weight for m in mlps]
    sparse = gate_values(inputs[0], gates[0], quantize_weight(gates[0]), 64, 2)
    assert active[0] == pytest.approx((sparse > 0).sum().item() / 16)
    assert active[1] == pytest.approx((inputs[1].float() @ gates[1].float().t() > 0).sum().item() / 16)
    assert active[0] != pytest.approx((inputs[0].float() @ gates[0].float().t() > 0).sum().item() / 16)
