"""The conversion-quality pipeline (benchmarks/quality/convert_quality.py) end to end at toy size on the CPU:
corpus, tokenizer, pretraining, two conversions (without and with distillation) through the real CLI,
the continued-training control, the held-out metrics, progressive-swap runs given by --runs at two budget shares,
runs of one and two passes over the head of the train split (--convert-epochs), report and plots; and its stages on
their own: the pretraining's resume, the metrics on two kinds of text. Also
the reports beside it (compare.py, frontier.py) and benchmarks/target_sparsity.py. Their
figures at toy size mean nothing; the tests keep the scripts from rotting and check what the reports must hold."""
import itertools
import json
import math
import shutil
import subprocess
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import load_benchmark, tiny_config, tiny_input_ids, tiny_model, tiny_tokenizer


def load_script():
    return load_benchmark("quality/convert_quality.py")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A --toy work folder after its first two stages (corpus, tokenizer and pretrained base), made once by
    prepare(), which main() runs first: each test that goes on from there works on its own copy (prepared_work)."""
    quality = load_script()
    work = tmp_path_factory.mktemp("quality") / "work"
    quality.prepare(quality.arguments(["--toy", "--work", str(work)]))
    return work


def prepared_work(prepared, tmp_path, monkeypatch) -> Path:
    """A copy of the prepared folder (file times kept); the conversions it goes on to run in their own processes
    train as the documented --toy command does on a CPU, without the Triton interpreter that conftest turns on
    (there a sparse enough layer would train on the hybrid kernels, which test_hybrid_routing.py checks)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return Path(shutil.copytree(prepared, tmp_path / "work"))


def test_held_out_split_is_disjoint_and_independent_of_order():
    quality = load_script()
    keys = [key for key, _ in quality.corpus.source_files(packages=False)]
    held = [quality.corpus.held_out(key, 0.1) for key in keys]
    # the reading order sorts by one hash; the split uses another, so both splits appear early in the order
    assert 0.03 < sum(held) / len(held) < 0.2
    assert 0 < sum(held[:200]) < 200


def test_toy_pipeline_end_to_end(prepared, tmp_path, monkeypatch):
    quality = load_script()
    report = tmp_path / "quality.json"
    work = prepared_work(prepared, tmp_path, monkeypatch)
    result = quality.main(["--toy", "--work", str(work), "--json", str(report)])

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
        assert c["ce_vs_original"] == pytest.approx(c["cross_entropy"]["after training"]
                                                    / c["cross_entropy"]["original"] - 1)
        assert len(c["layers"]) == 2 and all("dead_frac" in layer for layer in c["layers"])
        assert c["ce_vs_control"] == pytest.approx(c["cross_entropy"]["after training"]
                                                   / control["cross_entropy"]["after training"] - 1)
    # every conversion starts from the same pretrained model, measured on the same held-out blocks
    assert len({c["cross_entropy"]["original"] for c in result["conversions"]}) == 1
    # one budget share: the names, stage files and report layout of a single share
    assert result["convert_shares"] == [0.25] and [c["share"] for c in result["conversions"]] == [0.25, 0.25]
    assert [c["name"] for c in result["conversions"]] == ["l1_7", "l1_7_distill_0.5"] and control["name"] == "control"
    assert all((tmp_path / "work" / name).is_file()
               for name in ("convert_l1_7.json", "control.json", "metrics_base.json"))
    assert not report.with_name("quality_budget.png").exists()
    # every model measured on the same held-out blocks; converted checkpoints and the control load as plain models
    units = result["pretraining"]["config"]["intermediate_size"]
    original = result["original"]["metrics"]
    assert not {"greedy", "generations", "prompts"} & set(original)
    for entry in (original, control["metrics"], *(c["metrics"] for c in result["conversions"])):
        assert (0 <= entry["accuracy"] <= 1 and math.isfinite(entry["cross_entropy"])
                and entry["tokens"] == original["tokens"])
        assert entry["by_kind"] and all(0 <= k["accuracy"] <= 1 and k["tokens"] > 0 for k in entry["by_kind"].values())
    for c in (control, *result["conversions"]):
        assert 0 <= c["metrics"]["greedy"]["agreement"] <= 1 and c["metrics"]["greedy"]["prompts"] > 0
        assert 0 <= c["metrics"]["greedy"]["common_prefix"] <= c["metrics"]["greedy"]["new_tokens"]
    for c in result["conversions"]:  # the toy does not reach 99% sparse
        assert c["first_sparse"] == quality.runs.first_sparse(c["log"], units) is None
    # a finished stage is not redone: the second call reads the stage results back
    before = (tmp_path / "work/pretrain.json").stat().st_mtime_ns
    again = quality.main(["--toy", "--work", str(tmp_path / "work")])
    assert (tmp_path / "work/pretrain.json").stat().st_mtime_ns == before
    assert again["conversions"] == result["conversions"]


