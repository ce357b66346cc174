"""Training: the L1 term against a hand computation, config validation, the coefficient warm-up, dead-unit
tracking, and Ctrl-C (or an error) -> resume giving the same weights as an uninterrupted run."""
import copy
import dataclasses
import json
import math
import re
import time

import pytest
import torch
import torch.nn.functional as F
import yaml

from helpers import SMALL_CHUNK_BYTES, CountingTokenizer, Killed, interrupt, on_read, raising, tiny_model
from twell.training import sparsity_penalty
from sparsify.errors import ConfigError, DataError
from sparsify.relufy import relufy
from sparsify.config import RunOptions, TrainConfig
from sparsify.locations import saved_state
from sparsify.resume import check_resume
from sparsify.train import TrainingInterrupted, l1_coeff, slow_save_warning, source_share, train
from sparsify.train.loss import L1_SCALE_RANGE, L1_STEER_EFOLDS, allowed_active, steered_l1_scale
from sparsify.train.log import progress_text

SEQ, BATCH = 16, 2


def batches_from(seed=0):
    def batches(start, rank, world):
        g = torch.Generator().manual_seed(seed)
        stream = (torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(10**6))
        for i, b in enumerate(stream):
            if i >= start and (i - start) % world == rank:
                yield b

    return batches


def acting_at(n, action):
    """batches_from(), calling `action()` while reading the (n+1)-th micro-batch: `interrupt` (Ctrl-C, SIGINT to
    this process: training stops at the end of that micro-batch's step) or `raising(error)` (the read fails)."""
    def batches(start, rank, world):
        for i, b in enumerate(batches_from()(start, rank, world)):
            if i == n:
                action()
            yield b

    return batches


def config(**kw):
    # Dense path only: the hybrid kernels and the routing to them are tested in test_hybrid_routing.py.
    return TrainConfig(**{"steps": 4, "seq_len": SEQ, "batch_size": BATCH, "lr": 1e-3, "l1": 1e-3, "log_every": 1,
                          "hybrid_below": 0, **kw})


def test_l1_matches_hand_computation():
    model, _ = tiny_model("llama")
    reference = copy.deepcopy(model)
    ids = next(batches_from()(0, 0, 1))
    # The L1 penalty computed by hand on the original weights, with SiLU swapped for ReLU.
    layer_l1, inputs = [], []
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o: inputs.append(a[0])) for layer in reference.model.layers]
    reference.config.hidden_act = "relu"
    for layer in reference.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    with torch.no_grad():
        ce = reference(input_ids=ids, labels=ids).loss.item()
    for layer, x in zip(reference.model.layers, inputs):
        h = F.relu(x @ layer.mlp.gate_proj.weight.T) * (x @ layer.mlp.up_proj.weight.T)
        layer_l1.append(h.abs().sum(-1).mean().item())
    for h in hooks:
        h.remove()

    log = train(model, relufy(model), batches_from(), config(steps=1), device="cpu", show_progress=False).log
    expected_l1 = sum(layer_l1) / len(layer_l1)
    assert log[0]["l1"] == pytest.approx(expected_l1, rel=1e-5)
    assert [l["l1"] for l in log[0]["layers"]] == pytest.approx(layer_l1, rel=1e-5)
    assert log[0]["cross_entropy"] == pytest.approx(ce, rel=1e-5)
    assert log[0]["loss"] == pytest.approx(ce + 1e-3 * expected_l1, rel=1e-5)


def test_log_penalty_matches_hand_computation():
    """l1_log_scale: each layer's eps is the scale times its mean |h| over the firing units of the first batch, and
    the logged penalty is the mean over tokens of the sum of eps * log(1 + |h| / eps), below the L1."""
    model, _ = tiny_model("llama")
    reference = copy.deepcopy(model)
    ids = next(batches_from()(0, 0, 1))
    inputs = []
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o: inputs.append(a[0])) for layer in reference.model.layers]
    for layer in reference.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    with torch.no_grad():
        reference(input_ids=ids)
    for h in hooks:
        h.remove()
    eps, penalty, l1 = [], [], []
    for layer, x in zip(reference.model.layers, inputs):
        gate = x @ layer.mlp.gate_proj.weight.T
        h = F.relu(gate) * (x @ layer.mlp.up_proj.weight.T)
        eps.append(0.2 * h[gate > 0].abs().mean().item())
        penalty.append((eps[-1] * torch.log1p(h.abs() / eps[-1])).sum(-1).mean().item())
        l1.append(h.abs().sum(-1).mean().item())

    mlps = relufy(model)
    log = train(model, mlps, batches_from(), config(steps=1, l1_log_scale=0.2), device="cpu", show_progress=False).log
    assert [m.l1_eps for m in mlps] == pytest.approx(eps, rel=1e-5)
    assert [l["l1"] for l in log[0]["layers"]] == pytest.approx(penalty, rel=1e-5)
    assert all(p < 0.9 * a for p, a in zip(penalty, l1))
    assert log[0]["loss"] == pytest.approx(log[0]["cross_entropy"] + 1e-3 * sum(penalty) / len(penalty), rel=1e-5)


def test_a_given_log_penalty_eps_is_kept():
    """Training keeps the eps it is given (convert: the calibration's) instead of measuring its own."""
    model, _ = tiny_model("llama")
    mlps = relufy(model)
    train(model, mlps, batches_from(), config(steps=1, l1_log_scale=0.2), l1_eps=[0.5, 0.25], device="cpu",
          show_progress=False)
    assert [m.l1_eps for m in mlps] == [0.5, 0.25]


def test_log_penalty_slope_falls_with_the_activation():
    h = torch.tensor([[1e-4, -1e-4, 1.0, -3.0]], requires_grad=True)
    sparsity_penalty(h, 0.5).backward()
    assert h.grad[0].tolist() == pytest.approx([1 / (1 + 2e-4), -1 / (1 + 2e-4), 1 / 3, -1 / 7], rel=1e-5)
    assert sparsity_penalty(h.detach()).item() == pytest.approx(4.0002)


