"""twell.small_linear against torch's F.linear (cuBLAS) at decode shapes, bf16, on a GPU, with a correctness check
in the same run.

A row: M tokens (1, 8, 16) through a weight [N, K] (LINEAR_SHAPES), or an attention's q, k and v in one
small_linear_grouped launch against three F.linear calls and three small_linear calls (GROUPED_SHAPES). Each op is
timed as CUDA-graph replays over copies of the weights, called in turn, enough copies to hold COPY_BYTES so that
they do not stay in L2 (as the layers of a decode step do not): microseconds a call and the weight bytes read a
second; and launched eagerly one call after another (`eager_*_us`: the host's launch time included, as in a decode
step that is not captured). The check: each op's relative error against the fp32 product of the same bf16 inputs;
small_linear passes where it is within 1.5x (+1e-4) of F.linear's (both round an fp32 sum to bf16). --sweep also
times the launch settings of twell/small_linear.py (block rows, bytes a step, pipeline stages, warps) around the
defaults, at M = 1 and 16, for an attention's projections (SWEEP_SHAPES). --families times the projections of the
supported families' published sizes instead (FAMILY_SHAPES, 1 to 16 tokens), each row marked `served` where the
modeling file launches small_linear for it (small_linear_wins; elsewhere it calls F.linear); --grid times single
weights of GRID_N x GRID_K at GRID_ROWS tokens, marked the same way. Exits with status 1 if a check fails.

  python benchmarks/small_linear_bench.py --json small_linear_h200.json
  python benchmarks/small_linear_bench.py --sweep --json small_linear_sweep_h200.json
  python benchmarks/small_linear_bench.py --families --json small_linear_families_h200.json
  python benchmarks/small_linear_bench.py --grid --json small_linear_grid_h200.json
"""
import argparse
import itertools
import math
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from twell import small_linear, small_linear_grouped
from twell.launch import sm_count
from twell.small_linear import small_linear_wins

from sparsify.bench import versions, write_json

ROWS = (1, 8, 16)
# (N, K): o_proj-size and up/down-size weights; (3072, 4096) an o_proj whose heads x head_dim exceed the hidden size
LINEAR_SHAPES = ((2048, 2048), (256, 2048), (3072, 4096), (8960, 1536), (1536, 8960))
# (rows of q, k and v, K, bias): the 1.5B-shape Llama of model_bench.py; Qwen2-1.5B's grouped-query attention
GROUPED_SHAPES = (((2048, 2048, 2048), 2048, False), ((1536, 256, 256), 1536, True))
COPY_BYTES = 256 << 20  # weight bytes a timed graph walks: several times any GPU's L2
EAGER_CALLS = 200  # eager calls timed a row
SWEEP = dict(BN=(16, 32), STEP_BYTES=(4096, 8192, 16384), STAGES=(3, 4, 5), WARPS=(4, 8))
SWEEP_ROWS = (1, 16)
SWEEP_SHAPES = (((2048,), 2048, False), *GROUPED_SHAPES)  # an attention's o, and its q, k and v
# --families: the projections the modeling file routes (q, k and v grouped; o, or Phi-3's fused qkv, alone) of
# the supported families' published sizes, (rows, K, bias) by model, at FAMILY_ROWS tokens
FAMILY_SHAPES = {
    "Llama-3.2-1B o": ((2048,), 2048, False), "Llama-3.2-1B qkv": ((2048, 512, 512), 2048, False),
    "Llama-3.2-3B o": ((3072,), 3072, False), "Llama-3.2-3B qkv": ((3072, 1024, 1024), 3072, False),
    "Llama-3.1-8B o": ((4096,), 4096, False), "Llama-3.1-8B qkv": ((4096, 1024, 1024), 4096, False),
    "Qwen2-0.5B o": ((896,), 896, False), "Qwen2-0.5B qkv": ((896, 128, 128), 896, True),
    "Qwen2-1.5B o": ((1536,), 1536, False), "Qwen2-7B o": ((3584,), 3584, False),
    "Qwen2-7B qkv": ((3584, 512, 512), 3584, True),
    "Qwen3-0.6B o": ((1024,), 2048, False), "Qwen3-0.6B qkv": ((2048, 1024, 1024), 1024, False),
    "Qwen3-4B o": ((2560,), 4096, False), "Qwen3-4B qkv": ((4096, 1024, 1024), 2560, False),
    "Gemma-7B o": ((3072,), 4096, False), "Gemma-7B qkv": ((4096, 4096, 4096), 3072, False),
    "Gemma-2-2B o": ((2304,), 2048, False), "Gemma-2-2B qkv": ((2048, 1024, 1024), 2304, False),
    "Gemma-2-9B o": ((3584,), 4096, False), "Phi-3-mini qkv": ((9216,), 3072, False),
    "Qwen2.5-14B o": ((5120,), 5120, False), "Phi-3-medium qkv": ((7680,), 5120, False),
    "Llama-3.1-70B o": ((8192,), 8192, False),
}
FAMILY_ROWS = (1, 2, 4, 8, 16)
# --grid: single weights of N x K rows and columns (K at most twice N) at GRID_ROWS tokens
GRID_N = (2048, 3072, 4096, 5120, 6144, 7680, 8192, 9216, 10240, 12288, 14336, 16384)
GRID_K, GRID_ROWS = (2048, 4096, 8192), (1, 2, 8, 16)
MODULE = sys.modules["twell.small_linear"]


