"""Probe: the sparse up and down of the gated block as matmuls over the union of a token block's active
units, on tensor cores, instead of one up row and one down row gathered per (token, active unit) pair.

For a block of BT tokens with union U_b of active units (sorted ids, built on the host, not timed):
    up:   h[b, t, p] = (x_b @ Wu[U_b]^T)[t, p] * G[b, t, p]     (G: gate values in union coordinates)
    down: out_b = h_b @ WdT[U_b]                                 (WdT = down^T, [I, D])
Uniformly random active units (probability k / I), D 2048 / I 5632; each kernel's best of a small sweep,
against cuBLAS's dense up + down and the dense block in the same process; rel. error against fp32.

    python benchmarks/union_probe.py     (from the repository root; writes $OUT/union_probe.json; env U_TOKENS, U_K)
"""
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, "benchmarks")
from bench_inference import dense, rel_err  # noqa: E402


@triton.jit
def up_union(x_ptr, wu_ptr, uidx_ptr, ucnt_ptr, g_ptr, h_ptr, M, D, CAP,
             BT: tl.constexpr, UC: tl.constexpr, BK: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.load(ucnt_ptr + b)
    if c * UC >= n:
        return
    offs_u = c * UC + tl.arange(0, UC)
    umask = offs_u < n
    units = tl.load(uidx_ptr + b * CAP + offs_u, mask=umask, other=0).to(tl.int64)
    rows = b * BT + tl.arange(0, BT)
    rmask = rows < M
    kk = tl.arange(0, BK)
    acc = tl.zeros([BT, UC], tl.float32)
    for k in range(0, D, BK):
        xk = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + (k + kk)[None, :], mask=rmask[:, None] & ((k + kk) < D)[None, :], other=0.0)
        wk = tl.load(wu_ptr + units[None, :] * D + (k + kk)[:, None], mask=((k + kk) < D)[:, None], other=0.0)
        acc = tl.dot(xk, wk, acc)
    gofs = (b * BT + tl.arange(0, BT))[:, None].to(tl.int64) * CAP + offs_u[None, :]
    g = tl.load(g_ptr + gofs, mask=rmask[:, None] & umask[None, :], other=0.0)
    tl.store(h_ptr + gofs, (acc * g.to(tl.float32)).to(h_ptr.dtype.element_ty), mask=rmask[:, None] & umask[None, :])


