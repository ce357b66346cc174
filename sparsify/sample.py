"""Training text sampled from the source model, for a conversion with little text of its own.

A conversion's cost follows the share of the source's pretraining tokens it trains on (docs/quality.md), and a user
of a published model holds little of that text; the model can write more of it. `sample` continues prompts, the
heads of --data's training blocks in order (from the first again when they run out), with the source at a
temperature (1: its own distribution, which distillation then fits), a batch at a time through `generate` (on a GPU
with a static KV cache, for which generate compiles the decoding step once: its eager loop is bound by the host's
launches), and writes a data folder that `convert --data` takes: train.jsonl, a document a sample (to its EOS);
valid.jsonl, --data's held-out text, so that evaluation stays on real text; sample.yaml, what made it (YAML: --data
would read a .json as text). With `with_data` --data's training documents go into train.jsonl too, spread evenly
among the samples by tokens. The folder is written beside OUT and renamed into place when complete
(export.staged_output). The settings are checked against the source's config before any weight is read.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from typing import Callable, Iterator

import torch
import yaml
from transformers.generation.streamers import BaseStreamer

from .config import SampleOptions
from .data import Packer, TextData
from .errors import DataError
from .export import staged_output
from .load import check_device, load_config, load_model, require_tokenizer
from .locations import SAMPLE_DATA_REQUIRED, check_output_dir, demo_corpus_path
from .report import token_progress

# --batch-size where unset: on a CPU a fixed count; on a GPU as many samples as half its free memory holds the caches
# of, up to a cap past which a step's host overhead, which batching spreads, is a small part of it
CPU_BATCH, GPU_BATCH_MAX, GPU_MEMORY_SHARE = 32, 1024, 0.5
# The source's own distribution: every setting that a model's generation_config may carry to reshape it, neutral
# (generate fills a setting left None from the model's generation_config).
UNWARPED = dict(do_sample=True, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
                repetition_penalty=1.0, no_repeat_ngram_size=0)


def prompts(text: TextData, prompt_tokens: int) -> Iterator[torch.Tensor]:
    """Endless: the first `prompt_tokens` ids of each training block of `text`, in order, from the first again after
    the last."""
    while True:
        yield from (block[:prompt_tokens] for block in text.training_blocks())


class DrawnTokens(BaseStreamer):
    """generate's streamer that calls `advance` with a batch's ids as they are drawn: the prompts, then at each step
    one id for each sample that has not reached its EOS, which is what `samples` keeps of them."""

    def __init__(self, advance: Callable[[int], None], eos: int | None):
        self.advance, self.eos, self.live = advance, eos, None

    def put(self, value: torch.Tensor) -> None:
        if self.live is None:  # the prompts
            self.live = torch.ones(value.shape[0], dtype=torch.bool)
            self.advance(value.numel())
            return
        if self.eos is not None:
            self.live &= value.view(-1).cpu() != self.eos
        self.advance(int(self.live.sum()))

    def end(self) -> None:
        self.live = None


@torch.no_grad()
def samples(model, prompts: Iterator[torch.Tensor], tokens: int, seq_len: int, batch_size: int, temperature: float,
            eos: int | None, cache: str = "dynamic", advance: Callable[[int], None] | None = None
            ) -> Iterator[list[int]]:
    """Samples of the model, token ids with their prompt, each up to seq_len ids or to its EOS (left out), until
    `tokens` ids are drawn; generate's KV `cache` "dynamic" or "static" (every batch of one shape: compiled once);
    `advance` is called with the ids as they are drawn (DrawnTokens), a batch's before its samples are yielded."""
    drawn = 0
    while drawn < tokens:
        batch = torch.stack([next(prompts) for _ in range(batch_size)]).to(model.device)
        out = model.generate(batch, attention_mask=torch.ones_like(batch), temperature=temperature, **UNWARPED,
                             max_new_tokens=seq_len - batch.shape[1], eos_token_id=eos,
                             pad_token_id=0 if eos is None else eos, cache_implementation=cache,
                             streamer=None if advance is None else DrawnTokens(advance, eos))
        for row in out.tolist():
            head, tail = row[:batch.shape[1]], row[batch.shape[1]:]
            ids = head + (tail[:tail.index(eos)] if eos in tail else tail)
            drawn += len(ids)
            yield ids
            if drawn >= tokens:
                return


