"""Batched block: does the out kernel (L2-gather bound) overlap the gate kernel (tensor-core bound)?
Tokens split into chunks; gate(chunk c) on the main stream, out(chunk c) on a side stream after an event,
so out(c) can run beside gate(c + 1). Same kernels and configs as twell.gated_mlp; output checked equal.

    python benchmarks/overlap_probe.py benchmarks/results/overlap_h100.json   (from the repository root;
    the committed result ran as .gpu/overlap_probe.py, the same code without this line)
"""
import json
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, "benchmarks")
import twell
from bench_inference import dense, make_layer, make_x, rel_err, reference
from twell.format import empty_twell
from twell.gated_mlp import gate_config, gate_launch, out_config, out_launch

TILE, C = 128, 8
rows = []


def build(x, w, n_chunks, side):
    m, d = x.shape
    c = m // n_chunks
    i = w["gate"].shape[0]
    xs = [x[k * c:(k + 1) * c] for k in range(n_chunks)]
    tws = [empty_twell(c, i, TILE, C, x.dtype, x.device) for _ in range(n_chunks)]
    s = tws[0].values.shape[2]
    out = torch.empty_like(x)
    outs = [out[k * c:(k + 1) * c] for k in range(n_chunks)]
    g = gate_launch(xs[0], w["gate"], None, TILE, s, x.dtype, gate_config(c, TILE, 2, False))
    o = out_launch(xs[0], i, TILE, s, True, False, False, out_config(c, d, False))
    down_t = w["down_p"].t()
    events = [torch.cuda.Event() for _ in range(n_chunks)]

    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for k in range(n_chunks):
            tw = tws[k]
            g(xs[k], w["gate"], w["gate"], *tw[:3], tw.values)
            if side is main:
                o(xs[k], *tw[:3], tw.values, w["gate"], w["up"], down_t, outs[k], tw.counts)
                continue
            events[k].record(main)
            with torch.cuda.stream(side):
                side.wait_event(events[k])
                o(xs[k], *tw[:3], tw.values, w["gate"], w["up"], down_t, outs[k], tw.counts)
        main.wait_stream(side)
        return out
    return run


for d, i, m in ((2048, 5632, 16384), (2048, 5632, 4096), (2048, 5632, 65536), (4096, 14336, 16384)):
    w = make_layer(d, i, 29)
    x = make_x(m, d)
    ref = reference(x, w)
    dense_ms = do_bench(lambda: dense(x, w), return_mode="median")
    seq = twell.gated_mlp(x, w["gate"], w["up"], w["down_p"], tile=TILE, compression=C)
    twell_ms = do_bench(lambda: twell.gated_mlp(x, w["gate"], w["up"], w["down_p"], tile=TILE, compression=C),
                        return_mode="median")
    print(f"D {d} I {i} M {m}: dense {dense_ms:.4f} twell {twell_ms:.4f} ({dense_ms / twell_ms:.2f}x) "
          f"err {rel_err(seq, ref):.1e}", flush=True)
    main = torch.cuda.current_stream()
    for n_chunks in (1, 2, 4, 8, 16):
        if m // n_chunks < 1024:
            continue
        for prio in (None, 0, -1):
            side = main if prio is None else torch.cuda.Stream(priority=prio)
            if prio is None and n_chunks > 1 and n_chunks != 4:
                continue
            fn = build(x, w, n_chunks, side)
            out = fn()
            torch.cuda.synchronize()
            same = torch.equal(out, seq)
            ms = do_bench(fn, return_mode="median")
            r = dict(D=d, I=i, M=m, chunks=n_chunks, side_priority=prio, ms=ms, dense_ms=dense_ms,
                     twell_ms=twell_ms, speedup=dense_ms / ms, equal_to_twell=same)
            rows.append(r)
            print(f"  chunks {n_chunks:2d} side {str(prio):4s}: {ms:.4f} ms  {dense_ms / ms:.2f}x  equal {same}",
                  flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command="python " + " ".join(sys.argv), rows=rows), open(sys.argv[1], "w"), indent=1)
