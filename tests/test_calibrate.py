"""Calibration (--calibrate-steps): each ReLU MLP fitted to the source's MLP on the source's own inputs, or
bottom up to the source's residual stream (--calibrate-sequential), before training; the settings it refuses; through
the command line, and skipped by a resumed run, which reports the saved record."""
import json
import re

import pytest
import torch

from helpers import interrupt, on_read, tiny_input_ids, tiny_model
from sparsify import calibrate as calibrate_module
from sparsify import convert as convert_module
from sparsify import data as data_module
from sparsify.calibrate import SourceProjections, calibrate, calibration_blocks, source_rows, source_stream, stream_rows
from sparsify.config import TrainConfig
from sparsify.errors import ConfigError
from sparsify.load import mlp_parameter_count
from sparsify.relufy import relufy
from sparsify.train import train
from test_cli import assert_user_error, convert, files  # noqa: F401  (files: the fixture)


def test_source_rows_are_the_source_mlps_inputs_and_outputs():
    model, _ = tiny_model("llama")
    ids = tiny_input_ids(2, 16)
    seen = {}
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: seen.update(x=a[0], y=o))
    with torch.no_grad():
        model(ids)
    handle.remove()
    relufy(model)
    x, y = source_rows(model, [ids], 1)
    assert torch.equal(x, seen["x"].flatten(0, 1)) and torch.equal(y, seen["y"].flatten(0, 1))


def test_calibration_fits_every_mlp_and_nothing_else():
    model, _ = tiny_model("qwen3")
    mlps = relufy(model)
    before = {name: p.clone() for name, p in model.named_parameters()}
    blocks = [tiny_input_ids(4, 32, seed=s) for s in range(2)]
    result = calibrate(model, mlps, blocks, steps=40, lr=3e-3, shown=False)
    assert result.tokens == 256 and len(result.layers) == len(mlps)
    for fit in result.layers:
        assert 0 < fit.after < 0.5 * fit.before, fit
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) != (".mlp." in name), name  # MLP weights moved, the rest did not
    assert [m.__class__.__name__ for m in relufy(model)] == ["ReluGatedMLP"] * len(mlps)  # still relufied


def test_every_layer_is_fitted_on_the_untouched_sources_rows(monkeypatch):
    model, _ = tiny_model("llama", num_hidden_layers=3)
    blocks = [tiny_input_ids(4, 32)]
    mlps = relufy(model)
    source = [source_rows(model, blocks, layer) for layer in range(3)]  # before any fit
    fitted = {}
    fit_layer = calibrate_module.fit_layer

    def keep_rows(mlp, x, y, *args):
        fitted[mlps.index(mlp)] = (x, y)
        return fit_layer(mlp, x, y, *args)

    monkeypatch.setattr(calibrate_module, "fit_layer", keep_rows)
    calibrate(model, mlps, blocks, steps=20, lr=3e-2, shown=False)
    for layer, (x, y) in enumerate(source):
        assert torch.equal(fitted[layer][0], x) and torch.equal(fitted[layer][1], y), layer


def test_sparse_calibration_reaches_its_target_where_the_dense_fit_does_not():
    model, _ = tiny_model("llama")
    blocks = [tiny_input_ids(4, 32, seed=s) for s in range(2)]
    dense = calibrate(model, relufy(model), blocks, steps=300, lr=3e-3, shown=False)
    model, _ = tiny_model("llama")
    sparse = calibrate(model, relufy(model), blocks, steps=300, lr=3e-3, shown=False, sparsity=0.9)
    units = model.config.intermediate_size
    assert sparse.record()["sparsity"] == 0.9 and dense.record()["sparsity"] == 0.0
    for fit_dense, fit_sparse in zip(dense.layers, sparse.layers):
        assert fit_dense.active > 0.3 * units, fit_dense  # a dense fit leaves about half the units firing
        assert 0.05 * units < fit_sparse.active <= 0.12 * units, fit_sparse  # the target: 10% firing, give or take
        assert fit_sparse.after < fit_sparse.before, fit_sparse  # and it still fits the source
        assert fit_sparse.l1_swap == pytest.approx(fit_dense.l1_swap)  # the same swapped model's L1 before
    assert sparse.l1_reference == pytest.approx(sum(fit.l1_swap for fit in sparse.layers) / len(sparse.layers))


def stream_error(model, blocks, source) -> float:
    """The relative squared error of `model`'s residual stream after its last layer against `source`'s."""
    fitted = source_stream_of(model, blocks)
    return float((fitted - source).square().sum() / source.square().sum())


