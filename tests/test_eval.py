"""lm-eval (the `eval` extra) runs a converted checkpoint through its `hf` model with trust_remote_code, as the
README's evaluation command does for standard tasks: here the demo, converted for one step, on the local task of
tests/eval_task (which line of a held-out pydoc page comes next, of four)."""
from pathlib import Path

from click.testing import CliRunner

from cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_lm_eval_runs_a_converted_checkpoint(tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    out = tmp_path / "demo-sparse"
    result = CliRunner().invoke(main, ["convert", "demo", "-o", str(out), "--steps", "1", "--batch-size", "2",
                                       "--eval-tokens", "1024", "--quiet"])
    assert result.exit_code == 0, result.output
    monkeypatch.chdir(ROOT)  # the task's data path is relative to the repository, where the README runs it
    # what `lm_eval --model hf --model_args pretrained=OUT,trust_remote_code=True` builds
    tasks = TaskManager(include_path=str(ROOT / "tests" / "eval_task"))
    scores = {}
    for remote in (True, False):  # the checkpoint's own modeling file, and the plain dense ReLU model it also loads as
        model = HFLM(pretrained=str(out), trust_remote_code=remote, batch_size=16, device="cpu")
        assert (type(model.model).__name__ == "TwellForCausalLM") is remote
        evaluated = simple_evaluate(model=model, tasks=["sparsify_demo_next_line"], limit=16, task_manager=tasks)
        assert evaluated["n-samples"]["sparsify_demo_next_line"]["effective"] == 16
        scores[remote] = evaluated["results"]["sparsify_demo_next_line"]
    assert 0 <= scores[True]["acc,none"] <= 1
    assert scores[True]["acc,none"] == scores[False]["acc,none"]  # the same logits both ways
    assert scores[True]["acc_norm,none"] == scores[False]["acc_norm,none"]
