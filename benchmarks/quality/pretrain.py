"""The quality pipeline's base model: a byte-level BPE tokenizer and a SiLU Llama pretrained from scratch.

The pretraining is recipes/make_demo.py's loop at other sizes: the train split read in epochs of shuffled windows,
the best held-out loss kept. A long one spans several invocations of a time-limited machine: it saves its state
into the work folder every --pretrain-save-every steps (or after --pretrain-stop-after steps of this invocation, then
stops) and the same command resumes it, with the same result. The tokenizer and the token ids are kept in the work
folder meanwhile, so that a resumed run neither retrains nor re-reads them.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from recipes import make_demo  # noqa: E402  (the demo's tokenizer and pretraining, at other sizes)

from corpus import read_texts  # noqa: E402

PAUSED = 75  # the exit status of an invocation that paused the pretraining (EX_TEMPFAIL): run it again


class PretrainingPaused(Exception):
    """The pretraining stopped after --pretrain-stop-after steps with its state saved: the same command resumes it."""


def tokenizer(args, work: Path, texts: list[str]):
    """The tokenizer in WORK/tokenizer, trained there on the first --tokenizer-mb of `texts` unless it exists
    (written to a temporary folder and renamed into place)."""
    from transformers import AutoTokenizer

    folder = work / "tokenizer"
    if not folder.is_dir():
        sample, size = [], 0
        for text in texts:
            if size >= args.tokenizer_mb * 1e6:
                break
            sample.append(text)
            size += len(text)
        tmp = folder.with_name("tokenizer.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_demo.train_tokenizer(sample, args.vocab, tmp, max_length=args.seq_len)
        tmp.rename(folder)
    return AutoTokenizer.from_pretrained(folder)


def token_ids(tok, corpus: Path, cache: Path):
    """The train and held-out splits' token streams, kept in `cache` (int32) until the pretraining ends."""
    import torch

    if cache.is_file():
        saved = torch.load(cache)
        return saved["train"].long(), saved["valid"].long()
    train = make_demo.token_ids(tok, read_texts(corpus / "train.jsonl"))
    valid = make_demo.token_ids(tok, read_texts(corpus / "valid.jsonl"))
    tmp = cache.with_name(cache.name + ".tmp")
    torch.save({"train": train.int(), "valid": valid.int()}, tmp)
    tmp.rename(cache)
    return train, valid


def pretrain_base(args, work: Path, corpus: Path) -> dict:
    """WORK/base pretrained, and its figures; PretrainingPaused where --pretrain-stop-after stopped it."""
    from transformers import LlamaConfig

    tok = tokenizer(args, work, read_texts(corpus / "train.jsonl"))
    cache = work / "pretrain_tokens.pt"
    train, valid = token_ids(tok, corpus, cache)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq_len, hidden_act="silu",
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, rope_theta=10000.0)
    state = work / "pretrain_state.pt"
    result = make_demo.pretrain_llama(
        config, tok, train, valid, work / "base", steps=args.pretrain_steps, minutes=args.pretrain_minutes,
        batch=args.pretrain_batch, seq_len=args.seq_len, lr=args.pretrain_lr, warmup=args.pretrain_warmup,
        eval_every=args.eval_every, device=args.device, seed=args.seed, state_path=state,
        save_every=args.pretrain_save_every, stop_after=args.pretrain_stop_after)
    if result is None:
        raise PretrainingPaused(f"pretraining paused: its state is in {state}; run the same command again to resume it")
    cache.unlink()
    result.update(train_tokens=len(train), valid_tokens=len(valid), vocab=len(tok),
                  config={k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                          "num_attention_heads", "vocab_size")})
    return result
