"""`sparsify analyze`: the JSON holds every statistic and the recommendation, on an original SiLU model
and on a converted checkpoint (which defaults to the data it was converted on, found by its recorded name)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from cli import main
from helpers import tiny_model
from sparsify.measure import COMPRESSIONS


def test_analyze_json_plot_and_table(tmp_path):
    model, tokenizer = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "text.txt").write_text("class A:\n    pass\n" * 200)
    result = CliRunner().invoke(main, ["analyze", str(tmp_path / "m"), "--data", str(tmp_path / "text.txt"),
                                       "--tokens", "256", "--seq-len", "64", "--json", str(tmp_path / "a.json"),
                                       "--plot", str(tmp_path / "plots" / "a.png")])  # a folder made
    assert result.exit_code == 0, result.output
    assert "setting" in result.output and "sparsity" in result.output
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["family"] == "qwen2" and report["seq_len"] == 64 and report["tokens"] == 256
    assert report["perplexity"] > 1 and len(report["layers"]) == 2
    for layer in report["layers"]:
        assert {"mean_active", "median_active", "p99_active", "max_active", "sparsity", "dead_frac"} <= set(layer)
        assert layer["units"] == 160 and 0 < layer["mean_active"] < 160  # SiLU model: gate pre-activation > 0
        assert layer["sparsity"] == 1 - layer["mean_active"] / 160
        assert set(layer["tiles"]) == {"64", "128"}
        assert set(layer["tiles"]["64"]) == {"max", "p999", "overflow_frac", "overflow_frac_light"}
        assert set(layer["tiles"]["64"]["overflow_frac"]) == {str(c) for c in COMPRESSIONS}
        assert len(layer["position_active"]) == 64
        assert layer["recommended"] is None  # not converted: the kernels compute ReLU
    assert not report["converted"] and report["activation"] == "silu"
    mean = sum(layer["mean_active"] for layer in report["layers"]) / 2  # the whole model's figure under the table
    # outside a terminal (a log file) the caption and the note under it are whole lines, however long
    assert (f"\nall layers: {mean:.1f} of 160 units active per token on average ({100 * (1 - mean / 160):.2f}% "
            "sparse); dead: units that fire on none of these tokens; tile p99.9: a token's active units within one "
            "tile of that width, 99.9th percentile (the slots a tile needs)\n") in result.output
    assert f"\n{tmp_path / 'm'}: gate activity on 256 tokens of text.txt (seq-len 64, perplexity " in result.output
    assert ("is not converted (gate activation silu): active means gate pre-activation > 0, and no kernel setting "
            "applies; `sparsify convert` makes a sparse ReLU model.\n") in result.output
    assert (tmp_path / "plots" / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert (report["model"], report["data"]) == ("m", "text.txt")  # no local path: the JSON may go into a checkpoint
    assert str(tmp_path) not in (tmp_path / "a.json").read_text()


TABLE = """from twell.layer_plan import LayerPlan
from sparsify.report import console, layer_table
stats = {"units": 160, "mean_active": 3.5, "median_active": 3, "p99_active": 9, "max_active": 12, "sparsity": 0.978,
         "dead_frac": 0.01, "tiles": {"128": {"p999": 7}}}
plan = LayerPlan("sparse", 128, 8, ((1, 64), (700, None)))
console.print(layer_table([stats] * 2, [plan] * 2, "title", hybrid_share=[0.5, 0.25]))"""


def test_tables_take_their_natural_width_outside_a_terminal():
    """In a log file a table keeps each row on one line, wider than rich's default 80 columns; COLUMNS, where set,
    still decides, and in a terminal the table fits it as before."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE")}

    def table_lines(**extra) -> list[str]:
        done = subprocess.run([sys.executable, "-c", TABLE], cwd=Path(__file__).parents[1], capture_output=True,
                              stdin=subprocess.DEVNULL, text=True, env={**env, **extra}, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", done.stderr).splitlines()
        return [line for line in lines if line[:1] in "┏┃┡│└"]  # the table's, not its title's or caption's

    rows = [line for line in table_lines() if "T128 C8" in line]
    assert len(rows) == 2 and all(len(row) > 80 for row in rows), rows
    for i, share in enumerate((50, 25)):
        assert re.fullmatch(rf"│ +{i} │.* T128 C8 at 1-64, 700\+ │ +{share} │", rows[i]), rows[i]
    assert max(map(len, table_lines(COLUMNS="60"))) <= 60
    assert max(map(len, table_lines(FORCE_COLOR="1"))) <= 80  # a terminal (here of no size): rich's 80 columns


def test_analyze_measures_all_of_a_short_text_and_says_so(tmp_path):
    """Nothing trains on the text: a file shorter than --tokens is measured whole (3,584 tokens: 56 blocks of
    64), not a held-out tenth of it, with a warning that the figures rest on few tokens."""
    model, tokenizer = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "text.txt").write_text("class A:\n    pass\n" * 200)
    result = CliRunner().invoke(main, ["analyze", str(tmp_path / "m"), "--data", str(tmp_path / "text.txt"),
                                       "--seq-len", "64", "--json", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "a.json").read_text())["tokens"] == 3584
    assert (f"warning: measuring 3,584 tokens, all that {tmp_path / 'text.txt'} holds, not --tokens 65,536: too few "
            "for steady figures") in " ".join(result.output.split())
    assert "gate activity on 3,584 tokens of text.txt" in " ".join(result.output.split())


