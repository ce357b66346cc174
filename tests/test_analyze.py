"""`sparsify analyze`: the JSON holds every statistic and the recommendation, on an original SiLU model
and on a converted checkpoint (which defaults to the data it was converted on, found by its recorded name)."""
import json

from click.testing import CliRunner

from cli import main
from helpers import tiny_model
from sparsify.measure import COMPRESSIONS


def test_analyze_json_plot_and_table(tmp_path):
    model, tokenizer = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "text.txt").write_text("class A:\n    pass\n" * 200)
    result = CliRunner().invoke(main, ["analyze", str(tmp_path / "m"), "--data", str(tmp_path / "text.txt"), "--tokens", "256",
                                       "--seq-len", "64", "--json", str(tmp_path / "a.json"), "--plot", str(tmp_path / "a.png")])
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
    assert "is not converted (gate activation silu)" in " ".join(result.output.split())
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


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
    result = runner.invoke(main, ["analyze", str(tmp_path / "out"), "--tokens", "128", "--json", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["data"] == "text.jsonl" and report["tokens"] == 128
    assert report["seq_len"] == 32  # the seq-len it was converted at
    assert report["converted"] and "not converted" not in result.output
    # 64 wide, 160 units: narrower than the cost model's shapes, so dense (--measure would time it)
    assert [layer["recommended"]["mode"] for layer in report["layers"]] == ["dense", "dense"]


def test_default_data_for_demo_models(tmp_path):
    from helpers import tiny_config
    from sparsify.analyze import default_data
    from sparsify.load import demo_corpus_path

    config = tiny_config("llama")
    config.twell = {"training": {"base_model": "demo", "data": "demo corpus"}}
    config.save_pretrained(tmp_path)
    assert default_data("demo") == (demo_corpus_path(), "text")
    assert default_data(str(tmp_path)) == (demo_corpus_path(), "text")
