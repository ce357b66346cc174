"""`sparsify sample` on a tiny random model (CPU): the data folder it writes (samples continuing the heads of the
text's training blocks, the held-out text kept, the text's own documents spread among the samples), that the
conversion's data reader takes it, and its bad inputs: a clear message and no OUT."""
import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from cli import main
from helpers import tiny_model
from sparsify import sample as sample_module
from sparsify.config import SampleOptions
from sparsify.data import TextData, blocks

SEQ_LEN, PROMPT = 48, 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"
                                                                     * (1 + i % 5)})
                                                + "\n" for i in range(40)))
    (corpus / "valid.jsonl").write_text("".join(json.dumps({"text": f"def g{i}(y):\n    return y + {i}\n" * 4}) + "\n"
                                                for i in range(6)))
    model, tokenizer = tiny_model("llama")
    # a generation_config that would make sampling greedy and penalized: sample draws from the model's own
    # distribution regardless (the seeds below give other text)
    model.generation_config.update(do_sample=True, top_k=1, repetition_penalty=3.0, no_repeat_ngram_size=2)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root


def run(*args):
    return CliRunner().invoke(main, ["sample", *map(str, args)])


def sample(files, out, *extra):
    return run(files / "model", "-o", out, "--data", files / "corpus", "--tokens", 300, "--seq-len", SEQ_LEN,
               "--prompt-tokens", PROMPT, "--batch-size", 4, "--eval-tokens", 96, *extra)


def rows(folder, name="train.jsonl"):
    return [json.loads(line) for line in open(folder / name)]


def test_samples_continue_the_training_blocks_and_keep_the_held_out_text(files, tmp_path):
    result = sample(files, tmp_path / "out")
    assert result.exit_code == 0, result.output
    out, tokenizer = tmp_path / "out", tiny_model("llama")[1]
    record = yaml.safe_load((out / "sample.yaml").read_text())
    samples = rows(out)
    assert all(r["source"] == "sample" for r in samples) and len(samples) == record["samples"]
    assert 300 <= record["sampled_tokens"] < 300 + SEQ_LEN and record["ended_at_eos"] <= record["samples"]
    assert record["sampled_tokens"] <= record["samples"] * SEQ_LEN
    text = TextData(files / "corpus", tokenizer, SEQ_LEN, 96)
    heads = [tokenizer.decode(block[:PROMPT]) for block in text.training_blocks()]
    for k, r in enumerate(samples):  # the prompts in order, cycling; the random model's bytes after them
        assert r["text"].startswith(heads[k % len(heads)]) and len(r["text"]) > len(heads[k % len(heads)])
    # the folder's held-out text is the corpus's: the conversion's reader measures on the same ids
    again = TextData(out, tokenizer, SEQ_LEN, 96)
    assert [b.tolist() for b in again.eval_blocks] == [b.tolist() for b in text.eval_blocks]
    assert next(again.training_blocks()) is not None
    # the same seed samples the same text; another seed other text
    assert sample(files, tmp_path / "same").exit_code == 0 and rows(tmp_path / "same") == samples
    assert sample(files, tmp_path / "other", "--seed", 1).exit_code == 0 and rows(tmp_path / "other") != samples


def test_with_data_spreads_the_training_documents_among_the_samples_by_tokens(files, tmp_path):
    result = sample(files, tmp_path / "out", "--with-data")
    assert result.exit_code == 0, result.output
    written, tokenizer = rows(tmp_path / "out"), tiny_model("llama")[1]
    record = yaml.safe_load((tmp_path / "out" / "sample.yaml").read_text())
    # the conversion it is for: four passes over the folder's tokens, samples and --data's
    # with the lr it needs (a source other than the demo)
    assert f"--data {tmp_path / 'out'} --recipe small-budget --passes 4 --lr LR\n" in result.output
    documents = [json.loads(line)["text"] for line in open(files / "corpus" / "train.jsonl")]
    assert [r["text"] for r in written if r["source"] == "data"] == documents  # each once, in order
    tokens = [len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) for r in written]
    assert record["data_tokens"] == sum(t + 1 for t, r in zip(tokens, written) if r["source"] == "data")
    half = len(written) // 2  # spread: the first half of the rows holds about half of each kind's tokens
    for kind in ("sample", "data"):
        first = sum(t for t, r in zip(tokens[:half], written) if r["source"] == kind)
        assert 0.3 < first / sum(t for t, r in zip(tokens, written) if r["source"] == kind) < 0.7, kind