def test_budget_curve_runs_every_setting_and_the_control_at_every_share(prepared, tmp_path, monkeypatch):
    quality = load_script()
    work, report = prepared_work(prepared, tmp_path, monkeypatch), tmp_path / "budget.json"
    result = quality.main(["--toy", "--work", str(work), "--json", str(report), "--runs", "l1=3.5,swap_steps=3",
                           "--convert-share", "0.25", "0.1", "--jobs", "2", "--no-metrics"])
    large, small = result["conversions"]
    # a run's settings over the recipe's (swap 20%) and the toy's (L1 7)
    assert large["settings"] == small["settings"] == {"l1": 3.5, "swap_steps": 3} and large["l1_relative"] == 3.5
    assert large["calibration"] is None  # the calibration's record, where a run calibrates
    assert [e["source_share"] for e in large["log"][:2]] == pytest.approx([2 / 3, 0.0])  # steps 2 and 4
    # each share's run and control on their own tokens, in their own folders, stage files and logs
    pretrained = result["pretraining"]["tokens"]
    assert result["convert_shares"] == [0.25, 0.1]
    assert result["convert_tokens"] == [int(0.25 * pretrained), int(0.1 * pretrained)]
    assert ([(c["share"], c["tokens"]) for c in result["conversions"]]
            == list(zip([0.25, 0.1], result["convert_tokens"])))
    names = ["l1_3.5_swap_steps_3_share0.25", "l1_3.5_swap_steps_3_share0.1"]
    assert [c["name"] for c in result["conversions"]] == names
    assert [c["name"] for c in result["control"]] == ["control_share0.25", "control_share0.1"]
    for name in names:
        assert (work / name / "config.json").is_file() and (work / f"convert_{name}.json").is_file()
        assert (work / f"{name}.log").read_text()  # with --jobs, each conversion's output in its log
    controls = result["control"]
    assert [(c["share"], c["tokens"]) for c in controls] == [(0.25, large["tokens"]), (0.1, small["tokens"])]
    assert (work / "control_share0.25.json").is_file() and (work / "control_share0.1.json").is_file()
    for c, control in zip(result["conversions"], controls):
        assert c["ce_vs_control"] == pytest.approx(c["cross_entropy"]["after training"]
                                                   / control["cross_entropy"]["after training"] - 1)
        assert "metrics" not in c and "first_sparse" in c
    assert result["original"] is None and not list(work.glob("metrics_*"))  # --no-metrics
    assert report.with_name("budget_budget.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def passes_and_samples(prepared, tmp_path_factory):
    """One pipeline run that the two tests below read (each run of the toy pipeline starts processes that take
    most of their time importing): the head of the train split once and twice, and three passes over the base's
    samples mixed with that head and alone. Returns (work folder, report path, result)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        tmp_path = tmp_path_factory.mktemp("passes")
        work, report = prepared_work(prepared, tmp_path, monkeypatch), tmp_path / "epochs.json"
        result = load_script().main([
            "--toy", "--work", str(work), "--json", str(report), "--runs", "l1=3.5", "l1=3.5,data=sampled",
            "l1=3.5,data=sampled_alone", "--jobs", "2", "--convert-epochs", "1", "2", "--set", "shuffle_buffer=8",
            "--sample-tokens", "1000", "--sample-batch", "8", "--sampled-epochs", "3", "--no-metrics"])
    return work, report, result


def by_name(runs: list[dict], *names: str) -> list[dict]:
    return [next(run for run in runs if run["name"] == name) for name in names]


def test_epochs_pass_over_the_head_of_the_train_split_several_times(passes_and_samples):
    from transformers import AutoTokenizer

    from sparsify.data import Documents, TextData, blocks
    from sparsify.locations import resolve_data

    work, report, result = passes_and_samples
    # the head: the train split's first documents, the last cut, packed into the blocks of its first tokens
    subset, asked = result["convert_subsets"], result["convert_tokens"]
    assert [(s["share"], s["folder"], s["tokens_asked"]) for s in subset] == [(0.25, "corpus_share0.25", asked)]
    head, corpus = work / "corpus_share0.25", work / "corpus"
    rows, kept = ([json.loads(line) for line in open(folder / "train.jsonl")] for folder in (corpus, head))
    assert len(kept) == subset[0]["documents"] and kept[:-1] == rows[:len(kept) - 1]
    last = rows[len(kept) - 1]
    assert kept[-1]["kind"] == last["kind"] and last["text"].startswith(kept[-1]["text"]) and kept[-1] != last
    assert (head / "valid.jsonl").read_bytes() == (corpus / "valid.jsonl").read_bytes()
    tok, seq_len = AutoTokenizer.from_pretrained(work / "base"), 64

    def packed(folder: Path, count: int | None = None) -> list[tuple]:
        return [tuple(b.tolist()) for b in itertools.islice(
            blocks(iter(Documents(resolve_data(folder).train)), tok, seq_len), count)]

    pass_blocks = packed(head)
    distinct = subset[0]["distinct_tokens"]
    assert (distinct == subset[0]["blocks"] * seq_len == len(pass_blocks) * seq_len
            and asked <= distinct < asked + seq_len)
    assert pass_blocks == packed(corpus, len(pass_blocks))  # the blocks the one-pass run reads first

    once, twice = by_name(result["conversions"], "l1_3.5", "l1_3.5_epochs2")
    assert (once["epochs"], once["distinct_tokens"]) == (1, once["tokens"]) and twice["epochs"] == 2
    assert twice["distinct_tokens"] == distinct == once["tokens"]
    assert (twice["tokens"], twice["steps"]) == (2 * once["tokens"], 2 * once["steps"])
    # the convert's own count: the text it trained on holds the head's tokens, passed over twice
    log = " ".join((work / "l1_3.5_epochs2.log").read_text().split())
    assert f"the training text holds {distinct:,} tokens and the run trains on {2 * distinct:,}: 2.0 passes" in log
    assert "passes over it" not in (work / "l1_3.5.log").read_text()
    # the batches those steps draw: every block of the head, twice give or take one (the shuffle buffer runs on
    # through the passes), and nothing else
    stream = TextData(head, tok, seq_len, 512).train_batches(4, shuffle_buffer=8, seed=0)
    drawn = Counter(tuple(b.tolist()) for _ in range(twice["steps"]) for b in next(stream))
    assert drawn.keys() == set(pass_blocks) and sum(drawn.values()) == 2 * len(pass_blocks) and max(drawn.values()) <= 3
    # the control at each number of passes, on its conversions' text and tokens; all measured on the same held-out
    controls = by_name(result["control"], "control", "control_epochs2")
    assert [(c["name"], c["epochs"], c["tokens"], c["distinct_tokens"]) for c in controls] == [
        ("control", 1, once["tokens"], once["tokens"]), ("control_epochs2", 2, twice["tokens"], distinct)]
    for c, control in zip((once, twice), controls):
        assert c["ce_vs_control"] == pytest.approx(c["cross_entropy"]["after training"]
                                                   / control["cross_entropy"]["after training"] - 1)
    assert len({round(c["cross_entropy"]["original"], 6) for c in (*controls, once, twice)}) == 1
    assert result["convert_epochs"] == [1, 2] and report.with_name("epochs_budget.png").stat().st_size > 10_000
    assert all((work / f"{name}.json").is_file() for name in ("corpus_share0.25", "convert_l1_3.5_epochs2",
                                                              "control_epochs2"))


def test_sampled_runs_read_the_base_s_samples_and_the_share_s_text(passes_and_samples):
    work, _, result = passes_and_samples
    (made,) = result["samples"]
    assert made["folder"] == "sampled_share0.25" and 1000 <= made["sampled_tokens"] < 1000 + 64
    distinct = result["convert_subsets"][0]["distinct_tokens"]
    assert distinct <= made["data_tokens"] < distinct + 64  # the share's head whole, spread among the samples
    assert made["tokens"] % 64 == 0 and made["tokens"] > made["sampled_tokens"] + made["data_tokens"] - 2 * 64
    # the sampled settings once, at --sampled-epochs passes over the folder's tokens, their data setting left out
    # of their recipe
    assert [(c["name"], c["epochs"]) for c in result["conversions"]] == [
        ("l1_3.5", 1), ("l1_3.5_data_sampled_epochs3", 3), ("l1_3.5_data_sampled_alone_epochs3", 3),
        ("l1_3.5_epochs2", 2)]
    sampled, alone = result["conversions"][1:3]
    assert sampled["distinct_tokens"] == made["tokens"] and 3 * made["tokens"] <= sampled["tokens"] < \
        3 * made["tokens"] + 4 * 64  # whole steps
    assert "data" not in json.loads((work / "l1_3.5_data_sampled_epochs3.recipe.yaml").read_text())
    assert f"--data {work / 'sampled_share0.25'}" in sampled["command"]
    # the samples alone: the folder's sample rows, the same held-out text
    rows = [json.loads(line) for line in open(work / "sampled_share0.25" / "train.jsonl")]
    kept = [json.loads(line) for line in open(work / "sampled_share0.25_alone" / "train.jsonl")]
    assert kept == [r for r in rows if r["source"] == "sample"] and len(kept) < len(rows)
    assert (work / "sampled_share0.25_alone" / "valid.jsonl").read_bytes() == (
        work / "sampled_share0.25" / "valid.jsonl").read_bytes()
    assert alone["distinct_tokens"] == made["alone_tokens"] < made["tokens"]
    assert f"--data {work / 'sampled_share0.25_alone'}" in alone["command"]
    # a control on each text the runs read: the share once and twice, and each sampled folder three times
    controls = {c["name"]: c for c in result["control"]}
    assert list(controls) == ["control", "control_epochs2", "control_epochs3_sampled", "control_epochs3_sampled_alone"]
    assert controls["control_epochs3_sampled"]["tokens"] == sampled["tokens"]
    for run, control in zip(result["conversions"], ("control", "control_epochs3_sampled",
                                                    "control_epochs3_sampled_alone", "control_epochs2")):
        after = controls[control]["cross_entropy"]["after training"]
        assert run["ce_vs_control"] == pytest.approx(run["cross_entropy"]["after training"] / after - 1), run["name"]


def test_a_mistyped_run_setting_stops_before_the_pretraining(tmp_path, capsys):
    quality = load_script()
    for option, value, said in (("--runs", "l1=3.5,revive_dead=5", "unknown training settings: revive_dead"),
                                ("--runs", "l1=3.5,lr=-1", "--runs l1=3.5,lr=-1: "),
                                ("--control-set", "batch_sizes=4", "--control-set batch_sizes=4: unknown")):
        with pytest.raises(SystemExit):
            quality.arguments(["--toy", "--work", str(tmp_path / "work"), option, value])
        assert said in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_data_takes_sampled_with_sample_tokens(capsys):
    quality = load_script()
    for argv in (["--runs", "data=sampled"], ["--runs", "data=other", "--sample-tokens", "10"]):
        with pytest.raises(SystemExit):
            quality.arguments(["--toy", "--work", "unused", *argv])
        assert ("a run's data= takes sampled (the share's text and the samples) or sampled_alone"
                in capsys.readouterr().err)


@pytest.mark.parametrize("epochs", [["0"], ["1.5"], ["two"], ["2", "2"]])
def test_convert_epochs_must_be_whole_numbers_of_passes_once_each(epochs, capsys):
    quality = load_script()
    with pytest.raises(SystemExit):
        quality.arguments(["--toy", "--work", "unused", "--convert-epochs", *epochs])
    error = capsys.readouterr().err
    assert ("each number of passes once" if epochs == ["2", "2"] else
            f"passes over the text must be a whole number, at least 1: got '{epochs[0]}'") in error


def test_conversions_spread_over_the_gpus_the_least_busy_first(monkeypatch):
    """--jobs on several GPUs: each conversion's CUDA_VISIBLE_DEVICES is the GPU running the fewest, freed when
    it ends; one GPU or the CPU leave the environment as it is."""
    runs = load_benchmark("quality/runs.py")
    slots = runs.GpuSlots(["2", "5"])
    with slots.take() as first, slots.take() as second, slots.take() as third:
        assert [first, second, third] == [{"CUDA_VISIBLE_DEVICES": g} for g in ("2", "5", "2")]
        with slots.take() as fourth:
            assert fourth == {"CUDA_VISIBLE_DEVICES": "5"}
    assert slots.running == {"2": 0, "5": 0}
    with slots.take() as after:
        assert after == {"CUDA_VISIBLE_DEVICES": "2"}
    with runs.GpuSlots(["0"]).take() as one, runs.GpuSlots.visible("cpu").take() as cpu:
        assert one == cpu == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert list(runs.GpuSlots.visible("cuda").running) == ["3", "1"]
    assert not runs.GpuSlots.visible("cuda:1").running


def test_first_sparse_is_the_first_log_entry_at_99_percent():
    quality = load_script()
    log = [{"step": 10, "tokens": 100, "mean_active": 5.0}, {"step": 20, "tokens": 200, "mean_active": 1.0},
           {"step": 30, "tokens": 300, "mean_active": 0.5}]
    assert quality.runs.first_sparse(log, 100) == {"step": 20, "tokens": 200}
    assert quality.runs.first_sparse(log, 40) is None


def test_metrics_split_by_kind_and_the_original_agrees_with_itself(tmp_path):
    quality = load_script()
    metrics = quality.metrics
    for name, seed in (("base", 0), ("other", 1)):
        model, tok = tiny_model("llama", seed=seed)
        model.save_pretrained(tmp_path / name)
    code, prose = Path(json.__file__).read_text(), (Path(__file__).parents[1] / "docs/quality.md").read_text()
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus/valid.jsonl").write_text("".join(json.dumps({"text": text[:3000], "kind": kind}) + "\n"
                                                         for text, kind in ((code, "code"), (prose, "prose"))))
    blocks = metrics.heldout_blocks(tok, tmp_path / "corpus", 64, 1024)
    assert {kind: tuple(b.shape) for kind, b in blocks.items()} == {"code": (16, 64), "prose": (16, 64)}
    prompts = metrics.greedy_prompts(blocks)  # fewer blocks than prompts: one from each
    assert prompts.shape == (32, metrics.PROMPT_TOKENS)
    original = metrics.measure(tmp_path / "base", blocks, prompts, None, 32, "cpu")
    again = metrics.measure(tmp_path / "base", blocks, prompts, original["generations"], 32, "cpu")
    other = metrics.measure(tmp_path / "other", blocks, prompts, original["generations"], 32, "cpu")
    assert again["greedy"]["agreement"] == 1 and again["greedy"]["common_prefix"] == metrics.NEW_TOKENS
    assert other["greedy"]["agreement"] < 1 and other["greedy"]["common_prefix"] < metrics.NEW_TOKENS
    model.eval()  # the "other" model: its figures by a plain forward pass
    with torch.no_grad():
        for kind, b in blocks.items():
            assert other["by_kind"][kind]["cross_entropy"] == pytest.approx(model(b, labels=b).loss.item(), rel=1e-5)
            predicted = model(b).logits[:, :-1].argmax(-1)
            assert other["by_kind"][kind]["accuracy"] == pytest.approx((predicted == b[:, 1:]).float().mean().item())
            assert other["by_kind"][kind]["tokens"] == 16 * 63
    assert other["cross_entropy"] == pytest.approx(sum(k["cross_entropy"] for k in other["by_kind"].values()) / 2)
    variants = ("fp8_gate", "fp8_up_down", "fp8_gate_and_up_down")
    assert not any(name in original for name in variants)
    assert all(0 < abs(other[name]["cross_entropy"] / other["cross_entropy"] - 1) < 0.05 for name in variants)
    assert len({other[name]["cross_entropy"] for name in variants}) == 3
    for result in (other, *(other[name] for name in variants)):
        assert len(result["active_units"]) == len(model.model.layers) and min(result["active_units"]) > 0
    assert "active" in metrics.metrics_line(other)


def test_the_fp8_gate_metric_computes_each_gate_as_the_fp8_kernels_do():
    """use_fp8_gate: every layer's gate projection gives fp8_gate.gate_reference of its input and weight (what the
    kernels' gate pass computes with gate_fp8); the rest of the model is untouched."""
    from twell.fp8_gate import gate_reference, quantize_weight

    metrics = load_script().metrics
    model, _ = tiny_model("llama", seed=1)
    model.eval()
    ids = tiny_input_ids(2, 16)
    with torch.no_grad():
        plain = model(ids).logits
        projections = [layer.mlp.gate_proj for layer in model.model.layers]
        h = torch.randn(3, 5, projections[0].in_features)
        expected = [gate_reference(h.view(15, -1), *quantize_weight(p.weight)).view(3, 5, -1) for p in projections]
        metrics.use_fp8_gate(model)
        assert all(torch.equal(p(h), e) for p, e in zip(projections, expected))
        assert not any("forward" in vars(m) for m in model.modules() if m not in projections)
        fp8 = model(ids).logits
    assert 0 < ((fp8 - plain).norm() / plain.norm()).item() < 0.05


def test_the_fp8_up_down_metric_computes_up_and_down_from_their_e4m3_rows():
    """use_fp8_up_down: every layer's up and down projections give their input times the dequantized e4m3 copies
    (fp8_gate.up_down_reference); plain_projections undoes it and use_fp8_gate alike."""
    from twell.fp8_gate import quantize_up_down, up_down_reference

    metrics = load_script().metrics
    model, _ = tiny_model("llama", seed=1)
    model.eval()
    ids = tiny_input_ids(2, 16)
    with torch.no_grad():
        plain = model(ids).logits
        mlp = model.model.layers[1].mlp
        up, down = up_down_reference(quantize_up_down(mlp.up_proj.weight, mlp.down_proj.weight))
        h = torch.randn(3, 5, mlp.up_proj.in_features)
        metrics.use_fp8_up_down(model)
        assert torch.equal(mlp.up_proj(h), h @ up.t())
        assert torch.equal(mlp.down_proj(h @ up.t()), h @ up.t() @ down.t())
        assert 0 < ((model(ids).logits - plain).norm() / plain.norm()).item() < 0.05
        metrics.use_fp8_gate(model)
        metrics.plain_projections(model)
        assert not any("forward" in vars(m) for m in model.modules())
        assert torch.equal(model(ids).logits, plain)


def test_fp8_quality_measures_a_checkpoint_on_text_under_each_variant(tmp_path, capsys):
    """benchmarks/quality/fp8_quality.py: held-out CE, top-1 and active units of a saved model on a text file as it
    is and under each fp8 variant, the change against it, written as JSON; the plain figures those of a forward
    pass on the same blocks."""
    fp8_quality = load_benchmark("quality/fp8_quality.py")
    model, tok = tiny_model("llama", seed=2)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "text.txt").write_text((Path(__file__).parents[1] / "docs/quality.md").read_text()[:6000])
    result = fp8_quality.main([str(tmp_path / "ckpt"), "--data", str(tmp_path / "text.txt"), "--tokens", "256",
                               "--seq-len", "32", "--batch", "3", "--device", "cpu",
                               "--json", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(result))
    assert result["blocks"] == [8, 32] and result["device"] == "cpu" and "fp8_quality.py" in result["command"]
    plain = result["plain"]
    from sparsify.data import measured_blocks

    blocks = torch.stack(measured_blocks(str(tmp_path / "text.txt"), tok, 32, 256)[0])
    with torch.no_grad():
        assert plain["cross_entropy"] == pytest.approx(model(blocks, labels=blocks).loss.item(), rel=1e-5)
    names = ("fp8_gate", "fp8_up_down", "fp8_gate_and_up_down")
    for name in names:
        change = result[name]["cross_entropy"] / plain["cross_entropy"] - 1
        assert result[name]["cross_entropy_change"] == pytest.approx(change) and 0 < abs(change) < 0.05
        assert len(result[name]["active_units"]) == len(model.model.layers)
    assert len({result[name]["cross_entropy"] for name in names}) == 3
    for argv, message in (([str(tmp_path / "nowhere"), "--data", str(tmp_path / "text.txt")], "no config.json"),
                          ([str(tmp_path / "ckpt"), "--data", str(tmp_path / "missing.txt")], "missing.txt")):
        with pytest.raises(SystemExit):
            fp8_quality.main([*argv, "--device", "cpu"])
        assert message in capsys.readouterr().err


def test_active_units_count_each_layers_positive_gate_outputs_a_token_bf16_and_fp8():
    """active_units: a layer's mean count a token of units whose gate output is positive, from the gate as the
    model computes it (after use_fp8_gate, the fp8 gate's), counted from each MLP's own input."""
    from twell.fp8_gate import gate_reference, quantize_weight

    metrics = load_script().metrics
    model, _ = tiny_model("llama", seed=1)
    model.eval()
    ids = tiny_input_ids(3, 16)
    inputs = []
    handles = [layer.mlp.register_forward_pre_hook(lambda m, args: inputs.append(args[0].reshape(-1, args[0].shape[-1])))
               for layer in model.model.layers]
    weights = [layer.mlp.gate_proj.weight for layer in model.model.layers]
    with torch.no_grad():
        for fp8 in (False, True):
            inputs.clear()
            if fp8:
                metrics.use_fp8_gate(model)
            with metrics.active_units(model) as active:
                model(ids)
            gates = [gate_reference(x, *quantize_weight(w)) if fp8 else x @ w.t() for x, w in zip(inputs, weights)]
            assert active == pytest.approx([(g > 0).sum().item() / 48 for g in gates])
            assert 0 < min(active) and max(active) < weights[0].shape[0]
            assert not any(m._forward_hooks for m in model.modules())  # counting ends with the block
    for handle in handles:
        handle.remove()


def test_greedy_decodes_with_the_cache_what_whole_forward_passes_give():
    """Each step after the prompt's feeds the model one token (the KV cache holds the rest), and the continuations
    are the argmax of a whole forward pass over the prompt and the tokens so far, the end-of-text token included."""
    metrics = load_script().metrics
    model, _ = tiny_model("llama", seed=1)
    model.eval()
    prompts = tiny_input_ids(12, metrics.PROMPT_TOKENS)
    fed = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append((args[0] if args else kwargs["input_ids"]).shape[1]), with_kwargs=True)
    with torch.no_grad():
        cached = metrics.greedy(model, prompts, 8, "cpu")
        hook.remove()
        x = prompts
        for _ in range(metrics.NEW_TOKENS):
            x = torch.cat([x, model(x).logits[:, -1:].argmax(-1)], dim=1)
    assert fed == [metrics.PROMPT_TOKENS, *[1] * (metrics.NEW_TOKENS - 1)] * 2  # two batches
    assert torch.equal(cached, x[:, metrics.PROMPT_TOKENS:]) and (cached == model.config.eos_token_id).any()


