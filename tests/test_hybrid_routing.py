"""Per-layer routing of training between the dense path and the TwELL hybrid kernels (run by the Triton
interpreter on CPU fp32 here, hence the tiny sizes and few steps): layers switch by measured activity, with
hysteresis, the log records paths and backup rows, and training on the hybrid kernels gives the dense
path's losses and weights."""
import copy

import pytest
import torch

from helpers import interrupt, tiny_model
from sparsify.relufy import relufy
from sparsify.train import (HYBRID_EXIT, TrainConfig, TrainingInterrupted, hybrid_kernels_run, hybrid_paths,
                            hybrid_share, train)
from test_train import BATCH, SEQ, acting_at, batches_from


def config(**kw):
    return TrainConfig(**{"steps": 4, "seq_len": SEQ, "batch_size": BATCH, "lr": 1e-3, "l1": 1e-3,
                          "log_every": 1, **kw})


def entry(*layers):
    return {"layers": [{"active": a, "path": p} for a, p in layers]}


def test_paths_switch_below_threshold_and_back_above_the_band():
    below = 40
    paths = hybrid_paths(entry((39.9, "dense"), (40, "dense"), (45, "hybrid"), (HYBRID_EXIT * below, "hybrid"),
                               (50.1, "hybrid")), below)
    assert paths == [True, False, True, True, False]


def test_hybrid_share_weights_log_windows_by_their_steps():
    log = [{"step": 2, **entry((0, "dense"), (0, "hybrid"))}, {"step": 8, **entry((0, "hybrid"), (0, "hybrid"))}]
    assert hybrid_share(log) == [0.75, 1.0]
    assert hybrid_share([]) == []


@pytest.mark.interpreter
def test_kernels_run_on_cpu_only_under_the_interpreter(monkeypatch):
    assert hybrid_kernels_run(torch.device("cpu"))  # conftest sets TRITON_INTERPRET=1 without a GPU
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not hybrid_kernels_run(torch.device("cpu"))


@pytest.mark.interpreter
def test_layers_switch_by_activity_and_the_log_records_paths_and_backup_rows():
    model, _ = tiny_model("llama", hidden_size=16, intermediate_size=32, head_dim=8)
    mlps = relufy(model)
    layer0 = mlps[0].gate_proj.weight
    original = layer0.detach().clone()
    with torch.no_grad():  # 26 of 32 gate rows at 0: at most 6 active units (no gradient revives them)
        layer0[6:] = 0

    def batches(start, rank, world):
        for i, b in enumerate(batches_from()(start, rank, world)):
            if i == 3:  # before step 4: layer 0 dense again (~16 active units of 32)
                with torch.no_grad():
                    layer0[6:] = original[6:]
            yield b

    # Layer 1 has ~16 active units: dense throughout. max_nnz 2: rows of layer 0 above 2 active units
    # go to the dense backup.
    below = 10
    log = train(model, mlps, batches, config(steps=5, l1=0.0, hybrid_below=below, hybrid_max_nnz=2,
                                             hybrid_hot_rate=1.0), device="cpu", show_progress=False).log
    paths = [[l["path"] for l in e["layers"]] for e in log]
    active = [[l["active"] for l in e["layers"]] for e in log]
    assert all(a0 <= 6 for a0, _ in active[:3]) and all(a0 > HYBRID_EXIT * below for a0, _ in active[3:])
    assert all(a1 > HYBRID_EXIT * below for _, a1 in active)
    # Step 1 dense (nothing measured yet), steps 2-3 hybrid, step 4 hybrid (chosen after step 3) with
    # its measured activity high, so step 5 is dense again.
    assert [p0 for p0, _ in paths] == ["dense", "hybrid", "hybrid", "hybrid", "dense"]
    assert all(p1 == "dense" for _, p1 in paths)
    backup = [[l["backup_rows"] for l in e["layers"]] for e in log]
    assert all(b0 > 0 for b0, _ in backup[1:4]) and backup[0][0] == backup[4][0] == 0
    assert all(b1 == 0 for _, b1 in backup)
    assert backup[3][0] == SEQ * BATCH  # every row of the dense step 4 has more than 2 active units
    assert hybrid_share(log) == [0.6, 0.0]
    assert all(not m.use_hybrid for m in mlps)
    assert all(l["hot_units"] == 0 for e in log for l in e["layers"])