def test_relative_l1_weighs_l1_by_its_first_value():
    a, _ = tiny_model("llama")
    b = copy.deepcopy(a)
    relative = train(a, relufy(a), batches_from(), config(steps=3, l1=5.0, l1_relative=True), device="cpu",
                     show_progress=False).log
    first = relative[0]
    # L1_0 is the first micro-batch's L1, the value the first log entry reports for step 1
    assert first["l1_reference"] == pytest.approx(first["l1"], rel=1e-6) and first["l1_relative"] == 5.0
    assert first["l1_coeff"] == pytest.approx(5.0 / first["l1_reference"])
    assert first["loss"] == pytest.approx(first["cross_entropy"] + 5.0, rel=1e-5)
    # the same run as an absolute coefficient of 5 / L1_0
    train(b, relufy(b), batches_from(), config(steps=3, l1=5.0 / first["l1_reference"]), device="cpu",
          show_progress=False)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, msg=name)


def test_grad_accumulation_weights_l1_like_cross_entropy():
    # One step of 2 micro-batches of 2 sequences == one step of 1 batch of 4 sequences (same tokens).
    def stacked(start, rank, world):
        stream = batches_from()(0, 0, 1)
        while True:
            yield torch.cat([next(stream), next(stream)])

    a, _ = tiny_model("qwen3")
    b = copy.deepcopy(a)
    train(a, relufy(a), batches_from(), config(steps=1, grad_accum=2, l1=0.05, max_grad_norm=1e9), device="cpu",
          show_progress=False)
    train(b, relufy(b), stacked, config(steps=1, batch_size=4, l1=0.05, max_grad_norm=1e9), device="cpu",
          show_progress=False)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6, msg=name)


def test_training_reduces_l1_and_logs_layers():
    model, _ = tiny_model("mistral")
    # A coefficient far above any real one, so that the penalty dominates random-token cross-entropy.
    log = train(model, relufy(model), batches_from(), config(steps=12, l1=0.5, lr=3e-3, log_every=4), device="cpu",
                show_progress=False).log
    assert [e["step"] for e in log] == [4, 8, 12]
    assert log[-1]["tokens"] == 12 * SEQ * BATCH
    assert log[-1]["l1"] < log[0]["l1"] / 2 and log[-1]["mean_active"] < log[0]["mean_active"]
    assert len(log[0]["layers"]) == 2 and log[0]["layers"][0]["units"] == 160
    json.dumps(log)  # the log is plain JSON


def _source_and_swap():
    """A tiny model to train, its frozen source (a copy), its ReLU swap before any training and a batch."""
    model, _ = tiny_model("llama")
    student = copy.deepcopy(model)
    relufy(student)
    return model, copy.deepcopy(model), student, next(batches_from()(0, 0, 1))


def test_distillation_loss_matches_hand_computation():
    """With distill d the loss is (1 - d) * CE + d * KL(source || model) + the L1 term; KL summed over the
    vocabulary and averaged over every position, the source a frozen copy of the original SiLU model."""
    model, teacher, student, ids = _source_and_swap()
    with torch.no_grad():
        p = F.softmax(teacher(input_ids=ids).logits.double(), -1)
        q = F.softmax(student(input_ids=ids).logits.double(), -1)
        kl = (p * (p.log() - q.log())).sum(-1).mean().item()
    log = train(model, relufy(model), batches_from(), config(steps=1, distill=0.25), device="cpu", show_progress=False,
                teacher=teacher).log
    assert log[0]["kl"] == pytest.approx(kl, rel=1e-3) and kl > 1e-4  # the ReLU swap moves the distribution (fp32)
    assert log[0]["loss"] == pytest.approx(0.75 * log[0]["cross_entropy"] + 0.25 * kl + 1e-3 * log[0]["l1"], rel=1e-5)
    assert "kl" in progress_text(log[0])
    assert all(not p.requires_grad for p in teacher.parameters())  # frozen: the source stays as loaded


def test_distillation_at_a_temperature_matches_hand_computation():
    """distill-temperature T: T^2 * KL(softmax(source / T) || softmax(model / T)); at T = 1 the plain KL."""
    from sparsify.train.loss import distillation_kl

    generator = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(2, 5, 11, generator=generator, dtype=torch.float64) for _ in range(2))
    for temperature in (1.0, 2.5):
        p = F.softmax(teacher / temperature, -1)
        q = F.softmax(student / temperature, -1)
        kl = temperature ** 2 * (p * (p.log() - q.log())).sum(-1).mean().item()
        assert distillation_kl(student, teacher, temperature).item() == pytest.approx(kl, rel=1e-5)
    assert distillation_kl(student, teacher).item() == pytest.approx(distillation_kl(student, teacher, 1.0).item())
    with pytest.raises(ConfigError, match="--distill-temperature must be a number above 0, got 0"):
        TrainConfig.from_dict({"steps": 1, "distill": 0.5, "distill_temperature": 0}).validate()
    with pytest.raises(ConfigError, match="set --distill too"):
        TrainConfig.from_dict({"steps": 1, "distill_temperature": 2}).validate()


