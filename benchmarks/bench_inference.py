"""TwELL inference benchmark against the dense bf16 block, by the method of docs/performance.md.

Synthetic sparsity (synthetic_mlp.py): each unit fires with probability k/I. Dense baseline: gate and up as
one concatenated bf16 cuBLAS matmul, relu(g) * u, down matmul. Each row also checks correctness
(||out - ref|| / ||ref|| against the fp32 block on fresh inputs) in the same run.
Large sizes: triton do_bench median (it flushes L2 before every call). Up to GRAPH_ROWS tokens: CUDA graph
replays of LAYERS layer copies (so weights do not stay in L2), time per layer; no host time counts there.
Grid "decode_dense": decode with every unit active (k = I: gate[:, 0] = 10, so every pre-activation is
positive), so every (row, tile) overflows: the cost of the decode overflow fallback against dense.

  python benchmarks/bench_inference.py --grid main decode --json out.json
  python benchmarks/bench_inference.py --grid main decode --fp8-gate --json out.json  # also the fp8 gate
  python benchmarks/bench_inference.py --grid main --fp8-up-down --json out.json  # also e4m3 up/down rows
  python benchmarks/bench_inference.py --grid decode_dense
  python benchmarks/bench_inference.py --grid window --json out.json  # speed-up against token count
  python benchmarks/bench_inference.py --grid tiles --tile 64 128 256 --compression 4 8 16  # per (tile, C)
  python benchmarks/bench_inference.py --grid tiles ... --json out.json --resume  # finish a run cut short
  python benchmarks/bench_inference.py --robustness --json out.json  # as the modeling file runs it, heavy rows
  python benchmarks/bench_inference.py --robustness ... --json out.json --resume  # finish a run cut short
  python benchmarks/bench_inference.py --heavy-block --json out.json  # the dense block of heavy rows alone
  python benchmarks/bench_inference.py --decode-first-token --json out.json  # one such token in a decode-size call
  python benchmarks/bench_inference.py --decode-paths --json out.json  # decode against batched path, 8-64 tokens
  # decode launch rules against the ones they replace
  python benchmarks/bench_inference.py --decode-rules --json out.json
  python benchmarks/bench_inference.py --decode-rules heavy_tiles --json out.json  # only these rules
  python benchmarks/bench_inference.py --host-time --json out.json     # host time of one call, eager
  python benchmarks/bench_inference.py --sweep       # launch-config sweep at D=2048, I=5632
"""
import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

import twell
import twell.cost_model
from twell.format import decode_rows, empty_twell, slots
from twell.batched import gate_config, gate_launch, out_launch
from twell.decode import DECODE_TILE
from twell.heavy import HEAVY_FEW_ROWS, heavy_launches
from twell.paths import reads_fp8_gate, reads_fp8_up_down

from sparsify.bench import write_json

from decode_rules import DECODE_RULES, decode_paths, decode_rules
from inference_robustness import ROBUST_ACTIVE, ROBUST_KEY, ROBUST_TOKENS, robustness
from synthetic_mlp import (HEAVY_FIRST, HEAVY_K, HEAVY_TILE, LAYERS, add_fp8_gate, add_fp8_up_down, dense, launch_rules,
                           make_heavy, make_x, make_layer, per_layer_us, plan_launches, print_row, reference, rel_err,
                           sparse)