def test_a_corpus_without_document_kinds_fails_with_a_clear_message(tmp_path):
    quality = load_script()
    (tmp_path / "valid.jsonl").write_text(json.dumps({"text": "print(1)"}) + "\n")
    with pytest.raises(SystemExit, match="records no document kind .* or pass --no-metrics"):
        quality.corpus.read_documents(tmp_path / "valid.jsonl")


def test_pretraining_reads_epochs_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    make_demo = load_script().pretrain.make_demo
    config = tiny_config("llama", max_position_embeddings=16, tie_word_embeddings=True)
    generator = torch.Generator().manual_seed(0)
    train, valid = torch.randint(256, (16 * 20,), generator=generator), torch.randint(256, (64,), generator=generator)
    run = dict(steps=12, minutes=60, batch=4, seq_len=16, lr=1e-3, warmup=2, eval_every=5, device="cpu", seed=0)
    whole = make_demo.pretrain_llama(config, tiny_tokenizer(), train, valid, tmp_path / "whole", **run)
    assert 2 < whole["epochs"] < 3  # 48 windows of the stream's 19 or 20 a epoch

    save = make_demo.save_pretraining
    def killed_after_the_save_at_step_8(path, settings, state, *rest):
        save(path, settings, state, *rest)
        if state["step"] == 8:
            raise KeyboardInterrupt
    monkeypatch.setattr(make_demo, "save_pretraining", killed_after_the_save_at_step_8)
    state = tmp_path / "state.pt"
    with pytest.raises(KeyboardInterrupt):
        make_demo.pretrain_llama(config, tiny_tokenizer(), train, valid, tmp_path / "resumed", state_path=state,
                                 save_every=4, **run)
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="other settings \\(differing in lr\\)"):
        make_demo.pretrain_llama(config, tiny_tokenizer(), train, valid, tmp_path / "resumed", state_path=state,
                                 **{**run, "lr": 2e-3})
    resumed = make_demo.pretrain_llama(config, tiny_tokenizer(), train, valid, tmp_path / "resumed", state_path=state,
                                       save_every=4, **run)
    assert not state.exists()
    assert [e["valid_loss"] for e in resumed["curve"]] == [e["valid_loss"] for e in whole["curve"]]
    assert (resumed["steps"], resumed["epochs"]) == (whole["steps"], whole["epochs"])
    weights, again = load_file(tmp_path / "whole/model.safetensors"), load_file(tmp_path / "resumed/model.safetensors")
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)