def test_hidden_state_distillation_matches_hand_computation():
    """With distill-hidden w the loss adds w * the mean over decoder layers of ||h - h_source||^2 /
    ||h_source||^2 (each layer's output over all positions); without distill, the KL stays out of the loss."""
    model, teacher, student, ids = _source_and_swap()
    with torch.no_grad():
        mine = student(input_ids=ids, output_hidden_states=True).hidden_states
        source = teacher(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(mine) == model.config.num_hidden_layers + 1
    distance = sum(((h.double() - t.double()).pow(2).sum() / t.double().pow(2).sum()).item()
                   for h, t in zip(mine[1:], source[1:])) / model.config.num_hidden_layers
    log = train(model, relufy(model), batches_from(), config(steps=1, distill_hidden=2.0), device="cpu",
                show_progress=False, teacher=teacher).log
    assert log[0]["hidden"] == pytest.approx(distance, rel=1e-3) and distance > 1e-6
    assert "kl" not in log[0] and "hidden" in progress_text(log[0])
    assert log[0]["loss"] == pytest.approx(log[0]["cross_entropy"] + 2.0 * distance + 1e-3 * log[0]["l1"], rel=1e-5)


def test_hidden_state_distillation_runs_no_teacher_logits(monkeypatch):
    """distill-hidden alone reads the teacher's hidden states: its LM head (a vocabulary-wide output a token) does
    not run; with distill it does, as its module with the whole logits (--no-chunked-loss), else its weight in
    the chunks of head_loss (chunks of 5 tokens here)."""
    from sparsify.train import head_loss
    from twell.training import head_loss as head_loss_op

    monkeypatch.setattr(head_loss_op, "CHUNK_BYTES", SMALL_CHUNK_BYTES)
    chunks = []  # each chunked call: whether it took the teacher's head
    real = head_loss.head_losses
    monkeypatch.setattr(head_loss, "head_losses", lambda *args: chunks.append(args[4] is not None) or real(*args))
    for settings, head_runs in ((dict(distill_hidden=1.0), False), (dict(distill=0.5, distill_hidden=1.0), True)):
        for chunked in (True, False):
            model, _ = tiny_model("llama")
            teacher = copy.deepcopy(model)
            calls = []
            teacher.get_output_embeddings().register_forward_hook(lambda *args: calls.append(1))
            chunks.clear()
            train(model, relufy(model), batches_from(), config(steps=1, chunked_loss=chunked, **settings),
                  device="cpu", show_progress=False, teacher=teacher)
            assert bool(calls) == (head_runs and not chunked)
            assert chunks == ([head_runs] if chunked else [])


def test_mlp_lr_moves_the_mlps_alone():
    """--mlp-lr gives the MLPs' projections their own peak learning rate: with a vanishing --lr the rest of the
    model stays as it was while the MLPs train; without it, every weight moves."""
    for mlp_lr, rest_moves in ((1e-2, False), (None, True)):
        model, _ = tiny_model("llama")
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        lr = 1e-2 if mlp_lr is None else 1e-12
        train(model, relufy(model), batches_from(), config(steps=2, lr=lr, mlp_lr=mlp_lr), device="cpu",
              show_progress=False)
        moved = {name: not torch.allclose(p, before[name], rtol=0, atol=1e-9) for name, p in model.named_parameters()}
        assert all(v for name, v in moved.items() if ".mlp." in name)
        assert all(v == rest_moves for name, v in moved.items() if ".mlp." not in name), moved


def test_distillation_pulls_towards_the_source():
    """Trained at distill 1 with no L1, a model far from the teacher (another random initialization) moves
    towards its distributions (the KL falls), and its weights differ from a cross-entropy-only run on the
    same batches."""
    a, _ = tiny_model("qwen2")
    b = copy.deepcopy(a)
    teacher, _ = tiny_model("qwen2", seed=1)
    log = train(a, relufy(a), batches_from(), config(steps=12, l1=0.0, lr=3e-3, distill=1.0, log_every=4), device="cpu",
                show_progress=False, teacher=teacher).log
    assert log[-1]["kl"] < 0.8 * log[0]["kl"]
    train(b, relufy(b), batches_from(), config(steps=12, l1=0.0, lr=3e-3, log_every=4), device="cpu",
          show_progress=False)
    ids = next(batches_from(seed=1)(0, 0, 1))  # not trained on
    with torch.no_grad():
        target = F.log_softmax(teacher(input_ids=ids).logits, -1)
        kl = [F.kl_div(F.log_softmax(m(input_ids=ids).logits, -1), target, log_target=True, reduction="sum").item()
              for m in (a, b)]
    assert kl[0] < 0.8 * kl[1]


def test_distillation_needs_a_teacher():
    model, _ = tiny_model("llama")
    for settings in (dict(distill=0.5), dict(distill_hidden=1.0)):
        with pytest.raises(ConfigError, match="distill and distill-hidden need the source model"):
            train(model, relufy(model), batches_from(), config(**settings), device="cpu", show_progress=False)


def test_dead_units_are_those_that_never_fire():
    model, _ = tiny_model("llama")
    mlps = relufy(model)
    with torch.no_grad():  # zero gate rows: pre-activation exactly 0, never > 0, and no gradient revives them
        mlps[0].gate_proj.weight[:40] = 0
    log = train(model, mlps, batches_from(), config(steps=3, weight_decay=0.0), device="cpu", show_progress=False).log
    assert log[-1]["layers"][0]["dead_frac"] == pytest.approx(40 / 160)
    assert log[-1]["layers"][1]["dead_frac"] == 0


def test_l1_warmup():
    c = config(l1=1e-4, l1_warmup_steps=4)
    assert [l1_coeff(c, s) for s in range(6)] == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4])
    assert l1_coeff(config(l1=1e-4), 0) == 1e-4


def test_steered_l1_scale_moves_towards_the_allowed_units_within_its_range():
    # ten times the allowed units (clamped to e-fold) over a tenth of the run: one full e-fold up
    assert steered_l1_scale(1.0, mean_active=10.0, allowed=1.0, steps=10, total=100) == \
        pytest.approx(math.exp(L1_STEER_EFOLDS * 0.1))
    # a small error moves it by its log: twice the allowed units, over 1 step of 100
    assert steered_l1_scale(2.0, 2.0, 1.0, 1, 100) == pytest.approx(2.0 * 2 ** (L1_STEER_EFOLDS / 100))
    # sparser than allowed: down; at it: unchanged
    assert steered_l1_scale(1.0, 0.5, 1.0, 1, 100) < 1.0
    assert steered_l1_scale(1.5, 1.0, 1.0, 5, 100) == pytest.approx(1.5)
    # never beyond its range, whatever the error or the steps
    assert steered_l1_scale(1.0, 80.0, 1.0, 10_000, 100) == L1_SCALE_RANGE[1]
    assert steered_l1_scale(1.0, 0.0, 1.0, 10_000, 100) == L1_SCALE_RANGE[0]


def test_allowed_units_fall_geometrically_to_the_target_over_the_l1_warm_up():
    c = config(target_sparsity=0.99, l1_warmup_steps=10)
    # 100 units: 1 allowed at the target; from 64 at step 2, a factor 1/2 each 4/3 steps... geometric to step 10
    assert allowed_active(c, 2, 2, 64.0, 100) == pytest.approx(64.0)
    assert allowed_active(c, 6, 2, 64.0, 100) == pytest.approx(8.0)
    assert [allowed_active(c, step, 2, 64.0, 100) for step in (10, 11, 50)] == pytest.approx([1.0, 1.0, 1.0])
    # no warm-up, or a start already sparser than the target: the target at once
    assert allowed_active(config(target_sparsity=0.99), 2, 2, 64.0, 100) == pytest.approx(1.0)
    assert allowed_active(c, 4, 2, 0.5, 100) == pytest.approx(1.0)