ROW_KEY = ("D", "I", "M", "k", "tile", "compression")  # what identifies a grid row (--resume)
GRAPH_ROWS = 4096  # up to this many tokens: CUDA-graph replays (the launches are short enough for host time to show)
GRIDS = {
    "main": [(2048, 5632, m, k) for m in (4096, 16384, 65536) for k in (29, 100, 300)],
    "decode": [(2048, 5632, m, k) for m in (1, 8, 64) for k in (29, 100)],
    # where the batched path's e4m3 up/down walk starts to win (run with --fp8-up-down)
    "ud8_window": [(d, i, m, 29) for d, i, ms in ((2048, 5632, (128, 160, 192, 224, 256, 384)),
                                                 (896, 4864, (96, 128, 256, 512, 1024)), (3584, 18944, (96, 256, 1024)))
                   for m in ms],
    # between decode and the batched sizes
    "mid": [(d, i, m, 29) for d, i in ((2048, 5632), (4096, 14336)) for m in (96, 256, 512, 1024)],
    "real": [(d, i, m, 29) for d, i in ((896, 4864), (2048, 8192), (3584, 18944), (4096, 14336))
             for m in (1, 16384)],
    "decode_dense": [(2048, 5632, m, 5632) for m in (1, 8)],  # k = I: every tile overflows
    # speed-up against token count at the benchmark and real shapes: where the plan's dense window falls
    "window": [(d, i, m, 29) for d, i in ((2048, 5632), (896, 4864), (2048, 8192), (3584, 18944), (4096, 14336))
               for m in (1, 16, 64, 65, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096)],
    # batched sizes at three shapes, for the cost model's per-tile gate rates (run with several
    # --tile / --compression values)
    "tiles": [(d, i, m, 29) for d, i in ((2048, 5632), (896, 4864), (4096, 14336)) for m in (256, 1024, 4096, 16384)],
}


_layers = {}  # the last shape's layer copies, reused by the grid rows of that shape


def make_layers(d, i, k, skew, n):
    key = (d, i, k, skew)
    if key not in _layers or len(_layers[key]) < n:
        _layers.clear()
        _layers[key] = [make_layer(d, i, k, skew) for _ in range(n)]
    return _layers[key][:n]


def gate_pack(x, gate, tile, compression, cfg, up=None, down_t=None):
    """The gate launch alone: TwELL of relu(x @ gate^T), h = relu(g) * u with up and down_t (decode);
    returns (TwELL, partials), partials holding the overflowing (row, tile) pairs' output rows with up."""
    tw = empty_twell(x.shape[0], gate.shape[0], tile, compression, x.dtype, x.device)
    partials = tw.values if up is None else torch.empty(*tw.counts.shape, x.shape[1], device=x.device)
    gate_launch(x, gate, up, tile, tw.values.shape[2], x.dtype, cfg, partials=up is not None)(
        x, gate, gate if up is None else up, gate if up is None else down_t, *tw[:3], partials)
    return tw, partials


def twell_out(x, packed, w, cfg, packed_h=False):
    """The out launch alone, on gate_pack's result (packed_h: it holds h, decode path)."""
    tw, partials = packed
    down_t = w["down_p"].t()
    out = torch.empty_like(x)
    out_launch(x, tw.width, tw.tile, tw.values.shape[2], False, False, cfg, packed_h=packed_h)(
        x, *tw[:3], partials, w["gate"], w["up"], down_t, out, tw.counts)
    return out


