"""Training and evaluation text: local .txt / .jsonl / .parquet files (or a folder of them) or a
`datasets` Hub name (NAME[:CONFIG][@SPLIT]), streamed, tokenized and packed into fixed blocks of `seq_len` token ids
with the tokenizer's EOS between documents (labels = inputs: Hugging Face models shift them internally).

Evaluation text is never trained on: in a folder, files whose name starts with valid/validation/eval/test
(like the demo corpus's valid.jsonl) are held out whole; otherwise (single files, Hub datasets) the first
blocks of the training stream are held out and every epoch of training starts after them. A .txt file is one
document; .jsonl/.parquet rows and Hub dataset rows are documents, read from their `text_column` ("text" unless
given). The `datasets` library is imported lazily, so checkpoints and `analyze` with local files still work
where it is missing.

The training stream (TrainingBatches) has a position, saved with an interrupted run's state: the documents read
so far, the tokens read but not yet packed, and the shuffle buffer with its RNG. A resumed run continues from it
without reading or tokenizing the consumed text again.
"""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Iterator

import torch

from .errors import DataError
from .locations import hub_arguments, resolve_data

MIN_EVAL_TOKENS = 16384  # fewer held-out tokens measure perplexity and sparsity too noisily
HELD_OUT_SHARE_WARN = 0.2  # warn when the head held out of the training text is at least this share of it
PASSES_COUNTED = 2**22  # local training text is counted up to this many tokens to tell a run's passes over it
TOKENS_SAMPLED = 2**16  # beyond this many tokens, the text's length is read and its tokens estimated (count_blocks)
TOKENS_COUNTED = 2**40  # training_tokens counts (estimates) the whole text, up to this many tokens


class Documents:
    """The texts of a source's documents in order, rows' from their `text_column`, read from `position` (a
    `state_dict()` of an earlier Documents of the same source; None: the start). Each iteration reads the source
    again from there; `state_dict()` is the position after the documents yielded so far. With `datasets`, a position
    is the part of the source (a builder's files, or the Hub dataset) and the IterableDataset's own state_dict in
    it: datasets skips the files (shards) before it unread and reads the rows before it in its file without
    yielding them. Without `datasets`, it is the file and the byte offset in it."""

    def __init__(self, source: dict[str, list[str]] | str, text_column: str = "text", position: dict | None = None):
        self.source, self.text_column = source, text_column
        self.position = position or {}
        self._reading = None  # the IterableDataset being read: its position is asked for only when needed

    def state_dict(self) -> dict:
        if self._reading is not None:
            return {**self.position, "rows": self._reading.state_dict()}
        return dict(self.position)

    def __iter__(self) -> Iterator[str]:
        try:
            import datasets
        except ImportError:
            return self._without_datasets()
        return self._with_datasets(datasets)

    def _check_reader(self, reader: str) -> None:
        if self.position.get("reader", reader) != reader:
            raise DataError("--resume: the saved data position was read "
                            f"{'without' if reader == 'datasets' else 'with'}"
                            " the `datasets` package installed; resume where it was saved, or start again")

    def _with_datasets(self, datasets) -> Iterator[str]:
        self._check_reader("datasets")
        # critical: its builders log each read error that they then raise, which DataError says below
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
        datasets.disable_progress_bars()
        streams = self._streams(datasets)
        first = self.position.get("stream", 0)
        for index in range(first, len(streams)):
            name, stream, column = streams[index]
            if index == first and "rows" in self.position:
                stream.load_state_dict(self.position["rows"])
            self.position, self._reading = {"reader": "datasets", "stream": index}, stream
            try:
                for row in stream:
                    yield _text(row, name, column)
            except DataError:
                raise
            except Exception as e:  # malformed JSON / parquet surface as builder-specific errors
                raise DataError(f"cannot read {name}: {e}") from None
        self.position, self._reading = {"reader": "datasets", "stream": len(streams)}, None

    def _streams(self, datasets) -> list[tuple[str, object, str]]:
        """(name, IterableDataset, text column) of each part of the source: the Hub dataset, or per builder its
        files."""
        if isinstance(self.source, str):
            try:
                name, config, split = hub_arguments(self.source)
                return [(self.source, datasets.load_dataset(name, config, split=split, streaming=True),
                         self.text_column)]
            except Exception as e:  # the Hub client raises many kinds; all mean "cannot use this name"
                raise DataError(f"cannot load dataset {self.source!r}: {e}") from None
        streams = []
        # Each load of a builder asks the Hub to count a download (where the network is cut off, it waits for that
        # request to time out), and every epoch loads the files again: local files are no download.
        counts = getattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", False)
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
        try:
            for builder, files in self.source.items():
                options = {"sample_by": "document"} if builder == "text" else {}
                # the text builder makes each .txt file one row, whose only column is "text"
                try:
                    stream = datasets.load_dataset(builder, data_files=files, split="train", streaming=True,
                                                   **options)
                except Exception as e:  # a parquet file's schema is read here: a corrupt one fails at once
                    raise DataError(f"cannot read {', '.join(files)}: {e}") from None
                streams.append((", ".join(files), stream, "text" if builder == "text" else self.text_column))
        finally:
            datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts
        return streams

    def _without_datasets(self) -> Iterator[str]:
        # Minimal reader for environments without `datasets`: plain text and JSON lines only.
        self._check_reader("plain")
        if isinstance(self.source, str) or "parquet" in self.source:
            raise DataError("reading a Hub dataset or parquet files needs the `datasets` package: pip install datasets")
        files = [(builder, path) for builder, paths in self.source.items() for path in paths]
        start = self.position.get("file", 0)
        for index in range(start, len(files)):
            builder, path = files[index]
            if builder == "text":
                self.position = {"reader": "plain", "file": index + 1}
                yield Path(path).read_text(encoding="utf-8")
                continue
            resumed = index == start and "offset" in self.position
            offset, number = (self.position["offset"], self.position["line"]) if resumed else (0, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                for line in f:
                    offset, number = offset + len(line), number + 1
                    self.position = {"reader": "plain", "file": index, "offset": offset, "line": number}
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"cannot read {path}: line {number}: {e}") from None
                        yield _text(row, f"{path}: line {number}", self.text_column)
        self.position = {"reader": "plain", "file": len(files)}