def test_pipeline_pretraining_stops_and_resumes_to_the_same_base(prepared, tmp_path):
    quality = load_script()
    whole = json.loads((prepared / "pretrain.json").read_text())  # the pretraining in one go
    paused = quality.arguments(["--toy", "--work", str(tmp_path / "paused"), "--pretrain-stop-after", "7"])
    with pytest.raises(quality.pretrain.PretrainingPaused):
        quality.prepare(paused)
    assert (tmp_path / "paused/pretrain_state.pt").is_file() and not (tmp_path / "paused/pretrain.json").exists()
    with pytest.raises(SystemExit) as stopped:  # the command line: its exit status says to run it again
        quality.main(["--toy", "--work", str(tmp_path / "paused"), "--pretrain-stop-after", "6"])
    assert stopped.value.code == quality.pretrain.PAUSED
    resumed = quality.prepare(quality.arguments(["--toy", "--work", str(tmp_path / "paused")]))[1]
    assert [e["valid_loss"] for e in resumed["curve"]] == [e["valid_loss"] for e in whole["curve"]]
    assert resumed["epochs"] == whole["epochs"] > 0 and resumed["steps"] == whole["steps"] == 20
    assert not any((tmp_path / "paused" / name).exists() for name in ("pretrain_state.pt", "pretrain_tokens.pt"))
    weights, again = (load_file(work / "base/model.safetensors") for work in (prepared, tmp_path / "paused"))
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_plot_smooths_training_curves_and_keeps_the_trade_off_within_the_data():
    quality = load_script()
    noisy = [2.0 + (0.5 if i % 2 else -0.5) for i in range(40)]  # per-batch noise around 2
    curve = quality.plots.smoothed(noisy)  # trailing means over 4 entries
    assert curve[0] == noisy[0] and all(abs(value - 2.0) < 1e-9 for value in curve[3::2])
    assert max(curve[3:]) - min(curve[3:]) < 0.3 < max(noisy) - min(noisy)
    assert quality.plots.data_limits([99.1], top=100) == pytest.approx((98.85, 99.35))  # one point: around it
    low, high = quality.plots.data_limits([97.0, 99.9], top=100)
    assert low == pytest.approx(96.71) and high == 100  # never past 100% sparsity