def test_a_single_file_keeps_its_held_out_head_out_of_the_samples_and_the_documents(files):
    """Without a valid* file the head of the text is held out: its blocks give no prompt, its documents are not
    written (the one it cuts keeps its tail), and valid.jsonl holds it."""
    tokenizer = tiny_model("llama")[1]
    text = TextData(files / "corpus" / "train.jsonl", tokenizer, SEQ_LEN, 96)
    assert text.skip == 2
    documents = list(text.training_documents())
    assert [b.tolist() for b in blocks(iter(documents), tokenizer, SEQ_LEN)] == [
        b.tolist() for b in text.training_blocks()]
    held_out = text.held_out_documents()
    assert [b.tolist() for b in blocks(iter(held_out), tokenizer, SEQ_LEN)] == [b.tolist() for b in text.eval_blocks]
    original = [json.loads(line)["text"] for line in open(files / "corpus" / "train.jsonl")]
    assert original == held_out[:-1] + [held_out[-1] + documents[0]] + documents[1:]  # one document cut in two


def test_seq_len_not_given_fits_the_source_s_positions(files, tmp_path):
    result = run(files / "model", "-o", tmp_path / "out", "--data", files / "corpus", "--tokens", 200,
                 "--prompt-tokens", PROMPT, "--batch-size", 4, "--eval-tokens", 96)
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "out" / "sample.yaml").read_text())["seq_len"] == 128  # the tiny model's


def test_sample_options_are_sample_s_options_with_their_help():
    options = {option.name: option for option in main.commands["sample"].params}
    for setting in dataclasses.fields(SampleOptions):
        assert options[setting.name].help == setting.metadata["help"], setting.name


@pytest.mark.parametrize("extra, message", [
    (("--prompt-tokens", SEQ_LEN), f"--prompt-tokens {SEQ_LEN} leaves nothing to sample within --seq-len {SEQ_LEN}"),
    (("--seq-len", 1000, "--prompt-tokens", 8), "--seq-len 1000 is beyond the source's 128 positions"),
    (("--temperature", 0), "--temperature must be above 0, got 0.0"),
    (("--batch-size", 0), "--batch-size must be a positive integer, got 0"),
])
def test_impossible_settings_are_named(files, tmp_path, extra, message):
    result = sample(files, tmp_path / "out", *extra)
    assert result.exit_code == 1 and message in result.output and not (tmp_path / "out").exists()


