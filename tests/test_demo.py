"""The embedded demo: its model is a working next-token predictor on the held-out corpus, and
`sparsify convert demo` runs end to end (a few steps) into a checkpoint that reloads both ways."""
import json

import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from cli import main


def test_convert_demo_for_a_few_steps(tmp_path):
    out = tmp_path / "demo-sparse"
    result = CliRunner().invoke(main, ["convert", "demo", "-o", str(out), "--steps", "2", "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    training = json.loads((out / "config.json").read_text())["twell"]["training"]
    assert training["steps"] == 2 and training["l1"] == 0.08  # recipes/demo.yaml, --steps overriding it
    # The shipped model predicts the next token (a model trained on shifted labels reads in the thousands).
    assert training["perplexity"]["original"] < 30
    ids = torch.randint(3, 4096, (1, 24))
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(remote(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_demo_generates_the_same_text_at_every_call():
    """The README's `generate` on the demo: greedy by its generation config, so two calls agree."""
    from sparsify.load import load_model

    model, tokenizer, _ = load_model("demo", device="cpu")
    assert not model.generation_config.do_sample
    ids = tokenizer("def main(", return_tensors="pt").input_ids
    first, second = (model.generate(ids, max_new_tokens=12) for _ in range(2))
    assert torch.equal(first, second)