def test_plots_state_the_settings_every_run_shares_once_and_draw_one_share_over_its_passes(monkeypatch):
    """Legends name what sets the runs apart, the title what they share; a report of one share over several
    passes plots the passes alone (a share panel would hold one column of points), a run on a sampled folder at
    its tokens over the share's."""
    quality = load_script()
    calibrated = {"l1": 7, "calibrate_steps": 1500, "lr": 2e-4}
    runs = [dict(settings=settings, share=0.05, epochs=epochs, ce_vs_original=cost, sparsity=0.99)
            for settings in (calibrated, {**calibrated, "l1": 3.5}) for epochs, cost in ((1, 0.1), (2, 0.08))]
    assert quality.runs.shared_settings(runs) == {"calibrate_steps": 1500, "lr": 2e-4}
    assert quality.runs.shared_settings(runs[:1]) == {}
    runs.append(dict(settings={**calibrated, "data": "sampled"}, share=0.05, epochs=1, tokens=3 * 2_457_600,
                     ce_vs_original=0.09, sparsity=0.99))
    report = {"conversions": runs, "convert_shares": [0.05], "convert_tokens": [2_457_600], "convert_epochs": [1, 2],
              "control": [dict(share=0.05, epochs=epochs, cross_entropy={"original": 2.0, "after training": 2.0})
                          for epochs in (1, 2)],
              "pretraining": {"parameters": 120e6}, "device": "cpu"}
    saved = []
    monkeypatch.setattr(quality.plots, "save", lambda fig, result, path, common=(): saved.append((fig, common)))
    quality.plots.budget_plot(report, Path("unused.png"))
    (fig, common), = saved
    assert len(fig.axes) == 1 and fig.axes[0].get_xlabel().startswith("tokens trained on")
    assert common == ("calibrate_steps", "lr")
    labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert labels[:3] == ["l1 7 share 0.05", "l1 3.5 share 0.05", "l1 7 data sampled share 0.05"]
    assert [list(line.get_xdata()) for line in fig.axes[0].get_lines()[:3]] == [[1, 2], [1, 2], [3.0]]
    quality.plots.pyplot().close(fig)