def relative_error(out, exact):
    return ((out.float() - exact).norm() / exact.norm()).item()


def copies_of(rows, k, bias):
    """Weight (and bias) copies of `rows` [N, K] each, bf16, holding COPY_BYTES together."""
    count = max(2, math.ceil(COPY_BYTES / (2 * k * sum(rows))))
    return [([torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for n in rows],
             [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in rows] if bias else [None] * len(rows))
            for _ in range(count)]


def per_call_us(op, copies):
    """Microseconds of op(weights, biases) a copy, over CUDA-graph replays of all copies in turn."""
    def walk():
        for weights, biases in copies:
            op(weights, biases)

    walk()  # compiles the kernels outside the capture
    return 1e3 * do_bench_cudagraph(walk, rep=50, return_mode="median") / len(copies)


def eager_us(op, copies, calls=EAGER_CALLS):
    """Wall microseconds of op(weights, biases) a call, launched eagerly one after another over the copies: the
    host's launch time included, as in a decode step that is not captured."""
    op(*copies[0])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        op(*copies[i % len(copies)])
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def row(m, rows, k, bias, copies) -> dict:
    """One timed and checked row: small_linear (each weight alone, and grouped where `rows` holds several)
    against F.linear; `speedup` and `eager_speedup` are for the launch the modeling file makes (the grouped one
    where there is one)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ops = {"torch": lambda ws, bs: [F.linear(x, w, b) for w, b in zip(ws, bs)],
           "small_linear": lambda ws, bs: [small_linear(x, w, b) for w, b in zip(ws, bs)]}
    if len(rows) > 1:
        ops["small_linear_grouped"] = lambda ws, bs: small_linear_grouped(x, ws, bs)
    ours = list(ops)[-1]
    weights, biases = copies[0]
    exact = [x.float() @ w.float().t() + (0 if b is None else b.float()) for w, b in zip(weights, biases)]
    errors = {name: max(relative_error(out, e) for out, e in zip(ops[name](weights, biases), exact))
              for name in ("torch", ours)}
    times = {f"{name}_us": per_call_us(op, copies) for name, op in ops.items()}
    eager = {f"eager_{name}_us": eager_us(ops[name], copies) for name in ("torch", ours)}
    weight_bytes = 2 * k * sum(rows)
    return dict(M=m, N=list(rows), K=k, bias=bias, **times, **eager, speedup=times["torch_us"] / times[f"{ours}_us"],
                eager_speedup=eager["eager_torch_us"] / eager[f"eager_{ours}_us"],
                torch_TBps=weight_bytes / times["torch_us"] / 1e6,
                small_linear_TBps=weight_bytes / times[f"{ours}_us"] / 1e6, err_torch=errors["torch"],
                err_small_linear=errors[ours], ok=errors[ours] < 1.5 * errors["torch"] + 1e-4)


@contextmanager
def launch_settings(BN, STEP_BYTES, STAGES, WARPS):
    """small_linear's module-level launch settings replaced inside the block (BN: every grid's block rows)."""
    names = ("BLOCK_N", "WIDE_BLOCK_N", "STEP_BYTES", "STAGES", "WARPS")
    saved = {name: getattr(MODULE, name) for name in names}
    for name, value in zip(names, (BN, BN, STEP_BYTES, STAGES, WARPS)):
        setattr(MODULE, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(MODULE, name, value)


def shapes():
    """(rows, K, bias) of every timed shape: the single weights, then the grouped ones."""
    return [((n,), k, False) for n, k in LINEAR_SHAPES] + list(GROUPED_SHAPES)


def sweep_rows(rows, k, bias, copies) -> list:
    """row() at SWEEP_ROWS under every combination of SWEEP's launch settings (an error where one does not
    compile)."""
    results = []
    for values in itertools.product(*SWEEP.values()):
        settings = dict(zip(SWEEP, values))
        for m in SWEEP_ROWS:
            with launch_settings(**settings):
                try:
                    results.append(dict(settings, **row(m, rows, k, bias, copies)))
                except Exception as error:  # noqa: BLE001 (a setting that does not compile here: shared memory)
                    results.append(dict(settings, M=m, N=list(rows), K=k, error=repr(error)))
            print_row(results[-1])
    return results


def print_row(result):
    print({key: round(v, 4) if isinstance(v, float) else v for key, v in result.items()}, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time the launch settings around the defaults")
    parser.add_argument("--families", action="store_true",
                        help="time the supported families' attention projections (FAMILY_SHAPES) instead, each row "
                             "with whether the modeling file launches small_linear for it (small_linear_wins)")
    parser.add_argument("--grid", action="store_true",
                        help="time single weights of GRID_N x GRID_K instead, each row with whether the modeling file "
                             "would launch small_linear for it (small_linear_wins)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    result = dict(device=torch.cuda.get_device_name(), versions=versions(), command="python " + " ".join(sys.argv),
                  copy_bytes=COPY_BYTES, settings={name: getattr(MODULE, name) for name in
                                                   ("MAX_ROWS", "BLOCK_N", "WIDE_BLOCK_N", "WIDE_PROGRAMS_PER_SM",
                                                    "STEP_BYTES", "STAGES", "WARPS", "ROW_BLOCK_N",
                                                    "ROW_NARROW_PROGRAMS_PER_SM", "ROW_RESIDENT_PER_SM")}, rows=[])
    sms = sm_count(torch.device("cuda"))
    if args.families:
        timed, counts = [(model, *shape) for model, shape in FAMILY_SHAPES.items()], FAMILY_ROWS
    elif args.grid:
        timed = [(f"{n} x {k}", (n,), k, False) for n in GRID_N for k in GRID_K if k <= 2 * n]
        counts = GRID_ROWS
    else:
        timed, counts = [(None, *shape) for shape in shapes()], ROWS
    for model, rows, k, bias in timed:
        copies = copies_of(rows, k, bias)
        for m in counts:
            timed_row = row(m, rows, k, bias, copies)
            if model is not None:
                timed_row = dict(model=model, served=small_linear_wins(m, rows, k, sms), **timed_row)
            result["rows"].append(timed_row)
            print_row(timed_row)
        if args.sweep and (rows, k, bias) in SWEEP_SHAPES:
            result.setdefault("sweep", []).extend(sweep_rows(rows, k, bias, copies))
        del copies
        torch.cuda.empty_cache()
    if args.families or args.grid:
        for served in (True, False):
            speedups = [r["speedup"] for r in result["rows"] if r["served"] is served]
            if speedups:
                print(f"small_linear against F.linear where the modeling file {'launches' if served else 'skips'} "
                      f"it: {min(speedups):.2f}x to {max(speedups):.2f}x over {len(speedups)} rows")
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    failed = [r for r in result["rows"] + result.get("sweep", []) if r.get("ok") is False]
    if failed:
        print(f"{len(failed)} rows fail the check: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