def test_a_bad_data_path_is_said_before_torch_is_imported(tmp_path):
    """As convert's checks: a missing or empty --data is said at once, before torch is imported, for a source whose
    config.json is at hand and of a supported family; a missing or unsupported source names its own problem first,
    at once too."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    missing = str(tmp_path / "missing.jsonl")
    code = ("import sys\nfrom click.testing import CliRunner\nfrom cli import main\n"
            f"for source, data in (('demo', {missing!r}), ('demo', {str(tmp_path / 'empty')!r}),\n"
            f"                     ({str(tmp_path / 'no-model')!r}, {missing!r}),\n"
            f"                     ({str(tmp_path / 'gpt2')!r}, {missing!r})):\n"
            "    print(CliRunner().invoke(main, ['analyze', source, '--data', data]).output)\n"
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for message in (f"error: data path {missing} does not exist\n",
                    f"error: data folder {tmp_path / 'empty'} is empty\n",
                    f"error: {tmp_path / 'no-model'}: no such folder\n",
                    "error: model_type 'gpt2' is not a gated-MLP architecture that sparsify knows"):
        assert message in done.stdout, done.stdout
    assert done.stdout.count("data path") == 1, done.stdout


def test_analyze_converted_checkpoint_defaults_to_its_training_data(tmp_path, monkeypatch):
    """The checkpoint records its data by name (text.jsonl) and the column read (body): analyze finds it in the
    current folder, and says so where it is not there."""
    model, tokenizer = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "text.jsonl").write_text(json.dumps({"body": "import os\nprint(os.getcwd())\n" * 300}) + "\n")
    runner = CliRunner()
    convert = runner.invoke(main, ["convert", str(tmp_path / "m"), "-o", str(tmp_path / "out"), "--data",
                                   str(tmp_path / "text.jsonl"), "--text-column", "body", "--steps", "1", "--seq-len",
                                   "32", "--batch-size", "2"])
    assert convert.exit_code == 0, convert.output
    result = runner.invoke(main, ["analyze", str(tmp_path / "out"), "--tokens", "128"])
    assert result.exit_code == 1
    assert ("--data is required for this model (it was converted on text.jsonl, no file or folder here)"
            in " ".join(result.output.split()))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(main, ["analyze", str(tmp_path / "out"), "--tokens", "128",
                                  "--json", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["data"] == "text.jsonl" and report["tokens"] == 128
    assert report["seq_len"] == 32  # the seq-len it was converted at
    assert report["converted"] and "not converted" not in result.output
    # 64 wide, 160 units: narrower than the cost model's shapes, so dense (--measure would time it)
    assert [layer["recommended"]["mode"] for layer in report["layers"]] == ["dense", "dense"]
    # more tokens than the conversion held out of this one file would measure text it trained on: capped
    held_out = json.loads((tmp_path / "out" / "config.json").read_text())["twell"]["training"]["eval_tokens"]
    result = runner.invoke(main, ["analyze", str(tmp_path / "out"), "--tokens", str(held_out + 1000), "--json",
                                  str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "b.json").read_text())["tokens"] == held_out // 32 * 32
    assert f"measuring {held_out // 32 * 32:,} tokens, not {held_out + 1000:,}" in " ".join(result.output.split())


def test_default_data_for_demo_models(tmp_path):
    from helpers import tiny_config
    from sparsify.analyze import default_data
    from sparsify.locations import demo_corpus_path

    config = tiny_config("llama")
    config.twell = {"training": {"base_model": "demo", "data": "demo corpus"}}
    config.save_pretrained(tmp_path)
    assert default_data("demo") == (demo_corpus_path(), "text")
    assert default_data(str(tmp_path)) == (demo_corpus_path(), "text")


def test_write_plan_replaces_a_checkpoints_plan_and_keeps_its_weights(tmp_path):
    """analyze --write-plan gives a converted checkpoint the recommended plan (here the cost model's: dense,
    the layers being narrower than its shapes) in config.json and the card; the weights stay, and the
    checkpoint loads with the new plan. A model that is not converted, or not a local folder, is refused
    before anything is measured; a failed write leaves the old plan."""
    import pytest
    from transformers import AutoModelForCausalLM

    from sparsify import export
    from sparsify.errors import OutputError
    from sparsify.families import spec_for
    from sparsify.relufy import relufy
    from twell.layer_plan import ALL_TOKENS, LayerPlan, Mode

    model, tokenizer = tiny_model("llama")
    model.save_pretrained(tmp_path / "silu")
    tokenizer.save_pretrained(tmp_path / "silu")
    relufy(model)
    sparse = [LayerPlan(Mode.SPARSE, 64, 2, ALL_TOKENS)] * model.config.num_hidden_layers
    out = export.export_checkpoint(model, tokenizer, tmp_path / "ckpt", spec=spec_for(model.config), plan=sparse,
                                   training={"base_model": "someone/tiny", "tokens": 0})
    weights = (out / "model.safetensors").read_bytes()
    assert "T64 C2" in (out / "README.md").read_text()
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 200)
    runner = CliRunner()
    args = ["--data", str(tmp_path / "text.txt"), "--tokens", "128", "--seq-len", "32", "--write-plan"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sparsify.analyze.load_model", None)  # refused before any weight is read
        for refused in (tmp_path / "silu", tmp_path / "missing"):
            result = runner.invoke(main, ["analyze", str(refused), *args])
            assert result.exit_code == 1 and "is not a local converted checkpoint" in " ".join(result.output.split())
            if refused.name == "silu":  # says what is missing, not a Python exception
                assert 'no "twell" section' in " ".join(result.output.split()) and "KeyError" not in result.output
    failing = LayerPlan()  # a write that fails: the old plan stays whole

    def no_rename(*_):
        raise OSError("disk full")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export.os, "replace", no_rename)
        with pytest.raises(OutputError, match="disk full"):
            export.replace_plan(out, [failing] * model.config.num_hidden_layers)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert json.loads((out / "config.json").read_text())["twell"]["layers"][0]["mode"] == "sparse"
    renamed, rename = [], os.replace

    def second_rename_fails(source, target):
        if renamed:
            raise OSError("disk full")
        renamed.append(os.path.basename(target))
        rename(source, target)

    with pytest.MonkeyPatch.context() as patch:  # the card is renamed first, config.json (what loads) last
        patch.setattr(export.os, "replace", second_rename_fails)
        with pytest.raises(OutputError, match="disk full"):
            export.replace_plan(out, [failing] * model.config.num_hidden_layers)
    assert renamed == ["README.md"] and "T64 C2" not in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["twell"]["layers"][0]["mode"] == "sparse"
    with pytest.MonkeyPatch.context() as patch:  # the checkpoint named under ~, as a shell would leave it
        patch.setenv("HOME", str(tmp_path))
        result = runner.invoke(main, ["analyze", "~/ckpt", *args])
    assert result.exit_code == 0, result.output
    assert "wrote the recommended settings" in result.output
    layers = json.loads((out / "config.json").read_text())["twell"]["layers"]
    assert [layer["mode"] for layer in layers] == ["dense", "dense"]
    assert "narrower than the cost model's shapes" in layers[0]["stats"]["reason"]
    assert "T64 C2" not in (out / "README.md").read_text() and "dense" in (out / "README.md").read_text()
    assert (out / "model.safetensors").read_bytes() == weights
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert all(not mlp.plan.is_sparse for mlp in (layer.mlp for layer in loaded.model.layers))
    with pytest.raises(ValueError, match="the plan has 1 layers"):
        export.replace_plan(out, [failing])
