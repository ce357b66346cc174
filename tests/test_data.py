"""Data: formats, packing with EOS between documents, the held-out split, batching/resume positions (continued
without reading the consumed documents again), and every bad-data error."""
import itertools
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main
from helpers import CountingTokenizer, tiny_tokenizer
from sparsify import data as data_module
from sparsify.data import Documents, TextData, blocks
from sparsify.locations import hub_arguments, resolve_data
from sparsify.errors import DataError

EOS = tiny_tokenizer().eos_token_id


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_blocks_pack_documents_with_eos_between():
    tok = tiny_tokenizer()
    out = list(blocks(iter(["abc", "de", "fghij"]), tok, seq_len=4))
    ids = torch.cat(out).tolist()
    # 3 + 1 + 2 + 1 + 5 + 1 = 13 ids: three full blocks of 4, the last id dropped
    expected = tok("abc")["input_ids"] + [EOS] + tok("de")["input_ids"] + [EOS] + tok("fghij")["input_ids"]
    assert [b.shape for b in out] == [torch.Size([4])] * 3
    assert ids == expected[:12]


def test_validation_file_is_the_eval_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [f"train document {i} " * 4 for i in range(50)])
    write_jsonl(tmp_path / "valid.jsonl", ["validation text " * 40])
    data = TextData(tmp_path, tiny_tokenizer(), seq_len=16, eval_tokens=64)
    assert len(data.eval_blocks) == 4 and data.skip == 0
    assert tiny_tokenizer().decode(data.eval_blocks[0]).startswith("validation text")
    batch = next(data.train_batches(batch_size=3))
    assert batch.shape == (3, 16)
    assert tiny_tokenizer().decode(batch[0]).startswith("train document 0")


def test_held_out_blocks_are_never_trained_on(tmp_path):
    (tmp_path / "a.txt").write_text("".join(chr(ord("a") + i % 26) for i in range(16 * 30)))
    data = TextData(tmp_path / "a.txt", tiny_tokenizer(), seq_len=16, eval_tokens=32)
    assert len(data.eval_blocks) == 2 and data.skip == 2
    all_blocks = list(blocks(iter([(tmp_path / "a.txt").read_text()]), tiny_tokenizer(), 16))
    train = data.train_batches(batch_size=1)
    first_epoch = [next(train)[0] for _ in range(len(all_blocks) - 2)]
    assert all(torch.equal(a, b) for a, b in zip(first_epoch, all_blocks[2:]))
    assert torch.equal(next(train)[0], all_blocks[2])  # the next epoch skips the held-out blocks again


def test_batches_resume_position_and_ranks(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [f"doc {i} " * 8 for i in range(40)])
    data = TextData(tmp_path / "d.jsonl", tiny_tokenizer(), seq_len=8, eval_tokens=8)
    stream = data.train_batches(batch_size=2)
    first = [next(stream) for _ in range(6)]
    assert torch.equal(next(data.train_batches(2, start=4)), first[4])
    rank1 = data.train_batches(2, start=2, rank=1, world=2)
    assert torch.equal(next(rank1), first[3]) and torch.equal(next(rank1), first[5])


def test_local_files_are_read_without_asking_the_hub(tmp_path, monkeypatch):
    """datasets counts a load of its builders with a request to the Hub; every epoch loads the files again."""
    import datasets

    (tmp_path / "a.txt").write_text("hello world")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    monkeypatch.setattr(datasets.load, "get_session", lambda: pytest.fail("a request to the Hub"))
    assert list(Documents(resolve_data(tmp_path).train)) == ["hello world"]
    assert datasets.config.HF_UPDATE_DOWNLOAD_COUNTS


