"""Training and evaluation text: local .txt / .jsonl / .parquet files (or a folder of them) or a
`datasets` Hub name (NAME[:CONFIG][@SPLIT]), streamed, tokenized and packed into fixed blocks of `seq_len` token ids with the
tokenizer's EOS between documents (labels = inputs: Hugging Face models shift them internally).

Evaluation text is never trained on: in a folder, files whose name starts with valid/validation/eval/test
(like the demo corpus's valid.jsonl) are held out whole; otherwise (single files, Hub datasets) the first
blocks of the training stream are held out and every epoch of training starts after them. A .txt file is one
document; .jsonl/.parquet rows and Hub dataset rows are documents, read from their `text_column` ("text" unless
given). The `datasets` library is imported lazily, so checkpoints and `analyze` with local files still work
where it is missing.
"""
from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .errors import DataError

FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
EVAL_PREFIXES = ("valid", "eval", "test")  # valid* covers validation*
MIN_EVAL_TOKENS = 16384  # fewer held-out tokens measure perplexity and sparsity too noisily
HELD_OUT_SHARE_WARN = 0.2  # warn when the head held out of the training text is at least this share of it


@dataclass
class DataSource:
    """Where the documents come from: local files grouped by builder, or a Hub dataset name."""

    train: dict[str, list[str]] | str
    eval: dict[str, list[str]] | str | None  # None: hold out the first training blocks

    @property
    def description(self) -> str:
        return self.description_of(self.train)

    @staticmethod
    def description_of(files: dict[str, list[str]] | str) -> str:
        return files if isinstance(files, str) else ", ".join(sum(files.values(), []))


def resolve(spec: str | Path) -> DataSource:
    """`--data` value -> DataSource. A path that exists is local; anything else must look like a Hub
    dataset name ("owner/name" or "name"), else the path is reported missing."""
    path = Path(spec).expanduser()
    if not path.exists():
        parts = Path(hub_arguments(str(spec))[0]).parts
        if (str(spec).startswith((".", "/", "~")) or str(spec).endswith("/") or Path(spec).suffix in FORMATS
                or len(parts) > 1 and Path(parts[0]).is_dir()):  # a path, mistyped: no Hub lookup
            raise DataError(f"data path {spec} does not exist")
        return DataSource(train=str(spec), eval=None)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [p for p in files if not p.name.startswith(".")]
    if not files:
        raise DataError(f"data folder {path} is empty")
    unknown = [p.name for p in files if p.suffix.lower() not in FORMATS]
    if (unknown and path.is_file()) or len(unknown) == len(files):
        raise DataError(
            f"unknown data format: {', '.join(unknown[:5])} (use {', '.join(FORMATS)} files or a folder of them)"
        )
    files = [p for p in files if p.suffix.lower() in FORMATS]
    if all(p.stat().st_size == 0 for p in files):
        raise DataError(f"data {path} is empty")
    held_out = [p for p in files if path.is_dir() and p.stem.lower().startswith(EVAL_PREFIXES)]
    train = [p for p in files if p not in held_out]
    if not train:
        raise DataError(f"data {path} has only evaluation files ({', '.join(p.name for p in held_out)})")
    return DataSource(train=_by_builder(train), eval=_by_builder(held_out) if held_out else None)


def hub_arguments(spec: str) -> tuple[str, str | None, str]:
    """(name, config, split) of a Hub dataset given as NAME[:CONFIG][@SPLIT], e.g. allenai/c4:en@validation
    (split default: train)."""
    name_config, _, split = spec.partition("@")
    name, _, config = name_config.partition(":")
    return name, config or None, split or "train"


def _by_builder(files: list[Path]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for p in files:
        groups.setdefault(FORMATS[p.suffix.lower()], []).append(str(p))
    return groups


def documents(source: dict[str, list[str]] | str, text_column: str = "text") -> Iterator[str]:
    """Stream the documents' texts, rows' from their `text_column` (each pass re-reads the source)."""
    try:
        import datasets
    except ImportError:
        yield from _documents_without_datasets(source, text_column)
        return
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    if isinstance(source, str):
        try:
            name, config, split = hub_arguments(source)
            stream = datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as e:  # the Hub client raises many kinds; all mean "cannot use this name"
            raise DataError(f"cannot load dataset {source!r}: {e}") from None
        streams = [(source, stream, text_column)]
    else:
        streams = []
        for builder, files in source.items():
            options = {"sample_by": "document"} if builder == "text" else {}
            # the text builder makes each .txt file one row, whose only column is "text"
            stream = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **options)
            streams.append((", ".join(files), stream, "text" if builder == "text" else text_column))
    for name, stream, column in streams:
        try:
            for row in stream:
                yield _text(row, name, column)
        except DataError:
            raise
        except Exception as e:  # malformed JSON / parquet surface as builder-specific errors
            raise DataError(f"cannot read {name}: {e}") from None


def _documents_without_datasets(source: dict[str, list[str]] | str, text_column: str) -> Iterator[str]:
    # Minimal reader for machines without `datasets` (the GPU image): plain text and JSON lines only.
    if isinstance(source, str) or "parquet" in source:
        raise DataError("reading a Hub dataset or parquet files needs the `datasets` package: pip install datasets")
    for builder, files in source.items():
        for path in files:
            if builder == "text":
                yield Path(path).read_text(encoding="utf-8")
                continue
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"cannot read {path}: line {number}: {e}") from None
                        yield _text(row, path, text_column)