def fitted_batch(config, options: SampleOptions, dtype: torch.dtype, free_bytes: int | None) -> int:
    """options.batch_size, or where unset the batch that fits (CPU_BATCH without a GPU's `free_bytes`): a sample
    holds its static KV cache of options.seq_len positions and a step's logits with their fp32 copies; never more
    samples than options.tokens takes."""
    if options.batch_size is not None:
        return options.batch_size
    needed = -(-options.tokens // options.seq_len)
    if free_bytes is None:
        return min(CPU_BATCH, needed)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    cached = config.num_hidden_layers * 2 * kv_heads * head_dim  # a token's keys and values over the layers
    per_sample = cached * options.seq_len * dtype.itemsize + 4 * 4 * config.vocab_size
    return max(1, min(GPU_BATCH_MAX, needed, int(GPU_MEMORY_SHARE * free_bytes // per_sample)))


def sample(source: str, options: SampleOptions) -> dict:
    """Writes the data folder OUT (module docstring) of `options.tokens` tokens sampled from `source`; returns
    sample.yaml's record."""
    out = check_output_dir(options.out, options.overwrite)
    check_device(options.device)
    config, _ = load_config(source)  # a wrong source named first, as in convert
    data = options.data or (str(demo_corpus_path()) if source == "demo" else None)
    if data is None:
        raise DataError(SAMPLE_DATA_REQUIRED)
    positions = getattr(config, "max_position_embeddings", None)
    options = options.fit_seq_len(positions)
    options.validate(positions)
    model, tokenizer, _ = load_model(source, device=options.device, config=config)
    require_tokenizer(tokenizer, source, config)
    on_gpu = model.device.type == "cuda"
    free = torch.cuda.mem_get_info(model.device)[0] if on_gpu else None
    options = replace(options, batch_size=fitted_batch(config, options, model.dtype, free))
    text = TextData(data, tokenizer, options.seq_len, options.eval_tokens, options.text_column)
    if next(text.training_blocks(), None) is None:
        raise DataError(f"data {data}: no training block of {options.seq_len} tokens after its held-out text (give "
                        f"more text or a lower --seq-len)")
    torch.manual_seed(options.seed)
    eos = tokenizer.eos_token_id
    cache = "static" if on_gpu else "dynamic"
    started, counts = time.perf_counter(), {"samples": 0, "sampled_tokens": 0, "ended_at_eos": 0, "data_tokens": 0}
    data_docs = text.training_documents() if options.with_data else iter(())
    data_share = 0.0
    if options.with_data:
        data_share = text.training_tokens()[0] / options.tokens  # data tokens a sampled token
    separator = len(Packer(tokenizer, options.seq_len).sep)  # the ids packing adds after a document
    with staged_output(out) as staging, open(staging / "train.jsonl", "w") as train, \
            token_progress(options.tokens, "sampling") as advance:
        def write(document: str, kind: str) -> None:
            train.write(json.dumps({"text": document, "source": kind}) + "\n")

        def write_data() -> bool:
            """Writes --data's next training document and counts its packed ids; False where none is left."""
            document = next(data_docs, None)
            if document is None:
                return False
            write(document, "data")
            counts["data_tokens"] += len(tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"])
            counts["data_tokens"] += separator
            return True

        for ids in samples(model, prompts(text, options.prompt_tokens), options.tokens, options.seq_len,
                           options.batch_size, options.temperature, eos, cache, advance):
            write(tokenizer.decode(ids, skip_special_tokens=True), "sample")  # a BOS or PAD drawn is no text
            counts["samples"] += 1
            counts["sampled_tokens"] += len(ids)
            counts["ended_at_eos"] += len(ids) < options.seq_len
            while counts["data_tokens"] < data_share * counts["sampled_tokens"] and write_data():
                pass
        while write_data():
            pass
        held_out = text.held_out_documents()
        (staging / "valid.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in held_out))
        seconds = time.perf_counter() - started
        record = {"source": source, "data": data, **{k: v for k, v in asdict(options).items()
                                                     if k not in ("out", "data", "overwrite", "device")},
                  **counts, "held_out_documents": len(held_out), "seconds": round(seconds, 1),
                  "sampled_tokens_per_s": round(counts["sampled_tokens"] / seconds, 1), "device": str(model.device),
                  "cache": cache}
        (staging / "sample.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    return record

