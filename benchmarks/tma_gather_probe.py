"""Probe (session 12): how fast can rows be gathered from L2 on an H100, and does a TMA-fed fused up+down
kernel beat the Triton out kernel (one warp a row, register loads: 0.69 ms at 16384 tokens, 5.7 TB/s)?

- `fused`: fused_rows_kernel computes what the batched out kernel computes, out[t] = sum over the row's
  active units j of (g_j * x[t] . up[j]) * down_t[j] (h rounded to the weights' dtype), but fetches each
  (up row, down row) pair by TMA (one 3-D box [1, D/256, 256] a row) into a ring of RING shared-memory
  stages, the refill of a stage issued as soon as every warp holds its copy; its lists are CSR (built here
  in torch from the gate kernel's TwELL, not timed), loaded a ring's worth at a time. Persistent programs
  (per_sm a SM) over contiguous row ranges. Units drawn from the first `span` units only (gate rows past it
  never fire), at the same pairs per row: a smaller span is a smaller L2 working set.
- `spans`, `sms`, `boxes`: gather_only_kernel streams random (up row, down row) pairs through the same ring
  and reads back one 256-column slice of each up row (no arithmetic to speak of): the gathering ceiling,
  against the span of units, the number of SMs streaming, and the box shape (also 16 KB [128, 64]
  swizzled boxes as in a matmul, box_kernel, and up rows by TMA with down rows by register loads at once,
  hybrid_kernel).

    python benchmarks/tma_gather_probe.py --json benchmarks/results/tma_gather_h100.json
"""
import argparse
import importlib
import json
import math
import sys
from statistics import NormalDist

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench

# TMA load into shared memory: Triton 3.6 has only async_copy_global_to_shared, 3.9 only async_load
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
D, I, PAIRS = 2048, 5632, 480_000


