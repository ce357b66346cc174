"""The static KV cache write (twell.cache_write; interpreter on CPU, bf16 on GPU) against its PyTorch reference,
transformers' StaticLayer.update op for op: equal caches and counts, the written positions NaN before the kernel
runs; new rows as the attention makes them (transposed views), one program and several, a write past the caches'
end. Then the WritingCache that the fused attention forward hands on, over transformers' caches."""
import importlib

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer, StaticSlidingWindowLayer

import twell.decoder
from twell.cache_write import cache_write, cache_write_fits
from twell.decoder import WritingCache, static_update_computes
from twell.reference import cache_write_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CACHE_WRITE = importlib.import_module("twell.cache_write")  # the module: the package's name is the function


def inputs(batch, heads, length, queries, dim, dtype, count, value_dim=None, seed=0):
    """(keys, values, count, key_states, value_states): caches [B, H, L, D] holding random values, NaN at the
    positions the write fills; new rows [B, H, Q, D] viewed from [B, Q, H, D] as the attention's projections give
    them."""
    generator = torch.Generator().manual_seed(seed)
    value_dim = value_dim or dim
    keys, values = (torch.randn(batch, heads, length, d, generator=generator).to(DEV, dtype) for d in (dim, value_dim))
    for cache in (keys, values):
        cache[:, :, count:count + queries] = float("nan")
    new = [torch.randn(batch, queries, heads, d, generator=generator).to(DEV, dtype).transpose(1, 2)
           for d in (dim, value_dim)]
    return keys, values, torch.tensor(count, device=DEV), *new


@pytest.mark.parametrize("batch,heads,length,queries,dim,count,value_dim,dtype", [
    (1, 4, 16, 1, 32, 5, None, torch.float32),  # a decode step
    (2, 3, 9, 3, 24, 0, None, torch.float16),  # three tokens into an empty cache, a head size off the powers of two
    (3, 2, 7, 2, 16, 5, 8, torch.float32),  # filling the cache to its end, values narrower than keys
    (2, 5, 40, 1, 64, 39, None, torch.float16),
])
def test_cache_write_matches_reference(batch, heads, length, queries, dim, count, value_dim, dtype):
    args = inputs(batch, heads, length, queries, dim, dtype, count, value_dim)
    expected = [t.clone() for t in args[:3]]
    cache_write(*args)
    cache_write_reference(*expected, *args[3:])
    assert all(torch.equal(a, b) for a, b in zip(args[:3], expected))
    assert args[2].item() == count + queries


@pytest.mark.parametrize("queries", [1, 2])
def test_cache_write_over_several_programs(queries, monkeypatch):
    """Programs of 4 rows over 3 x 3 x Q rows, the last one short: each writes its rows at the count that all read,
    and the count moves once, by Q."""
    monkeypatch.setattr(CACHE_WRITE, "COPY_ELEMENTS", 64)
    args = inputs(3, 3, 11, queries, 16, torch.float32, 4)
    expected = [t.clone() for t in args[:3]]
    cache_write(*args)
    cache_write_reference(*expected, *args[3:])
    assert all(torch.equal(a, b) for a, b in zip(args[:3], expected))


def test_cache_write_past_the_end_poisons_the_last_position():
    """Where index_copy_ raises (a position past the caches' end), no row is written and each (sequence, head)'s
    last position becomes NaN, so that the attention over the full cache shows it; the count moves as
    transformers' does before it raises."""
    keys, values, count, key_states, value_states = inputs(2, 3, 6, 2, 16, torch.float32, 0)
    keys.normal_(), values.normal_()
    before = keys.clone(), values.clone()
    count.fill_(5)
    with pytest.raises(IndexError):
        cache_write_reference(*[t.cpu().clone() for t in (keys, values, count, key_states, value_states)])
    cache_write(keys, values, count, key_states, value_states)
    assert count.item() == 7
    for cache, old in zip((keys, values), before):
        assert cache[:, :, -1].isnan().all() and torch.equal(cache[:, :, :-1], old[:, :, :-1])


