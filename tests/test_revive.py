"""Reviving dead units (--revive-dead-tokens): the split keeps the layer's output and rescales AdamW's moments, a
training run revives the dead units and logs them, the same seed makes the same run, the data order stays, and the
setting is checked."""
import pytest
import torch
from accelerate import Accelerator

from helpers import HIDDEN, INTERMEDIATE, tiny_model
from test_train import BATCH, SEQ, batches_from, config
from sparsify.errors import ConfigError
from sparsify.relufy import relufy
from sparsify.train import loop, train
from sparsify.train.log import progress_text
from sparsify.train.revive import split_units

DEAD = 40  # layer 0's units made dead: their gate rows zeroed, so that their pre-activation is 0 on every token


def moment_views(mlp, optimizer, name: str) -> list[torch.Tensor]:
    """Copies of mlp.weights() read from AdamW's `name` moments in place of the parameters (they share their
    layout)."""
    params = list(mlp.parameters())
    kept = [p.data for p in params]
    try:
        for p in params:
            p.data = optimizer.state[p][name]
        return [w.clone() for w in mlp.weights()]
    finally:
        for p, data in zip(params, kept):
            p.data = data


@pytest.mark.parametrize("family, overrides", [("llama", {}), ("llama", {"mlp_bias": True}), ("phi3", {})])
def test_a_split_keeps_the_layers_output_and_rescales_the_moments(family, overrides):
    """Without noise the layer computes the same; the copies' moments are zeroed, those of the sources' gate and up
    rows scaled as their halved gradient (exp_avg by 1/2, exp_avg_sq by 1/4), the rest unchanged. phi3: views into
    the fused gate_up weight."""
    model, _ = tiny_model(family, **overrides)
    mlp = relufy(model)[0]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # biases, which the model initializes to zero, made to matter
        for p in mlp.parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=generator))
    x = torch.randn(3, 7, HIDDEN, generator=generator)
    optimizer = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    mlp(x).square().mean().backward()
    optimizer.step()
    before = {name: moment_views(mlp, optimizer, name) for name in ("exp_avg", "exp_avg_sq")}
    sources, targets = torch.tensor([3, 50, 7]), torch.tensor([100, 8, 159])
    with torch.no_grad():  # the targets made dead as the output sees them, after a step that gave them moments
        mlp.weights()[2][:, targets] = 0
        expected = mlp(x)
    split_units(mlp, sources, targets, generator, noise=0.0, optimizer=optimizer)

    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected)
    gate, up, down = mlp.weights()
    assert torch.equal(gate[targets], gate[sources]) and torch.equal(up[targets], up[sources])
    assert torch.equal(down[:, targets], down[:, sources])
    others = torch.tensor([i for i in range(INTERMEDIATE) if i not in sources and i not in targets])
    for name, power in (("exp_avg", 1), ("exp_avg_sq", 2)):
        for old, new, dim, scale in zip(before[name], moment_views(mlp, optimizer, name), (0, 0, 1),
                                        (0.5 ** power, 0.5 ** power, 1)):
            assert old.index_select(dim, targets).abs().sum() > 0  # the test moves moments that are there
            assert not new.index_select(dim, targets).any()
            torch.testing.assert_close(new.index_select(dim, sources), old.index_select(dim, sources) * scale)
            assert torch.equal(new.index_select(dim, others), old.index_select(dim, others))


def test_noise_sets_the_copies_apart():
    model, _ = tiny_model("llama")
    mlp = relufy(model)[0]
    sources, targets = torch.arange(10), torch.arange(100, 110)
    split_units(mlp, sources, targets, torch.Generator().manual_seed(0))
    gate = mlp.weights()[0].detach()
    apart = (gate[targets] - gate[sources]).norm(dim=1) / gate[sources].norm(dim=1)
    assert ((0.005 < apart) & (apart < 0.02)).all()  # gaussian noise of 1e-2 of the row's RMS


def _with_dead_units(seed: int = 0):
    model, _ = tiny_model("llama", seed=seed)
    mlps = relufy(model)
    with torch.no_grad():  # pre-activation exactly 0: never > 0, and no gradient revives them
        mlps[0].gate_proj.weight[:DEAD] = 0
    return model, mlps


