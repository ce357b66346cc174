"""`accelerate launch --config_file recipes/accelerate/fsdp.yaml` on 2 CPU processes (gloo): FSDP2 training
equals one process with both processes' batches, so do the perplexities and held-out statistics measured on
the sharded model, the export gathered from the shards equals that process's export file for file, and
Ctrl-C -> --resume from the sharded state, and a failure after training -> --resume, continue to the same weights.

accelerate runs CPU processes as DDP whatever the config says; tests/fsdp_on_cpu.py makes them FSDP (its
docstring says where and why) and checks inside every MLP forward that the weights are whole tensors; both runs
take the LM head and loss in chunks of 5 tokens.
Tolerance: the same tokens pass through the same fp32 arithmetic in both runs; only the sums differ in
order (gradients reduce-scattered over 2 processes against accumulated over one batch of 4), which moves
fp32 results by a few ulps per step: rtol 1e-5 on the logged losses, rtol 1e-4 / atol 1e-6 on the
weights after 3 AdamW steps, as for DDP in test_cli.py.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import SMALL_CHUNK_BYTES, chunked_calls, tiny_model
from test_cli import convert, files, model_folder, run  # noqa: F401 (files: the module's fixture)
from twell.training import head_loss as head_loss_op

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def launch_fsdp(files, out, *extra, interrupt_at=None, source=None, fail_write=False):
    command = [sys.executable, "-m", "accelerate.commands.launch",
               "--config_file", ROOT / "recipes" / "accelerate" / "fsdp.yaml",
               "--num_processes", 2, "--main_process_port", 0, ROOT / "tests" / "fsdp_on_cpu.py",
               "convert", source or model_folder(files, "llama"), "-o", out, "--data", files / "corpus",
               "--recipe", files / "recipe.yaml", "--steps", STEPS, "--batch-size", 2, *extra]
    env = {**os.environ, **({"SPARSIFY_TEST_SIGNAL": f"0:{interrupt_at}:SIGINT"} if interrupt_at is not None else {}),
           **({"SPARSIFY_TEST_FAIL_WRITE": "1"} if fail_write else {})}
    return subprocess.run([str(c) for c in command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(autouse=True, scope="module")
def small_chunks():
    """The one-process runs take the chunked LM head as fsdp_on_cpu.py's processes do."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(head_loss_op, "CHUNK_BYTES", SMALL_CHUNK_BYTES)
        yield


def weights(out):
    return load_file(out / "model.safetensors")


