"""Probe (session 4; not part of the kernels): a weight-stationary sparse up / down for the batched block.

Each program holds one D-slice of the down (or up) weight in a slice-major layout small enough for an SM's
L1 and walks every active (token, unit) pair, so that weights would be read once instead of one 4 KB row
per pair (the current out kernel's 3.9 GB of L2 gathers at 16384 tokens). D=2048, I=5632, M=16384, 29
uniformly random active units per token. Measures the gather side only: down sums its products per program
(no segmented reduction), up stores one partial dot per (pair, slice) and times their reduction apart.
Compare with the out kernel's 0.70 ms for up and down together (results/inference_h100.json).

  python benchmarks/weight_stationary_probe.py    # GPU; writes $OUT/ws_probe.json (results/ws_probe_h100.json)
"""
import json
import math
import os
from statistics import NormalDist

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

@triton.jit
def ws_down(col_ptr, h_ptr, w_ptr, sink_ptr, NNZ, I, P: tl.constexpr, BD: tl.constexpr, SLICE_MAJOR: tl.constexpr,
            D, STAGES: tl.constexpr):
    s = tl.program_id(0)
    dd = tl.arange(0, BD)
    pp = tl.arange(0, P)
    acc = tl.zeros((BD,), dtype=tl.float32)
    for p0 in tl.range(0, NNZ, P, num_stages=STAGES):
        p = p0 + pp
        m = p < NNZ
        j = tl.load(col_ptr + p, mask=m, other=0)
        h = tl.load(h_ptr + p, mask=m, other=0.0).to(tl.float32)
        if SLICE_MAJOR:
            w = tl.load(w_ptr + s.to(tl.int64) * I * BD + j[:, None] * BD + dd[None, :], mask=m[:, None], other=0.0)
        else:
            w = tl.load(w_ptr + j[:, None].to(tl.int64) * D + s * BD + dd[None, :], mask=m[:, None], other=0.0)
        acc += tl.sum(h[:, None] * w.to(tl.float32), axis=0)
    tl.store(sink_ptr + s * BD + dd, acc)

@triton.jit
def ws_up(row_ptr, col_ptr, x_ptr, w_ptr, part_ptr, seg_ptr, NNZ, I, D, R, RW,
          P: tl.constexpr, BDU: tl.constexpr, STAGES: tl.constexpr):
    s = tl.program_id(0)
    r = tl.program_id(1)
    kk = tl.arange(0, BDU)
    pp = tl.arange(0, P)
    lo = tl.load(seg_ptr + r)
    hi = tl.load(seg_ptr + r + 1)
    wbase = w_ptr + (s.to(tl.int64) * I + r * RW) * BDU  # slice s, units of range r, contiguous
    for p0 in tl.range(lo, hi, P, num_stages=STAGES):
        p = p0 + pp
        m = p < hi
        t = tl.load(row_ptr + p, mask=m, other=0)
        j = tl.load(col_ptr + p, mask=m, other=0) - r * RW
        xs = tl.load(x_ptr + t[:, None].to(tl.int64) * D + s * BDU + kk[None, :], mask=m[:, None], other=0.0)
        w = tl.load(wbase + j[:, None] * BDU + kk[None, :], mask=m[:, None], other=0.0)
        part = tl.sum(xs.to(tl.float32) * w.to(tl.float32), axis=1)
        tl.store(part_ptr + s.to(tl.int64) * NNZ + p, part, mask=m)

