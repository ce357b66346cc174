"""Tiny random models of every supported family, and a byte-level tokenizer that fits their vocabulary,
built offline in well under a second; shared by the tests of all stages."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import signal
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from sparsify.families import FAMILIES

# 256 byte tokens, then the specials: ids 256, 257, 258.
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
VOCAB_SIZE = 260
# twell.training.head_loss.CHUNK_BYTES where a test's micro-batches must take the chunked LM head: 5 tokens a chunk
# (the default's 256 MiB would hold a test's whole logits, which then take transformers' loss)
SMALL_CHUNK_BYTES = 4 * VOCAB_SIZE * 5
CHUNKED_CALLS = "chunked LM-head calls:"  # what tests/chunked_cli.py prints at exit before a process's count
HIDDEN, INTERMEDIATE, LAYERS = 64, 160, 2


def chunked_calls(stdout: str) -> list[int]:
    """Each process's count of chunked LM-head calls, as tests/chunked_cli.py prints them at exit."""
    return [int(n) for n in re.findall(re.escape(CHUNKED_CALLS) + r" (\d+)", stdout)]


@functools.cache
def _tokenizer_object() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in (BOS, EOS, PAD):
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (any text, no unknown tokens) with ids below VOCAB_SIZE."""
    return PreTrainedTokenizerFast(tokenizer_object=_tokenizer_object(), bos_token=BOS, eos_token=EOS, pad_token=PAD)


def tiny_config(family: str, **overrides):
    """A 2-layer config of `family` (a key of sparsify.families.FAMILIES) with the original SiLU/GELU gate."""
    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN // 4,
        max_position_embeddings=128,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return AutoConfig.for_model(family, **kwargs)


def tiny_model(family: str, *, seed: int = 0, **overrides):
    """(model, tokenizer): a random fp32 CPU model of `family` in eval mode and the tiny tokenizer."""
    assert family in FAMILIES, family
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    return model.eval(), tiny_tokenizer()


def tiny_input_ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=generator)


def head_loss_inputs_on_gpu(teacher: bool):
    """A head-loss problem at a real vocabulary (49152) with a partial last chunk of 1024 tokens, on the GPU:
    hidden [3000, 256] and the head weight (both requiring grad), labels (every 7th -100), and the teacher's
    (hidden, weight) or (None, None)."""
    generator = torch.Generator("cuda").manual_seed(0)
    tokens, dim, vocab = 3000, 256, 49152
    hidden, weight, teacher_hidden, teacher_weight = (
        torch.randn(*shape, generator=generator, device="cuda") / dim ** 0.25
        for shape in ((tokens, dim), (vocab, dim), (tokens, dim), (vocab, dim)))
    hidden.requires_grad_(), weight.requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device="cuda")
    labels[::7] = -100
    return hidden, weight, labels, (teacher_hidden, teacher_weight) if teacher else (None, None)


def poison(t: torch.Tensor, allocations: list) -> torch.Tensor:
    """t filled with NaN (integers: 987654), its shape appended to `allocations`."""
    allocations.append(tuple(t.shape))
    return t.fill_(float("nan") if t.dtype.is_floating_point else 987654)


class PoisonedTorch:
    """torch as a kernel module sees it, except that torch.empty and torch.empty_like come back poisoned."""

    def __init__(self, allocations: list):
        self.allocations = allocations

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        return poison(torch.empty(*args, **kwargs), self.allocations)

    def empty_like(self, *args, **kwargs):
        return poison(torch.empty_like(*args, **kwargs), self.allocations)


def poison_allocations(monkeypatch, *modules: str) -> list:
    """Makes the buffers that the named kernel modules allocate start poisoned (PoisonedTorch), so that an
    element a kernel leaves unwritten fails a test instead of holding whatever the allocator returned; returns
    the list of the poisoned allocations' shapes."""
    allocations = []
    for name in modules:
        monkeypatch.setattr(sys.modules[name], "torch", PoisonedTorch(allocations))
    return allocations


def load_benchmark(relative_path: str):
    """A script under benchmarks/ (no package) imported as a module, under its file name, with its folder on
    sys.path as when it runs (its sibling modules import)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / relative_path
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def unwritable_folder(where: Path, monkeypatch):
    """A folder `where`/locked that cannot be written (mode 0o555; as root, which writes anywhere, through
    sparsify.locations' write probe refused there as for another user), restored afterwards."""
    from sparsify import locations

    locked = where / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:
        real = locations.tempfile.mkdtemp

        def mkdtemp(*args, dir=None, **kwargs):
            if dir is not None and Path(dir) == locked:
                raise PermissionError(13, "Permission denied")
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(locations.tempfile, "mkdtemp", mkdtemp)
    try:
        yield locked
    finally:
        locked.chmod(0o755)


class Killed(BaseException):
    """A kill: no handler of errors (Exception) sees it."""


def interrupt() -> None:
    """Ctrl-C, as the terminal sends it."""
    os.kill(os.getpid(), signal.SIGINT)


def raising(error: BaseException):
    """An action (see on_read) that raises `error`."""
    def fail():
        raise error

    return fail


def on_read(next_batch, at: int, action):
    """TrainingBatches.__next__ through `next_batch`, calling `action()` first on the read that has `at` reads
    before it (an action that raises fails that read)."""
    reads = []

    @functools.wraps(next_batch)
    def read(self):
        if len(reads) == at:
            action()
        reads.append(None)
        return next_batch(self)

    return read


class CountingTokenizer:
    """The tiny tokenizer, recording the texts it tokenizes."""

    def __init__(self):
        self.tokenizer, self.texts = tiny_tokenizer(), []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, texts, **kwargs):
        self.texts += texts
        return self.tokenizer(texts, **kwargs)


def sibling(module_name: str, name: str):
    """The module `name` beside module `module_name` in its package (a checkpoint's copy of the files, or twell)."""
    return sys.modules[f"{module_name.rpartition('.')[0]}.{name}"]


def batched_from(monkeypatch, module_name: str, tokens: int) -> None:
    """The kernels of the package holding module `module_name` take the batched path from `tokens` tokens a call
    (its paths.decode_rows): the interpreter runs a batched program a row, so that fewer rows make a faster test."""
    monkeypatch.setattr(sibling(module_name, "paths"), "decode_rows", lambda d, width: tokens - 1)


def decoder_unfused(monkeypatch, module_name: str) -> None:
    """The norms, rotary and attention projections of the package holding module `module_name` run transformers'
    modules, as where Triton is missing: for tests of the MLPs, which the interpreter's norms (a program a token)
    would slow down."""
    monkeypatch.setattr(sibling(module_name, "decoder"), "use_triton", lambda x: False)