def test_target_sparsity_steers_the_l1_weight_along_the_allowed_units(capsys):
    model, _ = tiny_model("llama")
    other = copy.deepcopy(model)
    # a random tiny model is far from 99% sparse: once its allowed units reach the target at the warm-up's end,
    # the weight rises; the run ends short and warns
    log = train(model, relufy(model), batches_from(), config(steps=8, log_every=2, l1_warmup_steps=4,
                                                               target_sparsity=0.99), device="cpu",
                show_progress=False).log
    units = log[0]["layers"][0]["units"]
    assert log[0]["allowed_active"] == log[0]["mean_active"]  # the path starts at the first entry's activity
    assert [e["allowed_active"] for e in log[1:]] == pytest.approx([0.01 * units] * 3)
    scales = [e["l1_scale"] for e in log]
    assert scales[:2] == [1.0, 1.0] and 1.0 < scales[2] <= scales[3]  # moved after steps 4 and 6 (to the bound)
    assert [e["l1_coeff"] for e in log] == pytest.approx([1e-3 * min(1, e["step"] / 4) * e["l1_scale"] for e in log])
    assert "short of --target-sparsity 0.99" in capsys.readouterr().err
    # halfway down a longer warm-up: the allowed units between the start's and the target's, geometrically
    halfway = copy.deepcopy(other)
    log = train(halfway, relufy(halfway), batches_from(), config(steps=6, log_every=2, l1_warmup_steps=6,
                                                                 target_sparsity=0.99), device="cpu",
                show_progress=False).log
    start, final = log[0]["mean_active"], 0.01 * units
    assert log[1]["allowed_active"] == pytest.approx(start * (final / start) ** 0.5)
    capsys.readouterr()
    # a target any model meets: the weight falls, nothing to warn about
    log = train(other, relufy(other), batches_from(), config(steps=8, log_every=2, target_sparsity=0.01),
                device="cpu", show_progress=False).log
    assert [e["l1_scale"] for e in log][0] == 1.0 and log[-1]["l1_scale"] < log[1]["l1_scale"] < 1.0
    assert "target-sparsity" not in capsys.readouterr().err
    assert "L1 x" in progress_text(log[-1]) and f"of {log[-1]['allowed_active']:.1f}" in progress_text(log[-1])


def test_progressive_swap_moves_the_gate_from_the_source_activation_to_relu():
    model, _ = tiny_model("llama")
    source = copy.deepcopy(model)
    ids = next(batches_from()(0, 0, 1))
    mlps = relufy(model)
    with torch.no_grad():
        silu, relu = source(input_ids=ids).logits, model(input_ids=ids).logits
    assert not torch.allclose(silu, relu, atol=1e-3)
    for m in mlps:  # the first step's share: the source's own function
        m.source_share = source_share(config(swap_steps=4), 0)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, silu)

    assert [source_share(config(swap_steps=4), s) for s in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert source_share(config(), 0) == 0.0
    log = train(model, mlps, batches_from(), config(steps=6, swap_steps=4), device="cpu", show_progress=False).log
    # the first step's cross-entropy is the source's; the trained model ends as plain ReLU
    assert log[0]["cross_entropy"] == pytest.approx(source(input_ids=ids, labels=ids).loss.item(), rel=1e-5)
    assert [e["source_share"] for e in log] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert all(m.source_share == 0.0 for m in mlps)
    mlps[0].use_hybrid, mlps[0].source_share = True, 0.5  # the kernels compute plain ReLU only
    assert not mlps[0].runs_hybrid
    mlps[0].source_share = 0.0
    assert mlps[0].runs_hybrid
    with pytest.raises(ConfigError, match="--swap-steps 6 must be below the 6 training steps"):
        train(model, mlps, batches_from(), config(steps=6, swap_steps=6), device="cpu", show_progress=False)


def test_schedules_given_as_a_share_of_the_steps():
    c = TrainConfig.from_dict({"l1_warmup_steps": "50%", "swap_steps": " 20% ", "steps": 10})
    assert (c.l1_warmup_steps, c.swap_steps) == ("50%", "20%")
    c.validate()
    resolved = c.schedule(c.total_steps())
    assert (resolved.l1_warmup_steps, resolved.swap_steps) == (5, 2)
    assert TrainConfig.from_dict({"swap_steps": "150"}).swap_steps == 150  # the command line's strings
    model, _ = tiny_model("llama")
    log = train(model, relufy(model), batches_from(), config(steps=5, swap_steps="40%", l1_warmup_steps="80%"),
                device="cpu", show_progress=False).log
    assert [e["source_share"] for e in log] == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert [e["l1_coeff"] for e in log] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_steps_and_tokens_bound_training():
    assert config(steps=100, tokens=SEQ * BATCH * 10).total_steps() == 10
    assert config(steps=3, tokens=10**9).total_steps() == 3
    assert TrainConfig(tokens=1000, seq_len=10, batch_size=2, grad_accum=5).total_steps(world=2) == 5


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(l1=-1e-5), "--l1 must be between"),
        (dict(l1=5.0), "--l1 must be between"),
        (dict(l1=float("nan")), "--l1 must be between"),
        (dict(l1=150.0, l1_relative=True), r"--l1 \(relative\) must be between 0 and 100"),
        (dict(l1=2e-5, l1_relative=True),
         r"--l1 \(relative\) 2e-05 is the L1 term's initial weight in nats, too small.*add --l1-absolute"),
        (dict(steps=0), "--steps must be a positive integer"),
        (dict(steps=None, tokens=None), "set the training length: --steps, --tokens or --passes"),
        (dict(passes=0.0), r"--passes must be a number above 0 \(passes over the training text"),
        (dict(passes=float("inf")), "--passes must be a number above 0"),
        (dict(passes=2.0, tokens=100),
         r"--passes 2 and --tokens 100 both set the training tokens \(on the command line or in one recipe\)"),
        (dict(tokens=-5), "--tokens must be a positive integer"),
        (dict(seq_len=4096), "--seq-len 4096 is beyond the model's maximum of 128"),
        (dict(batch_size=0), "--batch-size must be a positive integer"),
        (dict(lr=0.0), "--lr must be"),
        (dict(warmup_steps=-1), "--warmup-steps must be an integer >= 0"),
        (dict(swap_steps=-1), "--swap-steps must be an integer >= 0 or a share"),
        (dict(swap_steps="100%"), "--swap-steps must be an integer >= 0 or a share of the steps below 100%"),
        (dict(l1_warmup_steps="x%"), "--l1-warmup-steps must be"),
        (dict(shuffle_buffer=-1), "--shuffle-buffer must be an integer >= 0"),
        (dict(hybrid_below=-1.0), "--hybrid-below must be a number >= 0"),
        (dict(hybrid_below=float("nan")), "--hybrid-below must be a number >= 0"),
        (dict(hybrid_hot_rate=0.0), r"--hybrid-hot-rate must be in \(0, 1\]"),
        (dict(hybrid_max_nnz=0), "--hybrid-max-nnz must be a positive integer"),
        (dict(distill=1.5), r"--distill must be in \[0, 1\]"),
        (dict(mlp_lr=0.0), r"--mlp-lr must be in \(0, 1\]"),
        (dict(distill_hidden=-1.0), r"--distill-hidden must be a number >= 0"),
        (dict(distill=float("nan")), r"--distill must be in \[0, 1\]"),
        (dict(target_sparsity=1.0), r"--target-sparsity must be in \[0, 1\)"),
        (dict(target_sparsity=0.99, l1=0.0), "--target-sparsity steers the L1 weight: set --l1 above 0"),
        (dict(l1_log_scale=-0.1), r"--l1-log-scale must be a number >= 0 \(0: L1\)"),
        (dict(l1_log_scale=float("inf")), "--l1-log-scale must be a number >= 0"),
        (dict(betas=(1.5, 0.9)), r"--betas must be two numbers in \[0, 1\)"),
        (dict(betas=(0.9, 0.95, 0.99)), "--betas must be two numbers"),
        (dict(betas=(0.9, float("nan"))), "--betas must be two numbers"),
    ],
)
def test_bad_config(kw, message):
    with pytest.raises(ConfigError, match=message):
        config(**kw).validate(max_positions=128)