def main():
    torch.manual_seed(0)
    D, I, M, k = 2048, 5632, 16384, 29
    dev = "cuda"
    x = torch.randn(M, D, device=dev); x[:, 0] = 1
    gate = torch.randn(I, D, device=dev) / math.sqrt(D); gate[:, 0] = -NormalDist().inv_cdf(1 - k / I)
    up = (torch.randn(I, D, device=dev) / math.sqrt(D)).bfloat16()
    down = (torch.randn(D, I, device=dev) / math.sqrt(k)).bfloat16()
    x = x.bfloat16(); gate = gate.bfloat16()
    g = torch.relu(x.float() @ gate.float().t())
    nz = g.nonzero()  # row-major: sorted by row, then unit
    rows, cols = nz[:, 0].int().contiguous(), nz[:, 1].int().contiguous()
    gv = g[nz[:, 0], nz[:, 1]]
    nnz = rows.numel()
    u_ref = (x.float()[nz[:, 0]] * up.float()[nz[:, 1]]).sum(1)
    h = (gv * u_ref).bfloat16().contiguous()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, nnz=nnz)
    print("nnz", nnz, "mean/row", nnz / M, flush=True)
    # --- down: per-program sums check against torch
    down_t = down.t().contiguous()  # [I, D]
    for bd in (16, 8):
        wds = down_t.view(I, D // bd, bd).permute(1, 0, 2).contiguous()  # [D/bd, I, bd]
        ref = (h.float()[:, None] * down_t.float()[cols.long()]).sum(0)  # [D]
        for sm in (True, False):
            for P, st, nw in ((128, 1, 4), (256, 3, 4), (512, 3, 8), (256, 4, 8), (1024, 3, 8)):
                sink = torch.full((D,), float("nan"), device=dev)
                fn = lambda: ws_down[(D // bd,)](cols, h, wds if sm else down_t, sink, nnz, I, P=P, BD=bd,
                                                 SLICE_MAJOR=sm, D=D, STAGES=st, num_warps=nw)
                try:
                    fn(); torch.cuda.synchronize()
                    err = ((sink - ref).norm() / ref.norm()).item()
                    ms = do_bench(fn, return_mode="median")
                    print(f"down BD={bd} slice_major={sm} P={P} stages={st} warps={nw}: {ms*1e3:.1f} us "
                          f"err {err:.1e}", flush=True)
                    res[f"down_bd{bd}_sm{int(sm)}_P{P}_st{st}_w{nw}_us"] = ms * 1e3
                except Exception as e:
                    print(f"down BD={bd} sm={sm} P={P}: failed {type(e).__name__} {str(e)[:100]}", flush=True)
    # --- up partials: ranges of RW units (tile-aligned), entries sorted by (range, row)
    for bdu, rw in ((64, 1408), (32, 2816), (16, 5632)):
        R = math.ceil(I / rw)
        rng = cols // rw
        order = torch.sort(rng.long() * M + rows.long(), stable=True).indices
        rows_r, cols_r = rows[order].contiguous(), cols[order].contiguous()
        seg = torch.zeros(R + 1, dtype=torch.int32, device=dev)
        seg[1:] = torch.bincount(rng.long(), minlength=R).cumsum(0).int()
        wus = up.view(I, D // bdu, bdu).permute(1, 0, 2).contiguous()  # [D/bdu, I, bdu]
        for P, st, nw in ((128, 3, 4), (256, 3, 8), (64, 4, 4)):
            part = torch.full((D // bdu, nnz), float("nan"), device=dev)
            fn = lambda: ws_up[(D // bdu, R)](rows_r, cols_r, x, wus, part, seg, nnz, I, D, R, rw, P=P, BDU=bdu,
                                              STAGES=st, num_warps=nw)
            try:
                fn(); torch.cuda.synchronize()
                u = part.sum(0)
                err = ((u - u_ref[order]).norm() / u_ref.norm()).item()
                ms = do_bench(fn, return_mode="median")
                red = do_bench(lambda: part.sum(0), return_mode="median")
                print(f"up BDU={bdu} RW={rw} P={P} stages={st} warps={nw}: {ms*1e3:.1f} us (+ reduce {red*1e3:.1f} us, "
                      f"{part.numel()*4/1e6:.0f} MB partials) err {err:.1e}", flush=True)
                res[f"up_bdu{bdu}_P{P}_st{st}_w{nw}_us"] = ms * 1e3
                res[f"up_bdu{bdu}_reduce_us"] = red * 1e3
            except Exception as e:
                print(f"up BDU={bdu} P={P}: failed {type(e).__name__} {str(e)[:100]}", flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "ws_probe.json"), "w"), indent=1)

main()
