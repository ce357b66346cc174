import pytest
import torch

from helpers import INTERMEDIATE, tiny_input_ids, tiny_model
from sparsify.families import FAMILIES, gate_weight, mlp_modules, spec_for, up_weight
from sparsify.relufy import MLPStats, ReluGatedMLP, original_mlps, relufy, unrelufy


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
    assert mlp_modules(model, spec) == modules
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

    with original_mlps(model), torch.no_grad():  # for a while, as before relufy (the config left as it is)
        assert mlp_modules(model, spec) == originals and getattr(model.config, spec.act_key) == "relu"
        torch.testing.assert_close(model(ids).logits, silu_logits, rtol=0, atol=0)
    assert mlp_modules(model, spec) == modules

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


def test_stats_only_when_tracking():
    model, _ = tiny_model("llama")
    mlp = relufy(model)[0]
    mlp(torch.randn(4, model.config.hidden_size))
    assert mlp.stats is None


def test_hybrid_switch_gives_the_dense_results():
    """use_hybrid routes through twell.hybrid_gated_mlp (Triton interpreter on CPU): same output, stats and
    gradients (through an output term and the L1 term) as the dense path. Phi-3: the fused weight's views.
    Small dimensions: the interpreter runs a program per (unit, D chunk)."""
    from sparsify import relufy as relufy_module

    assert relufy_module.hybrid_gated_mlp is not None  # twell is installed with sparsify

    model, _ = tiny_model("phi3", hidden_size=32, intermediate_size=48, head_dim=8)
    mlp = relufy(model)[0]
    mlp.track = True
    x = torch.randn(2, 5, model.config.hidden_size)
    results = []
    for hybrid in (False, True):
        mlp.use_hybrid = hybrid
        mlp.zero_grad()
        out = mlp(x)
        (out.square().sum() + 0.37 * mlp.stats.l1).backward()
        results.append((out.detach(), mlp.stats, [p.grad.clone() for p in mlp.parameters()]))
    (dense, dense_stats, dense_grads), (hybrid, hybrid_stats, hybrid_grads) = results
    torch.testing.assert_close(hybrid, dense, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(hybrid_stats.l1, dense_stats.l1, rtol=1e-4, atol=0)
    torch.testing.assert_close(hybrid_stats.active, dense_stats.active)
    assert torch.equal(hybrid_stats.fired, dense_stats.fired)
    for h, d in zip(hybrid_grads, dense_grads):
        torch.testing.assert_close(h, d, rtol=1e-4, atol=1e-6)
