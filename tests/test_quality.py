"""The conversion-quality pipeline (benchmarks/quality/convert_quality.py) end to end at toy size on the CPU:
corpus, tokenizer, pretraining, two conversions (without and with distillation) through the real CLI,
the continued-training control, a progressive-swap run given by --runs, report and plot. Its figures at toy size mean nothing; the test keeps the script from rotting and checks
what the report must hold."""
import json

import pytest

from helpers import load_benchmark


def load_script():
    return load_benchmark("quality/convert_quality.py")


def test_held_out_split_is_disjoint_and_independent_of_order():
    quality = load_script()
    keys = [key for key, _ in quality.source_files(packages=False)]
    held = [quality.held_out(key, 0.1) for key in keys]
    # the reading order sorts by one hash; the split uses another, so both splits appear early in the order
    assert 0.03 < sum(held) / len(held) < 0.2
    assert 0 < sum(held[:200]) < 200


def test_toy_pipeline_end_to_end(tmp_path):
    quality = load_script()
    report = tmp_path / "quality.json"
    result = quality.main(["--toy", "--work", str(tmp_path / "work"), "--json", str(report)])

    corpus = tmp_path / "work/corpus"
    train = {json.loads(line)["text"] for line in open(corpus / "train.jsonl")}
    valid = {json.loads(line)["text"] for line in open(corpus / "valid.jsonl")}
    assert train and valid and not train & valid
    assert json.loads(report.read_text()) == json.loads(json.dumps(result))
    assert report.with_suffix(".png").stat().st_size > 10_000
    assert result["pretraining"]["tokens"] > 0 and result["convert_tokens"] <= 0.25 * result["pretraining"]["tokens"]
    assert [(c["l1_relative"], c["distill"]) for c in result["conversions"]] == [(7.0, 0.0), (7.0, 0.5)]
    control = result["control"]  # the source trained on the same tokens: SiLU, no L1, no distillation
    assert control["tokens"] == result["conversions"][0]["tokens"] and control["log"]
    assert control["cross_entropy"]["original"] == pytest.approx(result["conversions"][0]["cross_entropy"]["original"])
    assert all("kl" in e for e in result["conversions"][1]["log"]) and "kl" not in result["conversions"][0]["log"][0]
    for c in result["conversions"]:
        assert set(c["cross_entropy"]) == {"original", "after swap", "after training"}
        assert c["tokens"] > 0 and c["log"] and 0 < c["sparsity"] < 1
        assert c["ce_vs_original"] == pytest.approx(c["cross_entropy"]["after training"] / c["cross_entropy"]["original"] - 1)
        assert len(c["layers"]) == 2 and all("dead_frac" in layer for layer in c["layers"])
        assert c["ce_vs_control"] == pytest.approx(c["cross_entropy"]["after training"]
                                                   / control["cross_entropy"]["after training"] - 1)
    # every conversion starts from the same pretrained model, measured on the same held-out blocks
    assert len({c["cross_entropy"]["original"] for c in result["conversions"]}) == 1
    # a finished stage is not redone: the second call reads the stage results back
    before = (tmp_path / "work/pretrain.json").stat().st_mtime_ns
    again = quality.main(["--toy", "--work", str(tmp_path / "work")])
    assert (tmp_path / "work/pretrain.json").stat().st_mtime_ns == before
    assert again["conversions"] == result["conversions"]


def test_runs_take_any_training_setting_and_run_side_by_side(tmp_path):
    quality = load_script()
    work = tmp_path / "work"
    result = quality.main(["--toy", "--work", str(work), "--runs", "l1=7,swap_steps=3", "l1=3.5,swap_steps=0",
                            "--jobs", "2"])
    swap, plain = result["conversions"]
    assert swap["settings"] == {"l1": 7, "swap_steps": 3} and plain["settings"] == {"l1": 3.5, "swap_steps": 0}
    assert [e["source_share"] for e in swap["log"][:2]] == pytest.approx([2 / 3, 0.0])  # steps 2 and 4
    assert "source_share" not in plain["log"][0] and plain["l1_relative"] == 3.5
    assert (work / "l1_7_swap_steps_3.log").read_text()  # with --jobs, each conversion's output in its log


def test_plot_smooths_training_curves_and_keeps_the_trade_off_within_the_data():
    quality = load_script()
    noisy = [2.0 + (0.5 if i % 2 else -0.5) for i in range(40)]  # per-batch noise around 2
    curve = quality.smoothed(noisy)  # trailing means over 4 entries
    assert curve[0] == noisy[0] and all(abs(value - 2.0) < 1e-9 for value in curve[3::2])
    assert max(curve[3:]) - min(curve[3:]) < 0.3 < max(noisy) - min(noisy)
    assert quality.data_limits([99.1], top=100) == pytest.approx((98.85, 99.35))  # one point: around it
    low, high = quality.data_limits([97.0, 99.9], top=100)
    assert low == pytest.approx(96.71) and high == 100  # never past 100% sparsity