def _text(row, name: str, column: str) -> str:
    if not isinstance(row, dict):
        raise DataError(f"{name}: a row is {type(row).__name__}, not an object with a {column!r} column")
    if column not in row:
        raise DataError(f"{name}: a row has no {column!r} column (its columns: {', '.join(row)}); name the one "
                        f"that holds the text with --text-column")
    text = row[column]
    if not isinstance(text, str):
        raise DataError(f"{name}: a row's {column!r} is {type(text).__name__} ({str(text)[:40]!r}), not text")
    return text


DOCUMENTS_A_CALL = 64  # documents tokenized together: fast tokenizers batch them in Rust


class Packer:
    """Tokenizes documents and packs them, EOS-separated, into LongTensor blocks of exactly seq_len ids. `pending`
    holds the ids read but not yet in a block (a tensor that is replaced, never written into)."""

    def __init__(self, tokenizer, seq_len: int):
        self.tokenizer, self.seq_len = tokenizer, seq_len
        sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
        self.sep = [] if sep is None else [sep]
        self.pending = torch.zeros(0, dtype=torch.long)

    def blocks(self, docs: Iterator[str]) -> Iterator[torch.Tensor]:
        """The blocks of `pending` and then of `docs` (the tail shorter than one block stays pending)."""
        while True:
            while len(self.pending) >= self.seq_len:
                # a copy: a view would keep the whole chunk's ids alive (in a shuffle buffer, in a saved state)
                block, self.pending = self.pending[: self.seq_len].clone(), self.pending[self.seq_len :]
                yield block
            chunk = list(itertools.islice(docs, DOCUMENTS_A_CALL))
            if not chunk:
                return
            encoded = self.tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]
            self.pending = torch.cat([self.pending, torch.tensor([i for ids in encoded for i in [*ids, *self.sep]],
                                                                 dtype=torch.long)])


def blocks(docs: Iterator[str], tokenizer, seq_len: int) -> Iterator[torch.Tensor]:
    """Tokenize documents and pack them, EOS-separated, into LongTensor blocks of exactly seq_len ids
    (the tail shorter than one block is dropped)."""
    return Packer(tokenizer, seq_len).blocks(docs)