def test_from_dict_mends_yaml_values():
    c = TrainConfig.from_dict({"l1": "2e-5", "tokens": 1e6, "betas": [0.9, 0.99]})
    assert c.l1 == 2e-5 and c.tokens == 1_000_000 and isinstance(c.tokens, int) and c.betas == (0.9, 0.99)
    with pytest.raises(ConfigError, match="unknown training settings: l2"):
        TrainConfig.from_dict({"l2": 1})
    with pytest.raises(ConfigError, match="not a float"):
        TrainConfig.from_dict({"lr": "fast"})


def test_from_dict_reads_settings_by_their_type_not_their_default():
    """A setting whose default is None reads as its field's type: a recipe's `mlp_lr: 1e-4` (a string in YAML
    1.1) is the float, and bad values name the type; YAML's true/false is no number."""
    c = TrainConfig.from_dict(yaml.safe_load("mlp_lr: 1e-4\ndistill_hidden: 1e-1\ndead_window_tokens: 1e6\nsteps: 10"))
    assert (c.mlp_lr, c.distill_hidden, c.dead_window_tokens) == (1e-4, 0.1, 1_000_000)
    c.validate()
    with pytest.raises(ConfigError, match="--mlp-lr: 'fast' is not a float"):
        TrainConfig.from_dict({"mlp_lr": "fast"})
    with pytest.raises(ConfigError, match="--distill-hidden: True is not a float"):
        TrainConfig.from_dict({"distill_hidden": True})
    with pytest.raises(ConfigError, match="--steps: True is not an int"):
        TrainConfig.from_dict({"steps": True})


@pytest.mark.parametrize("relative, tied, target, log_scale", [(False, False, 0, 0), (True, False, 0, 0),
                                                                (False, True, 0, 0), (True, False, 0.99, 0),
                                                                (True, False, 0, 0.2)],
                         ids=["absolute-l1", "relative-l1", "tied-embeddings", "steered-l1", "log-penalty"])
def test_interrupt_then_resume_equals_uninterrupted(tmp_path, caplog, relative, tied, target, log_scale):
    # relative: the resumed run must weigh L1 by the first run's L1_0, not by its own first batch's
    # tied: the state holds lm_head once (accelerate's warning about it is not shown) and the resumed model ties it
    # steered: the L1 weight's factor, moved at step 2, goes on from its saved value
    # log penalty: the resumed run keeps the first step's eps, not its own first batch's
    cfg = config(steps=6, grad_accum=2, warmup_steps=2, log_every=2, target_sparsity=target, l1_log_scale=log_scale,
                 **(dict(l1=5.0, l1_relative=True) if relative else {}))
    straight, _ = tiny_model("qwen2", tie_word_embeddings=tied)
    interrupted = copy.deepcopy(straight)
    train(straight, relufy(straight), batches_from(), cfg, device="cpu", show_progress=False)

    # the signal in step 3's 2nd micro-batch
    with pytest.raises(TrainingInterrupted, match="interrupted at step 3 of 6"):
        train(interrupted, relufy(interrupted), acting_at(5, interrupt), cfg, resume_dir=tmp_path / "r", device="cpu",
              show_progress=False)
    assert json.loads((tmp_path / "r" / "state.json").read_text())["step"] == 3
    assert "Removed shared tensor" not in caplog.text
    resumed, _ = tiny_model("qwen2", seed=1, tie_word_embeddings=tied)  # fresh process: other weights, all restored
    source = {name: p.detach().clone() for name, p in resumed.named_parameters()}
    seen = []  # evaluate runs on the prepared model before the resumed state loads: the source weights
    result = train(resumed, relufy(resumed), batches_from(), cfg, resume_dir=tmp_path / "r", resume=True, device="cpu",
                   show_progress=False, evaluate=lambda m: seen.append({n: p.clone() for n, p in m.named_parameters()}))
    assert result.steps == 6 and [e["step"] for e in result.log] == [2, 4, 6]
    assert len(seen) == 1 and all(torch.equal(seen[0][n], source[n]) for n in source)
    assert not result.sharded and not result.model.training
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_trackers_write_a_folder_per_run_that_a_resumed_run_keeps(tmp_path, monkeypatch):
    """Under logging_dir each run's trackers get their own folder, named by its start time; an interrupted run
    saves its name with the state and the resumed run writes on in it, while a fresh run never takes a folder
    that exists."""
    from sparsify.train import loop

    folders, real = [], loop._accelerator
    monkeypatch.setattr(loop, "_accelerator", lambda *args: folders.append(args[-1]) or real(*args))
    logs, cfg = tmp_path / "logs", config(steps=4)
    model, _ = tiny_model("llama")
    with pytest.raises(TrainingInterrupted):
        train(model, relufy(model), acting_at(2, interrupt), cfg, resume_dir=tmp_path / "r", device="cpu",
              show_progress=False, logging_dir=logs)
    assert folders[0].parent == logs and re.fullmatch(r"\d{8}-\d{6}", folders[0].name)
    assert json.loads((tmp_path / "r" / "state.json").read_text())["run_name"] == folders[0].name
    folders[0].mkdir(parents=True)  # as a tracker that writes files leaves it
    resumed, _ = tiny_model("llama")
    train(resumed, relufy(resumed), batches_from(), cfg, resume_dir=tmp_path / "r", resume=True, device="cpu",
          show_progress=False, logging_dir=logs)
    assert folders[1] == folders[0]
    fresh, _ = tiny_model("llama")
    train(fresh, relufy(fresh), batches_from(), cfg, device="cpu", show_progress=False, logging_dir=logs)
    assert folders[2].parent == logs and folders[2] != folders[0]


