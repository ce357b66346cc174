"""twell.decode_attention against transformers' sdpa attention function (torch's SDPA under a bool mask) at decode
shapes, bf16, on a GPU, with a correctness check in the same run.

A row: B sequences of one query token each over a cache of L positions of which the first `valid` are written (a
static cache as long as its longest use; the mask hides the rest), H query heads over Hkv key/value heads of 128
dimensions (HEADS x CACHES). Both ops are timed as CUDA-graph replays over copies of the cache, called in turn, enough
copies to hold COPY_BYTES so that they do not stay in L2 (as the layers of a decode step do not): microseconds a
call. Each row is marked `served` where the modeling file takes the kernel for it (decode_attention_wins; elsewhere
SDPA). The check: each op's relative error against the fp32 reference of the same bf16 inputs; the kernel passes
where it is within 1.5x (+1e-3) of SDPA's. Exits with status 1 if a check fails.

  python benchmarks/decode_attention_bench.py --json decode_attention_h200.json
"""
import argparse
import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from triton.testing import do_bench_cudagraph

from twell.decode_attention import decode_attention, decode_attention_wins
from twell.launch import sm_count
from twell.reference import decode_attention_reference

from sparsify.bench import versions, write_json
from sparsify.tune import relative_error

HEAD_DIM = 128
# (name, H, Hkv): the 1.5B-shape Llama of model_bench.py; Llama-3.1-8B's grouped-query attention
HEADS = (("1.5B shape", 16, 16), ("Llama-3.1-8B", 32, 8))
# (B, L, valid positions)
CACHES = ((1, 512, 80), (1, 512, 512), (8, 512, 80), (8, 512, 512), (1, 4096, 4096), (8, 4096, 2048), (16, 1024, 1024),
          (32, 1024, 1024))
COPY_BYTES = 256 << 20


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
                served=decode_attention_wins(batch, kv_heads, sm_count(query.device)), sdpa_us=times["sdpa"],
                kernel_us=times["kernel"], speedup=times["sdpa"] / times["kernel"], err_sdpa=errors["sdpa"],
                err_kernel=errors["kernel"], ok=errors["kernel"] <= 1.5 * errors["sdpa"] + 1e-3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="Write the rows here.")
    args = parser.parse_args(argv)
    result = dict(device=torch.cuda.get_device_name(), versions=versions(),
                  command="python benchmarks/decode_attention_bench.py" + (f" --json {args.json}" if args.json else ""),
                  head_dim=HEAD_DIM, copy_bytes=COPY_BYTES, rows=[])
    for (name, heads, kv_heads), (batch, length, valid) in ((h, c) for h in HEADS for c in CACHES):
        row = bench_row(name, heads, kv_heads, batch, length, valid)
        served = " (served)" if row["served"] else ""
        print(f"{name} B {batch} L {length} valid {valid}{served}: sdpa {row['sdpa_us']:.1f} us, kernel "
              f"{row['kernel_us']:.1f} us, {row['speedup']:.2f}x; rel. err {row['err_sdpa']:.1e} / "
              f"{row['err_kernel']:.1e}", flush=True)
        result["rows"].append(row)
    if args.json:
        write_json(result, args.json)
    return 0 if all(row["ok"] for row in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
