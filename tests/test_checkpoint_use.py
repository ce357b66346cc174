"""A converted checkpoint as someone who downloaded it uses it: its model card, print(model), use_fp8_gate's
warnings, and fine-tuning and saving the remote-code load again in a Python where sparsify is not importable."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from helpers import tiny_input_ids, tiny_model
from sparsify import card
from sparsify.export import export_checkpoint
from sparsify.families import spec_for
from sparsify.relufy import relufy
from twell.layer_plan import ALL_TOKENS, LayerPlan, Mode

PLAN = [LayerPlan(Mode.SPARSE, 64, 2, ALL_TOKENS, {"mean_active": 70.5}), LayerPlan(stats={"mean_active": 80.0})]
DENSE_PLAN = [LayerPlan(stats={"mean_active": 70.5}), LayerPlan(stats={"mean_active": 80.0})]
TRAINING = {"base_model": "someone/tiny-base", "license": "apache-2.0", "tokens": 4096, "steps": 2,
            "perplexity": {"original": 21.217, "after swap": 25.0, "after training": 22.5}}


def _export(tmp_path, name, plan=PLAN, training=TRAINING):
    model, tokenizer = tiny_model("llama")
    relufy(model)
    return model, export_checkpoint(model, tokenizer, tmp_path / name, spec=spec_for(model.config), plan=plan,
                                    training=training)


def test_card_says_which_layers_run_on_the_kernels_what_remote_code_runs_and_the_license(tmp_path):
    """The card does not claim kernels that the plan never runs, names the files trust_remote_code runs and the
    class the plain load builds, the held-out perplexity before and after, and the license."""
    _, out = _export(tmp_path, "sparse")
    text = ModelCard.load(out / "README.md").text
    assert "On a CUDA GPU, 1 of its 2 layers' MLPs run on TwELL sparse Triton kernels" in text
    assert "on a CPU every MLP runs the dense ReLU math" in text
    assert "Perplexity on that text: 21.22 for `someone/tiny-base`, 22.50 for this model." in text
    for named in ("`modeling_twell.py`", "`generation.py`", "transformers' own LlamaForCausalLM"):
        assert named in text
    assert text.split("## License\n\n")[1].startswith("`apache-2.0`, the license of `someone/tiny-base`")

    _, out = _export(tmp_path, "dense", plan=DENSE_PLAN, training={**TRAINING, "license": None})
    text = ModelCard.load(out / "README.md").text
    assert "run on TwELL sparse Triton kernels" not in text and "None of its 2 layers" in text
    assert "`someone/tiny-base` declares no license" in text


def test_a_custom_license_keeps_its_name_and_link(tmp_path, monkeypatch):
    """`license: other` comes with the source card's license_name and license_link (made absolute for a Hub
    source: the checkpoint does not hold that file), into the converted card's metadata and text."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "README.md").write_text("---\nlicense: other\nlicense_name: tiny-research\n"
                                      "license_link: LICENSE\n---\n# a base model\n")
    assert card.source_license(str(source)) == {"license": "other", "license_name": "tiny-research",
                                                "license_link": "LICENSE"}
    monkeypatch.setattr(card, "hf_hub_download", lambda repo, name: source / name)
    terms = card.source_license("someone/tiny-base")
    assert terms["license_link"] == "https://huggingface.co/someone/tiny-base/blob/main/LICENSE"
    (source / "README.md").write_text("---\nlicense: mit\n---\n")
    assert card.source_license(str(source)) == "mit"

    _, out = _export(tmp_path, "custom", training={**TRAINING, "license": terms})
    written = ModelCard.load(out / "README.md")
    assert (written.data.license, written.data.license_name, written.data.license_link) == \
        ("other", "tiny-research", "https://huggingface.co/someone/tiny-base/blob/main/LICENSE")
    assert "`tiny-research (https://huggingface.co/someone/tiny-base/blob/main/LICENSE)`" in written.text


def test_printed_model_shows_each_layers_plan(tmp_path):
    _, out = _export(tmp_path, "printed")
    printed = repr(AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True))
    plans = [line.strip() for line in printed.splitlines() if line.strip().startswith("plan: ")]
    assert plans == ["plan: TwELL kernels at 1+ tokens a call, tile 64, compression 2", "plan: dense"]