def test_parquet_and_mixed_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["parquet row " * 10] * 5}).to_parquet(str(tmp_path / "p.parquet"))
    (tmp_path / "t.txt").write_text("plain text file " * 10)
    assert set(resolve_data(tmp_path).train) == {"parquet", "text"}
    data = TextData(tmp_path, tiny_tokenizer(), seq_len=16, eval_tokens=16)
    text = tiny_tokenizer().decode(torch.cat(data.eval_blocks + [next(data.train_batches(4)).flatten()]))
    assert "parquet row" in text


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing.jsonl", "does not exist"),
        (lambda p: p / "nope" / "x", "does not exist"),
        (lambda p: (p / "empty.jsonl").write_text("") and None or p / "empty.jsonl", "empty"),
        (lambda p: (p / "sub").mkdir() or p / "sub", "empty"),
        (lambda p: (p / "x.csv").write_text("text\nhello") and p / "x.csv", "unknown data format"),
        (lambda p: write_jsonl(p / "short.jsonl", ["hi"]), "holds 1 document of 3 tokens: shorter than one sequence"),
        (lambda p: write_jsonl(p / "blank.jsonl", ["  ", "\n\n", " "]),
         "holds 3 documents of [0-9]+ tokens, all of it whitespace: shorter than one sequence"),
        (lambda p: write_jsonl(p / "one.jsonl", ["hello world " * 10]), "shorter than two sequences"),
        (lambda p: (p / "nt.jsonl").write_text('{"body": "x"}\n') and p / "nt.jsonl", "no 'text' column"),
        (lambda p: (p / "bad.jsonl").write_text("{not json\n") and p / "bad.jsonl", "cannot read"),
    ],
)
def test_bad_data(tmp_path, make, message):
    with pytest.raises(DataError, match=message):
        TextData(make(tmp_path), tiny_tokenizer(), seq_len=64, eval_tokens=64)


def test_text_column_names_the_column_of_rows(tmp_path, monkeypatch):
    """.jsonl and .parquet rows (and Hub rows) are read from `text_column`; .txt files stay whole documents; a row
    without the column is a DataError naming it and the row's columns, with or without `datasets`."""
    datasets = pytest.importorskip("datasets")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "body": f"jsonl row {i} " * 5}) + "\n"
                                              for i in range(30)))
    datasets.Dataset.from_dict({"body": ["parquet row " * 10] * 5}).to_parquet(str(tmp_path / "b.parquet"))
    (tmp_path / "c.txt").write_text("plain text " * 30)
    data = TextData(tmp_path, tiny_tokenizer(), seq_len=16, eval_tokens=32, text_column="body")
    text = tiny_tokenizer().decode(torch.cat(list(data._blocks(data.source.train))))
    assert "jsonl row 3" in text and "parquet row" in text and "plain text" in text and '"id"' not in text
    with monkeypatch.context() as hub:
        hub.setattr(datasets, "load_dataset", lambda *args, **kwargs: iter([{"content": "hello"}]))
        assert list(Documents("owner/name", "content")) == ["hello"]
    for reader in ("datasets", "plain"):
        if reader == "plain":
            (tmp_path / "b.parquet").unlink()
            monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
        with pytest.raises(DataError, match=r"a\.jsonl(: line 1)?: a row has no 'text' column "
                                            r"\(its columns: id, body\); name the "
                                            r"one that holds the text with --text-column"):
            TextData(tmp_path, tiny_tokenizer(), seq_len=16, eval_tokens=32)


def test_rows_whose_text_is_not_text_name_their_file(tmp_path, monkeypatch):
    """A null or numeric text, or a row that is no object, is a DataError naming the file (and, read without
    `datasets`, the line), not a tokenizer's TypeError."""
    for reader in ("datasets", "plain"):
        if reader == "plain":
            monkeypatch.setitem(sys.modules, "datasets", None)
        for row, message in (('{"text": null}', "a row's 'text' is NoneType"),
                             ('{"text": 12345}', "a row's 'text' is int"),
                             ('[1, 2]', "a row is list")):
            (tmp_path / "a.jsonl").write_text('{"text": "fine words here"}\n' + row + "\n")
            line = r": line 2" if reader == "plain" else ""
            if reader == "datasets" and row.startswith("["):  # datasets' JSON reader refuses it itself
                message, line = "JSON parse error", ""
            with pytest.raises(DataError, match=rf"a\.jsonl{line}: {message}"):
                list(Documents(resolve_data(tmp_path / "a.jsonl").train, "text"))


def test_without_datasets_package_jsonl_and_txt_read_the_same(tmp_path, monkeypatch):
    # The GPU image has no `datasets`: local .jsonl/.txt still work, through a plain reader.
    write_jsonl(tmp_path / "a.jsonl", [f"row {i} " * 5 for i in range(30)])
    (tmp_path / "b.txt").write_text("plain text " * 30)
    with_datasets = TextData(tmp_path, tiny_tokenizer(), seq_len=16, eval_tokens=32)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    without = TextData(tmp_path, tiny_tokenizer(), seq_len=16, eval_tokens=32)
    assert all(torch.equal(a, b) for a, b in zip(with_datasets.eval_blocks, without.eval_blocks))
    assert torch.equal(next(with_datasets.train_batches(8)), next(without.train_batches(8)))
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match="needs the `datasets` package"):
        TextData(tmp_path, tiny_tokenizer(), seq_len=16, eval_tokens=32)