def too_short(description: str, part, text_column: str, tokenizer, wanted: str) -> DataError:
    """The error for text that packs into fewer blocks than `wanted` ("one sequence of 256 tokens"): its documents
    and tokens as packing counts them (a separator after each), and whether all of it is whitespace."""
    texts = list(Documents(part, text_column))
    packer = Packer(tokenizer, 2 ** 62)  # one block that never fills: pending ends holding every id
    for _ in packer.blocks(iter(texts)):
        pass
    blank = ", all of it whitespace" if texts and not any(text.strip() for text in texts) else ""
    return DataError(f"data {description} holds {len(texts):,} document{'s' * (len(texts) != 1)} of "
                     f"{len(packer.pending):,} tokens{blank}: shorter than {wanted}")


def measured_blocks(spec: str | Path, tokenizer, seq_len: int, tokens: int, text_column: str = "text"
                    ) -> tuple[list[torch.Tensor], str]:
    """Blocks of up to `tokens` (whole blocks: rounded up) to measure a model on, and the files (or Hub name) they
    were read from: a folder's held-out files where it has them, else the head of the text (all of it where it
    holds fewer, as nothing is trained on it). DataError where it holds less than one block."""
    source = resolve_data(spec)
    part = source.eval if source.eval is not None else source.train
    found = list(itertools.islice(blocks(iter(Documents(part, text_column)), tokenizer, seq_len),
                                  max(1, -(-tokens // seq_len))))
    read = source.description_of(part)
    if not found:
        raise too_short(read, part, text_column, tokenizer, f"one sequence of {seq_len} tokens")
    return found, read


class TextData:
    """Packed blocks of one data source (rows read from their `text_column`): `eval_blocks` (held out) and an
    endless training stream of batches that cycles over the data (epochs) and can start at a saved position."""

    def __init__(self, spec: str | Path, tokenizer, seq_len: int, eval_tokens: int, text_column: str = "text"):
        self.source = resolve_data(spec)
        self.tokenizer, self.seq_len, self.text_column = tokenizer, seq_len, text_column
        self.eval_tokens = eval_tokens  # as asked for: the text may hold fewer
        n_eval = max(1, -(-eval_tokens // seq_len))
        if self.source.eval is not None:
            self.eval_blocks = list(itertools.islice(self._blocks(self.source.eval), n_eval))
            self.skip = 0
            if not self.eval_blocks:
                raise self._too_short(self.source.eval, f"one sequence of {seq_len} tokens")
            if next(self._blocks(self.source.train), None) is None:
                raise self._too_short(self.source.train, f"one sequence of {seq_len} tokens")
        else:
            head = list(itertools.islice(self._blocks(self.source.train), n_eval + 1))
            if len(head) < 2:
                wanted = "one sequence" if not head else "two sequences (one is held out for evaluation)"
                raise self._too_short(self.source.train, f"{wanted} of {seq_len} tokens")
            # Small data: hold out a tenth, at least one block, and train on the rest.
            self.skip = n_eval if len(head) > n_eval else max(1, len(head) // 10)
            self.eval_blocks = head[: self.skip]

    def held_out(self, train_tokens: int | None = None) -> tuple[str, list[str]]:
        """What is held out, in words, and warnings: fewer held-out tokens than asked for (the text is short) and
        too few to measure on; for local training text, counted as far as needed (count_blocks: beyond
        TOKENS_SAMPLED tokens, an estimate, said as such), a large held-out head (at least HELD_OUT_SHARE_WARN of the
        data) and a run of `train_tokens` that passes over the text more than once (counted up to PASSES_COUNTED
        tokens)."""
        tokens = len(self.eval_blocks) * self.seq_len
        warnings = []
        if tokens < min(MIN_EVAL_TOKENS, self.eval_tokens):
            more = ("give more held-out text" if self.source.eval is not None else
                    "give more text, or a folder with a valid* file")
            warnings.append(f"only {tokens:,} held-out tokens (of --eval-tokens {self.eval_tokens:,}): the "
                            f"perplexities and sparsity measured on them are noisy ({more})")
        if self.source.eval is not None:
            what = f"held out: {tokens:,} tokens of {self.source.description_of(self.source.eval)}"
        else:
            what = f"held out: the first {tokens:,} tokens of {self.source.description}; training starts after them"
        if isinstance(self.source.train, str):  # a Hub dataset: streamed, not counted
            return what, warnings
        share_limit = (0 if self.source.eval is not None  # the head's share: where the head is held out
                       else round(len(self.eval_blocks) * (1 / HELD_OUT_SHARE_WARN - 1)))
        run_blocks = -(-min(train_tokens or 0, PASSES_COUNTED) // self.seq_len)
        limit = max(share_limit, run_blocks)
        counted, estimated = self.count_blocks(self.skip + limit)
        rest = counted - self.skip
        about = "about " if estimated else ""
        if rest < share_limit:
            share = len(self.eval_blocks) / (len(self.eval_blocks) + rest)
            warnings.append(f"the held-out text is {about}{100 * share:.0f}% of the data, never trained on: lower "
                            f"--eval-tokens or give a folder with a valid* file")
        if rest < run_blocks:  # the text ended before the run's tokens
            how = " (estimated from its length at the tokens per character of its start)" if estimated else ""
            warnings.append(f"the training text holds {about}{rest * self.seq_len:,} tokens{how} and the run trains on "
                            f"{train_tokens:,}: {about}{train_tokens / (rest * self.seq_len):,.1f} passes over it "
                            f"(several pay on a small text: docs/quality.md; if unintended, lower --tokens or "
                            f"--steps, or give more text)")
        return what, warnings

    def count_blocks(self, limit: int, exact_tokens: int | None = None) -> tuple[int, bool]:
        """(blocks, estimated): the training text's blocks, counted as far as `limit`. Its first `exact_tokens`
        (TOKENS_SAMPLED unless given) tokens (and at least the held-out head and a block, so that an estimate leaves a
        block to train on) are tokenized and counted; beyond, the rest of the text is only read (tokenizing it would
        delay the start), its characters counted at the tokens per character of the part tokenized (estimated:
        True)."""
        characters = 0

        def counted(docs: Iterator[str]) -> Iterator[str]:
            nonlocal characters
            for doc in docs:
                characters += len(doc)
                yield doc

        docs, packer = iter(Documents(self.source.train, self.text_column)), Packer(self.tokenizer, self.seq_len)
        sampled = min(limit, max(self.skip + 1, (exact_tokens or TOKENS_SAMPLED) // self.seq_len))
        blocks = sum(1 for _ in itertools.islice(packer.blocks(counted(docs)), sampled))
        if blocks < sampled or blocks >= limit:  # the whole text, or as far as asked
            return blocks, False
        tokens_per_character = (blocks * self.seq_len + len(packer.pending)) / max(characters, 1)
        for _ in counted(docs):
            if characters * tokens_per_character >= limit * self.seq_len:
                break
        return min(limit, int(characters * tokens_per_character) // self.seq_len), True

    def training_tokens(self) -> tuple[int, bool]:
        """(tokens, estimated): the training text's tokens after its held-out head, in whole blocks, counted
        (count_blocks: exactly up to PASSES_COUNTED tokens, beyond estimated from the text's length at the tokens per
        character of those, estimated True). The whole text is read: local text, not a Hub dataset."""
        blocks, estimated = self.count_blocks(TOKENS_COUNTED // self.seq_len, PASSES_COUNTED)
        return (blocks - self.skip) * self.seq_len, estimated

    def training_blocks(self) -> Iterator[torch.Tensor]:
        """The training text's blocks once, in order, after its held-out head (an epoch of the stream, unshuffled)."""
        return itertools.islice(self._blocks(self.source.train), self.skip, None)

    def training_documents(self) -> Iterator[str]:
        """The training text's documents once, in order, after its held-out head: where the head of the text is held
        out (no valid* file), the documents within it are left out and the one it cuts keeps its tail. Packed, they
        give training_blocks()."""
        if self.source.eval is not None:
            return iter(Documents(self.source.train, self.text_column))
        return self._split_documents(self.source.train, self.skip * self.seq_len)[1]

    def held_out_documents(self) -> list[str]:
        """The documents that the held-out blocks hold, the last cut where they end. Packed, they give eval_blocks."""
        source = self.source.train if self.source.eval is None else self.source.eval
        return self._split_documents(source, len(self.eval_blocks) * self.seq_len)[0]

    def _split_documents(self, source, tokens: int) -> tuple[list[str], Iterator[str]]:
        """(head, rest): the documents of `source` that hold its first `tokens` packed ids, the one that their end
        cuts in two among them as its part before the cut, and the documents after them (the cut one's part after
        it first)."""
        docs, sep, head = iter(Documents(source, self.text_column)), Packer(self.tokenizer, self.seq_len).sep, []
        for doc in docs:
            if not tokens:
                return head, itertools.chain([doc], docs)
            ids = self.tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]
            if len(ids) + len(sep) <= tokens:
                head.append(doc)
                tokens -= len(ids) + len(sep)
                continue
            before, after = ids[:tokens], ids[tokens:]
            head += [self.tokenizer.decode(before)] if before else []
            return head, itertools.chain([self.tokenizer.decode(after)] if after else [], docs)
        return head, iter(())

    def _too_short(self, part, wanted: str) -> DataError:
        return too_short(self.source.description_of(part), part, self.text_column, self.tokenizer, wanted)

    def _blocks(self, source) -> Iterator[torch.Tensor]:
        return blocks(iter(Documents(source, self.text_column)), self.tokenizer, self.seq_len)

    def train_batches(self, batch_size: int, start: int = 0, rank: int = 0, world: int = 1, *,
                      shuffle_buffer: int = 0, seed: int = 0) -> TrainingBatches:
        """Endless [batch_size, seq_len] batches. Batch i (counted over all ranks) goes to rank i % world;
        `start` is the number of batches already consumed (all ranks), skipped by reading them, unless a saved
        position is loaded (TrainingBatches.load_state_dict), which reads none of them again.
        With `shuffle_buffer` > 0, blocks pass through a buffer of that many blocks drawn at random (seeded:
        every rank and a resumed run see the same order), so that batches mix documents of the whole
        stream instead of following the files' order."""
        return TrainingBatches(self, batch_size, start, rank, world, shuffle_buffer, seed)


class TrainingBatches:
    """One rank's endless training batches of a TextData (see TextData.train_batches): epochs over the training
    text, each after its held-out head, through the shuffle buffer. `state_dict()` is the position after the
    batches yielded so far over all ranks (the same on every rank: each reads a whole round of `world` batches
    before it yields its own); `load_state_dict(position)`, before the first batch, continues from there without
    reading or tokenizing the consumed documents again."""

    def __init__(self, data: TextData, batch_size: int, start: int, rank: int, world: int, shuffle_buffer: int,
                 seed: int):
        self.data, self.batch_size, self.rank, self.world = data, batch_size, rank, world
        self.start, self.buffer_size, self.rng = start, shuffle_buffer, random.Random(seed)
        self.buffer: list[torch.Tensor] = []
        self.documents = Documents(data.source.train, data.text_column)
        self.packer = Packer(data.tokenizer, data.seq_len)
        self.epoch_blocks = 0  # blocks packed in this epoch, whose first data.skip are held out
        self._batches = None

    def state_dict(self) -> dict:
        # Tensors shared with the stream, which replaces them and never writes into them: a snapshot costs no copy.
        return {"documents": self.documents.state_dict(), "pending": self.packer.pending,
                "epoch_blocks": self.epoch_blocks, "buffer": list(self.buffer), "rng": self.rng.getstate()}

    def load_state_dict(self, position: dict) -> None:
        self.documents = Documents(self.data.source.train, self.data.text_column, position["documents"])
        self.packer.pending, self.epoch_blocks = position["pending"], position["epoch_blocks"]
        self.buffer = list(position["buffer"])
        self.rng.setstate(position["rng"])
        self.start = 0

    def __iter__(self) -> TrainingBatches:
        return self

    def __next__(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = self._rounds()
        return next(self._batches)

    def _rounds(self) -> Iterator[torch.Tensor]:
        blocks = self._shuffled(self._epochs())
        for _ in range(self.start * self.batch_size):
            next(blocks)
        while True:
            batches = [[next(blocks) for _ in range(self.batch_size)] for _ in range(self.world)]
            yield torch.stack(batches[self.rank])

    def _epochs(self) -> Iterator[torch.Tensor]:
        while True:
            for block in self.packer.blocks(iter(self.documents)):
                self.epoch_blocks += 1
                if self.epoch_blocks > self.data.skip:
                    yield block
            # the next epoch reads the text again from its start; this one's tail shorter than a block is dropped
            self.documents = Documents(self.data.source.train, self.data.text_column)
            self.packer, self.epoch_blocks = Packer(self.data.tokenizer, self.data.seq_len), 0

    def _shuffled(self, blocks: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
        if not self.buffer_size:
            yield from blocks
            return
        while len(self.buffer) < self.buffer_size:
            self.buffer.append(next(blocks))
        for block in blocks:  # endless: each new block takes the place of a random one, which goes out
            i = self.rng.randrange(len(self.buffer))
            out, self.buffer[i] = self.buffer[i], block
            yield out