@pytest.mark.parametrize("method", ["use_fp8_gate", "use_fp8_up_down"])
def test_use_fp8_warns_where_no_call_would_read_it(tmp_path, monkeypatch, method):
    """use_fp8_gate() and use_fp8_up_down() on a model whose calls would never read the e4m3 copies (no sparse
    layer, fp32, off the GPU) say why, naming themselves; on one whose kernels read them (fp16 under the
    interpreter) they say nothing."""
    _, out = _export(tmp_path, "dense", plan=DENSE_PLAN)
    dense = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    module = sys.modules[type(dense).__module__]
    monkeypatch.setattr(module, "INTERPRET", False)  # a CPU user's process
    with pytest.warns(UserWarning, match=rf"{method}\(\) changes nothing as the model is now: no layer of this "
                                         r"checkpoint is planned on the sparse kernels.*; the model is on cpu.*; the "
                                         r"model is float32") as caught:
        getattr(dense, method)()
    assert caught[0].filename == __file__  # the user's line
    monkeypatch.undo()
    _, out = _export(tmp_path, "sparse")
    sparse = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(sparse, method)()
        getattr(sparse, method)(False)
        getattr(dense, method)(False)  # turning it off is never idle


# A user's script: sparsify and twell are not importable (as where only the checkpoint was downloaded); the
# remote-code load trains a step, saves to a new folder, and that folder loads again with trust_remote_code.
USER_SCRIPT = r"""
import importlib.abc, json, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("sparsify", "twell"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NotInstalled())
import torch
from transformers import AutoModelForCausalLM
folder, saved, ids = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(ids, labels=ids).loss.backward()
optimizer.step()
model.eval()
model.save_pretrained(saved)
again = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True)
with torch.no_grad():
    print(json.dumps({"class": type(again).__name__, "mlp": type(again.model.layers[0].mlp).__name__,
                      "difference": (again(ids).logits - model(ids).logits).abs().max().item()}))
"""


def test_the_remote_code_load_trains_and_saves_a_folder_that_loads_again(tmp_path):
    """Without sparsify installed and without the Triton interpreter (a CPU user): a training step through the
    dense fallback changes the weights, and save_pretrained writes the modeling and kernel files beside them, so
    that the saved folder loads with trust_remote_code as the same model."""
    model, out = _export(tmp_path, "downloaded")
    ids = tiny_input_ids(1, 12)
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-c", USER_SCRIPT, str(out), str(tmp_path / "saved"),
                           json.dumps(ids.tolist())], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"class": "TwellForCausalLM", "mlp": "TwellGatedMLP", "difference": 0.0}
    saved = {path.name for path in (tmp_path / "saved").iterdir()}
    assert {path.name for path in out.glob("*.py")} <= saved
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")  # the plain load reads the new weights
    assert not torch.equal(trained.model.layers[0].mlp.gate_proj.weight, model.model.layers[0].mlp.gate_proj.weight)


def test_a_hub_sources_license_files_are_fetched_and_an_unreachable_hub_gives_none(tmp_path, monkeypatch):
    """source_license_files lists a Hub source's top-level files of terms and downloads those; where the Hub
    cannot be reached it returns None (the conversion warns) rather than failing."""
    (tmp_path / "LICENSE.txt").write_text("terms")
    listed = ["config.json", "LICENSE.txt", "original/LICENSE", "model.safetensors"]
    monkeypatch.setattr(card.HfApi, "list_repo_files", lambda self, repo: listed)
    fetched = []
    monkeypatch.setattr(card, "hf_hub_download", lambda repo, name: fetched.append(name) or str(tmp_path / name))
    assert card.source_license_files("someone/base") == {"LICENSE.txt": b"terms"} and fetched == ["LICENSE.txt"]

    def offline(self, repo):
        raise OSError("offline")

    monkeypatch.setattr(card.HfApi, "list_repo_files", offline)
    assert card.source_license_files("someone/base") is None