def source_stream_of(model, blocks):
    """The residual stream after the last decoder layer of `model` as it is (ReLU MLPs), over `blocks`."""
    kept = []
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, o: kept.append(
        (o[0] if isinstance(o, tuple) else o).flatten(0, -2)))
    with torch.no_grad():
        for block in blocks:
            model(block)
    handle.remove()
    return torch.cat(kept)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: the MLP's output normalized before the residual
def test_sequential_targets_complete_the_source_stream_after_the_layers_below_are_fitted(family):
    model, _ = tiny_model(family, num_hidden_layers=3)
    blocks = [tiny_input_ids(2, 16)]
    after = []
    handles = [layer.register_forward_hook(lambda m, a, o: after.append(o[0] if isinstance(o, tuple) else o))
               for layer in model.model.layers]
    with torch.no_grad():
        model(blocks[0])
    for handle in handles:
        handle.remove()
    mlps = relufy(model)
    stream = [source_stream(model, blocks, layer) for layer in range(3)]
    for kept, seen in zip(stream, after):
        assert kept.device.type == "cpu" and torch.equal(kept, seen.flatten(0, 1))
    x, y = stream_rows(model, blocks, 0, stream[0])  # nothing below layer 0: its source MLP's rows
    x_source, y_source = source_rows(model, blocks, 0)
    tail = calibrate_module.output_norm(model, 0)
    assert (tail is not None) == (family == "gemma2")
    with torch.no_grad():
        y_source = tail(y_source) if tail is not None else y_source
    assert torch.equal(x, x_source) and torch.allclose(y, y_source, atol=1e-5)
    source = SourceProjections(mlps)
    source.keep(0)
    with torch.no_grad():
        for p in mlps[0].parameters():
            p.mul_(0.5)  # layer 0 "fitted": the stream above it moves
    fitted = [p.detach().clone() for p in mlps[0].parameters()]
    assert not torch.allclose(source_stream(model, blocks, 1), stream[1])
    with source.in_place():  # the source's projections back in layer 0: the source's stream again
        assert torch.equal(source_stream(model, blocks, 1), stream[1])
    assert all(torch.equal(p, f) for p, f in zip(mlps[0].parameters(), fitted))  # and the fitted ones after
    x, y = stream_rows(model, blocks, 1, stream[1])
    assert not torch.allclose(x, source_rows(model, blocks, 1)[0])  # layer 1's inputs as the fitted model gives them
    # layer 1's MLP (through its output norm where it has one) returns its target
    handle = (calibrate_module.output_norm(model, 1) or mlps[1]).register_forward_hook(lambda m, a, o: y.view_as(o))
    with torch.no_grad():
        stream_with_target = source_stream_of_layer(model, blocks, 1)
    handle.remove()
    assert torch.allclose(stream_with_target, stream[1], atol=1e-5)  # the source's stream after layer 1, restored


def source_stream_of_layer(model, blocks, layer):
    kept = []
    handle = model.model.layers[layer].register_forward_hook(lambda m, a, o: kept.append(
        (o[0] if isinstance(o, tuple) else o).flatten(0, -2)))
    for block in blocks:
        model(block)
    handle.remove()
    return torch.cat(kept)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_sequential_calibration_keeps_the_stream_nearer_the_source_than_independent_fits(family):
    blocks = [tiny_input_ids(4, 32, seed=s) for s in range(2)]
    errors = {}
    for sequential in (False, True):
        model, _ = tiny_model(family, num_hidden_layers=4)
        mlps = relufy(model)
        source = source_stream(model, blocks, 3)
        result = calibrate(model, mlps, blocks, steps=200, lr=3e-3, shown=False, sequential=sequential)
        assert result.record()["sequential"] is sequential
        errors[sequential] = stream_error(model, blocks, source)
    assert errors[True] < 0.7 * errors[False], errors


def test_sequential_calibration_refuses_projections_larger_than_the_memory_available(monkeypatch):
    model, _ = tiny_model("llama", num_hidden_layers=3)
    config = model.config
    needed = 3 * 3 * config.hidden_size * config.intermediate_size * 4  # fp32 gate, up and down of every layer
    assert 4 * mlp_parameter_count(config) == needed
    calibrate_module.check_kept_memory(needed, needed)
    calibrate_module.check_kept_memory(needed, None)  # unknown: not refused
    with pytest.raises(ConfigError, match=r"keeps the source's MLP projections.*--calibrate-independent"):
        calibrate_module.check_kept_memory(needed, needed - 1)
    assert calibrate_module.available_memory() is None or calibrate_module.available_memory() > 0
    monkeypatch.setattr(calibrate_module, "available_memory", lambda: needed - 1)  # calibrate's own check
    blocks = [tiny_input_ids(2, 16)]
    with pytest.raises(ConfigError, match="keeps the source's MLP projections"):
        calibrate(model, relufy(model), blocks, steps=1, lr=1e-3, shown=False, sequential=True)