def test_missing_data_and_a_full_out_are_named(files, tmp_path):
    result = run(files / "model", "-o", tmp_path / "out", "--tokens", 100)
    assert result.exit_code == 1 and "--data is required" in result.output
    result = run(tmp_path / "no-such-model", "-o", tmp_path / "out", "--tokens", 100)  # the source named first
    assert result.exit_code == 1 and "no such folder" in result.output and "--data" not in result.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    result = sample(files, tmp_path / "full")
    assert result.exit_code == 1 and "exists and is not empty" in result.output
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_missing_data_and_impossible_settings_are_said_before_torch_is_imported(files, tmp_path):
    """As convert's: a supported source's config.json read without torch, so these fail at once."""
    command = ["sample", str(files / "model"), "-o", str(tmp_path / "out"), "--tokens"]
    code = ("import sys\nfrom click.testing import CliRunner\nfrom cli import main\n"
            f"for extra in (['100'], ['-3', '--data', {str(files / 'corpus')!r}],\n"
            f"              ['100', '--seq-len', '1000', '--data', {str(files / 'corpus')!r}]):\n"
            f"    print(CliRunner().invoke(main, {command!r} + extra).output)\n"
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for message in ("error: --data is required: the text whose training blocks give the prompts",
                    "error: --tokens must be a positive integer, got -3",
                    "error: --seq-len 1000 is beyond the source's 128 positions"):
        assert message in done.stdout, done.stdout


def test_a_failed_run_leaves_no_out(files, tmp_path, monkeypatch):
    def failing(*args, **kwargs):  # a sample written, then the sampling fails
        yield list(b"def f(x):")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(sample_module, "samples", failing)
    result = sample(files, tmp_path / "out")
    assert isinstance(result.exception, RuntimeError)
    assert not (tmp_path / "out").exists() and not any(tmp_path.iterdir())


def test_an_unset_batch_fits_the_gpu_memory_the_tokens_and_a_cpu():
    """--batch-size unset: half the free memory over a sample's static cache and logits, at most
    GPU_BATCH_MAX; on a CPU CPU_BATCH; never more samples than --tokens takes; a given batch as it is."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=8,
                         vocab_size=1000)
    options = SampleOptions(out="unused", tokens=10**9, seq_len=1024)
    per_sample = (8 * 2 * 4 * 64) * 1024 * 2 + 4 * 4 * 1000
    fitted = lambda free, **changed: sample_module.fitted_batch(  # noqa: E731
        config, dataclasses.replace(options, **changed), torch.bfloat16, free)
    assert fitted(100 * per_sample) == 50 and fitted(per_sample) == 1 and fitted(0) == 1
    assert fitted(10**15) == sample_module.GPU_BATCH_MAX
    assert fitted(10**15, tokens=3000) == 3  # 3,000 tokens take three samples of 1,024
    assert fitted(None) == sample_module.CPU_BATCH and fitted(None, tokens=100) == 1
    assert fitted(10**15, batch_size=5) == fitted(None, batch_size=5) == 5


def test_the_record_holds_the_batch_it_sampled_at(files, tmp_path):
    result = run(files / "model", "-o", tmp_path / "out", "--data", files / "corpus", "--tokens", 300, "--seq-len",
                 SEQ_LEN, "--prompt-tokens", PROMPT, "--eval-tokens", 96, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "out" / "sample.yaml").read_text())["batch_size"] == 7  # 300 / 48 tokens


def test_a_static_cache_draws_the_samples_the_dynamic_one_does():
    """The GPU's static cache (generate compiles its step there; not on a CPU) against the dynamic one: the same
    seed gives the same samples, prompts kept, each at most seq_len ids."""
    model, _ = tiny_model("llama")
    heads = [torch.arange(5, 5 + PROMPT) + i for i in range(6)]
    drawn = {}
    for cache in ("dynamic", "static"):
        torch.manual_seed(0)
        drawn[cache] = list(sample_module.samples(model, iter(heads), 200, SEQ_LEN, 3, 1.0, None, cache))
    assert drawn["static"] == drawn["dynamic"] and sum(map(len, drawn["static"])) >= 200
    assert all(len(ids) <= SEQ_LEN and ids[:PROMPT] == heads[i].tolist() for i, ids in enumerate(drawn["static"]))


def test_progress_advances_at_each_step_by_the_ids_kept():
    """The progress hears of a batch's ids as generate draws them (the prompts, then one id a step for each sample
    before its EOS), not all at once at the batch's end, and in all as many as the samples hold."""
    model, _ = tiny_model("llama")
    heads = [torch.arange(5, 5 + PROMPT) + i for i in range(3)]
    torch.manual_seed(0)
    eos = next(sample_module.samples(model, iter(heads), 1, SEQ_LEN, 3, 1.0, None))[PROMPT + 2]  # drawn: one ends early
    calls = []
    torch.manual_seed(0)
    drawn = list(itertools.islice(sample_module.samples(model, iter(heads), 10**6, SEQ_LEN, 3, 1.0, eos,
                                                        advance=calls.append), 3))
    assert calls[0] == 3 * PROMPT and len(calls) > SEQ_LEN // 2
    assert sum(calls) == sum(map(len, drawn)) and any(len(ids) < SEQ_LEN for ids in drawn)


def test_token_progress_outside_a_terminal_logs_tenths_and_the_end_once(capsys, monkeypatch):
    """Where the output is no terminal: a line at each tenth of the total (at most one in LOGGED_SECONDS) and one at
    the end, not one for each batch drawn after it (a batch's last steps run on past the total)."""
    from sparsify import report

    def lines(seconds: float) -> list[int]:
        monkeypatch.setattr(report, "LOGGED_SECONDS", seconds)
        with report.token_progress(100, "sampling") as advance:
            for _ in range(15):
                advance(10)
        return [int(line.split("sampling: ")[1].split("/")[0]) for line in capsys.readouterr().err.splitlines()]

    assert lines(0) == list(range(10, 101, 10))
    assert lines(60) == [100]  # a short run: its last line alone