def fake_report(parameters: int, pretraining_tokens: int, points: list[tuple[int, float, float]],
                layers: int = 8) -> dict:
    """A quality report holding only what compare.py reads: conversions of one setting at (tokens, cost, sparsity)."""
    return {"pretraining": {"parameters": parameters, "tokens": pretraining_tokens,
                            "config": {"num_hidden_layers": layers}},
            "conversions": [{"settings": {"l1": 3.5}, "tokens": t, "ce_vs_original": cost, "sparsity": sparsity}
                            for t, cost, sparsity in points]}


def test_compare_puts_bases_on_tokens_and_on_their_share(tmp_path, capsys):
    compare = load_benchmark("quality/compare.py")
    short = fake_report(100_000_000, 40_000_000, [(10_000_000, 0.02, 0.992), (2_000_000, 0.14, 0.983)])
    short["conversions"].append({"settings": {"l1": 3.5}, "epochs": 2, "tokens": 4_000_000,
                                 "distinct_tokens": 2_000_000, "ce_vs_original": 0.1, "sparsity": 0.99})
    long = fake_report(100_000_000, 120_000_000, [(10_000_000, 0.01, 0.991)], layers=16)
    paths = [tmp_path / "short.json", tmp_path / "long.json"]
    for path, result in zip(paths, (short, long)):
        path.write_text(json.dumps(result))
    figure = tmp_path / "compare.png"
    compare.main([*map(str, paths), "--out", str(figure)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "setting: l1 3.5"
    # each base's points by tokens, with the share of its own pretraining
    assert lines[2:5] == ["100M, 8 layers, 0.40 tokens/param (short.json) | 2.00M | 0.05 | 98.30% | +14.00%",
                          "100M, 8 layers, 0.40 tokens/param (short.json) | 10.00M | 0.25 | 99.20% | +2.00%",
                          "100M, 16 layers, 1.20 tokens/param (long.json) | 10.00M | 0.0833 | 99.10% | +1.00%"]
    assert figure.stat().st_size > 10_000
    # another report of the short base (pretrained again) joins its curve
    again = fake_report(100_000_000, 40_000_000, [(5_000_000, 0.08, 0.987)])
    curves = compare.base_curves({"short.json": short, "long.json": long, "again.json": again}, "l1 3.5")
    assert {label: [p["tokens"] for p in points] for label, points in curves.items()} == {
        "100M, 8 layers, 0.40 tokens/param": [2_000_000, 5_000_000, 10_000_000],
        "100M, 16 layers, 1.20 tokens/param": [10_000_000]}
    # two passes over 2M tokens: a setting of its own, at the distinct tokens its user lacks
    compare.main([str(paths[0]), "--out", str(figure), "--setting", "l1 3.5 epochs 2"])
    assert capsys.readouterr().out.splitlines()[2] == ("100M, 8 layers, 0.40 tokens/param (short.json) | 2.00M | "
                                                       "0.05 | 99.00% | +10.00%")
    long["conversions"][0]["settings"] = {"l1": 7}
    paths[1].write_text(json.dumps(long))
    with pytest.raises(SystemExit, match="choose the conversion setting"):
        compare.main([*map(str, paths), "--out", str(figure)])
    with pytest.raises(SystemExit, match=r"--setting 'l1 3.5': not among the conversions of long.json"):
        compare.main([*map(str, paths), "--out", str(figure), "--setting", "l1 3.5"])


def test_frontier_keeps_the_runs_no_other_beats_on_sparsity_and_cost(tmp_path, capsys):
    frontier = load_benchmark("quality/frontier.py")
    run = lambda sparsity, cost, **settings: {"settings": {"l1": 7, **settings}, "share": 0.05,  # noqa: E731
                                              "sparsity": sparsity, "ce_vs_original": cost}
    reports = {"a": {"conversions": [run(0.99, 0.09), run(0.98, 0.12), run(0.995, 0.10, lr=4e-4),
                                     {**run(0.999, 0.01), "share": 0.25}]},
               "b": {"conversions": [run(0.97, 0.08, distill=1), run(0.992, 0.095, distill=1)]}}
    for name, report in reports.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    front = frontier.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--share", "0.05",
                           "--out", str(tmp_path / "frontier.png")])
    # by sparsity: the 0.98 run is beaten by the 0.99 one, the other share is left out
    assert [(p["report"], round(p["sparsity"], 1), round(p["cost"], 1)) for p in front] == [
        ("b", 97.0, 8.0), ("a", 99.0, 9.0), ("b", 99.2, 9.5), ("a", 99.5, 10.0)]
    # labelled by what sets them apart (l1 7 they share; a run with nothing else, by its own settings)
    assert frontier.labels(front) == ["distill 1", "l1 7", "distill 1", "lr 0.0004"]
    printed = capsys.readouterr().out
    assert "99.20% | +9.50% | distill 1 | b" in printed and (tmp_path / "frontier.png").stat().st_size > 0


