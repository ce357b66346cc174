import ast
import dataclasses
import inspect
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, DynamicCache

from helpers import INTERMEDIATE, batched_from, decoder_unfused, sibling, tiny_input_ids, tiny_model, unwritable_folder
from sparsify import export
from sparsify.remote.generation import cache_arguments
from sparsify.errors import OutputError
from sparsify.card import is_hub_id, objective
from sparsify.export import GENERATION_FILE, MODELING_FILE, export_checkpoint
from sparsify.locations import check_output_dir
from twell.reference import forward_reference
from sparsify.families import FAMILIES, spec_for
from sparsify.relufy import relufy
from twell.layer_plan import ALL_TOKENS, LayerPlan, Mode

# Layer 0 on the kernels (tile 64, 2 slots per 64 -> random weights overflow: the dense fallback runs too),
# layer 1 dense.
PLAN = [
    LayerPlan(Mode.SPARSE, 64, 2, ALL_TOKENS, {"mean_active": 70.5, "p99_active": 90, "dead_frac": 0.0125}),
    LayerPlan(stats={"mean_active": 80.0, "p99_active": 100, "dead_frac": 0.0}),
]
TIED = ("gemma", "qwen3")  # released models of these families share the embedding with the LM head
TRAINING = {"base_model": "someone/tiny-base", "tokens": 4096, "steps": 2, "l1": 2e-5, "betas": [0.9, 0.95],
            "perplexity": {"original": 21.217893457, "after training": 20.651234}, "max_steps": 2,
            "max_tokens": 100_000}
# The inference runtime: the files at the top of the kernel package (export.runtime_files)
RUNTIME = {"batched.py", "cache_write.py", "cost_model.py", "decode.py", "decode_attention.py", "decoder.py",
           "epilogues.py", "format.py", "fp8_gate.py", "gate_hopper.py", "gated_mlp.py", "graphs.py", "heavy.py",
           "launch.py", "layer_plan.py", "paths.py", "reference.py", "rms_norm.py", "rotary.py", "routing.py",
           "small_linear.py"}