def test_convert_refuses_sequential_calibration_without_the_memory_before_reading_a_weight(files, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setattr(convert_module, "available_memory", lambda: 1)
    monkeypatch.setattr(convert_module, "load_model", None)  # no weight is read
    calibrating = ("--calibrate-steps", 5, "--swap-steps", 0)
    assert_user_error(convert(files, "llama", tmp_path / "out", *calibrating, "--calibrate-sequential"),
                      "keeps the source's MLP projections")
    assert not (tmp_path / "out").exists()
    result = convert(files, "llama", tmp_path / "dry", *calibrating, "--calibrate-independent", "--dry-run")
    assert result.exit_code == 0, result.output


def test_calibration_blocks_take_whole_batches_up_to_the_tokens():
    batches = iter([torch.zeros(2, 8, dtype=torch.long)] * 10)
    assert len(calibration_blocks(batches, 17)) == 2 and len(calibration_blocks(batches, 16)) == 1


@pytest.mark.parametrize("settings,world,message", [
    ({"swap_steps": "20%"}, None, "set --swap-steps 0 (it is 20%)"),
    ({"swap_steps": 10}, None, "set --swap-steps 0 (it is 10)"),
    ({"calibrate_steps": -1}, None, "--calibrate-steps must be an integer >= 0"),
    ({"calibrate_tokens": 0}, None, "--calibrate-tokens must be a positive integer"),
    ({"calibrate_lr": 2.0}, None, "--calibrate-lr must be in (0, 1]"),
    ({"calibrate_sparsity": 1.0}, None, "--calibrate-sparsity must be in [0, 1)"),
    ({"calibrate_sparsity": 0.99, "calibrate_steps": 0}, None, "set --calibrate-steps too"),
    ({"calibrate_sequential": True, "calibrate_steps": 0}, None, "--calibrate-sequential sets how calibration fits"),
    ({"calibrate_sequential": True}, 2, "--calibrate-sequential runs on one process, not 2"),
])
def test_impossible_calibration_settings(settings, world, message):
    config = TrainConfig.from_dict({"steps": 100, "calibrate_steps": 10, **settings})
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.validate(world=world)


def test_the_log_penalty_eps_is_measured_on_each_swapped_layer_and_weighs_its_fit():
    """With the log penalty each layer's eps is the scale times its mean |h| over the firing units of its first rows
    before the fit, and the fit's reference is the log penalty of the swapped layer with that eps."""
    model, _ = tiny_model("llama")
    blocks = [tiny_input_ids(4, 32, seed=s) for s in range(2)]
    mlps = relufy(model)
    eps, penalty = [], []
    for layer, mlp in enumerate(mlps):
        x, _ = source_rows(model, blocks, layer)  # the source's rows: no layer is fitted yet
        with torch.no_grad():
            gate, up = mlp.gate_up(x)
            h = torch.relu(gate) * up
        first = h[:calibrate_module.ROWS_PER_STEP][gate[:calibrate_module.ROWS_PER_STEP] > 0]
        eps.append(0.2 * first.abs().mean().item())
        penalty.append((eps[-1] * torch.log1p(h.abs() / eps[-1])).sum(-1).mean().item())
    result = calibrate(model, mlps, blocks, steps=300, lr=3e-3, shown=False, sparsity=0.9, l1_log_scale=0.2)
    assert result.l1_eps == pytest.approx(eps, rel=1e-5) and result.record()["l1_eps"] == result.l1_eps
    assert [fit.l1_swap for fit in result.layers] == pytest.approx(penalty, rel=1e-5)
    units = model.config.intermediate_size
    assert all(0.05 * units < fit.active <= 0.12 * units for fit in result.layers)  # the target under this penalty
    assert calibrate(model, relufy(model), blocks, steps=1, lr=1e-3, shown=False).l1_eps is None  # L1


@pytest.mark.parametrize("sequential, log_scale", [(False, 0.0), (True, 0.0), (False, 0.2)])
def test_convert_calibrates_and_records_it(files, tmp_path, monkeypatch, sequential, log_scale):
    out = tmp_path / "out"
    trained = []  # the l1_eps that convert hands to training
    monkeypatch.setattr(convert_module, "train", lambda *a, **k: trained.append(k["l1_eps"]) or train(*a, **k))
    # --no-hybrid: the calibrated layers are sparse enough for the hybrid kernels, which would train through the
    # interpreter here (test_hybrid_routing.py checks them; the calibration is what this test is about)
    result = convert(files, "llama", out, "--calibrate-steps", 20, "--calibrate-tokens", 64, "--calibrate-lr", 3e-3,
                     "--no-hybrid", "--l1-relative", "--l1", 3.5, *["--calibrate-sequential"] * sequential,
                     "--l1-log-scale", log_scale)
    assert result.exit_code == 0, result.output
    training = json.loads((out / "training_log.json").read_text())["training"]
    calibration = training["calibration"]
    assert calibration["tokens"] == 64 and calibration["steps"] == 20 and calibration["lr"] == 3e-3
    assert calibration["sequential"] is sequential
    assert len(calibration["layers"]) == 2 and all(l["after"] < l["before"] for l in calibration["layers"])
    # the relative L1's reference is the swapped model's L1, measured by calibration before it changed the MLPs
    log = json.loads((out / "training_log.json").read_text())["log"]
    assert log[0]["l1_reference"] == calibration["l1_reference"] > 0
    ppl = training["perplexity"]
    assert list(ppl) == ["original", "after swap", "after calibration", "after training"]
    assert "after calibration" in result.output and "calibrated layer 1 (layers 0-1)" in result.output
    # the log penalty's eps: measured by calibration, kept by training
    assert trained == [calibration["l1_eps"]] and (calibration["l1_eps"] is None) == (not log_scale)


def test_a_resumed_conversion_reports_the_calibration_without_calibrating_again(files, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = data_module.TrainingBatches.__next__
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", on_read(real, 3, interrupt))
    calibrated, after = [], []  # the interrupted run's calibration and perplexity after it
    monkeypatch.setattr(convert_module, "calibrate",
                        lambda *a, **k: calibrated.append(calibrate(*a, **k)) or calibrated[-1])
    measure_after = convert_module._Perplexities.after_calibration

    def keep_after(self, model):
        measure_after(self, model)
        after.append(self.values["after calibration"])

    monkeypatch.setattr(convert_module._Perplexities, "after_calibration", keep_after)
    extra = ("--steps", 4, "--calibrate-steps", 5, "--calibrate-tokens", 64)
    assert_user_error(convert(files, "llama", out, *extra), "interrupted at step")
    assert len(calibrated) == 1 and len(after) == 1
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", real)
    monkeypatch.setattr(convert_module, "calibrate", lambda *a, **k: pytest.fail("calibrated on resume"))
    result = convert(files, "llama", out, *extra, "--resume")
    assert result.exit_code == 0, result.output
    training = json.loads((out / "training_log.json").read_text())["training"]
    assert training["calibration"] == calibrated[0].record()
    assert training["perplexity"]["after calibration"] == after[0]
    assert list(training["perplexity"]) == ["original", "after swap", "after calibration", "after training"]


def _calibrate_as_process(rank, world, init_file, out):
    """Process `rank` of `world` (gloo): calibrates a 3-layer model and saves what the last process holds."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, _ = tiny_model("llama", num_hidden_layers=3)
        mlps = relufy(model)
        blocks = [tiny_input_ids(4, 32, seed=s) for s in range(2)]
        result = calibrate(model, mlps, blocks, steps=5, lr=3e-3, shown=False, sparsity=0.5, l1_log_scale=0.2,
                           rank=rank, world=world)
        if rank == world - 1:  # it fitted layer 1 alone
            torch.save({"weights": model.state_dict(), "record": result.record(),
                        "eps": [mlp.l1_eps for mlp in mlps]}, out)
    finally:
        torch.distributed.destroy_process_group()


def test_processes_share_their_layers_fits(tmp_path):
    """Three layers over two processes (process 0 fits layers 2 and 0, process 1 layer 1): a process ends with every
    layer fitted, the weights, record and log-penalty eps of one process's calibration."""
    torch.multiprocessing.spawn(_calibrate_as_process, args=(2, tmp_path / "init", tmp_path / "two.pt"), nprocs=2)
    two = torch.load(tmp_path / "two.pt")
    model, _ = tiny_model("llama", num_hidden_layers=3)
    mlps = relufy(model)
    source = {name: p.clone() for name, p in model.named_parameters()}
    blocks = [tiny_input_ids(4, 32, seed=s) for s in range(2)]
    one = calibrate(model, mlps, blocks, steps=5, lr=3e-3, shown=False, sparsity=0.5, l1_log_scale=0.2).record()
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=1e-4, atol=1e-6, msg=name)
        if ".mlp." in name:
            assert not torch.equal(weight, source[name]), name  # every layer's MLP fitted
    assert two["eps"] == pytest.approx(one["l1_eps"], rel=1e-5) and len(one["layers"]) == 3
    for two_layer, one_layer in zip(two["record"]["layers"], one["layers"]):
        assert two_layer == pytest.approx(one_layer, rel=1e-4)