def assert_same_weights(a, b):
    assert sorted(a) == sorted(b)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def fsdp_out(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "two"
    done = launch_fsdp(files, out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert chunked_calls(done.stdout) == [STEPS, STEPS]  # a micro-batch a step on each process
    return out


def test_fsdp_trains_and_exports_like_one_process_with_both_batches(files, fsdp_out, tmp_path):
    one = tmp_path / "one"
    assert convert(files, "llama", one, "--steps", STEPS, "--batch-size", 4).exit_code == 0
    assert sorted(p.name for p in fsdp_out.iterdir()) == sorted(p.name for p in one.iterdir())
    assert_same_weights(weights(fsdp_out), weights(one))
    two_log = json.loads((fsdp_out / "training_log.json").read_text())
    one_log = json.loads((one / "training_log.json").read_text())
    assert two_log["training"]["tokens"] == one_log["training"]["tokens"] == STEPS * 4 * 32
    assert [e["step"] for e in two_log["log"]] == list(range(1, STEPS + 1))
    for a, b in zip(two_log["log"], one_log["log"]):
        for key in ("loss", "cross_entropy", "l1", "mean_active", "dead_frac"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)
        assert [l["dead_frac"] for l in a["layers"]] == pytest.approx([l["dead_frac"] for l in b["layers"]])
    # the perplexities and the measurement, run sharded (the held-out batches split over the processes):
    # the same held-out statistics and plan
    two_config, one_config = (json.loads((o / "config.json").read_text())["twell"] for o in (fsdp_out, one))
    assert two_config["training"]["perplexity"] == pytest.approx(one_config["training"]["perplexity"], rel=1e-4)
    for two_layer, one_layer in zip(two_config["layers"], one_config["layers"], strict=True):
        # pytest.approx takes numbers only (pytest 9.2 rejects a mapping that holds a string)
        numbers = {k for k, v in one_layer["stats"].items() if isinstance(v, (int, float))}
        assert {k: two_layer["stats"][k] for k in numbers} == pytest.approx(
            {k: one_layer["stats"][k] for k in numbers}, rel=1e-4)
        assert {k: v for k, v in two_layer["stats"].items() if k not in numbers} == {
            k: v for k, v in one_layer["stats"].items() if k not in numbers}
        assert {k: v for k, v in two_layer.items() if k != "stats"} == {
            k: v for k, v in one_layer.items() if k != "stats"}


def test_fsdp_distillation_with_tied_embeddings_like_one_process(files, tmp_path):
    """--distill under FSDP on a source with tied input and output embeddings (Qwen2.5 0.5B-3B and others: one
    parameter in two modules, which the processes that read no weights tie as the main one does): each process
    holds the whole teacher, the main process's weights broadcast to the other (which read none), so the run
    equals one process with both batches, and the export is saved tied, as the source."""
    model, tokenizer = tiny_model("qwen2", tie_word_embeddings=True)
    source = tmp_path / "tied"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    done = launch_fsdp(files, tmp_path / "two", "--distill", 0.5, source=source)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert chunked_calls(done.stdout) == [STEPS, STEPS]
    one = run("convert", source, "-o", tmp_path / "one", "--data", files / "corpus", "--recipe", files / "recipe.yaml",
              "--steps", STEPS, "--batch-size", 4, "--distill", 0.5)
    assert one.exit_code == 0, one.output
    assert_same_weights(weights(tmp_path / "two"), weights(tmp_path / "one"))
    assert "lm_head.weight" not in weights(tmp_path / "two")
    two_log, one_log = (json.loads((o / "training_log.json").read_text())["log"] for o in (tmp_path / "two",
                                                                                           tmp_path / "one"))
    assert [e["kl"] for e in two_log] == pytest.approx([e["kl"] for e in one_log], rel=1e-5)


@pytest.mark.slow
def test_fsdp_ctrl_c_then_a_failure_after_training_each_resume_from_the_sharded_state(files, fsdp_out, tmp_path):
    """Ctrl-C during step 2 saves the sharded state of the steps done; --resume continues from it.
    That resumed run then fails after training: with several processes an error after training cannot save (the
    others have gone on or finished), so the last step was saved when training ended (periodic saves on, as by
    default), and --resume from it trains nothing, then measures and writes the uninterrupted run's checkpoint."""
    out, resume = tmp_path / "out", tmp_path / "out.resume"
    done = launch_fsdp(files, out, interrupt_at=1)  # Ctrl-C to the main process during step 2: 2 steps done
    assert done.returncode != 0 and "interrupted at step 2 of 3" in done.stdout + done.stderr
    state = json.loads((resume / "state.json").read_text())
    assert state["step"] == 2 and not out.exists()
    saved = state["before_training"]["perplexity"]  # measured on the sharded model before the first step
    assert set(saved) == {"original", "after swap"}
    assert (resume / "pytorch_model_fsdp_0").is_dir()  # the sharded weights (torch.distributed.checkpoint)

    done = launch_fsdp(files, out, "--resume", fail_write=True)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0 and "No space left on device" in output
    assert f"the training state of step {STEPS} of {STEPS} is saved in {resume}" in output
    assert json.loads((resume / "state.json").read_text())["step"] == STEPS and not out.exists()

    done = launch_fsdp(files, out, "--resume")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert [e["step"] for e in json.loads((out / "training_log.json").read_text())["log"]] == [1, 2, 3]
    record = json.loads((out / "config.json").read_text())["twell"]["training"]["perplexity"]
    assert {key: record[key] for key in saved} == saved
    assert_same_weights(weights(out), weights(fsdp_out))
    assert not resume.exists()