def _text(row: dict, name: str, column: str) -> str:
    if column not in row:
        raise DataError(f"{name}: a row has no {column!r} column (its columns: {', '.join(row)}); name the one "
                        f"that holds the text with --text-column")
    return row[column]


def blocks(docs: Iterator[str], tokenizer, seq_len: int) -> Iterator[torch.Tensor]:
    """Tokenize documents and pack them, EOS-separated, into LongTensor blocks of exactly seq_len ids
    (the tail shorter than one block is dropped)."""
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    buffer: list[int] = []
    while chunk := list(itertools.islice(docs, 64)):  # 64 documents a call: fast tokenizers batch in Rust
        for ids in tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]:
            buffer.extend(ids)
            if sep is not None:
                buffer.append(sep)
        n = len(buffer) // seq_len * seq_len
        for i in range(0, n, seq_len):
            yield torch.tensor(buffer[i : i + seq_len])
        del buffer[:n]


class TextData:
    """Packed blocks of one data source (rows read from their `text_column`): `eval_blocks` (held out) and an
    endless training stream of batches that cycles over the data (epochs) and can start at a saved position."""

    def __init__(self, spec: str | Path, tokenizer, seq_len: int, eval_tokens: int, text_column: str = "text"):
        self.source = resolve(spec)
        self.tokenizer, self.seq_len, self.text_column = tokenizer, seq_len, text_column
        n_eval = max(1, -(-eval_tokens // seq_len))
        if self.source.eval is not None:
            self.eval_blocks = list(itertools.islice(self._blocks(self.source.eval), n_eval))
            self.skip = 0
            if not self.eval_blocks:
                raise DataError(f"evaluation data is shorter than one sequence of {seq_len} tokens")
            if next(self._blocks(self.source.train), None) is None:
                raise DataError(f"data {self.source.description} is shorter than one sequence of {seq_len} tokens")
        else:
            head = list(itertools.islice(self._blocks(self.source.train), n_eval + 1))
            if len(head) < 2:
                raise DataError(
                    f"data {self.source.description} is shorter than "
                    f"{'one sequence' if not head else 'two sequences (one is held out for evaluation)'}"
                    f" of {seq_len} tokens"
                )
            # Small data: hold out a tenth, at least one block, and train on the rest.
            self.skip = n_eval if len(head) > n_eval else max(1, len(head) // 10)
            self.eval_blocks = head[: self.skip]

    def held_out(self) -> tuple[str, list[str]]:
        """What is held out, in words, and warnings: held-out text too small to measure on, or (held out from
        the head of local training text) a large share of the data, counted up to HELD_OUT_SHARE_WARN."""
        tokens = len(self.eval_blocks) * self.seq_len
        warnings = []
        if tokens < MIN_EVAL_TOKENS:
            warnings.append(f"only {tokens:,} held-out tokens: the perplexities and sparsity measured on them are "
                            f"noisy (set --eval-tokens, or give a folder with a valid* file)")
        if self.source.eval is not None:
            return f"held out: {tokens:,} tokens of {self.source.description_of(self.source.eval)}", warnings
        what = f"held out: the first {tokens:,} tokens of {self.source.description}; training starts after them"
        if not isinstance(self.source.train, str):  # local: count the rest, as far as the share that warns
            limit = round(len(self.eval_blocks) * (1 / HELD_OUT_SHARE_WARN - 1))
            rest = sum(1 for _ in itertools.islice(self._blocks(self.source.train), self.skip + limit)) - self.skip
            if rest < limit:
                share = len(self.eval_blocks) / (len(self.eval_blocks) + rest)
                warnings.append(f"the held-out text is {100 * share:.0f}% of the data, never trained on: lower "
                                f"--eval-tokens or give a folder with a valid* file")
        return what, warnings

    def _blocks(self, source) -> Iterator[torch.Tensor]:
        return blocks(documents(source, self.text_column), self.tokenizer, self.seq_len)

    def train_batches(self, batch_size: int, start: int = 0, rank: int = 0, world: int = 1, *,
                      shuffle_buffer: int = 0, seed: int = 0) -> Iterator[torch.Tensor]:
        """Endless [batch_size, seq_len] batches. Batch i (counted over all ranks) goes to rank i % world;
        `start` is the number of batches already consumed (all ranks), to resume where training stopped.
        With `shuffle_buffer` > 0, blocks pass through a buffer of that many blocks drawn at random (seeded:
        every rank and a resumed run see the same order), so that batches mix documents of the whole
        stream instead of following the files' order."""

        def epochs():
            while True:
                yield from itertools.islice(self._blocks(self.source.train), self.skip, None)

        stream = _shuffled(epochs(), shuffle_buffer, seed) if shuffle_buffer > 0 else epochs()
        yield from itertools.islice(_batched(stream, batch_size), start + rank, None, world)


def _shuffled(stream: Iterator[torch.Tensor], buffer_size: int, seed: int) -> Iterator[torch.Tensor]:
    rng = random.Random(seed)
    buffer = list(itertools.islice(stream, buffer_size))
    for block in stream:  # endless: each new block takes the place of a random one, which goes out
        i = rng.randrange(len(buffer))
        yield buffer[i]
        buffer[i] = block


def _batched(stream: Iterator[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    while True:  # the stream is endless
        yield torch.stack(list(itertools.islice(stream, batch_size)))