def _relufied(family, **overrides):
    model, tokenizer = tiny_model(family, **overrides)
    relufy(model)
    return model, tokenizer, spec_for(model.config)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _remote_module(model):
    return sys.modules[type(model).__module__]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_reloads_both_ways_with_the_same_logits(family, tmp_path, monkeypatch):
    model, tokenizer, spec = _relufied(family, tie_word_embeddings=family in TIED)
    out = export_checkpoint(model, tokenizer, tmp_path / f"ckpt-{family}", spec=spec, plan=PLAN,
                            training=TRAINING, max_shard_size="200KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    ids = tiny_input_ids()
    expected = _logits(model, ids)

    plain = AutoModelForCausalLM.from_pretrained(out)
    assert type(plain).__name__ == type(model).__name__
    _close(_logits(plain, ids), expected)

    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert type(remote).__name__ == "TwellForCausalLM" and isinstance(remote, type(model))
    assert Path(inspect.getfile(type(remote))).is_relative_to(os.environ["HF_MODULES_CACHE"])  # not the user's cache
    assert [type(layer.mlp).__name__ for layer in remote.get_submodule(spec.layers)] == ["TwellGatedMLP"] * 2
    assert remote.state_dict().keys() == model.state_dict().keys()
    if family in TIED:
        assert remote.lm_head.weight is remote.model.embed_tokens.weight

    calls = []
    kernel = _remote_module(remote).gated_mlp
    monkeypatch.setattr(_remote_module(remote), "gated_mlp", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    _close(_logits(remote, ids), expected)
    assert [{k: v for k, v in call.items() if k != "overflow"} for call in calls] == \
        [{"tile": 64, "compression": 2, "precision": "highest"}]  # the sparse layer only
    assert calls[0]["overflow"][0].item() > 0  # counted for the layer's ActivityRouter

    generated = remote.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 9) and len(calls) > 1  # prefill and cached decode steps on the kernel
    assert torch.equal(generated, plain.generate(ids[:1, :5], max_new_tokens=4, do_sample=False))


def test_use_fp8_gate_hands_the_sparse_layers_the_gates_fp8_copy(tmp_path, monkeypatch):
    """model.use_fp8_gate(): each kernel call of a sparse layer gets gate_fp8, the e4m3 copy of that layer's
    gate weight as fp8_gate.quantize_weight makes it (16-bit calls only; fp32 ones cannot take it), the
    logits move by the quantization only; use_fp8_gate(False) ends it."""
    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-fp8", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float16)
    module = _remote_module(remote)
    calls = []
    kernel = module.gated_mlp
    monkeypatch.setattr(module, "gated_mlp", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    monkeypatch.setattr(module.ActivityRouter, "loses", lambda self, *measured: False)  # every call on the kernels
    batched_from(monkeypatch, type(remote).__module__, 4)
    decoder_unfused(monkeypatch, type(remote).__module__)
    ids = tiny_input_ids(1, 5)  # the batched path, which reads the fp8 gate
    with torch.no_grad():
        plain = remote(ids).logits.float()
        remote.use_fp8_gate()
        fp8 = remote(ids).logits.float()
        remote.use_fp8_gate(False)
        again = remote(ids).logits.float()
    assert [("gate_fp8" in call) for call in calls] == [False, True, False]
    weight, scale = module.quantize_weight(remote.model.layers[0].mlp.gate_proj.weight)
    assert torch.equal(calls[1]["gate_fp8"][0].float(), weight.float()) and torch.equal(calls[1]["gate_fp8"][1], scale)
    assert torch.equal(again, plain) and 0 < ((fp8 - plain).norm() / plain.norm()).item() < 0.05


def test_use_fp8_up_down_hands_the_sparse_layers_the_e4m3_rows(tmp_path, monkeypatch):
    """model.use_fp8_up_down(): each kernel call of a sparse layer that paths.reads_fp8_up_down takes gets
    up_down_fp8, the e4m3 copies of that layer's up and down weights as fp8_gate.quantize_up_down makes them, a
    call it refuses does not; the logits move by the quantization only; use_fp8_up_down(False) ends it."""
    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-ud8", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float16)
    module = _remote_module(remote)
    rule = module.reads_fp8_up_down.__globals__
    monkeypatch.setitem(rule, "UP_DOWN_FP8_MIN_ROW_BYTES", 0)  # the interpreter's tiny shapes: taken
    calls = []
    kernel = module.gated_mlp
    monkeypatch.setattr(module, "gated_mlp", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    monkeypatch.setattr(module.ActivityRouter, "loses", lambda self, *measured: False)  # every call on the kernels
    batched_from(monkeypatch, type(remote).__module__, 4)
    decoder_unfused(monkeypatch, type(remote).__module__)
    ids = tiny_input_ids(1, 5)
    with torch.no_grad():
        plain = remote(ids).logits.float()
        remote.use_fp8_up_down()
        ud8 = remote(ids).logits.float()
        monkeypatch.setitem(rule, "UP_DOWN_FP8_MIN_ROW_BYTES", 1 << 20)  # refused
        remote(ids)
        remote.use_fp8_up_down(False)
        again = remote(ids).logits.float()
    assert [("up_down_fp8" in call) for call in calls] == [False, True, False, False]
    mlp = remote.model.layers[0].mlp
    copies = module.quantize_up_down(mlp.up_proj.weight, mlp.down_proj.weight)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(calls[1]["up_down_fp8"], copies))
    assert torch.equal(again, plain) and 0 < ((ud8 - plain).norm() / plain.norm()).item() < 0.05


class _Shard(torch.Tensor):
    """A tensor subclass, as a tensor-parallel plan's DTensor shards are."""


@pytest.mark.interpreter  # the kernels on CPU tensors
def test_weights_that_are_tensor_subclasses_run_their_modules_forward(tmp_path, monkeypatch):
    """A layer whose weights are tensor subclasses (DTensor shards under a tensor-parallel plan) runs its MLP's and
    attention projections' own forward: the kernels read plain tensors. The layer before it keeps the kernels."""
    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-shards", spec=spec, plan=[PLAN[0], PLAN[0]],
                            training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    module = _remote_module(remote)
    calls = _record_fused_kernels(remote, monkeypatch)
    kernel = module.gated_mlp
    monkeypatch.setattr(module, "gated_mlp", lambda *a, **k: calls.append(("gated_mlp",)) or kernel(*a, **k))
    layer = remote.model.layers[1]  # the last: the subclass reaches no later layer's inputs
    attention = [getattr(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    for linear in (*layer.mlp.children(), *attention):
        linear.weight = torch.nn.Parameter(linear.weight.detach().as_subclass(_Shard), requires_grad=False)
    short = tiny_input_ids()[:, :8]  # 16 tokens: the projections' decode size
    _close(_logits(remote, short), _logits(model, short))
    launches = [call for call in calls if call[0] in ("gated_mlp", "small_linear", "small_linear_grouped")]
    assert sorted(launches) == [("gated_mlp",), ("small_linear",), ("small_linear_grouped",)]  # layer 0's


def test_router_per_device_and_kernel_dtypes(tmp_path):
    """A layer's ActivityRouter belongs to one device (its counter, the stream its event waits on): a call on
    another device starts a new one. Inputs in a dtype the kernels do not take, or in another dtype than the
    weights (autocast), run dense."""
    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-router", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    mlp = remote.get_submodule(spec.layers)[0].mlp
    x = torch.randn(1, 12, remote.config.hidden_size)
    with torch.no_grad():
        mlp(x)
        router = mlp.router
        assert router is not None and router.device == x.device
        mlp(x)
        assert mlp.router is router
        router.device = torch.device("meta")  # as a layer that ran on another device holds it
        mlp(x)
        assert mlp.router is not router and mlp.router.device == x.device
        assert mlp.use_kernel(x, 12) and not mlp.use_kernel(x.double(), 12) and not mlp.use_kernel(x.half(), 12)


def test_sparse_tokens_window_picks_the_path_per_call(tmp_path, monkeypatch):
    """A layer planned sparse for decode sizes only: prefill runs dense, each one-token step on the kernels."""
    model, tokenizer, spec = _relufied("llama")
    plan = [dataclasses.replace(PLAN[0], sparse_tokens=((1, 1),)), PLAN[1]]
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-window", spec=spec, plan=plan, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    calls = []
    kernel = _remote_module(remote).gated_mlp
    monkeypatch.setattr(_remote_module(remote), "gated_mlp",
                        lambda x, *a, **k: calls.append(x.numel() // x.shape[-1]) or kernel(x, *a, **k))
    ids = tiny_input_ids()
    _close(_logits(remote, ids), _logits(model, ids))
    assert calls == []  # 24 tokens: outside the window
    generated = remote.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    assert calls == [1, 1, 1]  # the 5-token prefill dense, then three single-token steps on the kernel
    assert torch.equal(generated, model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False))

    config = json.loads((out / "config.json").read_text())
    del config["twell"]["layers"][0]["sparse_tokens"]  # as written before windows: every token count
    (out / "config.json").write_text(json.dumps(config))
    mlp = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).model.layers[0].mlp
    assert mlp.in_window(1) and mlp.in_window(24) and mlp.in_window(1 << 20)
    config["twell"]["layers"][0]["sparse_tokens"] = [[0, 4]]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"sparse_tokens must be \[lo, hi\] ranges"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)


class AdaptedLinear(torch.nn.Module):
    """A projection wrapped as PEFT's LoRA layers are: the base as `base_layer` (its weight passed through as
    `.weight`), plus a low-rank update."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base_layer = base
        self.lora_a = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.normal_(self.lora_b.weight, std=0.5)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_b(self.lora_a(x))


@pytest.mark.interpreter  # the kernels on CPU tensors
def test_wrapped_or_hooked_projections_run_their_own_forward(tmp_path, monkeypatch):
    """A layer whose projections were wrapped after loading (LoRA adapters), carry forward hooks or are
    offloaded (accelerate) runs its projections' own forward, not the kernels on their base weights; the other
    layers keep the kernels."""
    from accelerate import cpu_offload
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-adapted", spec=spec, plan=[PLAN[0], PLAN[0]],
                            training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    calls = []
    kernel = _remote_module(remote).gated_mlp
    monkeypatch.setattr(_remote_module(remote), "gated_mlp",
                        lambda x, *a, **k: calls.append(x.shape) or kernel(x, *a, **k))
    torch.manual_seed(0)
    for m in (remote, model):
        mlp = m.model.layers[0].mlp
        torch.manual_seed(0)
        mlp.gate_proj = AdaptedLinear(mlp.gate_proj)
    ids = tiny_input_ids()
    _close(_logits(remote, ids), _logits(model, ids))
    assert len(calls) == 1  # layer 1 on the kernels, layer 0 through its adapter
    seen = []
    hook = remote.model.layers[1].mlp.up_proj.register_forward_hook(lambda *args: seen.append(1))
    calls.clear()
    _close(_logits(remote, ids), _logits(model, ids))
    assert calls == [] and seen == [1]
    hook.remove()
    # accelerate's device hooks (a model spread over devices) keep the kernels; its offload hooks bring the
    # weights in inside the projection's own forward
    add_hook_to_module(remote.model.layers[1].mlp.down_proj, AlignDevicesHook(execution_device="cpu"))
    _close(_logits(remote, ids), _logits(model, ids))
    assert len(calls) == 1
    cpu_offload(remote.model.layers[1].mlp.up_proj, execution_device=torch.device("cpu"))
    assert remote.model.layers[1].mlp.up_proj.weight.is_meta
    calls.clear()
    _close(_logits(remote, ids), _logits(model, ids))
    assert calls == []


def test_batched_calls_follow_the_activity_router(tmp_path, monkeypatch):
    """Eager batched calls count their activity for the layer's ActivityRouter, which judges a window by its
    heavy rows and sampled units as the reference counts them; once a window predicts a loss, the layer runs
    dense for PROBE_EVERY calls with the same logits, then measures again."""
    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-router", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    module = _remote_module(remote)
    calls, verdicts = [], []
    kernel = module.gated_mlp
    monkeypatch.setattr(module, "gated_mlp", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    monkeypatch.setattr(module.ActivityRouter, "WINDOW", 2)
    monkeypatch.setattr(module.ActivityRouter, "PROBE_EVERY", 3)
    monkeypatch.setattr(module.ActivityRouter, "loses",
                        lambda self, *measured: verdicts.append(measured) or True)
    # the batched path, where the kernels count activity, from 9 tokens; rows 0 and 8 sampled (the reference too)
    batched_from(monkeypatch, type(remote).__module__, 9)
    monkeypatch.setattr(sibling(type(remote).__module__, "batched"), "UNIT_SAMPLE", 8)
    monkeypatch.setattr(sys.modules["twell.reference"], "UNIT_SAMPLE", 8)
    monkeypatch.setattr(sys.modules["twell.reference"], "decode_rows", lambda d, width: 8)
    ids = tiny_input_ids(1, 9, seed=4)  # two heavy rows; rows 0 and 8 not
    short = tiny_input_ids(2, 5)  # the calls after the window, each routed by the window's verdict
    mlp = remote.model.layers[0].mlp
    inputs = []
    mlp.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach().clone()))
    window = module.ActivityRouter.WINDOW
    for call in range(window + 3 + 1):
        x = ids if call < window else short
        _close(_logits(remote, x), _logits(model, x))
    assert len(calls) == window + 1  # a window on the kernels, three dense calls, the kernels again
    counter = torch.zeros(4, dtype=torch.int64)
    for x in inputs[:window]:
        forward_reference(x, *mlp._gate_up_weights(), mlp.down_proj.weight, PLAN[0].tile, PLAN[0].compression, counter)
    _, units, rows, heavy = counter.tolist()
    assert rows > 0 and heavy > 0
    # one window: (heavy share, tokens a call, the sampled rows' mean units)
    assert verdicts == [pytest.approx((heavy / (window * ids.numel()), ids.numel(), units / rows))]


def test_only_decode_steps_replay_graphs(tmp_path):
    """Eager calls of one position per sequence go through the layer's DecodeGraphs; prefill calls launch the
    kernels directly, so that a prompt leaves no graph behind and every generate call allocates alike (CUDA-graph
    trees of a compiled decode step key on the static cache's addresses)."""
    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-graphs", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    mlp, graphed = remote.model.layers[0].mlp, []
    replay = mlp.graphs
    mlp.graphs = lambda fn, x, *a, **k: graphed.append(tuple(x.shape[:-1])) or replay(fn, x, *a, **k)
    ids = tiny_input_ids()
    generated = remote.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
    assert graphed == [(2, 1)] * 3  # the 2 x 5 prefill direct, three steps of one position per sequence
    assert torch.equal(generated, model.generate(ids[:, :5], max_new_tokens=4, do_sample=False))


def test_checkpoint_layout(tmp_path):
    model, tokenizer, spec = _relufied("phi3")
    log = tmp_path / "log.json"
    log.write_text("[]")
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"\x89PNG")
    out = export_checkpoint(model, tokenizer, tmp_path / "out-layout", spec=spec, plan=PLAN, training=TRAINING,
                            artifacts={"training_log.json": log, "sparsity.png": plot})
    names = {p.name for p in out.iterdir()}
    # exactly the runtime (no training kernels, no package __init__), and every relative import resolves in it
    assert {name for name in names if name.endswith(".py")} == RUNTIME | {"modeling_twell.py", "generation.py"}
    for name in RUNTIME | {"modeling_twell.py", "generation.py"}:
        relative = {node.module for node in ast.walk(ast.parse((out / name).read_text()))
                    if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert {f"{module}.py" for module in relative} <= names, name
    assert type(AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)).__name__ == "TwellForCausalLM"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md",
            "modeling_twell.py", "generation.py", "training_log.json", "sparsity.png"} <= names
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind

    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == "relu"
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling_twell.TwellForCausalLM"}
    assert config["twell"] == {
        "format_version": 1, "family": "phi3", "training": TRAINING,
        "layers": [{"mode": "sparse", "tile": 64, "compression": 2, "sparse_tokens": [[1, None]],
                    "stats": {"mean_active": 70.5, "p99_active": 90, "dead_frac": 0.0125}},
                   {"mode": "dense", "stats": {"mean_active": 80.0, "p99_active": 100, "dead_frac": 0.0}}],
        "mlp": {"layers": "model.layers", "mlp": "mlp", "gate": None, "up": None, "down": "down_proj",
                "gate_up": "gate_up_proj", "act_key": "hidden_act"},
    }
    modeling = (out / "modeling_twell.py").read_text()
    assert 'BASE_MODEL = "transformers.models.phi3.modeling_phi3.Phi3ForCausalLM"' in modeling.splitlines()

    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "someone/tiny-base" and card.data.library_name == "transformers"
    assert card.data.to_dict()["base_model_relation"] == "finetune"
    assert card.data.pipeline_tag == "text-generation" and "phi3" in card.data.tags
    sparsity = 100 * (1 - 70.5 / INTERMEDIATE)
    assert f"| 0 | 70.5 | {sparsity:.2f} | 1.25 | T64 C2 |" in card.text
    assert "| 1 | 80.0 | 50.00 | 0.00 | dense |" in card.text
    assert "![sparsity.png](sparsity.png)" in card.text
    # readable: plain values, rounded, each limit beside what was reached where they differ
    for row in ("| tokens | 4,096 (at most 100,000) |", "| steps | 2 |", "| l1 | 2e-05 |", "| betas | 0.9, 0.95 |",
                "| perplexity | original 21.22, after training 20.65 |"):
        assert row in card.text.splitlines()
    table = card.text.split("## Training")[1].split("## How to load")[0]
    assert "max_" not in table and '"' not in table
    assert "(loss = cross-entropy + 2e-05 * L1)" in card.text  # the record's absolute L1, no distillation
    assert objective({"l1": 3.5, "l1_relative": True, "distill": 0.5}) == (
        "loss = 0.5 * cross-entropy + 0.5 * KL(source || trained) + 3.5 * L1 / L1_0, "
        "L1_0 the L1 term at the first step")
    assert objective({"l1": 3.5, "l1_relative": True, "distill_hidden": 4}) == (
        "loss = cross-entropy + 4 * hidden-state distance to the source + 3.5 * L1 / L1_0, "
        "L1_0 the L1 term at the first step")
    assert objective({"l1": 0.45, "l1_log_scale": 0.2, "target_sparsity": 0.99}) == (
        "loss = cross-entropy + 0.45 * P; P the sum over the MLP units of eps * log(1 + |h| / eps), eps 0.2 times the "
        "layer's mean |h| over its firing units at the first step; "
        "the weight steered towards 99.0% of the units silent")
    assert 'model.generate(input_ids, max_new_tokens=64, cache_implementation="static")' in card.text


def test_modeling_file_needs_only_torch_and_transformers():
    tree = ast.parse(MODELING_FILE.read_text())
    absolute = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    absolute |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert absolute == {"collections", "functools", "importlib", "math", "torch", "transformers", "warnings"}
    relative = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
    assert relative == {"decode_attention", "decoder", "format", "fp8_gate", "gated_mlp", "graphs", "paths", "routing",
                        "generation", "launch", "layer_plan", "small_linear"}
    generation = ast.parse(GENERATION_FILE.read_text())  # shipped beside it: torch, transformers and the stdlib
    assert {alias.name for node in ast.walk(generation) if isinstance(node, ast.Import) for alias in node.names} \
        | {node.module.split(".")[0] for node in ast.walk(generation) if isinstance(node, ast.ImportFrom)} \
        == {"copy", "inspect", "threading", "torch", "transformers", "weakref"}


def test_remote_model_falls_back_to_dense_math(tmp_path, monkeypatch):
    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-fallback", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = tiny_input_ids()
    calls = []
    kernel = _remote_module(remote).gated_mlp
    monkeypatch.setattr(_remote_module(remote), "gated_mlp", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    logits = remote(ids).logits  # gradients enabled: the inference kernels have no backward
    assert calls == [] and logits.requires_grad
    logits.sum().backward()
    assert remote.model.layers[0].mlp.gate_proj.weight.grad is not None
    monkeypatch.setattr(_remote_module(remote), "use_triton", lambda x: False)  # no triton: no fp32 reference
    _close(_logits(remote, ids), _logits(model, ids))
    assert calls == []
    monkeypatch.setattr(_remote_module(remote), "gated_mlp", None)  # no kernel files
    _close(_logits(remote, ids), _logits(model, ids))
    assert calls == []
    monkeypatch.undo()  # the kernels again (interpreter): the path the two above turned off
    monkeypatch.setattr(_remote_module(remote), "gated_mlp", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    _logits(remote, ids)
    assert calls


def _record_fused_kernels(remote, monkeypatch) -> list:
    """Calls of the remote module's decoder kernels, ("rms_norm",), ("rms_norm_add",), ("rotary",),
    ("small_linear",) or ("small_linear_grouped",), and of their argument checks wherever they run (the modeling
    file or the kernel's file), ("rms_norm_fits",), ("rms_norm_add_fits",), ("rotary_fits",) or
    ("small_linear_fits",) (one a weight: small_linear_grouped_fits runs it for each)."""
    calls, module = [], _remote_module(remote)
    decoder = sys.modules[module.fuse_norms_and_rotary.__module__]  # the checkpoint's decoder.py

    def recorded(label, function):
        return lambda *a, **k: calls.append((label,)) or function(*a, **k)

    for owner, name, label in ((decoder, "rms_norm_fitted", "rms_norm"),
                               (decoder, "rms_norm_add_fitted", "rms_norm_add"), (decoder, "rotary_fitted", "rotary"),
                               (module, "small_linear_fitted", "small_linear"),
                               (module, "small_linear_grouped_fitted", "small_linear_grouped")):
        monkeypatch.setattr(owner, name, recorded(label, getattr(owner, name)))
    for owner, name in ((decoder, "rms_norm_fits"), (decoder, "rms_norm_add_fits"), (decoder, "rotary_fits"),
                        (module, "small_linear_fits")):
        check = getattr(owner, name)
        for where in (owner, sys.modules[check.__module__]):
            monkeypatch.setattr(where, name, recorded(name, check))
    return calls


def _projection_launches(fusion) -> list:
    """A decode-size forward's launches of small_linear in one layer: one a group of DecoderFusion.projections."""
    return [("small_linear_grouped",) if len(group) > 1 else ("small_linear",) for group in fusion.projections]


@pytest.mark.interpreter  # the kernels on CPU tensors
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_decoder_runs_norms_rotary_and_projections_on_the_kernels(family, tmp_path, monkeypatch):
    """Eager inference runs every RMSNorm of the family's class (Qwen3's and Gemma 3's per-head norms too, a
    pre-norm layer's second norm with the residual add before it) and each layer's rotary embedding on the kernels,
    and at decode size (up to small_linear.MAX_ROWS tokens) the attention's projections too (q, k and v in one
    launch; Qwen2's biases), with the plain load's logits, in a whole forward and in cached decode steps; the modules
    keep their classes and weights. Where gradients are recorded the norms and rotary stay on their kernels, with
    the plain load's gradients, the residual adds are torch's and the projections run their own forward; for inputs
    in a dtype the kernels do not take, transformers' modules run."""
    model, tokenizer, spec = _relufied(family, tie_word_embeddings=family in TIED)
    out = export_checkpoint(model, tokenizer, tmp_path / f"ckpt-{family}", spec=spec, plan=[LayerPlan()] * 2,
                            training=TRAINING)
    plain = AutoModelForCausalLM.from_pretrained(out)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    fusion = _remote_module(remote).DECODER_FUSIONS[family]
    norms = [m for m in remote.modules() if type(m).__name__ == fusion.norm]
    layers = remote.get_submodule(spec.layers)
    projections = [getattr(layer.self_attn, name) for layer in layers for group in fusion.projections for name in group]
    assert len(norms) == len([m for m in plain.modules() if type(m).__name__ == fusion.norm]) > 2 * len(layers)
    assert all("forward" in vars(m) for m in (*norms, *(layer.self_attn for layer in layers), *projections))
    assert all(type(p) is torch.nn.Linear for p in projections)
    calls = _record_fused_kernels(remote, monkeypatch)
    # a GPU's SM count, not the interpreter's few: the tiny weights' grids in one round, where small_linear_wins
    monkeypatch.setattr(_remote_module(remote), "device_sms", lambda device: 132)
    ids = tiny_input_ids()  # 24 tokens: above small_linear's bound
    _close(_logits(remote, ids), _logits(plain, ids))
    # pre-norm layers (not Gemma 2's and 3's, with norms after the attention and the MLP too): the residual add and
    # the second norm in one launch
    fused_layers = [layer for layer in layers if "forward" in vars(layer)]
    assert len(fused_layers) == (0 if family in ("gemma2", "gemma3_text") else len(layers))
    rotary = [("rotary",), ("rotary_fits",)] * len(layers)
    kernels = ([("rms_norm",), ("rms_norm_fits",)] * (len(norms) - len(fused_layers)) + rotary
               + [("rms_norm_add",), ("rms_norm_add_fits",), ("rms_norm_fits",)] * len(fused_layers))
    prefill = [call for call in calls if call != ("small_linear_fits",)]  # the projections' checks decline 24 tokens
    assert sorted(prefill) == sorted(kernels)  # every norm and rotary on the kernel, its arguments checked once
    calls.clear()
    short = ids[:, :8]  # 16 tokens
    _close(_logits(remote, short), _logits(plain, short))
    checks = [("small_linear_fits",)] * len(projections)  # each projection's arguments checked once
    assert sorted(calls) == sorted(kernels + _projection_launches(fusion) * len(layers) + checks)
    calls.clear()
    with torch.no_grad():  # a prefill of 12 tokens, then a step of one token a sequence over the cache
        steps = []
        for m in (remote, plain):
            cache = DynamicCache(config=m.config)
            m(ids[:, :6], **cache_arguments(m, cache, torch.arange(6)), use_cache=True)
            steps.append(m(ids[:, 6:7], **cache_arguments(m, cache, torch.tensor([6])), use_cache=True).logits)
        _close(*steps)
    assert calls.count(("small_linear_grouped",)) + calls.count(("small_linear",)) == \
        2 * len(_projection_launches(fusion)) * len(layers)
    calls.clear()
    logits = remote(short).logits  # gradients recorded: the projections' and the add's kernels have no backward
    assert sorted(calls) == sorted([("rms_norm",), ("rms_norm_fits",)] * len(norms) + rotary) and logits.requires_grad
    _close(logits.detach(), _logits(plain, short))
    logits.square().mean().backward()
    plain(short).logits.square().mean().backward()
    for (name, p), q in zip(remote.named_parameters(), plain.parameters()):
        _close(p.grad, q.grad)
    calls.clear()
    remote.double()
    _close(_logits(remote, short), _logits(plain.double(), short))
    assert calls == []


@pytest.mark.interpreter
def test_attention_projections_share_one_launch_and_can_be_turned_off(tmp_path, monkeypatch):
    """q_proj's call launches q, k and v, whose outputs k_proj's and v_proj's calls on the same input take once
    each, unchecked (the group's launch checked the three); any other call launches its own. fuse_projections(False)
    leaves the projections their own forward, fuse_projections() puts the kernel back, with the same logits."""
    model, tokenizer, spec = _relufied("qwen2")  # q, k and v with biases
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-projections", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    attention = remote.model.layers[0].self_attn
    calls = _record_fused_kernels(remote, monkeypatch)
    x, other = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    with torch.no_grad():
        def check(name, x):
            projection = getattr(attention, name)
            _close(projection(x), torch.nn.functional.linear(x, projection.weight, projection.bias))

        for name in ("q_proj", "k_proj", "v_proj"):
            check(name, x)
        assert calls == [("small_linear_fits",)] * 3 + [("small_linear_grouped",)]
        check("k_proj", x)  # taken already
        check("k_proj", other)
        check("q_proj", other)
        check("v_proj", x)  # kept for `other` now, not for x
        assert [call for call in calls if call != ("small_linear_fits",)] == [
            ("small_linear_grouped",), ("small_linear",), ("small_linear",), ("small_linear_grouped",),
            ("small_linear",)]
        ids = tiny_input_ids(length=4)
        fused_logits = remote(ids).logits
        calls.clear()
        remote.fuse_projections(False)
        assert not any("forward" in vars(getattr(attention, name)) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        _close(remote(ids).logits, fused_logits)
        assert ("small_linear",) not in calls and ("small_linear_grouped",) not in calls and ("rotary",) in calls
        remote.fuse_projections()
        calls.clear()
        _close(remote(ids).logits, fused_logits)
        assert calls.count(("small_linear_grouped",)) == calls.count(("small_linear",)) == 2


@pytest.mark.interpreter
def test_a_projection_runs_its_own_forward_where_cublas_wins(tmp_path, monkeypatch):
    """A single projection's decode-size call launches small_linear where small_linear_wins on the device's SM
    count, else runs the module's own forward (cuBLAS); the grouped q, k and v launch either way."""
    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-routed", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    module, attention = _remote_module(remote), remote.model.layers[0].self_attn
    calls = _record_fused_kernels(remote, monkeypatch)
    x = torch.randn(2, 8, attention.o_proj.in_features)  # 16 rows: 64 output rows are 4 programs of 16
    with torch.no_grad():
        for sms, launched in ((4, True), (3, False)):  # one round; 3 SMs: one busy in the second
            monkeypatch.setattr(module, "device_sms", lambda device: sms)
            calls.clear()
            _close(attention.o_proj(x), torch.nn.functional.linear(x, attention.o_proj.weight))
            attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
            assert (("small_linear",) in calls) is launched and calls.count(("small_linear_grouped",)) == 1


class _CudaInput:
    """What ProjectionGroup.signature reads of a projection's input, as a CUDA tensor of `rows` tokens has it."""

    is_cuda, dtype, device = True, torch.bfloat16, torch.device("cuda")

    def __init__(self, rows):
        self.shape = torch.Size((rows, 1, 64))

    def stride(self):
        return (64, 64, 1)


def test_projections_launch_on_a_gpu_only_under_capture(tmp_path, monkeypatch):
    """On a GPU, small_linear serves the projections' captured calls; an uncaptured call runs the module's own
    forward (the Triton launcher's host time would lose to cuBLAS's) but for the first of each signature that the
    kernel serves (the warm-up before a capture), which loads the kernel that the capture launches. On CPU (the
    interpreter) every call launches. A call whose arguments the kernel declines (shape, dtype, the cost rule)
    settles its signature too; one that fused() turns away (recorded gradients) settles nothing. A group that does
    not launch leaves every projection its own forward."""
    model, tokenizer, spec = _relufied("qwen2")  # q, k and v with biases
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-captured", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    attention = remote.model.layers[0].self_attn
    q, k = attention.q_proj, attention.k_proj
    group = q.forward.args[0]
    capturing, served, takes = False, True, True
    launched = []  # the row counts of the calls that reached `launch`
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda linear, x: "own")
    monkeypatch.setattr(group, "fused", lambda x: takes)
    monkeypatch.setattr(group, "launch", lambda index, linear, x: launched.append(x.shape[0]) or (
        "kernel" if served else None))
    one, eight = _CudaInput(1), _CudaInput(8)
    assert [group(q, one) for _ in range(3)] == ["kernel", "own", "own"]
    assert [group(q, eight) for _ in range(2)] == ["kernel", "own"]  # another signature: loaded once too
    assert [group(k, one) for _ in range(2)] == ["kernel", "own"]  # k_proj's own launch: another kernel
    capturing = True
    assert all(group(p, x) == "kernel" for p in (q, k) for x in (one, eight) for _ in range(2))
    capturing, takes = False, False  # turned away by fused() (gradients recorded): checked each call
    assert [group(attention.v_proj, one) for _ in range(2)] == ["own", "own"]
    takes = True
    assert group(attention.v_proj, one) == "kernel" and group(q, one) == "own"
    served, four = False, _CudaInput(4)  # declined by launch (shape, dtype, the cost rule): checked once
    launched.clear()
    assert [group(q, four) for _ in range(3)] == ["own"] * 3 and launched == [4]
    served = True
    assert all(group(q, torch.randn(1, 1, 64)) == "kernel" for _ in range(2))  # CPU tensors: the interpreter
    monkeypatch.undo()

    calls = _record_fused_kernels(remote, monkeypatch)
    monkeypatch.setattr(group, "launch", lambda index, linear, x: None)
    x = torch.randn(2, 1, 64)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            projection = getattr(attention, name)
            _close(projection(x), torch.nn.functional.linear(x, projection.weight, projection.bias))
    assert ("small_linear",) not in calls and ("small_linear_grouped",) not in calls and group.kept is None


def test_fused_decoder_checks_the_installed_transformers(tmp_path, monkeypatch):
    """A norm class that does not compute its form, an apply_rotary_pos_emb that is not the standard one or a
    decoder layer that is not pre-norm (another transformers release) keeps transformers' forward; the projections,
    plain nn.Linear layers, take the kernel in any release. A fused layer in training mode runs its class's forward
    (a family's dropouts)."""
    from transformers.models.llama import modeling_llama

    class PostNormLayer(modeling_llama.LlamaDecoderLayer):
        def forward(self, hidden_states, **kwargs):
            attended, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
            hidden_states = self.input_layernorm(hidden_states + attended)
            return self.post_attention_layernorm(hidden_states + self.mlp(hidden_states))

    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-checks", spec=spec, plan=PLAN, training=TRAINING)
    module = _remote_module(AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True))
    decoder = sys.modules[module.fuse_norms_and_rotary.__module__]  # the checkpoint's decoder.py
    assert decoder.norm_computes(modeling_llama.LlamaRMSNorm, "llama", "variance_epsilon")
    assert not decoder.norm_computes(modeling_llama.LlamaRMSNorm, "gemma", "variance_epsilon")
    assert not decoder.norm_computes(modeling_llama.LlamaRMSNorm, "llama", "eps")
    assert decoder.rotary_computes(modeling_llama.apply_rotary_pos_emb)
    assert not decoder.rotary_computes(lambda q, k, cos, sin: (q, k))
    assert not decoder.rotary_computes(lambda q, k, cos, sin, position_ids: (q, k))  # another signature
    assert decoder.layer_computes(modeling_llama.LlamaDecoderLayer, modeling_llama.LlamaConfig)
    assert not decoder.layer_computes(PostNormLayer, modeling_llama.LlamaConfig)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    monkeypatch.setattr(decoder, "rms_norm_add_fitted", None)  # not reached in training mode
    remote.train()
    _close(_logits(remote, tiny_input_ids()), _logits(AutoModelForCausalLM.from_pretrained(out), tiny_input_ids()))
    monkeypatch.setitem(decoder.DECODER_FUSIONS, "llama", decoder.DecoderFusion("LlamaRMSNorm", "gemma"))
    module.fuse_decoder(model, model.model.layers)
    attention = [layer.self_attn for layer in model.model.layers]
    projections = [p for a in attention for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)]
    assert all("forward" in vars(m) for m in attention + projections)  # nn.Linear: nothing to check
    assert not any("forward" in vars(m) for m in model.modules() if m not in attention + projections)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_gpu_fused_decoder_bf16_logits_and_captured_step(family, tmp_path):
    """bf16 on a GPU: the remote load's logits (norms and rotary on the kernels, MLPs dense) within
    bf16 rounding of the plain load's, both measured against the fp32 model; so are a decode step's captured as
    a CUDA graph (the attention projections on small_linear too), which gives the logits of the step run directly
    (its projections on their own forward)."""
    from sparsify.bench import capture_step
    from sparsify.tune import relative_error

    model, tokenizer, spec = _relufied(family, tie_word_embeddings=family in TIED)
    out = export_checkpoint(model, tokenizer, tmp_path / f"ckpt-{family}", spec=spec, plan=[LayerPlan()] * 2,
                            training=TRAINING)
    ids = tiny_input_ids(4, 40).cuda()
    exact = _logits(model.cuda(), ids)
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).cuda()
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16).cuda()
    rounding = relative_error(_logits(plain, ids).float(), exact)
    assert relative_error(_logits(remote, ids).float(), exact) < 1.5 * rounding
    assert relative_error(_logits(remote, ids), _logits(plain, ids)) < 2 * rounding
    exact_step = capture_step(model, ids)[2].float()
    step_rounding = relative_error(capture_step(plain, ids)[2].float(), exact_step)
    _, _, step, graph_error = capture_step(remote, ids)
    assert relative_error(step.float(), exact_step) < 1.5 * step_rounding and graph_error < 1e-3