@pytest.mark.interpreter
def test_busy_units_of_hybrid_layers_run_as_dense_columns():
    model, _ = tiny_model("llama")
    mlps = relufy(model)
    with torch.no_grad():  # layer 0: at most 20 active units of 160, each in far more than 1.3% of tokens
        mlps[0].gate_proj.weight[20:] = 0
    log = train(model, mlps, batches_from(), config(steps=2, l1=0.0, hybrid_below=50, hybrid_max_nnz=4),
                device="cpu", show_progress=False).log
    hot = [[l["hot_units"] for l in e["layers"]] for e in log]
    backup = [[l["backup_rows"] for l in e["layers"]] for e in log]
    # chosen at the first log step, a multiple of 8 of the 20 busy units; outside the row budget, so
    # the rows that went to the backup without them (test above) fit the ELL now
    assert hot[0][0] in (8, 16) and hot[0][1] == 0 and hot[1] == hot[0]
    assert (all(b0 < SEQ * BATCH for b0, _ in backup[1:])
            and all(p == "hybrid" for p in [e["layers"][0]["path"] for e in log[1:]]))


@pytest.mark.interpreter
@pytest.mark.parametrize("hot_rate, log_scale", [(1.0, 0.2), (0.5, 0.0)])
def test_training_on_the_hybrid_kernels_matches_dense(hot_rate, log_scale):
    # 32 units, ~16 active per token, E = 16: about half the rows go through the ELL kernels, the rest
    # through the dense backup (the interpreter's time grows with E and D: small ones keep this fast).
    # hot_rate 0.5: the units firing in over half the tokens run as dense columns instead. log_scale 0.2:
    # the log penalty, its eps measured on the first (dense) step, in every kernel that computes the penalty
    # (each kernel with and without it: test_twell_hybrid.py).
    dense, _ = tiny_model("qwen3", hidden_size=16, intermediate_size=32, head_dim=8)
    hybrid = copy.deepcopy(dense)
    runs = []
    for model, below in ((dense, 0), (hybrid, 1e9)):  # 1e9: every layer hybrid from step 2 on
        runs.append(train(model, relufy(model), batches_from(), config(steps=3, hybrid_below=below,
                                                                       hybrid_max_nnz=16, hybrid_hot_rate=hot_rate,
                                                                       l1_log_scale=log_scale),
                          device="cpu", show_progress=False).log)
    dense_log, hybrid_log = runs
    assert [[l["path"] for l in e["layers"]] for e in hybrid_log] == [["dense"] * 2] + [["hybrid"] * 2] * 2
    backup = [l["backup_rows"] for e in hybrid_log[1:] for l in e["layers"]]
    hot = [l["hot_units"] for e in hybrid_log[1:] for l in e["layers"]]
    if hot_rate == 1.0:
        assert 0 < sum(backup) < 0.8 * len(backup) * SEQ * BATCH and not any(hot)
    else:
        assert all(h >= 8 for h in hot)
    assert all(l["path"] == "dense" for e in dense_log for l in e["layers"])
    for key in ("loss", "cross_entropy", "l1", "mean_active"):
        assert [e[key] for e in hybrid_log] == pytest.approx([e[key] for e in dense_log], rel=1e-5), key
    for (name, a), b in zip(dense.named_parameters(), hybrid.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.interpreter
def test_mlps_with_bias_stay_dense_in_the_log():
    # The hybrid kernels have no bias terms: such MLPs run dense whatever their activity, and say so.
    model, _ = tiny_model("llama", mlp_bias=True)
    log = train(model, relufy(model), batches_from(), config(steps=2, hybrid_below=1e9), device="cpu",
                show_progress=False).log
    assert all(l["path"] == "dense" and l["backup_rows"] == 0 for e in log for l in e["layers"])


@pytest.mark.interpreter
def test_resume_continues_on_the_paths_chosen_before_the_interrupt(tmp_path):
    def sparse_layer0(seed=0):  # layer 0 at most 8 active units: hybrid from step 2 on
        model, _ = tiny_model("llama", seed=seed, hidden_size=16, intermediate_size=32, head_dim=8)
        mlps = relufy(model)
        with torch.no_grad():
            mlps[0].gate_proj.weight[8:] = 0
        return model, mlps

    cfg = config(steps=3, hybrid_below=12, hybrid_max_nnz=4)
    straight, mlps = sparse_layer0()
    expected = train(straight, mlps, batches_from(), cfg, device="cpu", show_progress=False).log
    interrupted, mlps = sparse_layer0()
    with pytest.raises(TrainingInterrupted, match="interrupted at step 2 of 3"):  # its step 2 on the hybrid path
        train(interrupted, mlps, acting_at(1, interrupt), cfg, resume_dir=tmp_path / "r", device="cpu",
              show_progress=False)
    resumed, mlps = sparse_layer0(seed=1)  # every weight comes back from the saved state
    log = train(resumed, mlps, batches_from(), cfg, resume_dir=tmp_path / "r", resume=True, device="cpu",
                show_progress=False).log
    assert [[l["path"] for l in e["layers"]] for e in log] == [[l["path"] for l in e["layers"]] for e in expected]
    assert [e["layers"][0]["path"] for e in log] == ["dense", "hybrid", "hybrid"]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, msg=name)