def test_shuffled_batches_are_seeded_resumable_and_keep_held_out_blocks_out(tmp_path):
    letters = random.Random(0)  # random text: no two blocks alike, so blocks can be told apart by content
    write_jsonl(tmp_path / "d.jsonl", ["".join(letters.choices("abcdefghij", k=64)) for _ in range(40)])
    data = TextData(tmp_path / "d.jsonl", tiny_tokenizer(), seq_len=8, eval_tokens=16)
    ordered = [b for batch in itertools.islice(data.train_batches(1), 30) for b in batch]
    shuffled = [b for batch in itertools.islice(data.train_batches(1, shuffle_buffer=16, seed=3), 30) for b in batch]
    key = lambda blocks: [tuple(b.tolist()) for b in blocks]
    assert key(shuffled) != key(ordered)
    epoch = list(itertools.islice(data._blocks(data.source.train), data.skip, None))
    assert len(epoch) > 30 and set(key(shuffled)) <= set(key(epoch))  # training blocks only
    assert not set(key(data.eval_blocks)) & set(key(shuffled))
    again = list(itertools.islice(data.train_batches(2, shuffle_buffer=16, seed=3), 8))
    assert all(torch.equal(a, b)
               for a, b in zip(again, list(itertools.islice(data.train_batches(2, shuffle_buffer=16, seed=3), 8))))
    resumed = data.train_batches(2, start=5, shuffle_buffer=16, seed=3)
    assert torch.equal(next(resumed), again[5])
    rank1 = data.train_batches(2, start=2, rank=1, world=2, shuffle_buffer=16, seed=3)
    assert torch.equal(next(rank1), again[3])
    other_seed = list(itertools.islice(data.train_batches(2, shuffle_buffer=16, seed=4), 8))
    assert not all(torch.equal(a, b) for a, b in zip(again, other_seed))


@pytest.mark.parametrize("reader", ["datasets", "without-datasets", "hub"])
def test_batches_continue_from_a_saved_position_without_reading_the_consumed_documents(tmp_path, monkeypatch, reader):
    """A stream loaded with another's state_dict (saved and read back as --resume does) yields the batches the
    other would have yielded next, over epochs, and tokenizes none of the documents read before the position."""
    letters = random.Random(0)  # each document its own text: what is tokenized can be told apart
    texts = [f"{i}:" + "".join(letters.choices("abcdefgh", k=letters.randint(2, 30))) for i in range(300)]
    if reader == "hub":
        datasets = pytest.importorskip("datasets")
        monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: datasets.Dataset.from_dict(
            {"text": texts}).to_iterable_dataset(num_shards=4))
        spec = "owner/corpus"
    else:  # a folder: rows in two files and a whole-document text file
        for name, part in (("a.jsonl", texts[:150]), ("b.jsonl", texts[150:299])):
            write_jsonl(tmp_path / name, part)
        (tmp_path / "c.txt").write_text(texts[299])
        spec = tmp_path
        if reader == "without-datasets":
            monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    tokenizer = CountingTokenizer()
    data = TextData(spec, tokenizer, seq_len=8, eval_tokens=16)
    batches = dict(batch_size=2, rank=1, world=2, shuffle_buffer=16, seed=3)
    uninterrupted = list(itertools.islice(data.train_batches(**batches), 700))  # over two epochs
    first = data.train_batches(**batches)
    tokenizer.texts.clear()
    consumed = [next(first) for _ in range(100)]
    torch.save(first.state_dict(), tmp_path / "position.pt")
    read_before, tokenizer.texts = tokenizer.texts, []
    resumed = data.train_batches(**batches, start=200)
    resumed.load_state_dict(torch.load(tmp_path / "position.pt"))
    following = [next(resumed) for _ in range(600)]
    assert all(torch.equal(a, b) for a, b in zip(consumed + following, uninterrupted, strict=True))
    epoch = tokenizer.texts.index(texts[0])  # where the next epoch reads the text again
    assert tokenizer.texts[:epoch] == texts[len(read_before):]