@pytest.mark.gpu
def test_gpu_projections_launch_in_the_capture_and_its_warm_up(tmp_path, monkeypatch):
    """A captured decode step (bench.capture_step: warm-up steps on a side stream, then the capture) launches
    small_linear in its first warm-up step, which loads the kernel, and in the capture, which then succeeds and
    replays as the eager step runs (k and v take the group's launch there, so their own kernel is never loaded);
    the step run directly afterwards runs the projections' own forward, turned away before the kernel's checks."""
    from sparsify.bench import capture_step

    model, tokenizer, spec = _relufied("qwen2")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-capture", spec=spec, plan=[LayerPlan()] * 2,
                            training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16).cuda()
    launches = _projection_launches(_remote_module(remote).DECODER_FUSIONS["qwen2"]) * 2  # one step's
    calls = _record_fused_kernels(remote, monkeypatch)
    _, step, _, graph_error = capture_step(remote, tiny_input_ids(4, 40).cuda())
    projection_calls = [call for call in calls if call in launches]
    assert sorted(projection_calls) == sorted(launches * 2) and graph_error < 1e-3  # the first warm-up, the capture
    calls.clear()
    step()
    assert not any(call in launches for call in calls) and ("small_linear_fits",) not in calls  # before the checks


def _failing(error):
    def card(**kwargs):
        raise error

    return card