def test_resume_continues_the_text_from_its_saved_position(tmp_path, monkeypatch):
    """TextData's batches: Ctrl-C, then --resume, ends with the uninterrupted run's weights, and the resumed run
    tokenizes none of the documents the interrupted one read (it continues from the saved position)."""

    from sparsify.data import TextData, TrainingBatches

    # 4 tokens a document (3 digits and EOS): 16 blocks of 16 tokens a chunk of 64 tokenized documents
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"{i:03d}"}) + "\n" for i in range(400)))
    cfg = config(steps=6, grad_accum=2, log_every=2, shuffle_buffer=8, eval_tokens=SEQ)
    tokenizer = CountingTokenizer()

    def run(model, resume=False):  # the texts the tokenizer read in training (the head read by TextData aside)
        data = TextData(tmp_path / "d.jsonl", tokenizer, SEQ, cfg.eval_tokens)
        tokenizer.texts.clear()
        batches = lambda start, rank, world: data.train_batches(cfg.batch_size, start, rank, world,
                                                                shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed)
        train(model, relufy(model), batches, cfg, resume_dir=tmp_path / "r", resume=resume, device="cpu",
              show_progress=False)

    straight, _ = tiny_model("qwen2")
    interrupted = copy.deepcopy(straight)
    run(straight)
    with monkeypatch.context() as patch, pytest.raises(TrainingInterrupted, match="interrupted at step 3 of 6"):
        # Ctrl-C while step 3 reads its 2nd micro-batch
        patch.setattr(TrainingBatches, "__next__", on_read(TrainingBatches.__next__, 5, interrupt))
        run(interrupted)
    read_before = list(tokenizer.texts)
    resumed, _ = tiny_model("qwen2", seed=1)
    run(resumed, resume=True)
    assert read_before and tokenizer.texts and not set(read_before) & set(tokenizer.texts)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_a_killed_run_resumes_from_its_last_periodic_save(tmp_path):
    """save_every: a run that dies without saving (here killed while reading step 4's batch) resumes from the
    state saved after step 2 and ends with the uninterrupted run's weights."""
    cfg = config(steps=5, log_every=1, save_every=2)
    straight, _ = tiny_model("llama")
    killed = copy.deepcopy(straight)
    train(straight, relufy(straight), batches_from(), cfg, device="cpu", show_progress=False)
    with pytest.raises(Killed):
        train(killed, relufy(killed), acting_at(3, raising(Killed())), cfg, resume_dir=tmp_path / "r", device="cpu",
              show_progress=False)
    assert json.loads((tmp_path / "r" / "state.json").read_text())["step"] == 2
    assert not (tmp_path / "r.tmp").exists()
    resumed, _ = tiny_model("llama", seed=1)
    result = train(resumed, relufy(resumed), batches_from(), cfg, resume_dir=tmp_path / "r", resume=True, device="cpu",
                   show_progress=False)
    assert [e["step"] for e in result.log] == [1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "r" / "state.json").read_text())["step"] == 4  # saved again on the way
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def failing_at_call(n, error):
    """A function that raises `error` at its n-th call (1-based) and does nothing before."""
    calls = []

    def fail(*args, **kwargs):
        calls.append(None)
        if len(calls) == n:
            raise error

    return fail


@pytest.mark.parametrize("where", ["data", "forward"])
def test_an_error_saves_the_last_completed_step_and_resume_continues(tmp_path, capsys, where):
    """An error in step 3 (bad data read for it, or out of memory in its forward) saves the state of step 2,
    says where and how to resume, and propagates unchanged; resuming ends with the uninterrupted run's weights."""
    cfg = config(steps=5, grad_accum=2, log_every=1)
    straight, _ = tiny_model("llama")
    failing = copy.deepcopy(straight)
    train(straight, relufy(straight), batches_from(), cfg, device="cpu", show_progress=False)

    error = DataError("bad row") if where == "data" else torch.cuda.OutOfMemoryError("CUDA out of memory")
    mlps = relufy(failing)
    batches = acting_at(5, raising(error)) if where == "data" else batches_from()  # step 3's 2nd micro-batch
    if where == "forward":
        mlps[1].register_forward_pre_hook(failing_at_call(5, error))  # step 3's 1st micro-batch
    with pytest.raises(type(error)) as raised:
        train(failing, mlps, batches, cfg, resume_dir=tmp_path / "r", device="cpu", show_progress=False)
    assert raised.value is error
    assert json.loads((tmp_path / "r" / "state.json").read_text())["step"] == 2
    assert (f"the training state of step 2 of 5 is saved in {tmp_path / 'r'}: run the same command with --resume "
            "to continue from it") in " ".join(capsys.readouterr().err.split())
    resumed, _ = tiny_model("llama", seed=1)
    result = train(resumed, relufy(resumed), batches_from(), cfg, resume_dir=tmp_path / "r", resume=True, device="cpu",
                   show_progress=False)
    assert [e["step"] for e in result.log] == [1, 2, 3, 4, 5]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_an_error_before_a_completed_step_or_within_an_update_saves_nothing(tmp_path, monkeypatch):
    # in the first step there is nothing to save; in the optimizer's update the weights may be half updated
    model, _ = tiny_model("llama")
    with pytest.raises(DataError):
        train(model, relufy(model), acting_at(0, raising(DataError("bad row"))), config(),
              resume_dir=tmp_path / "first", device="cpu", show_progress=False)
    assert not (tmp_path / "first").exists()
    monkeypatch.setattr(torch.optim.AdamW, "step", failing_at_call(3, RuntimeError("in the update")))
    model, _ = tiny_model("llama")
    with pytest.raises(RuntimeError, match="in the update"):
        train(model, relufy(model), batches_from(), config(), resume_dir=tmp_path / "update", device="cpu",
              show_progress=False)
    assert not (tmp_path / "update").exists()