def test_held_out_text_is_reported_with_its_share_and_size(tmp_path):
    tok = tiny_tokenizer()
    (tmp_path / "one.txt").write_text("abcdefgh" * 640)  # 5120 tokens: 80 blocks of 64
    what, warnings = TextData(str(tmp_path / "one.txt"), tok, 64, eval_tokens=64 * 40).held_out()
    assert "the first 2,560 tokens of" in what
    assert any("is 50% of the data, never trained on" in w for w in warnings)
    assert not any("only" in w for w in warnings)  # few, but as many as asked for: the user's choice
    _, warnings = TextData(str(tmp_path / "one.txt"), tok, 64, eval_tokens=64 * 100).held_out()
    assert "only 512 held-out tokens (of --eval-tokens 6,400)" in warnings[0]  # the text is short: a tenth held out
    _, warnings = TextData(str(tmp_path / "one.txt"), tok, 64, eval_tokens=64 * 10).held_out()
    assert not any("of the data" in w for w in warnings)  # 10 of 80 blocks: below the share that warns
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.txt").write_text("abcdefgh" * 640)
    (folder / "valid.txt").write_text("abcdefgh" * 4096)
    what, warnings = TextData(str(folder), tok, 64, eval_tokens=32768).held_out()
    assert what == f"held out: 32,768 tokens of {folder / 'valid.txt'}" and warnings == []
    (folder / "valid.txt").write_text("abcdefgh" * 64)  # a short held-out file: asks for more of it
    _, warnings = TextData(str(folder), tok, 64, eval_tokens=32768).held_out()
    assert warnings[0].endswith("are noisy (give more held-out text)")


def test_a_run_longer_than_the_text_is_told_its_passes(tmp_path, monkeypatch):
    (tmp_path / "one.txt").write_text("abcdefgh" * 640)  # 80 blocks of 64, the first 10 held out
    data = TextData(str(tmp_path / "one.txt"), tiny_tokenizer(), 64, eval_tokens=64 * 10)
    assert data.held_out(train_tokens=64 * 70)[1] == []  # one pass
    _, warnings = data.held_out(train_tokens=64 * 700)
    assert warnings == ["the training text holds 4,480 tokens and the run trains on 44,800: 10.0 passes over it "
                        "(several pay on a small text: docs/quality.md; if unintended, lower --tokens or --steps, "
                        "or give more text)"]
    monkeypatch.setattr(data_module, "PASSES_COUNTED", 64 * 20)  # counted no further: longer text is not told
    assert data.held_out(train_tokens=64 * 700)[1] == []


def test_training_tokens_count_the_text_after_its_held_out_head(tmp_path, monkeypatch):
    """--passes' count: exact for a text within PASSES_COUNTED tokens, beyond estimated from its length."""
    (tmp_path / "one.txt").write_text("abcdefgh" * 640)  # 80 blocks of 64, the first 10 held out
    data = TextData(str(tmp_path / "one.txt"), tiny_tokenizer(), 64, eval_tokens=64 * 10)
    assert data.training_tokens() == (70 * 64, False)
    monkeypatch.setattr(data_module, "TOKENS_SAMPLED", 64 * 20)  # the held-out warning's sample, not --passes'
    assert data.training_tokens() == (70 * 64, False)
    monkeypatch.setattr(data_module, "PASSES_COUNTED", 64 * 20)
    tokens, estimated = data.training_tokens()
    assert estimated and tokens == pytest.approx(70 * 64, rel=0.05)