def test_failure_mid_write_leaves_no_output(tmp_path, monkeypatch):
    model, tokenizer, spec = _relufied("qwen2")
    monkeypatch.setattr(export, "model_card", _failing(RuntimeError("bug")))  # after the weights are written
    with pytest.raises(RuntimeError, match="bug"):
        export_checkpoint(model, tokenizer, tmp_path / "out", spec=spec, plan=PLAN, training=TRAINING)
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setattr(export, "model_card", _failing(OSError("No space left on device")))
    with pytest.raises(OutputError, match="No space left"):  # the environment's problem: a user error
        export_checkpoint(model, tokenizer, tmp_path / "out", spec=spec, plan=PLAN, training=TRAINING)
    assert list(tmp_path.iterdir()) == []

    old = tmp_path / "out"
    old.mkdir()
    (old / "keep.txt").write_text("previous")
    with pytest.raises(OutputError, match="No space left"):
        export_checkpoint(model, tokenizer, old, spec=spec, plan=PLAN, training=TRAINING, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in old.iterdir()] == ["keep.txt"]


def test_existing_output(tmp_path, monkeypatch):
    model, tokenizer, spec = _relufied("mistral")
    out = tmp_path / "out"
    out.mkdir()
    export_checkpoint(model, tokenizer, out, spec=spec, plan=PLAN, training=TRAINING)  # empty: fine
    (out / "stale.txt").write_text("old")

    monkeypatch.setattr(type(model), "save_pretrained", lambda *a, **k: pytest.fail("wrote before checking"))
    with pytest.raises(OutputError, match="not empty"):
        export_checkpoint(model, tokenizer, out, spec=spec, plan=PLAN, training=TRAINING)
    with pytest.raises(OutputError, match="not a folder"):
        check_output_dir(out / "stale.txt", overwrite=True)
    with pytest.raises(OutputError, match=r"cannot be written, .*stale\.txt is a file"):  # before anything is written
        export_checkpoint(model, tokenizer, out / "stale.txt" / "sub" / "deeper", spec=spec, plan=PLAN,
                          training=TRAINING)
    with pytest.raises(OutputError, match="does not exist"):
        export_checkpoint(model, tokenizer, tmp_path / "new", spec=spec, plan=PLAN, training=TRAINING,
                          artifacts={"log.json": tmp_path / "missing.json"})
    monkeypatch.undo()

    export_checkpoint(model, tokenizer, out, spec=spec, plan=PLAN, training=TRAINING, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_layout_mismatch_is_caught_before_writing(tmp_path):
    model, tokenizer = tiny_model("gemma2")
    with pytest.raises(ValueError, match="hidden_activation is 'gelu_pytorch_tanh'"):
        export_checkpoint(model, tokenizer, tmp_path / "a", spec=spec_for(model.config), plan=PLAN, training=TRAINING)
    model, tokenizer, spec = _relufied("llama")
    with pytest.raises(ValueError, match="plan has 1 layers"):
        export_checkpoint(model, tokenizer, tmp_path / "a", spec=spec, plan=PLAN[:1], training=TRAINING)
    model.model.layers[0].mlp.extra = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="extra"):
        export_checkpoint(model, tokenizer, tmp_path / "b", spec=spec, plan=PLAN, training=TRAINING)
    assert list(tmp_path.iterdir()) == []


