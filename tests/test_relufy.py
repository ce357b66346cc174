import pytest
import torch

from helpers import INTERMEDIATE, tiny_input_ids, tiny_model
from sparsify.families import FAMILIES, gate_weight, mlp_modules, spec_for, up_weight
from sparsify.relufy import MLPStats, ReluGatedMLP, relu_mlps, relufy, unrelufy


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_relufy_keeps_parameters_and_matches_hf_relu(family):
    model, _ = tiny_model(family)
    spec = spec_for(model.config)
    ids = tiny_input_ids()
    originals = mlp_modules(model, spec)
    params_before = dict(model.named_parameters())
    with torch.no_grad():
        silu_logits = model(ids).logits

    modules = relufy(model)
    assert [type(m) for m in modules] == [ReluGatedMLP] * len(originals)
    assert relu_mlps(model) == modules
    assert getattr(model.config, spec.act_key) == "relu"
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[k] is params_before[k] for k in params_before)  # adopted, not copied
    assert relufy(model) == modules  # idempotent

    reference, _ = tiny_model(family, **{spec.act_key: "relu"})  # same seed: same weights
    with torch.no_grad():
        relu_logits = model(ids).logits
        torch.testing.assert_close(relu_logits, reference(ids).logits, rtol=0, atol=0)
    assert not torch.allclose(relu_logits, silu_logits)

    unrelufy(model)
    assert mlp_modules(model, spec) == originals
    assert getattr(model.config, spec.act_key) != "relu"
    assert dict(model.named_parameters()) == params_before
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, silu_logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_tracked_stats_follow_the_definition(family):
    model, _ = tiny_model(family)
    mlp = relufy(model)[0]
    mlp.track = True
    x = torch.randn(3, 7, model.config.hidden_size)
    out = mlp(x)

    g = x @ gate_weight(mlp, mlp.spec).T
    h = torch.relu(g) * (x @ up_weight(mlp, mlp.spec).T)
    assert isinstance(mlp.stats, MLPStats)
    l1, active, fired = mlp.stats
    torch.testing.assert_close(l1, h.abs().sum(-1).mean())
    torch.testing.assert_close(active, (g > 0).sum(-1).float().mean())
    assert fired.dtype == torch.int64 and fired.shape == (INTERMEDIATE,)
    assert torch.equal(fired, (g > 0).reshape(-1, INTERMEDIATE).sum(0))
    assert not active.requires_grad and not fired.requires_grad

    l1.backward()  # the L1 penalty reaches the gate weights
    projection = getattr(mlp, mlp.spec.gate_source)  # the fused parameter for phi3
    assert projection.weight.grad is not None and projection.weight.grad.abs().sum() > 0
    torch.testing.assert_close(out, h @ getattr(mlp, mlp.spec.down).weight.T)


def test_stats_only_when_tracking_and_hybrid_falls_back_on_cpu():
    model, _ = tiny_model("llama")
    mlp = relufy(model)[0]
    x = torch.randn(4, model.config.hidden_size)
    dense = mlp(x)
    assert mlp.stats is None
    mlp.use_hybrid = True  # CPU tensors: the guarded switch keeps the dense math
    torch.testing.assert_close(mlp(x), dense, rtol=0, atol=0)
