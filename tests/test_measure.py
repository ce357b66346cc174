"""Measuring: per-layer statistics against direct computation from the gate pre-activations, on SiLU and
relufied models, fused (Phi-3) and separate projections; perplexity against transformers' loss."""
import math

import pytest
import torch

from helpers import tiny_input_ids, tiny_model
from sparsify.families import spec_for
from sparsify import measure as measure_module
from sparsify.measure import measure, perplexity, slots
from sparsify.relufy import relufy
from twell.format import HEAVY_UNITS


def gate_preactivations(model, ids):
    """[layers] of [tokens, I] gate pre-activations, computed from each MLP's input."""
    inputs = []
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o: inputs.append(a[0])) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
        gates = []
        for layer, x in zip(model.model.layers, inputs):
            mlp = layer.mlp
            g = mlp.gate_up_proj(x).chunk(2, -1)[0] if hasattr(mlp, "gate_up_proj") else mlp.gate_proj(x)
            gates.append(g.flatten(0, 1))
    for h in hooks:
        h.remove()
    return gates


@pytest.mark.parametrize("family, relu", [("llama", False), ("phi3", False), ("qwen3", True)])
def test_statistics_match_direct_computation(family, relu):
    model, _ = tiny_model(family)
    if relu:
        relufy(model)
    ids = tiny_input_ids(batch=3, length=20)
    blocks = list(ids)
    stats = measure(model, spec_for(model.config), blocks, batch_size=2)
    assert stats["tokens"] == 60
    for layer, g in zip(stats["layers"], gate_preactivations(model, ids)):
        active = g > 0
        per_token = active.sum(-1).double()
        assert layer["units"] == 160 and layer["tokens"] == 60
        assert layer["mean_active"] == pytest.approx(per_token.mean().item())
        assert layer["max_active"] == per_token.max().item()
        assert layer["p99_active"] == pytest.approx(torch.quantile(per_token, 0.99).item())
        assert layer["sparsity"] == pytest.approx(1 - per_token.mean().item() / 160)
        assert layer["dead_frac"] == pytest.approx((active.sum(0) == 0).double().mean().item())
        assert set(layer["tiles"]) == {"64", "128"}  # 256 is wider than the 160 units
        per_tile = torch.nn.functional.pad(active, (0, 32)).view(60, -1, 64).sum(-1)  # 160 units -> 3 tiles of 64
        assert layer["tiles"]["64"]["max"] == per_tile.max().item()
        light = (per_token <= HEAVY_UNITS)[:, None]
        for c, frac in layer["tiles"]["64"]["overflow_frac"].items():
            assert frac == pytest.approx((per_tile > slots(64, int(c))).double().mean().item())
            light_frac = layer["tiles"]["64"]["overflow_frac_light"][c]
            assert light_frac == pytest.approx(((per_tile > slots(64, int(c))) & light).double().mean().item())
        by_position = active.view(3, 20, 160).sum(-1).double().mean(0)
        assert layer["position_active"] == pytest.approx(by_position.tolist())


def test_p999_is_the_tile_count_quantile():
    model, _ = tiny_model("llama")
    stats = measure(model, spec_for(model.config), list(tiny_input_ids(batch=4, length=32)))
    for layer in stats["layers"]:
        t = layer["tiles"]["64"]
        assert t["p999"] <= t["max"] and t["overflow_frac"]["2"] <= t["overflow_frac"]["16"]


def test_perplexity_is_exp_of_the_models_loss():
    model, _ = tiny_model("mistral")
    ids = tiny_input_ids(batch=4, length=16)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert perplexity(model, list(ids), batch_size=3) == pytest.approx(math.exp(loss), rel=1e-5)
    assert measure(model, spec_for(model.config), list(ids))["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)


def test_sharded_batches_split_evenly(monkeypatch):
    """Sharded, each process runs as many forwards as the others (FSDP's are collective), and the counted
    ones cover every batch once."""
    blocks = [torch.full((4,), i) for i in range(13)]  # 7 batches of 2 (the last of 1)
    counted = []
    for rank in range(3):
        monkeypatch.setattr(measure_module.dist, "get_rank", lambda: rank)
        monkeypatch.setattr(measure_module.dist, "get_world_size", lambda: 3)
        share = list(measure_module._batches(blocks, 2, sharded=True))
        assert len(share) == 3
        counted += [int(batch[0, 0]) for batch, use in share if use]
        assert all(torch.equal(batch, torch.stack(blocks[:2])) for batch, use in share if not use)  # the first, again
    assert sorted(counted) == list(range(0, 13, 2))
    assert [b.shape[0] for b, _ in measure_module._batches(blocks, 2)] == [2] * 6 + [1]