class FakeHfApi:
    calls = []

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        if kwargs["repo_id"].endswith("denied"):
            raise OSError("403 Forbidden")
        if kwargs["repo_id"].endswith("offline"):
            raise ConnectError("[Errno -2] Name or service not known")


class ConnectError(Exception):
    """As the Hub client's HTTP library raises it: no OSError, no HfHubHTTPError."""


def test_hub_ids_are_what_the_hub_accepts():
    """The card's base_model names a Hub repository only where the source reads as one, never a local path."""
    assert is_hub_id("meta-llama/Llama-2-7b") and is_hub_id("Qwen/Qwen2.5-0.5B")
    assert not any(map(is_hub_id, ["./llama", "../ckpt", "gpt2", "a/b/c", "x/.y", None]))


def test_push_to_hub_creates_the_repo_and_uploads_once(tmp_path, monkeypatch):
    from sparsify import push

    monkeypatch.setattr(push, "HfApi", FakeHfApi)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "README.md").write_text('x = AutoModelForCausalLM.from_pretrained("<this repo or folder>")\n')
    url = push.push_to_hub(tmp_path, "me/sparse", private=True, token="tok")
    assert url == "https://huggingface.co/me/sparse"
    assert (tmp_path / "README.md").read_text() == 'x = AutoModelForCausalLM.from_pretrained("me/sparse")\n'  # its id
    (_, token), (_, repo, create), (_, upload) = FakeHfApi.calls
    assert token == "tok" and repo == "me/sparse"
    assert create == {"private": True, "repo_type": "model", "exist_ok": True}
    assert upload["repo_id"] == "me/sparse" and Path(upload["folder_path"]) == tmp_path
    assert upload["delete_patterns"] == "*"  # one commit: the folder replaces whatever an earlier push left
    with pytest.raises(OutputError, match="403"):
        push.push_to_hub(tmp_path, "me/denied")
    with pytest.raises(OutputError, match=rf"ConnectError: \[Errno -2\] Name or service not known\); the checkpoint "
                                          rf"in {tmp_path} is complete: upload it with "
                                          rf"`hf upload me/offline {tmp_path} "
                                          r"--delete '\*' --private`"):
        push.push_to_hub(tmp_path, "me/offline", private=True)
    spaced = tmp_path / "my model"  # the retry command quoted for a shell
    spaced.mkdir()
    (spaced / "config.json").write_text("{}")
    with pytest.raises(OutputError, match=re.escape(f"`hf upload me/offline '{spaced}' --delete '*'`")):
        push.push_to_hub(spaced, "me/offline")
    with pytest.raises(OutputError, match="no config.json"):
        push.push_to_hub(tmp_path / "missing", "me/sparse")