def time_fn(fn, graphs):
    if graphs:
        return do_bench_cudagraph(fn, rep=50, return_mode="median") / LAYERS
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_row(d, i, m, k, tile, compression, skew=0.0, fp8=False, fp8_up_down=False):
    """One grid row: dense against TwELL (with fp8, also TwELL with the fp8 gate: its error against the fp32
    block and against the fp8 gate's reference, whose g is what the kernels compute from quantized x and gate;
    with fp8_up_down, also TwELL on e4m3 up and down rows, and with both, both)."""
    decode = m <= decode_rows(d, i)
    graphs = m <= GRAPH_ROWS
    layers = make_layers(d, i, k, skew, LAYERS if graphs else 1)
    w = layers[0]
    # correctness on fresh inputs, in the same run
    x = make_x(m, d)
    check = slice(0, min(m, 4096))
    ref = reference(x[check], w)
    err_dense = rel_err(dense(x, w)[check], ref)
    err_sparse = rel_err(sparse(x, w, tile, compression)[check], ref)
    err_highest = rel_err(sparse(x, w, tile, compression, "highest")[check], ref)
    # measured activity, with the tile the kernel actually used
    used_tile = min(tile, DECODE_TILE) if decode else tile
    x = make_x(m, d)
    tw, _ = gate_pack(x, w["gate"], used_tile, compression, gate_config(m, used_tile, 2, decode))
    per_row = tw.counts.sum(1).float()
    s = slots(used_tile, compression)
    ovf = torch.zeros(1, dtype=torch.int64, device="cuda")
    twell.gated_mlp(x, w["gate"], w["up"], w["down_p"], tile=tile, compression=compression, overflow=ovf)
    t_dense = time_fn(lambda: [dense(x, lw) for lw in layers], graphs)
    t_sparse = time_fn(lambda: [sparse(x, lw, tile, compression) for lw in layers], graphs)
    row = dict(D=d, I=i, M=m, k=k, skew=skew, tile=used_tile, compression=compression, slots=s,
               mean_active=per_row.mean().item(), max_active=per_row.max().item(),
               max_tile_active=tw.counts.max().item(), overflow_tiles=int(ovf.item()),
               dense_ms=t_dense, twell_ms=t_sparse, speedup=t_dense / t_sparse,
               err_dense=err_dense, err_twell=err_sparse, err_twell_highest=err_highest)
    if not decode:  # breakdown of the two launches, and cuBLAS's x @ gate^T beside the gate kernel
        gate, out = plan_launches(x, layers, tile, compression)
        row["gate_ms"] = time_fn(lambda: [gate(lw) for lw in layers], graphs)
        row["updown_ms"] = time_fn(lambda: [out(lw) for lw in layers], graphs)
        row["cublas_gate_ms"] = time_fn(lambda: [x @ lw["gate"].t() for lw in layers], graphs)
    # the fp8 variants: "fp8" (the gate pass), "ud8" (e4m3 up and down rows), "all8" (both); decode-size calls
    # read neither, and the e4m3 rows are timed where reads_fp8_up_down refuses them too, to check the rule
    variants = [(name, gate8, ud8) for name, gate8, ud8 in (("fp8", True, False), ("ud8", False, True),
                                                            ("all8", True, True))
                if (fp8 or not gate8) and (fp8_up_down or not ud8)]
    ud8_by_default = reads_fp8_up_down(m, d, i)
    with launch_rules(UP_DOWN_FP8_MIN_ROW_BYTES=0):
        if variants and reads_fp8_gate(m, d, i) and reads_fp8_up_down(m, d, i):  # the same paths read both
            row.update(fp8_columns(x, layers, tile, compression, graphs, t_dense, check, variants))
    if "speedup_ud8" in row:
        row["ud8_by_default"] = ud8_by_default
    return row


def fp8_columns(x, layers, tile, compression, graphs, t_dense, check, variants):
    """A grid row's columns of the block in each fp8 variant (name, fp8 gate, e4m3 up and down rows): time,
    speed-up, error against the fp32 block and against the reference of what the kernels compute (g from quantized
    x and gate, the up and down rows mixed as the kernels read them); the gate pass alone with the fp8 gate, the
    out pass alone on the e4m3 rows."""
    if any(gate8 for _, gate8, _ in variants):
        add_fp8_gate(layers)
    if any(ud8 for _, _, ud8 in variants):
        add_fp8_up_down(layers)
    w = layers[0]
    fresh = make_x(x.shape[0], x.shape[1])[check]
    columns = {}
    for name, gate8, ud8 in variants:
        out = sparse(fresh, w, tile, compression, fp8=gate8, fp8_up_down=ud8)
        its_reference = twell.gated_mlp_reference(
            fresh.float(), w["gate"], w["up"], w["down"], tile=tile, compression=compression,
            gate_fp8=w["gate_fp8"] if gate8 else None, up_down_fp8=w["up_down_fp8"] if ud8 else None)
        t = time_fn(lambda: [sparse(x, lw, tile, compression, fp8=gate8, fp8_up_down=ud8) for lw in layers], graphs)
        columns.update({f"twell_{name}_ms": t, f"speedup_{name}": t_dense / t,
                        f"err_twell_{name}": rel_err(out, reference(fresh, w)),
                        f"err_{name}_vs_its_reference": rel_err(out, its_reference.float())})
        if name in ("fp8", "ud8"):  # the pass it changes, alone
            gate, out_pass = plan_launches(x, layers, tile, compression, fp8=gate8, fp8_up_down=ud8)
            passes = {"gate_fp8_ms": gate} if gate8 else {"updown_ud8_ms": out_pass}
            columns.update({key: time_fn(lambda: [fn(lw) for lw in layers], graphs) for key, fn in passes.items()})
    return columns