@triton.jit
def down_union(h_ptr, wd_ptr, uidx_ptr, ucnt_ptr, out_ptr, M, D, CAP,
               BT: tl.constexpr, UC: tl.constexpr, BD: tl.constexpr):
    d = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.load(ucnt_ptr + b)
    rows = b * BT + tl.arange(0, BT)
    rmask = rows < M
    cols = d * BD + tl.arange(0, BD)
    cmask = cols < D
    uu = tl.arange(0, UC)
    acc = tl.zeros([BT, BD], tl.float32)
    for c in range(0, n, UC):
        um = (c + uu) < n
        units = tl.load(uidx_ptr + b * CAP + c + uu, mask=um, other=0).to(tl.int64)
        hk = tl.load(h_ptr + rows[:, None].to(tl.int64) * CAP + (c + uu)[None, :], mask=rmask[:, None] & um[None, :], other=0.0)
        wk = tl.load(wd_ptr + units[:, None] * D + cols[None, :], mask=um[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(hk, wk, acc)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def build(active, g, BT, UC):
    M, I = active.shape
    nb = triton.cdiv(M, BT)
    pad = nb * BT - M
    a = torch.nn.functional.pad(active, (0, 0, 0, pad)).view(nb, BT, I)
    gg = torch.nn.functional.pad(g, (0, 0, 0, pad)).view(nb, BT, I)
    union = a.any(1)
    cnt = union.sum(1).to(torch.int32)
    cap = triton.cdiv(int(cnt.max()), UC) * UC
    order = torch.argsort((~union).to(torch.int8), dim=1, stable=True)[:, :cap]
    uidx = order.to(torch.int32).contiguous()
    valid = torch.arange(cap, device=g.device)[None, :] < cnt[:, None]
    G = gg.gather(2, order[:, None, :].expand(nb, BT, cap)) * valid[:, None, :]
    return uidx, cnt, G.reshape(nb * BT, cap)[:M].contiguous(), cap, nb


def main():
    dev = "cuda"
    D, I = 2048, 5632
    tokens = [int(t) for t in os.environ.get("U_TOKENS", "16384 4096").split()]
    ks = [int(k) for k in os.environ.get("U_K", "29 98").split()]
    res = []
    torch.manual_seed(0)
    wu = (torch.randn(I, D, device=dev) / D ** 0.5).bfloat16()
    wd = (torch.randn(D, I, device=dev) / 29 ** 0.5).bfloat16()
    wdT = wd.t().contiguous()
    wg = (torch.randn(I, D, device=dev) / D ** 0.5).bfloat16()
    layer = dict(gate=wg, gate_up=torch.cat([wg, wu]), down=wd)  # bench_inference's dense block
    for M, k in itertools.product(tokens, ks):
        x = torch.randn(M, D, device=dev).bfloat16()
        active = torch.rand(M, I, device=dev) < k / I
        g = (torch.rand(M, I, device=dev) * active).bfloat16()
        ref = ((x.float() @ wu.float().t()) * g.float()) @ wd.float().t()

        def dense_updown():
            return ((x @ wu.t()) * g) @ wd.t()

        t_ud = do_bench(dense_updown, warmup=50, rep=300)
        t_blk = do_bench(lambda: dense(x, layer), warmup=50, rep=300)
        t_gate = do_bench(lambda: x @ wg.t(), warmup=50, rep=300)
        print(f"M {M} k {k}: dense block {t_blk*1e3:.0f} us, cuBLAS up+down {t_ud*1e3:.0f}, gate {t_gate*1e3:.0f}", flush=True)
        for BT in (64, 128):
            uidx, cnt, G, cap, nb = build(active, g, BT, 128)
            mean_u = cnt.float().mean().item()
            h = torch.empty(M, cap, device=dev, dtype=torch.bfloat16)
            best_up = None
            for UC, BK, w, st in itertools.product((64, 128), (64, 128), (4, 8), (3, 4)):
                if BT == 128 and UC == 128 and w == 4:
                    continue
                try:
                    f = lambda: up_union[(cap // UC, nb)](x, wu, uidx, cnt, G, h, M, D, cap, BT=BT, UC=UC, BK=BK, num_warps=w, num_stages=st)
                    f()
                    t = do_bench(f, warmup=20, rep=150)
                except Exception as e:
                    print("up fail", BT, UC, BK, w, st, str(e)[:80]); continue
                if best_up is None or t < best_up[0]:
                    best_up = (t, dict(UC=UC, BK=BK, w=w, st=st))
            t, c = best_up
            up_union[(cap // c["UC"], nb)](x, wu, uidx, cnt, G, h, M, D, cap, BT=BT, UC=c["UC"], BK=c["BK"], num_warps=c["w"], num_stages=c["st"])
            out = torch.empty(M, D, device=dev, dtype=torch.bfloat16)
            best_dn = None
            for UC, BD, w, st in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4)):
                if BT == 128 and BD == 256 and w == 4:
                    continue
                try:
                    f = lambda: down_union[(triton.cdiv(D, BD), nb)](h, wdT, uidx, cnt, out, M, D, cap, BT=BT, UC=UC, BD=BD, num_warps=w, num_stages=st)
                    out.fill_(float("nan")); f()
                    t2 = do_bench(f, warmup=20, rep=150)
                except Exception as e:
                    print("down fail", BT, UC, BD, w, st, str(e)[:80]); continue
                if best_dn is None or t2 < best_dn[0]:
                    best_dn = (t2, dict(UC=UC, BD=BD, w=w, st=st))
            c2 = best_dn[1]
            out.fill_(float("nan"))
            down_union[(triton.cdiv(D, c2["BD"]), nb)](h, wdT, uidx, cnt, out, M, D, cap, BT=BT, UC=c2["UC"], BD=c2["BD"], num_warps=c2["w"], num_stages=c2["st"])
            err = rel_err(out, ref)
            r = dict(M=M, k=k, BT=BT, union_mean=mean_u, union_frac=mean_u / I, cap=cap, up_us=t * 1e3, up_cfg=c,
                     down_us=best_dn[0] * 1e3, down_cfg=c2, err=err, dense_block_us=t_blk * 1e3,
                     cublas_updown_us=t_ud * 1e3, cublas_gate_us=t_gate * 1e3)
            print(json.dumps(r), flush=True)
            res.append(r)
    out_dir = os.environ.get("OUT", "/tmp")
    json.dump(dict(device=torch.cuda.get_device_name(), command="python benchmarks/union_probe.py", torch=torch.__version__, triton=triton.__version__, rows=res),
              open(os.path.join(out_dir, "union_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