def test_the_state_is_saved_when_the_minutes_have_passed(tmp_path, monkeypatch):
    clock = iter(range(0, 10**6, 100))  # each read of the clock: 100 s later
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    model, _ = tiny_model("llama")
    train(model, relufy(model), batches_from(), config(steps=3, save_every_minutes=1.0), resume_dir=tmp_path / "r",
          device="cpu", show_progress=False)
    assert json.loads((tmp_path / "r" / "state.json").read_text())["step"] == 2  # the last step before the end
    model, _ = tiny_model("llama")
    train(model, relufy(model), batches_from(), config(steps=3, save_every_minutes=0.0), resume_dir=tmp_path / "off",
          device="cpu", show_progress=False)
    assert not (tmp_path / "off").exists()


def test_resume_needs_the_saved_settings_and_processes(tmp_path):
    cfg = config(steps=6, log_every=2)
    model, _ = tiny_model("llama")
    inputs = {"source": "tiny-llama", "data": "corpus"}
    with pytest.raises(TrainingInterrupted):
        train(model, relufy(model), acting_at(3, interrupt), cfg, resume_dir=tmp_path / "r", device="cpu",
              show_progress=False, inputs=inputs)
    state_path = tmp_path / "r" / "state.json"
    assert json.loads(state_path.read_text())["processes"] == 1

    def resume(source="tiny-llama", data="corpus", **changes):
        resumed, _ = tiny_model("llama")
        return train(resumed, relufy(resumed), batches_from(), dataclasses.replace(cfg, **changes),
                     resume_dir=tmp_path / "r", resume=True, device="cpu", show_progress=False,
                     inputs={"source": source, "data": data})

    # named by their options, as typed; the source, an argument, by its own name
    with pytest.raises(ConfigError, match=r"other training settings \(--l1-warmup-steps 0 -> 2; --batch-size 2 -> 4; "
                                          r"--betas \[0.9, 0.95\] -> \[0.9, 0.99\]\)"):
        resume(batch_size=4, betas=(0.9, 0.99), l1_warmup_steps=2)
    with pytest.raises(ConfigError, match=r"saved by a run on other inputs \(--data 'corpus' -> 'other'\)"):
        resume(data="other")
    with pytest.raises(ConfigError, match=r"saved by a run on other inputs \(source 'tiny-llama' -> 'other'\)"):
        resume(source="other")
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({**state, "processes": 2}))
    with pytest.raises(ConfigError, match="saved by 2 processes and this run has 1: launch 2"):
        resume()
    state_path.write_text(json.dumps({k: v for k, v in state.items() if k != "l1_reference"}))
    with pytest.raises(ConfigError, match=r"lacks l1_reference \(saved by another version of sparsify, or edited\): "
                                          r"start over with --overwrite"):
        resume()
    state_path.write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=r"--eval-tokens 65536 -> 128"):  # it moves where training starts
        resume(eval_tokens=128)
    assert resume(log_every=3, save_every_minutes=5.0).steps == 6  # logging and saving settings may change


def test_resume_reads_a_state_only_where_a_save_completed_it(tmp_path):
    """check_resume and saved_state follow one rule: a save writes its state.json last, so a folder without one (a
    save killed midway) holds no state to continue, and one with it does."""
    resume_dir = tmp_path / "r"
    with pytest.raises(ConfigError, match="no saved training state"):
        check_resume(resume_dir, config(), 1)
    resume_dir.mkdir()
    (resume_dir / "last_fired.pt").touch()
    with pytest.raises(ConfigError, match="no saved training state"):
        check_resume(resume_dir, config(), 1)
    (resume_dir / "state.json").write_text("{}")
    assert saved_state(resume_dir) == resume_dir
    with pytest.raises(ConfigError, match="lacks step"):  # found, and read
        check_resume(resume_dir, config(), 1)


def test_gradient_checkpointing_trains_the_same():
    a, _ = tiny_model("llama")
    b = copy.deepcopy(a)
    train(a, relufy(a), batches_from(), config(steps=2), device="cpu", show_progress=False)
    seen = []  # whether the layer checkpoints, at each training forward
    b.model.layers[0].register_forward_pre_hook(lambda layer, args: seen.append(layer.gradient_checkpointing))
    train(b, relufy(b), batches_from(), config(steps=2, grad_checkpointing=True), device="cpu", show_progress=False)
    assert seen and all(seen) and not b.model.layers[0].gradient_checkpointing  # on while training, off after
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, msg=name)


def test_fsdp_config_without_gpus_is_an_error_not_ddp(monkeypatch):
    # accelerate runs CPU processes as DDP whatever the FSDP config says (tests/fsdp_on_cpu.py)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    model, _ = tiny_model("llama")
    with pytest.raises(ConfigError, match="FSDP runs on GPUs only"):
        train(model, relufy(model), batches_from(), config(steps=1), device="cpu", show_progress=False)


def test_progress_line_shows_gpu_memory_when_logged():
    entry = {"tokens": 4096, "tokens_per_s": 1000.0, "loss": 2.0, "cross_entropy": 1.9, "l1": 5.0, "mean_active": 30.0,
             "dead_frac": 0.01, "layers": [{"path": "dense"}]}
    assert "mem" not in progress_text(entry)
    assert progress_text({**entry, "max_memory_gib": 12.34}).endswith("mem 12.3 GiB")


def test_log_lines_outside_a_terminal_are_whole_with_time_and_eta(capsys):
    model, _ = tiny_model("llama")
    train(model, relufy(model), batches_from(), config(steps=3), device="cpu", show_progress=True)
    lines = capsys.readouterr().err.splitlines()  # these lines alone: no progress bar, which a file cannot show
    assert [re.search(r" step (\d)/3 ", line).group(1) for line in lines] == ["1", "2", "3"]
    for line in lines:  # one line each however long: date, time, the figures, the time left
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  step", line) and "active" in line
        assert re.search(r"eta \d+:\d\d:\d\d$", line)
    assert lines[-1].endswith("eta 0:00:00")