@pytest.mark.interpreter  # the kernels on CPU tensors
def test_compiled_decode_step_runs_the_kernel_in_one_graph(tmp_path):
    """The down weight is laid out for the kernels at load (the dense layer's left alone), so that a fresh
    model's one-token step over a static cache compiles with fullgraph=True (no graph break) around the
    checkpoint's own gated_mlp op (not the installed package's) and its small_linear op for the attention's
    projections, with the uncompiled model's logits."""
    from transformers import StaticCache

    model, tokenizer, spec = _relufied("llama")
    out = export_checkpoint(model, tokenizer, tmp_path / "ckpt-compile", spec=spec, plan=PLAN, training=TRAINING)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    layers = remote.model.layers
    assert layers[0].mlp.down_proj.weight.t().is_contiguous()
    assert layers[1].mlp.down_proj.weight.is_contiguous()
    ids = tiny_input_ids(length=6)
    graphs = []

    def backend(gm, example_inputs):  # records the graph, runs it as traced
        graphs.append(gm)
        return gm.forward

    def step(forward):
        cache = StaticCache(config=remote.config, max_cache_len=8)
        forward(input_ids=ids, **cache_arguments(remote, cache, torch.arange(ids.shape[1])), use_cache=True)  # prefill
        position = torch.tensor([ids.shape[1]])
        return forward(input_ids=ids[:, -1:], **cache_arguments(remote, cache, position),
                       position_ids=position.expand(ids.shape[0], 1), use_cache=True).logits

    with torch.no_grad():  # compiled first: no eager call has run on the fresh model
        torch._dynamo.reset()
        try:
            compiled = step(torch.compile(remote, backend=backend, fullgraph=True, dynamic=False))
        finally:
            torch._dynamo.reset()
        expected = step(remote)
    assert len(graphs) == 2  # prefill and decode shapes, one graph each
    decode_ops = [node.target for node in graphs[1].graph.nodes if node.op == "call_function"]
    copy_launch = sibling(type(remote).__module__, "launch")
    name = copy_launch.op_name("gated_mlp")
    assert name != sys.modules["twell.launch"].op_name("gated_mlp")
    assert decode_ops.count(getattr(torch.ops.twell, name).default) == 1  # layer 0 only
    # the attention's projections on small_linear: q, k and v in one launch, o in another, in every layer
    projections = getattr(torch.ops.twell, copy_launch.op_name("small_linear")).default
    assert decode_ops.count(projections) == 2 * len(layers)
    _close(compiled, expected)