def sweep():
    """Launch configurations of both kernels at D=2048, I=5632, k=29 (batched and decode)."""
    d, i, k = 2048, 5632, 29
    rows = []
    w = make_layer(d, i, k)
    for m in (16384, 4096):
        x = make_x(m, d)
        ref = reference(x[:2048], w)
        rows.append(dict(kernel="cublas_gate", M=m, ms=do_bench(lambda: x @ w["gate"].t(), return_mode="median")))
        rows.append(dict(kernel="dense_block", M=m, ms=do_bench(lambda: dense(x, w), return_mode="median")))
        print(rows[-2], rows[-1])
        for tile, bm, bk, warps, stages in ((128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
                                            (128, 128, 128, 8, 3), (256, 64, 64, 8, 3), (256, 128, 64, 8, 3),
                                            (64, 128, 64, 4, 4)):
            cfg = dict(BM=bm, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
            try:
                t = do_bench(lambda: gate_pack(x, w["gate"], tile, 8, cfg), return_mode="median")
            except Exception as e:  # out of shared memory etc.
                print("gate", m, tile, cfg, "failed:", type(e).__name__)
                continue
            rows.append(dict(kernel="gate", M=m, tile=tile, **cfg, ms=t))
            print(rows[-1])
        packed = gate_pack(x, w["gate"], 128, 8, gate_config(m, 128, 2, decode=False))
        for ch in (1, 2, 4):
            for warps in (1, 2):
                cfg = dict(CH=ch, num_warps=warps)
                out = twell_out(x, packed, w, cfg)
                t = do_bench(lambda: twell_out(x, packed, w, cfg), return_mode="median")
                rows.append(dict(kernel="updown", M=m, **cfg, ms=t, err=rel_err(out[:2048], ref)))
                print(rows[-1])
    layers = [make_layer(d, i, k) for _ in range(LAYERS)]
    for m in (1, 64):
        x = make_x(m, d)
        rows.append(dict(kernel="dense_block", M=m, ms=do_bench_cudagraph(
            lambda: [dense(x, lw) for lw in layers], return_mode="median") / LAYERS))
        print(rows[-1])
        bm = max(16, triton.next_power_of_2(m))
        for tile, bk, stages in ((32, 256, 3), (64, 256, 3), (64, 128, 4), (128, 128, 3), (128, 128, 4)):
            cfg = dict(BM=bm, BK=bk, GROUP_M=1, num_warps=4, num_stages=stages)
            try:
                t = do_bench_cudagraph(lambda: [gate_pack(x, lw["gate"], tile, 8, cfg, up=lw["up"],
                                                          down_t=lw["down_p"].t())
                                                for lw in layers], return_mode="median") / LAYERS
            except Exception as e:
                print("gate", m, tile, cfg, "failed:", type(e).__name__)
                continue
            rows.append(dict(kernel="gate_up", M=m, tile=tile, **cfg, ms=t))
            print(rows[-1])
        tws = [gate_pack(x, lw["gate"], 64, 8, gate_config(m, 64, 2, decode=True), up=lw["up"],
                         down_t=lw["down_p"].t()) for lw in layers]
        ref = reference(x, layers[0])
        for ch in (16, 32):
            for bd in (64, 128, 256):
                cfg = dict(CH=ch, BD=bd, num_warps=4)
                out = twell_out(x, tws[0], layers[0], cfg, packed_h=True)
                t = do_bench_cudagraph(lambda: [twell_out(x, tw, lw, cfg, packed_h=True)
                                                for tw, lw in zip(tws, layers)],
                                       return_mode="median") / LAYERS
                rows.append(dict(kernel="down", M=m, **cfg, ms=t, err=rel_err(out, ref)))
                print(rows[-1])
    return rows


def heavy_block():
    """The dense block of heavy rows alone (twell.heavy.heavy_launches: the launches a batched call makes
    after its out kernel posted n rows) against cuBLAS's dense block of the same n rows, at three shapes;
    each checked against fp32 at those rows. do_bench medians (L2 flushed). Fits twell.cost_model.HEAVY."""
    rows = []
    for d, i in ((896, 4864), (2048, 5632), (4096, 14336)):
        w = make_layer(d, i, HEAVY_K)
        capacity = 16384
        x = make_x(capacity, d)
        heavy = heavy_launches(x, i, False)
        down_t = w["down_p"].t()
        # the block's buffers allocated once, outside the timed calls
        h = torch.empty(capacity, i, dtype=x.dtype, device="cuda")
        part = torch.empty(heavy.splits, HEAVY_FEW_ROWS, d, device="cuda")
        for n in (1, 4, 16, 17, 64, 256, 1024, 4096, 16384):
            posted = torch.randperm(capacity, device="cuda")[:n].sort().values
            workspace = torch.zeros(1 + capacity, dtype=torch.int32, device="cuda")
            workspace[0], workspace[1:1 + n] = n, posted.int()
            out = torch.full_like(x, float("nan"))

            def block():
                heavy(x, w["gate"], w["up"], down_t, workspace, out, h=h, part=part)

            block()
            xs = x[posted]
            row = dict(D=d, I=i, rows=n, heavy_ms=do_bench(block, return_mode="median"),
                       cublas_ms=do_bench(lambda: dense(xs, w), return_mode="median"),
                       rel_err=rel_err(out[posted], reference(xs, w)),
                       dense_rel_err=rel_err(dense(xs, w), reference(xs, w)))
            print_row(row)
            rows.append(row)
        del w, x, h
    return rows


def issue_us(fn, calls=50):
    """Host microseconds to issue one fn() call: the GPU is held busy (torch.cuda._sleep) while `calls` calls
    are issued, so that no launch waits for it and only the host's work counts."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles, longer than the calls take to issue
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e6


def host_times():
    """Host time of one eager call against its GPU time, per token count (D 2048 / I 5632, 29 active units,
    one 2000-unit first token every 2048 tokens): the dense block as a plain checkpoint runs it (gate, up
    and down through F.linear), `gated_mlp` called directly, and through `twell.DecodeGraphs` (up to its
    64 rows). Where the host time exceeds the GPU time an eager model cannot profit from the GPU saving."""
    import torch.nn.functional as F

    d, i = 2048, 5632
    w = make_layer(d, i, HEAVY_K)
    graphs = twell.DecodeGraphs()
    rows = []
    for m in (1, 8, 64, 128, 512, 2048, 4096, 16384):
        x = make_x(m, d)
        make_heavy(x, slice(None, None, 2048), HEAVY_FIRST, i)
        calls = {"dense": lambda: F.linear(torch.relu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"]),
                 "twell": lambda: sparse(x, w, HEAVY_TILE, 8)}
        if graphs.graphable(x):
            calls["twell_graphs"] = lambda: graphs(twell.gated_mlp, x, w["gate"], w["up"], w["down_p"], tile=HEAVY_TILE,
                                                   compression=8)
        row = dict(D=d, I=i, M=m)
        with torch.inference_mode():
            for name, fn in calls.items():
                fn()  # a graphed call is captured the second time its signature is seen
                row[name + "_host_us"] = issue_us(fn)
                row[name + "_gpu_us"] = do_bench(fn, return_mode="median") * 1e3
        print_row(row)
        rows.append(row)
    return rows


def decode_first_token():
    """Decode-size calls (1-64 tokens, the plan's compression 16) with one heavy first token (HEAVY_FIRST
    units) against the same call without it, at D 2048 / I 5632: the heavy row's overflowing tiles go through
    the gate programs' partial rows. CUDA-graph replays over the layer copies, per layer; the heavy row
    checked against fp32 in the same run."""
    d, i = 2048, 5632
    layers = [make_layer(d, i, HEAVY_K) for _ in range(LAYERS)]
    rows = []
    for m in (1, 2, 8, 16, 33, 64):
        for heavy in (0, HEAVY_FIRST):
            x = make_x(m, d)
            if heavy:
                make_heavy(x, [0], heavy, i)
            ref = reference(x[:1], layers[0])
            active = int((x[:1].float() @ layers[0]["gate"].float().t() > 0).sum())
            dense_us = per_layer_us(lambda lw: dense(x, lw), layers)
            twell_us = per_layer_us(lambda lw: sparse(x, lw, HEAVY_TILE, 16), layers)
            first = sparse(x, layers[0], HEAVY_TILE, 16)[:1]
            row = dict(D=d, I=i, M=m, first_token_units=active, dense_us=dense_us, twell_us=twell_us,
                       speedup=dense_us / twell_us, first_token_rel_err=rel_err(first, ref))
            print_row(row)
            rows.append(row)
    return rows


def resumed(path, key):
    """An earlier run's result at `path` (a run cut short) and the identities (`key`'s fields) of its rows;
    None and no rows where there is no file yet."""
    if not os.path.exists(path):
        return None, set()
    with open(path) as f:
        result = json.load(f)
    return result, {tuple(row[name] for name in key) for row in result["rows"]}


def block_grid(args, result: dict, done: set) -> None:
    """The block grid's rows missing from `done` appended to result["rows"] (written to --json after each),
    then all of them as a table."""
    rows = result["rows"]
    for grid in args.grid:
        for (d, i, m, k), tile, compression in itertools.product(GRIDS[grid], args.tile, args.compression):
            comp = compression if k < 200 else min(compression, 4)
            if (d, i, m, k, tile, comp) in done:
                continue
            rows.append(bench_row(d, i, m, k, tile, comp, fp8=args.fp8_gate, fp8_up_down=args.fp8_up_down))
            print({key: round(v, 4) if isinstance(v, float) else v for key, v in rows[-1].items()}, flush=True)
            if args.json:  # after every row, so that a run cut short keeps what it measured
                write_json(result, args.json)
    print(f"\n{'D':>5} {'I':>6} {'M':>6} {'k':>4} {'mean':>6} {'max':>5} {'maxT':>4} {'ovf':>6} {'dense':>8} "
          f"{'twell':>8} {'x':>5} {'gate':>7} {'updn':>7} {'cuBLAS':>7} {'errD':>7} {'errT':>7} {'x fp8':>6} "
          f"{'x ud8':>6} {'x all8':>6} {'updn8':>7}")
    for r in rows:
        print(f"{r['D']:5d} {r['I']:6d} {r['M']:6d} {r['k']:4d} {r['mean_active']:6.1f} "
              f"{r['max_active']:5.0f} {r['max_tile_active']:4d} {r['overflow_tiles']:6d} "
              f"{r['dense_ms']:8.4f} {r['twell_ms']:8.4f} {r['speedup']:5.2f} "
              f"{r.get('gate_ms', float('nan')):7.4f} {r.get('updown_ms', float('nan')):7.4f} "
              f"{r.get('cublas_gate_ms', float('nan')):7.4f} "
              f"{r['err_dense']:7.1e} {r['err_twell']:7.1e} {r.get('speedup_fp8', float('nan')):6.2f} "
              f"{r.get('speedup_ud8', float('nan')):6.2f} {r.get('speedup_all8', float('nan')):6.2f} "
              f"{r.get('updown_ud8_ms', float('nan')):7.4f}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--grid", nargs="*", default=["main", "decode"], choices=sorted(GRIDS))
    p.add_argument("--tile", type=int, nargs="+", default=[128], help="each row at every tile given")
    p.add_argument("--compression", type=int, nargs="+", default=[8], help="each row at every compression given")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="launch configurations of both kernels")
    mode.add_argument("--robustness", action="store_true",
                      help="the layer as the modeling file runs it against dense: tokens x heavy rows x active units")
    mode.add_argument("--decode-paths", action="store_true", help="decode against batched path at 8-64 tokens")
    mode.add_argument("--host-time", action="store_true", help="host time of one eager call against its GPU time")
    mode.add_argument("--heavy-block", action="store_true", help="the dense block of heavy rows alone, 1-16384 rows")
    mode.add_argument("--decode-first-token", action="store_true",
                      help="one heavy first token in a decode-size call (1-64 tokens)")
    mode.add_argument("--decode-rules", nargs="*", choices=list(DECODE_RULES), default=None,
                      help="decode launch rules against what they replace (these ones; none named: all)")
    p.add_argument("--runtime", default=None, metavar="CHECKPOINT",
                   help="--robustness: time the kernel and modeling files of this exported checkpoint")
    p.add_argument("--plan-active", type=int, default=None, metavar="K",
                   help="--robustness: plan every layer from calibration inputs of K active units")
    p.add_argument("--tokens", type=int, nargs="+", default=ROBUST_TOKENS, help="--robustness: token counts")
    p.add_argument("--active", type=int, nargs="+", default=ROBUST_ACTIVE, help="--robustness: mean active units")
    p.add_argument("--fp8-gate", action="store_true",
                   help="block grid: each row of the batched path also with its gate pass in fp8 (twell.fp8_gate), "
                        "timed and checked; --robustness: the kernel layers with use_fp8_gate()")
    p.add_argument("--fp8-up-down", action="store_true",
                   help="block grid: each row of the batched path also with its out pass on e4m3 up and down rows "
                        "(twell.fp8_gate.quantize_up_down), and with --fp8-gate also with both, timed and checked; "
                        "--robustness: the kernel layers with use_fp8_up_down()")
    p.add_argument("--json", default=None)
    p.add_argument("--resume", action="store_true",
                   help="block grid and --robustness: keep the rows already in --json (a run cut short) and "
                        "measure only the missing ones")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.runtime and not (Path(args.runtime) / "modeling_twell.py").is_file():
        p.error(f"--runtime: {args.runtime} has no modeling_twell.py (give an exported checkpoint's folder)")
    if args.resume and not args.json:
        p.error("--resume needs --json: the file whose rows to keep")
    other_modes = ("sweep", "decode_paths", "host_time", "heavy_block", "decode_first_token", "decode_rules")
    if args.resume and any(getattr(args, name) not in (None, False) for name in other_modes):
        p.error("--resume continues the block grid and --robustness only; the other modes' runs start afresh")
    runtime_name = args.runtime or "this tree"
    earlier, done = None, set()
    if args.resume:
        kind = "--robustness" if args.robustness else "grid"
        try:
            earlier, done = resumed(args.json, ROBUST_KEY if args.robustness else ROW_KEY)
        except (OSError, ValueError, KeyError, TypeError) as error:  # unreadable, not JSON, not such rows
            p.error(f"--resume: {args.json} is not a {kind} result ({error!r})")
        if args.robustness and earlier is not None and earlier.get("runtime") != runtime_name:
            p.error(f"--resume: {args.json} timed the runtime {earlier.get('runtime')!r}, not {runtime_name!r}")
        for option in ("fp8_gate", "fp8_up_down") if args.robustness and earlier is not None else ():
            if earlier.get(option, False) != getattr(args, option):
                flag = "--" + option.replace("_", "-")
                p.error(f"--resume: {args.json} ran {'with' if earlier.get(option) else 'without'} {flag}")
        measured_on = (earlier or {}).get("device")
        if measured_on is not None and measured_on != torch.cuda.get_device_name():
            p.error(f"--resume: {args.json} was measured on {measured_on}, not on this {torch.cuda.get_device_name()}")
    rows = earlier["rows"] if earlier is not None else []
    torch.manual_seed(0)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python " + " ".join(sys.argv))
    if args.sweep:
        result = dict(meta, sweep=sweep())
    elif args.robustness:
        result = dict(meta, runtime=runtime_name, heavy_cost=twell.cost_model.HEAVY, fp8_gate=args.fp8_gate,
                      fp8_up_down=args.fp8_up_down, rows=rows)
        for row in robustness(args.runtime, args.plan_active, args.tokens, args.active, done, args.fp8_gate,
                              args.fp8_up_down):
            rows.append(row)
            if args.json:  # after every row, so that a run cut short keeps what it measured
                write_json(result, args.json)
    elif args.heavy_block:
        result = dict(meta, rows=heavy_block())
    elif args.host_time:
        result = dict(meta, k=HEAVY_K, tile=HEAVY_TILE, rows=host_times())
    elif args.decode_first_token:
        result = dict(meta, k=HEAVY_K, tile=HEAVY_TILE, compression=16, rows=decode_first_token())
    elif args.decode_paths:
        result = dict(meta, rows=decode_paths())
    elif args.decode_rules is not None:
        result = dict(meta, rows=decode_rules(args.decode_rules))
    else:
        result = dict(meta, rows=rows)
        block_grid(args, result, done)
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