def test_training_memory_is_checked_before_loading(monkeypatch, tmp_path):
    """A model whose training state (16 bytes a parameter) exceeds the GPU stops before any weight is read,
    naming FSDP; under FSDP the state is shared by the processes."""
    from types import SimpleNamespace

    from sparsify import convert
    from sparsify.load import parameter_count
    from sparsify.train import memory

    monkeypatch.setattr(memory, "on_cpu", lambda device: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * 2**30))
    check = memory.check_training_memory
    with pytest.raises(ConfigError, match="needs 119 GiB on each GPU.*has 80 GiB: shard it.*fsdp.yaml"):
        check(8_000_000_000, None, 1, sharded=False)
    check(8_000_000_000, "cuda:1", 2, sharded=True)  # 60 GiB each
    with pytest.raises(ConfigError, match="use more than 1 GPUs"):
        check(8_000_000_000, None, 1, sharded=True)
    model, tokenizer = tiny_model("qwen2", tie_word_embeddings=True)
    assert parameter_count(model.config) == sum(p.numel() for p in model.parameters())  # tied: once
    model.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    monkeypatch.setattr(memory, "TRAINING_BYTES", 2**40)  # this tiny model then needs more than 80 GiB
    monkeypatch.setattr(convert, "load_model", lambda *a, **k: pytest.fail("weights read before the memory check"))
    (tmp_path / "text.txt").write_text("some text " * 100)
    with pytest.raises(ConfigError, match="on each GPU"):
        convert.convert(str(tmp_path / "src"), config(steps=1),
                        RunOptions(tmp_path / "out", data=str(tmp_path / "text.txt"), quiet=True))


def test_a_state_too_large_to_save_after_ctrl_c_is_warned_about():
    """Several processes, no periodic save and a state a launcher's 30 s cannot write: warned, naming the fix."""
    warning = slow_save_warning(6_500_000_000, processes=2, save_every=0)
    assert "97 GiB" in warning and "--save-every" in warning
    assert slow_save_warning(6_500_000_000, processes=1, save_every=0) is None  # no launcher to kill it
    assert slow_save_warning(6_500_000_000, processes=2, save_every=100) is None
    assert slow_save_warning(1_000_000_000, processes=2, save_every=0) is None  # 15 GiB


@pytest.mark.interpreter  # the kernels on CPU tensors
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_fused_decoder_trains_as_transformers_modules(family, monkeypatch):
    """With fused_decoder (where decoder_kernels_run: CUDA; here the interpreter) the norms and rotary train on
    twell's kernels, forward and backward: the same losses and weights as transformers' modules within fp32
    rounding; the trained model runs its classes' forwards again."""
    import twell.decoder

    monkeypatch.setattr("sparsify.train.loop.decoder_kernels_run", lambda device: True)
    calls = []
    for name in ("rms_norm_fitted", "rotary_fitted"):
        kernel = getattr(twell.decoder, name)
        monkeypatch.setattr(twell.decoder, name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a))
    runs = []
    for fused in (True, False):
        model, _ = tiny_model(family)
        result = train(model, relufy(model), batches_from(), config(steps=3, fused_decoder=fused), device="cpu",
                       show_progress=False)
        assert not any("forward" in vars(m) for m in result.model.modules() if type(m).__name__.endswith("RMSNorm"))
        runs.append((result.log, result.model.state_dict(), len(calls)))
    (fused_log, fused_weights, fused_calls), (log, weights, plain_calls) = runs
    layers = len(model.model.layers)
    assert fused_calls == 3 * (2 * layers + 1 + layers) and plain_calls == fused_calls  # norms, rotary a forward
    assert [e["loss"] for e in fused_log] == pytest.approx([e["loss"] for e in log], rel=1e-5)
    for name, w in weights.items():
        torch.testing.assert_close(fused_weights[name], w, rtol=1e-4, atol=1e-6)


def test_cpu_training_warning_names_the_work_against_the_demo():
    from sparsify.train import cpu_training_warning
    from sparsify.train.memory import DEMO_WORK

    assert cpu_training_warning(3_050_000, 819_200, "cpu") is None  # the demo itself
    warning = cpu_training_warning(500_000_000, 50_000_000, "cpu")
    assert warning.startswith("training 500M parameters on 50,000,000 tokens on the CPU: ")
    assert f"{500e6 * 50e6 / DEMO_WORK:,.0f} times the arithmetic of the demo's conversion" in warning
    # sparsify sample's suggested small-budget run on the demo: a teacher and calibration make it ten demos
    assert cpu_training_warning(3_050_000, 3_580_000, "cpu") is None
    warning = cpu_training_warning(3_050_000, 3_580_000, "cpu", teacher=True, calibration=1500 * 4096 * 2_000_000)
    assert warning.startswith("training 3M parameters on 3,580,000 tokens with a distillation teacher and sparse "
                              "calibration on the CPU: 11 times")


def test_a_run_that_ends_far_from_sparse_says_what_to_change():
    from sparsify.convert import _sparsity_hint

    def layer(active):  # as measure() reports a layer
        return {"mean_active": active, "units": 528, "sparsity": 1 - active / 528}

    layers = [layer(40.0), layer(10.0)]  # 95.27% sparse
    assert _sparsity_hint(layers, config()) is None
    layers[0] = layer(100.0)  # 89.58%
    assert _sparsity_hint(layers, config()).startswith("the model ends 89.58% sparse on the held-out text")
    assert _sparsity_hint(layers, config(target_sparsity=0.99)) is None  # the trainer says that shortfall


def test_a_layer_that_ends_mostly_dead_is_named_with_the_option_that_revives():
    from sparsify.convert import _dead_units_hint

    layers = [{"dead_frac": 0.988}, {"dead_frac": 0.46}, {"dead_frac": 0.80}]
    assert _dead_units_hint(layers, config(batch_size=4, seq_len=32)) == (
        "layers 0 (98.8%), 2 (80.0%) ended with most of their units dead, silent on all the held-out text: that "
        "capacity is lost; --revive-dead-tokens 1280 (about ten optimizer steps' tokens) gives silent units a live "
        "unit's weights to train again")
    assert _dead_units_hint(layers[1:2], config()) is None  # 46% dead: no measurable cost
    assert _dead_units_hint(layers[:1], config(revive_dead_tokens=4096)).endswith("that capacity is lost")