def test_cache_write_fits_and_refuses(monkeypatch):
    keys, values, count, key_states, value_states = inputs(2, 3, 8, 1, 16, torch.float16, 2)
    assert cache_write_fits(keys, values, count, key_states, value_states)
    refused = {
        "dtype": (keys, values, count, key_states.float(), value_states),
        "count dtype": (keys, values, count.int(), key_states, value_states),
        "count shape": (keys, values, count[None], key_states, value_states),
        "heads": (keys, values, count, key_states[:, :2], value_states),
        "more tokens than positions": (keys[:, :, :1], values[:, :, :1], count, key_states.expand(2, 3, 2, 16),
                                       value_states.expand(2, 3, 2, 16)),
        "inner stride": (keys, values, count, key_states.transpose(2, 3), value_states),
    }
    for name, args in refused.items():
        assert not cache_write_fits(*args), name
    none = keys[:0], values[:0], count, key_states[:0], value_states[:0]
    assert not cache_write_fits(*none)  # no rows: the count must move all the same
    monkeypatch.setattr(CACHE_WRITE, "COPY_ELEMENTS", 16)  # a program a row of 16
    many = torch.zeros(1, 1, 1, 16, dtype=torch.float16, device=DEV).expand(1 << 23, 1, 1, 16)
    assert not cache_write_fits(many, many, count, many, many)  # as many programs as the tickets count
    assert cache_write_fits(*(t[:-1] for t in (many, many)), count, *(t[:-1] for t in (many, many)))
    with pytest.raises(ValueError, match=r"cache_write: caches .* new rows \[B, H, Q, D\]"):
        cache_write(keys, values, count, key_states.float(), value_states)


def test_static_update_computes_only_static_layers():
    assert static_update_computes(StaticLayer)
    assert not static_update_computes(StaticSlidingWindowLayer) and not static_update_computes(DynamicLayer)


def tiny_config():
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64)


def test_writing_cache_updates_static_layers_on_the_kernel(monkeypatch):
    """A WritingCache over transformers' StaticCache: a layer's first update (its lazy allocation) is the cache's
    own, later ones launch the kernel; caches, counts and returned tensors equal a plain StaticCache's after the
    same updates. A DynamicCache's updates stay its own."""
    calls = []
    kernel = twell.decoder.cache_write_fitted
    monkeypatch.setattr(twell.decoder, "cache_write_fitted", lambda *a: calls.append(a[3].shape) or kernel(*a))
    config = tiny_config()
    generator = torch.Generator().manual_seed(0)
    plain, fused = (StaticCache(config=config, max_cache_len=12) for _ in range(2))
    for tokens in (5, 1, 2):
        for layer in range(2):
            new = [torch.randn(2, tokens, 2, 8, generator=generator).to(DEV).transpose(1, 2) for _ in range(2)]
            expected = plain.update(*new, layer)
            returned = WritingCache(fused).update(*new, layer)
            assert returned[0] is fused.layers[layer].keys and returned[1] is fused.layers[layer].values
            assert all(torch.equal(a, b) for a, b in zip(returned, expected))
    assert fused.get_seq_length() == plain.get_seq_length() == 8
    assert WritingCache(fused).get_max_length() == 12  # other attributes: the cache's
    assert calls == [(2, 2, 1, 8)] * 2 + [(2, 2, 2, 8)] * 2
    dynamic = DynamicCache(config=config)
    new = [torch.randn(1, 2, 3, 8).to(DEV) for _ in range(2)]
    for _ in range(2):
        WritingCache(dynamic).update(*new, 0)
    assert dynamic.get_seq_length() == 6 and len(calls) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,queries", [(1, 16, 1), (8, 8, 1), (4, 8, 3)])
def test_cache_write_bf16_matches_reference_on_gpu(batch, heads, queries):
    args = inputs(batch, heads, 512, queries, 128, torch.bfloat16, 300)
    expected = [t.clone() for t in args[:3]]
    cache_write(*args)
    cache_write_reference(*expected, *args[3:])
    assert all(torch.equal(a, b) for a, b in zip(args[:3], expected))
