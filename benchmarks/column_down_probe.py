"""Probe (not adopted): a down pass over the union of the rows' active units for 16-64 decode rows, in
place of the decode out kernel's per-row gathers. Its input is what a decode gate program could store per
tile: the tile's active columns compacted (count, unit ids, h [rows, T] at those columns; built here in
PyTorch). Programs own BD output columns and 1/KS of the tiles, TG tiles a step: h [rows, TG * T] times
the active units' down rows [TG * T, BD] on tensor cores, the next step's counts, ids and h loaded before
this step's down rows; KS fp32 partials summed by a second launch in a fixed order (deterministic).
Each down row is read once per output chunk instead of once per (row, unit) pair, but the pass stays
latency-bound: 9-10 us at 16 rows and 16.6 at 64 (D 2048 / I 5632) against the out kernel's 6 and 16.8
(benchmarks/NOTES-inference.md, session 13). Per layer over 8 layer copies replayed as CUDA graphs, both
launches; rel. error against h @ down^T in fp32.

    python benchmarks/column_down_probe.py --json benchmarks/results/column_down_h100.json
"""
import argparse
import json
import sys
import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_inference import LAYERS, make_layer, make_x, save_rows  # noqa: E402

@triton.jit
def _step_loads(t, t_hi, c, r, n_ptr, ids_ptr, hc_ptr, BM: tl.constexpr, T: tl.constexpr):
    on = t < t_hi
    n = tl.load(n_ptr + t, mask=on, other=0)
    ids = tl.load(ids_ptr + t * T + c, mask=on, other=0)
    h = tl.load(hc_ptr + (t * BM)[None, :] * T + r[:, None] * T + c[None, :], mask=on[None, :], other=0.0)
    return n, ids, h

@triton.jit
def coldown(hc_ptr, ids_ptr, n_ptr, down_ptr, part_ptr, M, D, NT, TPS,
            BM: tl.constexpr, T: tl.constexpr, TG: tl.constexpr, BD: tl.constexpr):
    pid_d = tl.program_id(0)
    ks = tl.program_id(1)
    r = tl.arange(0, BM)
    do = pid_d * BD + tl.arange(0, BD)
    omask = do < D
    s = tl.arange(0, TG * T)          # slots of TG tiles
    ts_in = s // T
    c = s % T
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    t_lo = ks * TPS
    t_hi = tl.minimum(NT, t_lo + TPS)
    n, ids, h = _step_loads(t_lo + ts_in, t_hi, c, r, n_ptr, ids_ptr, hc_ptr, BM, T)
    for t0 in range(t_lo, t_hi, TG):
        n2, ids2, h2 = _step_loads(t0 + TG + ts_in, t_hi, c, r, n_ptr, ids_ptr, hc_ptr, BM, T)
        live = c < n
        dw = tl.load(down_ptr + ids[:, None].to(tl.int64) * D + do[None, :], mask=live[:, None] & omask[None, :], other=0.0)
        acc = tl.dot(tl.where(live[None, :], h, 0.0).to(dw.dtype), dw, acc)
        n, ids, h = n2, ids2, h2
    tl.store(part_ptr + (ks * M + r[:, None]) * D + do[None, :], acc, mask=(r < M)[:, None] & omask[None, :])

@triton.jit
def reduce_parts(part_ptr, out_ptr, N, KS: tl.constexpr, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < N
    acc = tl.zeros((B,), dtype=tl.float32)
    for k in tl.static_range(KS):
        acc += tl.load(part_ptr + k * N + o, mask=m, other=0.0)
    tl.store(out_ptr + o, acc.to(out_ptr.dtype.element_ty), mask=m)

def compact(x, w, ts, T=64):
    """A decode gate program's tiles of `ts` units as compacted active columns (h rounded like the kernel's)."""
    m, d = x.shape
    i = w["gate"].shape[0]
    g = torch.relu(x.float() @ w["gate"].float().t()).bfloat16().float()
    h = (g * (x.float() @ w["up"].float().t())).bfloat16()
    nt = triton.cdiv(i, ts)
    bm = max(16, triton.next_power_of_2(m))
    hc = torch.zeros(nt, bm, T, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(nt, T, dtype=torch.int32, device="cuda")
    n = torch.zeros(nt, dtype=torch.int32, device="cuda")
    for t in range(nt):
        cols = torch.arange(t * ts, min(i, t * ts + ts), device="cuda")
        on = cols[(g[:, cols] > 0).any(0)]
        n[t] = len(on); ids[t, :len(on)] = on.int(); hc[t, :m, :len(on)] = h[:, on]
    return hc, ids, n, h, bm

def us(fn):
    return do_bench_cudagraph(fn, rep=40, return_mode="median") / LAYERS * 1e3

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    res = []
    for d, i, ms in ((2048, 5632, (16, 32, 64)), (4096, 14336, (16, 32, 64))):
        layers = [make_layer(d, i, 29) for _ in range(LAYERS)]
        for m in ms:
            x = make_x(m, d)
            ts = min(64, max(triton.cdiv(i, 132), 32)) if m > 16 else 64
            data = [compact(x, lw, ts) for lw in layers]
            nt = triton.cdiv(i, ts)
            ref = (data[0][3].float() @ layers[0]["down"].float().t())
            for bd in (64, 128, 256):
                for tg in (1, 4):
                    for ks in (8, 16, 33):
                        bm = data[0][4]
                        tps = triton.cdiv(triton.cdiv(nt, ks), tg) * tg
                        ksr = triton.cdiv(nt, tps)
                        parts = [torch.empty(ksr, m, d, device="cuda") for _ in layers]
                        outs = [torch.empty(m, d, device="cuda", dtype=torch.bfloat16) for _ in layers]
                        def f():
                            for (hc, ids, n, _, _), lw, p, o in zip(data, layers, parts, outs):
                                coldown[(triton.cdiv(d, bd), ksr)](hc, ids, n, lw["down_p"].t(), p, m, d, nt, tps, BM=bm, T=64, TG=tg, BD=bd, num_warps=4 if bd * tg <= 128 else 8)
                                reduce_parts[(triton.cdiv(m * d, 1024),)](p, o, m * d, KS=ksr, B=1024)
                        try:
                            t = us(f)
                            err = ((outs[0].float() - ref).norm() / ref.norm()).item()
                        except Exception as e:
                            t, err = str(e)[:60], None
                        row = dict(D=d, I=i, M=m, BD=bd, TG=tg, KS=ksr, us=t, err=err)
                        res.append(row)
            best = sorted([r for r in res if r["D"] == d and r["M"] == m and isinstance(r["us"], float)], key=lambda r: r["us"])[:5]
            for r in best: print(json.dumps(r), flush=True)
    save_rows(args.json, "column_down_probe.py", res)


if __name__ == "__main__":
    main()