def test_the_runtime_is_what_the_modeling_file_runs():
    """Every file a checkpoint carries is imported by the modeling file or generation.py, directly or through
    another (flat beside them: relative imports of one level), and imports only files it carries."""
    shipped = {path.stem: path for path in export.shipped_files(export.kernel_dir())}
    reached, reading = set(), ["modeling_twell", "generation"]
    while reading:
        name = reading.pop()
        if name not in reached:
            reached.add(name)
            reading += [node.module or alias.name for node in ast.walk(ast.parse(shipped[name].read_text()))
                        if isinstance(node, ast.ImportFrom) and node.level == 1 for alias in node.names]
    assert reached == set(shipped)


def test_shipped_files_cite_nothing_outside_the_checkpoint():
    """The files a checkpoint carries name no repository folder or document (a reader of the checkpoint has
    neither) and hold no before/after timing (measured figures live in docs/performance.md)."""
    import re

    shipped = export.shipped_files(export.kernel_dir())
    outside = re.compile(r"docs/|benchmarks/|results/|twell\.md|\d+(\.\d+)? ?-> ?\d+(\.\d+)? ?(us|ms)\b")
    cited = [f"{path.name}:{n}" for path in shipped for n, line in enumerate(path.read_text().splitlines(), 1)
             if outside.search(line)]
    assert not cited


