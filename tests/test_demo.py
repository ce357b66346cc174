"""The embedded demo: its model is a working next-token predictor on the held-out corpus, `sparsify convert demo`
runs end to end (a few steps) into a checkpoint that reloads both ways, the README's use of the result runs on it
as written, and lm-eval (the `eval` extra) scores it through its `hf` model with trust_remote_code."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from cli import main
from helpers import decoder_unfused

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_sparse(tmp_path_factory):
    """The demo converted for two steps into a folder named as the README names it, its held-out figures on the
    first 8,192 tokens of the held-out text."""
    out = tmp_path_factory.mktemp("demo") / "demo-sparse"
    result = CliRunner().invoke(main, ["convert", "demo", "-o", str(out), "--steps", "2", "--batch-size", "4",
                                       "--eval-tokens", "8192"])
    assert result.exit_code == 0, result.output
    return out


def test_convert_demo_for_a_few_steps(demo_sparse):
    training = json.loads((demo_sparse / "config.json").read_text())["twell"]["training"]
    assert training["steps"] == 2 and training["l1"] == 0.08  # recipes/demo.yaml, --steps overriding it
    # The shipped model predicts the next token (a model trained on shifted labels reads in the thousands).
    assert training["perplexity"]["original"] < 30
    ids = torch.randint(3, 4096, (1, 24))
    plain = AutoModelForCausalLM.from_pretrained(demo_sparse).eval()
    remote = AutoModelForCausalLM.from_pretrained(demo_sparse, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(remote(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_readme_use_of_the_result_runs_as_written(demo_sparse):
    """The README's "Use the result" code, as written, on the converted demo, in a Python of its own as a CPU user
    runs it: without the Triton interpreter that conftest turns on for the kernel tests."""
    section = (ROOT / "README.md").read_text().split("## Use the result")[1].split("\n## ")[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=demo_sparse.parent, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("NAME\n    os") and "\nimport os\n" in done.stdout


def test_usage_conversion_from_python_runs_as_written(tmp_path, monkeypatch, capsys):
    """docs/usage.md's "From Python" code at 2 steps of 4 sequences instead of its 40 of the recipe's 8, measured on
    8,192 held-out tokens: the summary it prints."""
    section = (ROOT / "docs" / "usage.md").read_text().split("### From Python")[1].split("\n## ")[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    assert '"steps": 40}' in code
    monkeypatch.chdir(tmp_path)
    exec(code.replace('"steps": 40}', '"steps": 2, "batch_size": 4, "eval_tokens": 8192}'), {})
    perplexity, sparsity = map(ast.literal_eval, capsys.readouterr().out.splitlines()[-2:])
    assert list(perplexity) == ["original", "after swap", "after training"] and min(perplexity.values()) > 1
    assert len(sparsity) == 5 and all(0 < s < 1 for s in sparsity)
    assert (tmp_path / "demo-sparse" / "model.safetensors").is_file()


def test_lm_eval_runs_a_converted_checkpoint(demo_sparse, monkeypatch):
    """What `lm_eval run --model hf --model_args pretrained=demo-sparse,trust_remote_code=True --include_path
    tests/eval_task --tasks sparsify_demo_next_line` runs, on the local task's first question (four choices of
    other lengths, in one padded batch; the checkpoint's decoder kernels answering as where Triton is missing, as
    on a CPU user's machine, not through the interpreter, a program a token): the checkpoint's own modeling file,
    scoring every choice as the plain dense load of the same weights does."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task's data path is relative to the repository, where the README runs it
    # the local task alone: not the index of lm-eval's own thousands of task files, which its command reads too
    tasks = TaskManager(include_path=str(ROOT / "tests" / "eval_task"), include_defaults=False)
    task = "sparsify_demo_next_line"
    scores, choices = {}, {}
    for remote in (True, False):
        model = HFLM(pretrained=str(demo_sparse), trust_remote_code=remote, batch_size=16, device="cpu")
        assert (type(model.model).__name__ == "TwellForCausalLM") is remote
        if remote:
            decoder_unfused(monkeypatch, type(model.model).__module__)
        evaluated = simple_evaluate(model=model, tasks=[task], limit=1, task_manager=tasks)
        assert evaluated["n-samples"][task]["effective"] == 1
        scores[remote] = evaluated["results"][task]
        [sample] = evaluated["samples"][task]
        choices[remote] = [likelihood for likelihood, _ in sample["filtered_resps"]]
    assert 0 <= scores[True]["acc,none"] <= 1
    assert scores[True]["acc,none"] == scores[False]["acc,none"]  # the same logits both ways
    assert scores[True]["acc_norm,none"] == scores[False]["acc_norm,none"]
    # each choice's log-likelihood, as the dense load gives it (fp32 sums in another order)
    assert len(choices[True]) == 4 and choices[True] == pytest.approx(choices[False], rel=1e-5)


def test_demo_generates_the_same_text_at_every_call():
    """The README's `generate` on the demo: greedy by its generation config, so two calls agree; the config sets no
    length, so a caller's max_length holds."""
    from sparsify.load import load_model

    model, tokenizer, _ = load_model("demo", device="cpu")
    assert not model.generation_config.do_sample
    ids = tokenizer("def main(", return_tensors="pt").input_ids
    first, second = (model.generate(ids, max_new_tokens=12) for _ in range(2))
    assert torch.equal(first, second)
    assert model.generate(ids, max_length=ids.shape[1] + 5).shape[1] == ids.shape[1] + 5