@gluon.jit
def _ring(desc, RING: gl.constexpr):
    """RING shared-memory stages shaped like desc's box, with a barrier each."""
    bufs = gl.allocate_shared_memory(desc.dtype, [RING] + desc.block_type.shape, desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(ready.index(i), count=1)
    return bufs, ready


@gluon.jit
def _issue(up_desc, dn_desc, unit, bar, up_buf, dn_buf, live):
    mbarrier.expect(bar, 2 * up_desc.block_type.nbytes, pred=live)
    tma_load(up_desc, [unit, 0, 0], bar, up_buf, pred=live)
    tma_load(dn_desc, [unit, 0, 0], bar, dn_buf, pred=live)


@gluon.jit
def _pick(v, j: gl.constexpr, idx):
    """Element j of a vector every thread holds whole (a thread-local select, no shuffles)."""
    return gl.sum(gl.where(idx == j, v, gl.zeros_like(v)), axis=0)


@gluon.jit
def fused_rows_kernel(x_ptr, g_ptr, unit_ptr, rowptr_ptr, out_ptr, up_desc, dn_desc, M, ROWS,
                      RING: gl.constexpr, num_warps: gl.constexpr):
    """Rows [pid * ROWS, +ROWS) of out (module docstring); stage j of the ring holds the program's pairs j,
    j + RING, ...; the next ring's units and this ring's gate values are loaded once a ring."""
    dtype: gl.constexpr = up_desc.dtype
    NB: gl.constexpr = up_desc.block_type.shape[1]
    C: gl.constexpr = up_desc.block_type.shape[2]
    D: gl.constexpr = NB * C
    up_bufs, ready = _ring(up_desc, RING)
    dn_bufs = gl.allocate_shared_memory(dtype, [RING] + dn_desc.block_type.shape, dn_desc.layout)
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [1, num_warps, 1], [2, 1, 0])
    whole: gl.constexpr = gl.BlockedLayout([RING], [32], [num_warps], [0])  # every thread holds all RING
    ridx = gl.arange(0, RING, layout=whole)
    b = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    offs = gl.expand_dims(gl.expand_dims(b, 0), 2) * C + gl.expand_dims(gl.expand_dims(c, 0), 1)
    r0 = gl.program_id(0) * ROWS
    r1 = gl.minimum(r0 + ROWS, M)
    q0 = gl.load(rowptr_ptr + r0)
    q1 = gl.load(rowptr_ptr + r1)
    units = gl.load(unit_ptr + q0 + ridx, mask=q0 + ridx < q1, other=0)
    for j in gl.static_range(RING):
        _issue(up_desc, dn_desc, _pick(units, j, ridx), ready.index(j), up_bufs.index(j), dn_bufs.index(j),
               q0 + j < q1)
    row = r0
    row_end = gl.load(rowptr_ptr + r0 + 1)
    x = gl.load(x_ptr + row.to(gl.int64) * D + offs).to(gl.float32)
    nxt = gl.minimum(row + 1, M - 1)
    x_next = gl.load(x_ptr + nxt.to(gl.int64) * D + offs)
    end_next = gl.load(rowptr_ptr + nxt + 1)
    acc = gl.zeros([1, NB, C], gl.float32, layout)
    for base in range(q0, q1, RING):
        phase = ((base - q0) // RING) & 1
        units = gl.load(unit_ptr + base + RING + ridx, mask=base + RING + ridx < q1, other=0)
        gs = gl.load(g_ptr + base + ridx, mask=base + ridx < q1, other=0.0).to(gl.float32)
        for j in gl.static_range(RING):
            q = base + j
            if q < q1:
                while q == row_end:  # the row is complete (or empty): write it, move to the next
                    gl.store(out_ptr + row.to(gl.int64) * D + offs, acc.to(dtype))
                    acc = gl.zeros([1, NB, C], gl.float32, layout)
                    row += 1
                    row_end = end_next
                    x = x_next.to(gl.float32)
                    nxt = gl.minimum(row + 1, M - 1)
                    x_next = gl.load(x_ptr + nxt.to(gl.int64) * D + offs)
                    end_next = gl.load(rowptr_ptr + nxt + 1)
                mbarrier.wait(ready.index(j), phase)
                u = up_bufs.index(j).load(layout)
                dn = dn_bufs.index(j).load(layout)
                gl.thread_barrier()  # every warp holds its part of stage j: refill it
                _issue(up_desc, dn_desc, _pick(units, j, ridx), ready.index(j), up_bufs.index(j),
                       dn_bufs.index(j), q + RING < q1)
                dot = gl.sum(gl.sum(gl.sum(u.to(gl.float32) * x, axis=2), axis=1), axis=0)
                h = (_pick(gs, j, ridx) * dot).to(dtype).to(gl.float32)
                acc += h * dn.to(gl.float32)
    while row < r1:  # the last row with pairs, and empty rows after it
        gl.store(out_ptr + row.to(gl.int64) * D + offs, acc.to(dtype))
        acc = gl.zeros([1, NB, C], gl.float32, layout)
        row += 1


@gluon.jit
def gather_only_kernel(unit_ptr, out_ptr, PER, up_desc, dn_desc, RING: gl.constexpr, num_warps: gl.constexpr):
    """PER (up row, down row) pairs of units unit_ptr[pid * PER ...] through the ring; one slice of each read."""
    dtype: gl.constexpr = up_desc.dtype
    up_bufs, ready = _ring(up_desc, RING)
    dn_bufs = gl.allocate_shared_memory(dtype, [RING] + dn_desc.block_type.shape, dn_desc.layout)
    whole: gl.constexpr = gl.BlockedLayout([RING], [32], [num_warps], [0])
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 1, 32], [1, num_warps, 1], [2, 1, 0])
    C: gl.constexpr = up_desc.block_type.shape[2]
    ridx = gl.arange(0, RING, layout=whole)
    q0 = gl.program_id(0) * PER
    q1 = q0 + PER
    units = gl.load(unit_ptr + q0 + ridx)
    for j in gl.static_range(RING):
        _issue(up_desc, dn_desc, _pick(units, j, ridx), ready.index(j), up_bufs.index(j), dn_bufs.index(j), True)
    acc = gl.zeros([1, 1, C], gl.float32, layout)
    for base in range(q0, q1, RING):
        phase = ((base - q0) // RING) & 1
        units = gl.load(unit_ptr + base + RING + ridx, mask=base + RING + ridx < q1, other=0)
        for j in gl.static_range(RING):
            mbarrier.wait(ready.index(j), phase)
            u = up_bufs.index(j).slice(0, 1, dim=1).load(layout)
            acc += u.to(gl.float32)
            gl.thread_barrier()
            _issue(up_desc, dn_desc, _pick(units, j, ridx), ready.index(j), up_bufs.index(j), dn_bufs.index(j),
                   base + RING + j < q1)
    cols = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    gl.store(out_ptr + gl.program_id(0) * 256 + cols[None, None, :], acc)  # keeps the reads alive


@gluon.jit
def box_kernel(blk_ptr, out_ptr, PER, desc, RING: gl.constexpr, num_warps: gl.constexpr):
    """PER boxes of desc at the (row block, column block) pairs numbered blk_ptr[...] (32 column blocks)."""
    BR: gl.constexpr = desc.block_type.shape[0]
    BC: gl.constexpr = desc.block_type.shape[1]
    bufs, ready = _ring(desc, RING)
    whole: gl.constexpr = gl.BlockedLayout([RING], [32], [num_warps], [0])
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    ridx = gl.arange(0, RING, layout=whole)
    q0 = gl.program_id(0) * PER
    q1 = q0 + PER
    blks = gl.load(blk_ptr + q0 + ridx)
    for j in gl.static_range(RING):
        mbarrier.expect(ready.index(j), desc.block_type.nbytes)
        b = _pick(blks, j, ridx)
        tma_load(desc, [(b // 32) * BR, (b % 32) * BC], ready.index(j), bufs.index(j))
    acc = gl.zeros([BR, BC], gl.float32, layout)
    for base in range(q0, q1, RING):
        phase = ((base - q0) // RING) & 1
        blks = gl.load(blk_ptr + base + RING + ridx, mask=base + RING + ridx < q1, other=0)
        for j in gl.static_range(RING):
            mbarrier.wait(ready.index(j), phase)
            acc += bufs.index(j).load(layout).to(gl.float32)
            gl.thread_barrier()
            live = base + RING + j < q1
            b = _pick(blks, j, ridx)
            mbarrier.expect(ready.index(j), desc.block_type.nbytes, pred=live)
            tma_load(desc, [(b // 32) * BR, (b % 32) * BC], ready.index(j), bufs.index(j), pred=live)
    cols = gl.arange(0, BC, layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + gl.program_id(0) * BC + cols[None, :], gl.sum(acc, axis=0)[None, :])


@gluon.jit
def hybrid_kernel(unit_ptr, out_ptr, PER, up_desc, dn_ptr, RING: gl.constexpr, num_warps: gl.constexpr):
    """gather_only_kernel with the down rows loaded into registers instead of by TMA (both summed)."""
    NB: gl.constexpr = up_desc.block_type.shape[1]
    C: gl.constexpr = up_desc.block_type.shape[2]
    up_bufs, ready = _ring(up_desc, RING)
    whole: gl.constexpr = gl.BlockedLayout([RING], [32], [num_warps], [0])
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [1, num_warps, 1], [2, 1, 0])
    ridx = gl.arange(0, RING, layout=whole)
    b = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    offs = gl.expand_dims(gl.expand_dims(b, 0), 2) * C + gl.expand_dims(gl.expand_dims(c, 0), 1)
    q0 = gl.program_id(0) * PER
    q1 = q0 + PER
    units = gl.load(unit_ptr + q0 + ridx)
    for j in gl.static_range(RING):
        mbarrier.expect(ready.index(j), up_desc.block_type.nbytes)
        tma_load(up_desc, [_pick(units, j, ridx), 0, 0], ready.index(j), up_bufs.index(j))
    acc = gl.zeros([1, NB, C], gl.float32, layout)
    for base in range(q0, q1, RING):
        phase = ((base - q0) // RING) & 1
        cur = units
        units = gl.load(unit_ptr + base + RING + ridx, mask=base + RING + ridx < q1, other=0)
        for j in gl.static_range(RING):
            dn = gl.load(dn_ptr + _pick(cur, j, ridx).to(gl.int64) * (NB * C) + offs)
            mbarrier.wait(ready.index(j), phase)
            u = up_bufs.index(j).load(layout)
            gl.thread_barrier()
            live = base + RING + j < q1
            mbarrier.expect(ready.index(j), up_desc.block_type.nbytes, pred=live)
            tma_load(up_desc, [_pick(units, j, ridx), 0, 0], ready.index(j), up_bufs.index(j), pred=live)
            acc += u.to(gl.float32) + dn.to(gl.float32)
    gl.store(out_ptr + gl.program_id(0).to(gl.int64) * (NB * C) + offs, acc)


def csr_from_twell(tw):
    """(units, gate values, row pointers) of the TwELL's fitting slots, in row, tile, slot order."""
    slot = torch.arange(tw.values.shape[2], device=tw.values.device)
    live = slot[None, None, :] < tw.counts[:, :, None]
    rowptr = torch.zeros(tw.counts.shape[0] + 1, dtype=torch.int32, device=tw.counts.device)
    rowptr[1:] = tw.counts.sum(1).cumsum(0)
    return tw.indices[live].int().contiguous(), tw.values[live].contiguous(), rowptr


def row_desc(w, inner=256):
    """A descriptor whose box is one whole row of w [n, D], viewed as [n, D / inner, inner]."""
    n, d = w.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
    return TensorDescriptor.from_tensor(w.view(n, d // inner, inner), [1, d // inner, inner], layout)


def ms(fn):
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def fused(sms):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import twell
    from bench_inference import gate_pack, make_x, twell_out
    G = importlib.import_module("twell.gated_mlp")
    rows = []
    for m in (16384, 4096):
        x = make_x(m, D)
        for span in (I, I // 4):
            gate = torch.randn(I, D, device="cuda") / math.sqrt(D)
            gate[:, 0] = -NormalDist().inv_cdf(1 - 29 / span)
            gate[span:, 0] = -30.0
            w = dict(gate=gate.bfloat16(), up=(torch.randn(I, D, device="cuda") / math.sqrt(D)).bfloat16(),
                     down=(torch.randn(D, I, device="cuda") / math.sqrt(29)).bfloat16())
            w["down_p"] = twell.prepare_down(w["down"])
            packed = gate_pack(x, w["gate"], 128, 8, G.gate_config(m, 128, 2, decode=False))
            ocfg = G.out_config(m, D, decode=False)
            ref = twell_out(x, packed, w, ocfg).float()
            units, g, rowptr = csr_from_twell(packed[0])
            descs = row_desc(w["up"]), row_desc(w["down_p"].t())
            row = dict(M=m, span=span, pairs=units.numel(), triton_out_ms=ms(lambda: twell_out(x, packed, w, ocfg)),
                       variants=[])
            for warps, ring, per_sm in ((4, 2, 12), (4, 4, 4), (2, 4, 6), (1, 4, 6)):
                per = triton.cdiv(m, per_sm * sms)
                out = torch.full_like(x, float("nan"))

                def run():
                    fused_rows_kernel[(triton.cdiv(m, per),)](x, g, units, rowptr, out, *descs, m, per,
                                                              RING=ring, num_warps=warps)
                run()
                t = ms(run)
                row["variants"].append(dict(warps=warps, ring=ring, per_sm=per_sm, ms=t,
                                            TBps=row["pairs"] * 4 * D / t / 1e9,
                                            rel_err_vs_triton_out=((out.float() - ref).norm() / ref.norm()).item()))
            print(row, flush=True)
            rows.append(row)
    return rows


def gather(sms):
    up = torch.randn(I, D, device="cuda").bfloat16()
    dn = torch.randn(I, D, device="cuda").bfloat16()
    rows = []

    def case(kind, span, progs, ring, warps, inner=256):
        per = (PAIRS // progs) // ring * ring
        units = torch.randint(0, span, (progs * per + ring,), device="cuda", dtype=torch.int32)
        descs = row_desc(up, inner), row_desc(dn, inner)
        out = torch.empty(progs, 256, device="cuda")
        t = ms(lambda: gather_only_kernel[(progs,)](units, out, per, *descs, RING=ring, num_warps=warps))
        rows.append(dict(kind=kind, span=span, programs=progs, ring=ring, warps=warps, inner=inner,
                         pairs=progs * per, ms=t, TBps=progs * per * 4 * D / t / 1e9))
        print(rows[-1], flush=True)

    for span in (64, 256, 704, 1408, 2816, 5632):
        case("spans", span, 6 * sms, 4, 1)
    for progs in (sms, sms // 2, sms // 4):  # one program an SM (a 16-stage ring fills its shared memory)
        case("sms", I, progs, 16, 1)
    for inner in (64, 32):
        case("boxes", I, 6 * sms, 4, 1, inner)
    # 16 KB boxes [128, 64] at random row blocks of [up; down]: the same bytes as PAIRS pairs
    w = torch.cat([up, dn])
    desc = TensorDescriptor.from_tensor(w, [128, 64], gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16))
    for warps, ring, per_sm in ((4, 4, 2), (4, 2, 3)):
        progs = per_sm * sms
        per = (PAIRS // 2 // progs) // ring * ring
        blocks = torch.randint(0, (w.shape[0] // 128) * (D // 64), (progs * per + ring,), device="cuda",
                               dtype=torch.int32)
        out = torch.empty(progs, 64, device="cuda")
        t = ms(lambda: box_kernel[(progs,)](blocks, out, per, desc, RING=ring, num_warps=warps))
        rows.append(dict(kind="boxes_128x64", programs=progs, ring=ring, warps=warps, ms=t,
                         TBps=progs * per * 16384 / t / 1e9))
        print(rows[-1], flush=True)
    for warps, ring, per_sm in ((4, 4, 6), (2, 4, 6)):
        progs = per_sm * sms
        per = (PAIRS // progs) // ring * ring
        units = torch.randint(0, I, (progs * per + ring,), device="cuda", dtype=torch.int32)
        out = torch.empty(progs, D, device="cuda")
        t = ms(lambda: hybrid_kernel[(progs,)](units, out, per, row_desc(up), dn, RING=ring, num_warps=warps))
        rows.append(dict(kind="hybrid", span=I, programs=progs, ring=ring, warps=warps, ms=t,
                         TBps=progs * per * 4 * D / t / 1e9))
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  command="python benchmarks/tma_gather_probe.py --json " + args.json, D=D, I=I)
    result["fused"] = fused(sms)
    result["gather"] = gather(sms)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
