"""The decode step's attention over the cache on the kernels against transformers, bf16, on a GPU, with a correctness
check in the same run: twell.decode_attention against transformers' sdpa attention function (torch's SDPA under a
bool mask), and twell.cache_write against transformers' StaticLayer.update (the new keys and values into a static
cache).

An attention row: B sequences of one query token each over a cache of L positions of which the first `valid` are written
(a static cache as long as its longest use; the mask hides the rest), H query heads over Hkv key/value heads of 128
dimensions (HEADS x CACHES). Both ops are timed as CUDA-graph replays over copies of the cache, called in turn, enough
copies to hold COPY_BYTES so that they do not stay in L2 (as the layers of a decode step do not): microseconds a call.
Each row is marked `served` where the modeling file takes the kernel for it (decode_attention_wins; elsewhere SDPA),
which depends on whether the running transformers copies the key/value heads for their query heads under a mask
(`sdpa_repeats_kv` in the JSON: releases before its pack_gqa). The check: each op's relative error against the fp32
reference of the same bf16 inputs; the kernel passes where it is within 1.5x (+1e-3) of SDPA's.

A write row (WRITES): Q new positions of B sequences' H heads of 128 dimensions written at position WRITE_AT of a
WRITE_LENGTH-position static layer, both ops timed as CUDA-graph replays that first set the layer's count back (the
reset timed alone and taken off). The check: the caches and the count equal transformers' after the same write.
Exits with status 1 if a check fails.

  python benchmarks/decode_attention_bench.py --json decode_attention_h200.json
"""
import argparse
import sys

import torch
from transformers.cache_utils import StaticLayer
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from triton.testing import do_bench_cudagraph

from twell.cache_write import cache_write
from twell.decode_attention import decode_attention, decode_attention_wins
from twell.launch import sm_count
from twell.reference import decode_attention_reference

from sparsify.bench import versions, write_json
from sparsify.tune import relative_error

HEAD_DIM = 128
# (name, H, Hkv): the 1.5B-shape Llama of model_bench.py; Llama-3.1-8B's and Qwen2.5-7B's grouped-query attention
HEADS = (("1.5B shape", 16, 16), ("Llama-3.1-8B", 32, 8), ("Qwen2.5-7B", 28, 4))
# (B, L, valid positions)
CACHES = ((1, 512, 80), (1, 512, 512), (8, 512, 80), (8, 512, 512), (1, 4096, 4096), (8, 4096, 2048), (16, 1024, 1024),
          (32, 1024, 1024), (64, 1024, 1024), (128, 1024, 1024))
# whether transformers' sdpa attention copies the key/value heads for their query heads under a mask
SDPA_REPEATS_KV = not hasattr(sdpa_attention, "pack_gqa")
COPY_BYTES = 256 << 20
# (B, H, Q): decode steps of 1-128 sequences, a 4-token step, prefills of 1024 and 8 x 256 tokens into the cache
WRITES = ((1, 16, 1), (8, 16, 1), (32, 16, 1), (64, 8, 1), (128, 16, 1), (4, 16, 4), (1, 16, 1024), (8, 16, 256))
WRITE_LENGTH, WRITE_AT = 2048, 700


def sdpa(query, key, value, mask):
    """transformers' sdpa attention function as an attention of these heads calls it at decode."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = query.shape[1] // key.shape[1], True
    return sdpa_attention_forward(module, query, key, value, mask, scaling=query.shape[-1] ** -0.5)[0]


def bench_row(name, heads, kv_heads, batch, length, valid):
    cache_bytes = 2 * batch * kv_heads * length * HEAD_DIM * 2
    copies = max(1, COPY_BYTES // cache_bytes)
    query = torch.randn(batch, 1, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    caches = [[torch.randn(batch, kv_heads, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
              for _ in range(copies)]
    mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device="cuda")
    mask[..., :valid] = True
    ref = decode_attention_reference(query.float(), *(t.float() for t in caches[0]), mask)
    errors = {"sdpa": relative_error(sdpa(query, *caches[0], mask), ref),
              "kernel": relative_error(decode_attention(query, *caches[0], mask), ref)}
    times = {op: do_bench_cudagraph(lambda: [fn(query, k, v, mask) for k, v in caches], rep=50,
                                    return_mode="median") * 1e3 / copies
             for op, fn in (("sdpa", sdpa), ("kernel", decode_attention))}
    return dict(model=name, H=heads, Hkv=kv_heads, B=batch, L=length, valid=valid,
                served=decode_attention_wins(batch, kv_heads, sm_count(query.device),
                                             repeated_kv=SDPA_REPEATS_KV and heads > kv_heads), sdpa_us=times["sdpa"],
                kernel_us=times["kernel"], speedup=times["sdpa"] / times["kernel"], err_sdpa=errors["sdpa"],
                err_kernel=errors["kernel"], ok=errors["kernel"] <= 1.5 * errors["sdpa"] + 1e-3)


def write_row(batch, heads, queries):
    layer = StaticLayer(max_cache_len=WRITE_LENGTH)
    new = [torch.randn(batch, queries, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
           for _ in range(2)]
    layer.lazy_initialization(*new)
    count = layer.cumulative_length

    def reset():
        count.fill_(WRITE_AT)

    def transformers_update():
        reset()
        layer.update(*new)

    def kernel():
        reset()
        cache_write(layer.keys, layer.values, count, *new)

    transformers_update()
    expected = [t.clone() for t in (layer.keys, layer.values, count)]
    for t in (layer.keys, layer.values):
        t.zero_()
    kernel()
    ok = all(torch.equal(a, b) for a, b in zip((layer.keys, layer.values, count), expected))
    times = {op: do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
             for op, fn in (("reset", reset), ("transformers", transformers_update), ("kernel", kernel))}
    transformers_us, kernel_us = times["transformers"] - times["reset"], times["kernel"] - times["reset"]
    return dict(B=batch, H=heads, Q=queries, L=WRITE_LENGTH, at=WRITE_AT, transformers_us=transformers_us,
                kernel_us=kernel_us, speedup=transformers_us / kernel_us, reset_us=times["reset"], ok=ok)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="Write the rows here.")
    args = parser.parse_args(argv)
    result = dict(device=torch.cuda.get_device_name(), versions=versions(),
                  command="python benchmarks/decode_attention_bench.py" + (f" --json {args.json}" if args.json else ""),
                  head_dim=HEAD_DIM, copy_bytes=COPY_BYTES, sdpa_repeats_kv=SDPA_REPEATS_KV, rows=[])
    for (name, heads, kv_heads), (batch, length, valid) in ((h, c) for h in HEADS for c in CACHES):
        row = bench_row(name, heads, kv_heads, batch, length, valid)
        served = " (served)" if row["served"] else ""
        print(f"{name} B {batch} L {length} valid {valid}{served}: sdpa {row['sdpa_us']:.1f} us, kernel "
              f"{row['kernel_us']:.1f} us, {row['speedup']:.2f}x; rel. err {row['err_sdpa']:.1e} / "
              f"{row['err_kernel']:.1e}", flush=True)
        result["rows"].append(row)
    result["writes"] = []
    for batch, heads, queries in WRITES:
        row = write_row(batch, heads, queries)
        print(f"write B {batch} H {heads} Q {queries}: transformers {row['transformers_us']:.2f} us, kernel "
              f"{row['kernel_us']:.2f} us, {row['speedup']:.2f}x; {'equal' if row['ok'] else 'DIFFERENT'}", flush=True)
        result["writes"].append(row)
    if args.json:
        write_json(result, args.json)
    return 0 if all(row["ok"] for row in result["rows"] + result["writes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