def test_a_failed_final_rename_puts_the_old_output_back(tmp_path, monkeypatch):
    """--overwrite moves the old OUT aside (.OUT.old-*) only once the new one is complete; where the new one's
    rename into place then fails, the old OUT goes back, whole, and nothing is left beside it."""
    model, tokenizer, spec = _relufied("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous")
    (out / "sub").mkdir()
    (out / "sub" / "deep.txt").write_text("nested")
    real = Path.rename
    renamed = []

    def rename(self, target):
        renamed.append((Path(self).name, Path(target)))
        if Path(target) == out and Path(self).name.startswith(".out.partial-"):  # the new checkpoint into place
            raise OSError(28, "No space left on device")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OutputError, match=r"writing .*out failed \(.*No space left on device\); nothing was written"):
        export_checkpoint(model, tokenizer, out, spec=spec, plan=PLAN, training=TRAINING, overwrite=True)
    moved_aside, into_place = renamed[:2]
    assert moved_aside[0] == "out" and moved_aside[1].parent.name.startswith(".out.old-") and into_place[1] == out
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no .out.old-* nor .out.partial-* left
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["keep.txt", "sub", "sub/deep.txt"]
    assert (out / "keep.txt").read_text() == "previous" and (out / "sub" / "deep.txt").read_text() == "nested"


def test_an_unwritable_parent_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """OUT is staged beside itself and renamed into place: the nearest existing folder above it must be writable,
    checked before a weight is written (or, by convert, read)."""
    model, tokenizer, spec = _relufied("llama")
    monkeypatch.setattr(type(model), "save_pretrained", lambda *a, **k: pytest.fail("wrote before checking"))
    with unwritable_folder(tmp_path, monkeypatch) as locked:
        for out in (locked / "out", locked / "not" / "yet" / "out"):  # the nearest existing folder above OUT
            with pytest.raises(OutputError, match=rf"{out}: cannot be written, {locked} is not writable"):
                export_checkpoint(model, tokenizer, out, spec=spec, plan=PLAN, training=TRAINING)
            with pytest.raises(OutputError, match="is not writable"):
                check_output_dir(out, overwrite=True)
        assert list(locked.iterdir()) == []
    assert check_output_dir(tmp_path / "out", overwrite=False) == tmp_path / "out"  # a writable parent: fine


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_no_one_can_write_is_refused_as_root_too():
    """/proc takes no new folder, whoever asks (os.access says root may write there)."""
    with pytest.raises(OutputError, match="/proc/out: cannot be written, /proc is not writable"):
        check_output_dir("/proc/out", overwrite=False)


def test_an_old_output_that_cannot_be_put_back_is_named(tmp_path, monkeypatch):
    """Where the new checkpoint's rename into place and the old OUT's return both fail, the error names the
    hidden folder that holds the old OUT."""
    model, tokenizer, spec = _relufied("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous")
    real = Path.rename

    def rename(self, target):
        if Path(target) == out:
            raise OSError(28, "No space left on device")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OutputError, match=r"failed \(.*No space left on device\), and its previous contents could not "
                                          r"be put back: they are in (\S+\.out\.old-\S+/out) ") as error:
        export_checkpoint(model, tokenizer, out, spec=spec, plan=PLAN, training=TRAINING, overwrite=True)
    kept = Path(re.search(r"they are in (\S+) \(", str(error.value)).group(1))
    assert (kept / "keep.txt").read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == [kept.parent.name]  # the new checkpoint's staging is gone