def test_the_passes_over_long_text_are_estimated_from_its_length(tmp_path, monkeypatch):
    """Beyond TOKENS_SAMPLED tokens the text is read, not tokenized: its tokens are estimated from its length at the
    tokens per character of its start, and the warning says it is an estimate."""
    monkeypatch.setattr(data_module, "TOKENS_SAMPLED", 64 * 8)
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(50, 150))) for _ in range(1000)]
    tokenizer = CountingTokenizer()
    data = TextData(str(write_jsonl(tmp_path / "one.jsonl", texts)), tokenizer, 64, eval_tokens=64 * 10)
    tokenizer.texts.clear()
    _, warnings = data.held_out(train_tokens=64 * 10_000)
    assert len(tokenizer.texts) == data_module.DOCUMENTS_A_CALL  # the sample's documents: one call
    told = re.fullmatch(r"the training text holds about ([\d,]+) tokens \(estimated from its length at the tokens per "
                        r"character of its start\) and the run trains on 640,000: about ([\d.]+) passes over it "
                        r"\(several pay on a small text: docs/quality.md; if unintended, lower --tokens or --steps, "
                        r"or give more text\)", warnings[0])
    exact = (sum(len(text) + 1 for text in texts) // 64 - data.skip) * 64  # the byte tokenizer: a token a character
    assert told and int(told[1].replace(",", "")) == pytest.approx(exact, rel=0.05)
    assert float(told[2]) == pytest.approx(640_000 / exact, rel=0.05)


def test_a_mistyped_local_folder_is_no_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    for spec in ("corpus/trian", "corpsu/"):
        with pytest.raises(DataError, match=f"data path {spec} does not exist"):
            resolve_data(spec)
    assert resolve_data("owner/name").train == "owner/name"  # no local folder "owner": a Hub name


def test_hub_dataset_name_config_and_split(monkeypatch):
    assert hub_arguments("allenai/c4:en@validation") == ("allenai/c4", "en", "validation")
    assert hub_arguments("wikitext:wikitext-2-raw-v1") == ("wikitext", "wikitext-2-raw-v1", "train")
    assert hub_arguments("owner/name@train[:1%]") == ("owner/name", None, "train[:1%]")
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return iter([{"text": "hello"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert resolve_data("allenai/c4:en@validation").train == "allenai/c4:en@validation"
    assert list(Documents("allenai/c4:en@validation")) == ["hello"]
    assert calls == [(("allenai/c4", "en"), {"split": "validation", "streaming": True})]


def _first_batch_within(data, seconds=30):
    """The first training batch of `data` (batch size 1), read in a daemon thread: None where none came within
    `seconds` (a stream that holds out every block reads epochs forever and never yields)."""
    import threading

    got = []
    reader = threading.Thread(target=lambda: got.append(next(data.train_batches(batch_size=1))), daemon=True)
    reader.start()
    reader.join(seconds)
    return got[0] if got else None


@pytest.mark.parametrize("n_blocks, eval_tokens, held_out", [
    (4, 64, 1),          # exactly n_eval = 4 blocks: not enough for both, a tenth (at least one) is held out
    (5, 64, 4),          # n_eval + 1 blocks: the n_eval asked for, one left to train on
    (25, 16 * 40, 2),    # 25 blocks where 40 are asked for: a tenth of them
])
def test_small_data_holds_out_a_tenth_and_keeps_blocks_to_train_on(tmp_path, n_blocks, eval_tokens, held_out):
    tok = tiny_tokenizer()
    # A .txt file is one document: 16 * n_blocks - 1 byte tokens and the EOS after them make exactly n_blocks
    # blocks of 16.
    text = "".join(chr(ord("a") + i % 26) for i in range(16 * n_blocks - 1))
    (tmp_path / "a.txt").write_text(text)
    all_blocks = list(blocks(iter([text]), tok, 16))
    assert len(all_blocks) == n_blocks and all_blocks[-1][-1].item() == EOS
    data = TextData(tmp_path / "a.txt", tok, seq_len=16, eval_tokens=eval_tokens)
    batch = _first_batch_within(data)
    assert batch is not None, "no training batch: every block is held out"
    assert data.skip == held_out and len(data.eval_blocks) == held_out
    assert all(torch.equal(a, b) for a, b in zip(data.eval_blocks, all_blocks[:held_out], strict=True))
    assert batch.shape == (1, 16) and torch.equal(batch[0], all_blocks[held_out])  # training starts after them


def test_a_corrupt_parquet_file_is_said_without_a_traceback(tmp_path):
    (tmp_path / "train.parquet").write_bytes(b"PAR1 not a parquet file")
    result = CliRunner().invoke(main, ["convert", "demo", "-o", str(tmp_path / "out"), "--data",
                                       str(tmp_path / "train.parquet"), "--steps", "2", "--dry-run"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert f"error: cannot read {tmp_path / 'train.parquet'}: Parquet magic bytes not found" in result.output


def test_malformed_json_lines_are_said_once(tmp_path):
    # a process of its own: the `datasets` reader logs to the stderr it found when first imported
    (tmp_path / "train.jsonl").write_text("not json\n")
    done = subprocess.run([sys.executable, "-m", "cli", "convert", "demo", "-o", tmp_path / "out", "--data",
                           tmp_path / "train.jsonl", "--dry-run"], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Failed to load JSON" not in done.stderr, done.stderr
    assert done.stderr.endswith(f"\nerror: cannot read {tmp_path / 'train.jsonl'}: JSON parse error: Invalid value. "
                                "in row 0\n"), done.stderr
