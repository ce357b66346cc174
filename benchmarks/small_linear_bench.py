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
defaults, at M = 1 and 16, for an attention's projections (SWEEP_SHAPES). Exits with status 1 if a check fails.

  python benchmarks/small_linear_bench.py --json small_linear_h200.json
  python benchmarks/small_linear_bench.py --sweep --json small_linear_sweep_h200.json
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

from sparsify.bench import versions, write_json

ROWS = (1, 8, 16)
LINEAR_SHAPES = ((2048, 2048), (256, 2048), (8960, 1536), (1536, 8960))  # (N, K)
# (rows of q, k and v, K, bias): the 1.5B-shape Llama of model_bench.py; Qwen2-1.5B's grouped-query attention
GROUPED_SHAPES = (((2048, 2048, 2048), 2048, False), ((1536, 256, 256), 1536, True))
COPY_BYTES = 256 << 20  # weight bytes a timed graph walks: several times any GPU's L2
EAGER_CALLS = 200  # eager calls timed a row
SWEEP = dict(BN=(16, 32), STEP_BYTES=(4096, 8192, 16384), STAGES=(3, 4, 5), WARPS=(4, 8))
SWEEP_ROWS = (1, 16)
SWEEP_SHAPES = (((2048,), 2048, False), *GROUPED_SHAPES)  # an attention's o, and its q, k and v
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
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    result = dict(device=torch.cuda.get_device_name(), versions=versions(), command="python " + " ".join(sys.argv),
                  copy_bytes=COPY_BYTES, settings={name: getattr(MODULE, name) for name in
                                                   ("MAX_ROWS", "BLOCK_N", "WIDE_BLOCK_N", "WIDE_PROGRAMS_PER_SM",
                                                    "STEP_BYTES", "STAGES", "WARPS")}, rows=[])
    for rows, k, bias in shapes():
        copies = copies_of(rows, k, bias)
        for m in ROWS:
            result["rows"].append(row(m, rows, k, bias, copies))
            print_row(result["rows"][-1])
        if args.sweep and (rows, k, bias) in SWEEP_SHAPES:
            result.setdefault("sweep", []).extend(sweep_rows(rows, k, bias, copies))
        del copies
        torch.cuda.empty_cache()
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    failed = [r for r in result["rows"] + result.get("sweep", []) if r.get("ok") is False]
    if failed:
        print(f"{len(failed)} rows fail the check: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
