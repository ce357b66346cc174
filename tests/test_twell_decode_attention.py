"""Decode attention (twell.decode_attention; interpreter on CPU, bf16 on GPU) against its PyTorch reference and
SDPA: grouped heads, several query tokens, head sizes and cache lengths off the block sizes, masks that hide
whole blocks, rows and everything, one split and several; the outputs and the splits' partial rows start NaN."""
import pytest
import torch
import torch.nn.functional as F

from twell.decode_attention import (BLOCK_N, MAX_QUERIES, MAX_ROWS, decode_attention, decode_attention_fits,
                                    decode_attention_wins, splits)
from twell.reference import decode_attention_reference

from sparsify.tune import relative_error

from helpers import poison_allocations

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(batch, heads, kv_heads, queries, length, dim, dtype, seed=0):
    """query [B, H, Q, D] as the attention makes it (a projection's output viewed and transposed), key and value
    [B, Hkv, L, D] as a cache holds them."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, queries, heads, dim, generator=generator).to(DEV, dtype).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator).to(DEV, dtype) for _ in range(2))
    return query, key, value


def random_mask(shape, seed=1):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)).to(DEV) < 0.6


@pytest.mark.parametrize("batch,heads,kv_heads,queries,length,dim,dtype", [
    (1, 4, 4, 1, 100, 32, torch.float32),  # one token, every head its own keys, two splits
    (2, 8, 2, 1, 1, 16, torch.float32),  # grouped heads, a one-position cache
    (1, 6, 2, 3, 70, 40, torch.float16),  # three query tokens, a head size off the powers of two
    (3, 2, 1, 1, 300, 64, torch.float32),  # several splits, the last one short
    (2, 4, 4, 2, 63, 24, torch.float16),  # one split, shorter than a block
])
@pytest.mark.parametrize("masked", ["none", "random", "broadcast"])
def test_decode_attention_matches_reference(batch, heads, kv_heads, queries, length, dim, dtype, masked, monkeypatch):
    allocations = poison_allocations(monkeypatch, "twell.decode_attention")
    query, key, value = inputs(batch, heads, kv_heads, queries, length, dim, dtype)
    mask = {"none": None, "random": random_mask((batch, heads, queries, length)),
            "broadcast": random_mask((1, 1, queries, length))}[masked]
    out = decode_attention(query, key, value, mask, scale=0.3)
    ref = decode_attention_reference(query, key, value, mask, scale=0.3)
    assert out.shape == (batch, queries, heads, dim) and out.is_contiguous()
    # the output, and where several splits cover the cache their partial rows and statistics
    assert len(allocations) == (3 if splits(batch * kv_heads, length, 4) > 1 else 1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tolerance, atol=tolerance)


def test_masked_blocks_rows_and_whole_calls_give_what_the_reference_gives(monkeypatch):
    """A mask that hides the first blocks of the cache from every row (a static cache's unwritten end is hidden the
    same way), one row from every position (zeros), and a call whose mask hides everything (zeros)."""
    poison_allocations(monkeypatch, "twell.decode_attention")
    query, key, value = inputs(2, 4, 2, 2, 5 * BLOCK_N + 7, 32, torch.float32)
    mask = random_mask((2, 4, 2, key.shape[2]))
    mask[..., :3 * BLOCK_N] = False
    mask[1, 2, 1] = False
    out = decode_attention(query, key, value, mask)
    assert torch.allclose(out, decode_attention_reference(query, key, value, mask), atol=1e-5)
    assert out[1, 1, 2].eq(0).all() and out[0].abs().amax() > 0
    assert decode_attention(query, key, value, torch.zeros_like(mask)).eq(0).all()


def test_output_buffer_is_written_whole():
    query, key, value = inputs(1, 4, 2, 1, 80, 16, torch.float32)
    out = torch.full((1, 1, 4, 16), float("nan"), device=DEV)
    assert decode_attention(query, key, value, out=out) is out
    assert torch.allclose(out, decode_attention_reference(query, key, value), atol=1e-5)


def test_what_the_kernel_takes():
    query, key, value = inputs(1, 8, 2, 1, 16, 32, torch.float32)
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool, device=DEV)
    assert decode_attention_fits(query, key, value, mask) and decode_attention_fits(query, key, value)
    many = inputs(1, 8, 2, MAX_QUERIES + 1, 16, 32, torch.float32)[0]
    wide = inputs(1, 4 * MAX_ROWS, 2, 1, 16, 32, torch.float32)[0]
    refused = [
        (many, key, value, None),  # a prefill's tokens
        (wide, key, value, None),  # more query heads a key/value head than a tile's rows
        (inputs(1, 6, 4, 1, 16, 32, torch.float32)[0], *inputs(1, 6, 4, 1, 16, 32, torch.float32)[1:], None),
        (query.half(), key, value, None),  # mixed dtypes
        (query, key, value, mask.float()),  # an additive mask
        (query, key, value, mask[..., :8]),  # a mask of another length
        (query, key.transpose(-1, -2).contiguous().transpose(-1, -2), value, None),  # head dims not contiguous
        (query.double(), key.double(), value.double(), None),
        (*inputs(1, 4, 4, 1, 16, 512, torch.float32), None),  # head size
        (*inputs(0, 4, 4, 1, 16, 32, torch.float32), None),  # no sequence
    ]
    for case in refused:
        assert not decode_attention_fits(*case)
    with pytest.raises(ValueError, match=r"query \(1, 2, 17, 32\).*query \[B, H, 1-16, D\]"):
        decode_attention(*inputs(1, 2, 2, MAX_QUERIES + 1, 16, 32, torch.float32))


def test_the_kernel_wins_where_sequences_times_key_value_heads_leave_sms_to_fill():
    assert decode_attention_wins(1, 16, 132) and decode_attention_wins(8, 16, 132) and decode_attention_wins(16, 8, 132)
    assert not decode_attention_wins(16, 16, 132) and not decode_attention_wins(32, 8, 132)
    # against an attention that copies the key/value heads for their query heads first: at every batch
    assert decode_attention_wins(32, 8, 132, repeated_kv=True) and decode_attention_wins(256, 4, 132, repeated_kv=True)


def test_splits_spread_small_batches_over_the_gpu():
    assert splits(16, 512, 132) == 8  # one sequence of 16 heads: a block of positions each of 8 splits
    assert splits(16, 4096, 132) == 17  # two programs an SM
    assert splits(256, 4096, 132) == 2
    assert splits(1024, 4096, 132) == 1 and splits(16, 10, 132) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads,length", [(1, 16, 16, 512), (8, 32, 8, 300), (2, 16, 4, 4097)])
def test_decode_attention_bf16_matches_sdpa_on_gpu(batch, heads, kv_heads, length, monkeypatch):
    poison_allocations(monkeypatch, "twell.decode_attention")
    query, key, value = inputs(batch, heads, kv_heads, 1, length, 128, torch.bfloat16)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=DEV)
    mask[:, :, :, length // 3:] = False  # a static cache's unwritten positions
    mask[0, :, :, :5] = False  # a left-padded prompt
    out = decode_attention(query, key, value, mask)
    expanded = [t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value)]
    sdpa = F.scaled_dot_product_attention(query, *expanded, attn_mask=mask).transpose(1, 2)
    ref = decode_attention_reference(query.float(), key.float(), value.float(), mask)
    assert relative_error(out, ref) < 1e-2 and relative_error(sdpa, ref) < 1e-2 and relative_error(out, sdpa) < 1e-2