def test_dead_units_are_revived_and_logged(monkeypatch):
    model, mlps = _with_dead_units()
    revivals = []  # per revival: exp_avg of layer 0 before and after it, and the units' last firing after it

    def recorded(run, state, outcome, entry):
        moments = moment_views(mlps[0], run.optimizer, "exp_avg")
        revive_dead(run, state, outcome, entry)
        revivals.append((moments, moment_views(mlps[0], run.optimizer, "exp_avg"), state.last_fired.clone()))

    revive_dead = loop.revive_dead
    monkeypatch.setattr(loop, "revive_dead", recorded)
    step_tokens = SEQ * BATCH
    log = train(model, mlps, batches_from(), config(steps=3, revive_dead_tokens=step_tokens), device="cpu",
                show_progress=False).log

    first = log[0]
    assert first["layers"][0]["dead_frac"] == pytest.approx(DEAD / INTERMEDIATE)  # counted before the revival
    assert [layer["revived"] for layer in first["layers"]] == [DEAD, 0] and first["revived"] == DEAD
    assert "revived 40" in progress_text(first)
    (gate, up, down), (new_gate, new_up, new_down), last_fired = revivals[0]
    assert (last_fired[0, :DEAD] == step_tokens).all()  # now, so not dead at once
    assert not new_gate[:DEAD].any() and not new_up[:DEAD].any() and not new_down[:, :DEAD].any()
    halved = (new_gate != gate).any(dim=1)  # the sources' gate rows: their moments follow their halved gradient
    assert halved.sum() == DEAD and not halved[:DEAD].any()
    torch.testing.assert_close(new_gate[halved], gate[halved] / 2)
    torch.testing.assert_close(new_up[halved], up[halved] / 2)
    assert torch.equal(new_down, down)
    assert log[1]["layers"][0]["dead_frac"] < 0.05  # the revived units fire where their sources do
    assert all(entry["revived"] < 10 for entry in log[1:-1])
    assert "revived" not in log[-1]  # none at the last step: a copy made then would never train


def test_the_same_seed_revives_the_same_and_the_data_order_stays():
    """The revival draws from a generator of its own: the batches, drawn from the global RNG that the run seeds,
    are the same with and without it."""
    def run(**settings):
        model, mlps = _with_dead_units()
        drawn = []

        def batches(start, rank, world):
            while True:
                drawn.append(torch.randint(0, 256, (BATCH, SEQ)))
                yield drawn[-1]

        train(model, mlps, batches, config(steps=3, **settings), device="cpu", show_progress=False)
        return model, drawn

    a, drawn = run(revive_dead_tokens=SEQ * BATCH)
    b, _ = run(revive_dead_tokens=SEQ * BATCH)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    c, drawn_without = run()
    assert len(drawn) == 3 and all(torch.equal(x, y) for x, y in zip(drawn, drawn_without, strict=True))
    assert not torch.equal(a.model.layers[0].mlp.gate_proj.weight, c.model.layers[0].mlp.gate_proj.weight)
    other, _ = run(revive_dead_tokens=SEQ * BATCH, seed=1)
    assert not torch.equal(a.model.layers[0].mlp.gate_proj.weight, other.model.layers[0].mlp.gate_proj.weight)


@pytest.mark.parametrize("value, message", [
    (0, "--revive-dead-tokens must be a positive integer, got 0"),
    (-32, "--revive-dead-tokens must be a positive integer, got -32"),
    (31, r"--revive-dead-tokens 31 is below one optimizer step's 32 tokens \(--seq-len x --batch-size x "
         r"--grad-accum\)"),
])
def test_bad_revival_window(value, message):
    with pytest.raises(ConfigError, match=message):
        config(revive_dead_tokens=value).validate()


def test_revival_window_spans_a_step_of_all_processes():
    config(revive_dead_tokens=32).validate()
    with pytest.raises(ConfigError, match=r"--revive-dead-tokens 32 is below one optimizer step's 64 tokens "
                                          r"\(.* x 2 processes\)"):
        config(revive_dead_tokens=32).validate(world=2)


def test_revival_is_refused_under_fsdp(monkeypatch):
    monkeypatch.setattr(Accelerator, "is_fsdp2", property(lambda self: True))
    model, mlps = _with_dead_units()
    with pytest.raises(ConfigError, match="--revive-dead-tokens does not run under FSDP"):
        train(model, mlps, batches_from(), config(steps=1, revive_dead_tokens=32), device="cpu", show_progress=False)