def cli_in_process(command, cwd=None):
    """subprocess.run of `python -m cli ...` run in this process through click's runner: the same command line and
    CLI code without a new process's imports (most of a tiny conversion's time). The exit status as the process's."""
    from click.testing import CliRunner

    from cli import main

    assert command[1:3] == ["-m", "cli"], command
    return subprocess.CompletedProcess(command, CliRunner().invoke(main, command[3:]).exit_code)


def test_target_sparsity_report_converts_each_setting_once_and_reads_it_back(tmp_path, monkeypatch):
    """benchmarks/target_sparsity.py: fixed weights and steered ones through the CLI (in this process; the next test
    runs it as the script does, in its own) on a tiny source; the steered runs' L1 factor moves, the fixed one's
    stays 1; run again, it reads the checkpoints without converting."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as the script runs on a CPU
    script = load_benchmark("target_sparsity.py")
    monkeypatch.setattr(script, "subprocess", types.SimpleNamespace(run=cli_in_process))
    model, tokenizer = tiny_model("llama")
    model.save_pretrained(tmp_path / "source")
    tokenizer.save_pretrained(tmp_path / "source")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 6}) + "\n"
                                                for i in range(60)))
    (corpus / "valid.jsonl").write_text(json.dumps({"text": "def g(y):\n    return y + 1\n" * 20}) + "\n")
    argv = [str(tmp_path / "source"), "--work", str(tmp_path / "work"), "--fixed", "0.01", "--steered", "0.9",
            "--log", "0.01", "--log-steered", "0.9", "--json", str(tmp_path / "report.json"), "--",
            "--data", str(corpus), "--steps", "8", "--log-every", "2",
            "--seq-len", "32", "--batch-size", "2", "--eval-tokens", "256", "--lr", "1e-3", "--l1", "0.001",
            "--l1-absolute", "--l1-warmup-steps", "0", "--device", "cpu"]
    report = script.main(argv)
    fixed, steered, log_penalty, log_steered = report["runs"]
    assert (fixed["name"], fixed["l1"], fixed["target_sparsity"], fixed["l1_log_scale"]) == ("l1 0.01", 0.01, 0.0, 0.0)
    assert (log_penalty["name"], log_penalty["l1"], log_penalty["l1_log_scale"]) == ("log 0.01", 0.01, 0.2)
    # the same weight: the log penalty's logged term is below L1's from the first step
    assert log_penalty["curve"][0]["l1"] < fixed["curve"][0]["l1"]
    assert (steered["name"], steered["l1"], steered["target_sparsity"]) == ("target 0.9", 0.001, 0.9)
    assert (log_steered["name"], log_steered["l1"], log_steered["target_sparsity"], log_steered["l1_log_scale"]) == \
        ("log target 0.9", 0.001, 0.9, 0.2)
    assert log_steered["curve"][-1]["l1_scale"] != 1.0
    assert {e["l1_scale"] for e in fixed["curve"]} == {1.0} and "allowed_active" not in fixed["curve"][0]
    # no L1 warm-up: the target's allowed units from the start
    assert [e["allowed_active"] for e in steered["curve"]] == pytest.approx([0.1 * steered["units"]] * 4)
    assert steered["curve"][0]["l1_scale"] == 1.0 and steered["curve"][-1]["l1_scale"] != 1.0
    assert [e["step"] for e in steered["curve"]] == [2, 4, 6, 8]
    assert 0 <= steered["sparsity"] <= 1 and len(steered["layer_sparsity"]) == len(steered["layer_dead"]) == 2
    assert json.loads((tmp_path / "report.json").read_text())["runs"][1]["name"] == "target 0.9"
    assert (tmp_path / "report.png").stat().st_size > 10_000
    monkeypatch.setattr(script.subprocess, "run", lambda *a, **k: pytest.fail("converted again"))
    assert script.main(argv)["runs"] == report["runs"]


def test_target_sparsity_report_stops_on_a_failed_conversion(tmp_path, monkeypatch, capfd):
    """A conversion the CLI refuses ends the script with the CLI's message and the folder, not a traceback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    script = load_benchmark("target_sparsity.py")
    with pytest.raises(SystemExit, match="the conversion into .*l1_0.01 failed"):
        script.main([str(tmp_path / "missing"), "--work", str(tmp_path / "work"), "--fixed", "0.01",
                     "--json", str(tmp_path / "report.json"), "--", "--device", "cpu"])
    assert "missing" in capfd.readouterr().err and not (tmp_path / "report.json").exists()
