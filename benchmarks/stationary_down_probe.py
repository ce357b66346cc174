"""Probe (session 11): a weight-stationary down pass, out = H @ down^T for a given sparse H, in Gluon (H100).

Each program holds a 16-column slice of down^T ([I, 16], all of I: 180 KB at I 5632) in shared memory,
loaded by TMA, and walks the (unit, h) lists of BT tokens, one lane a token, reading its units' 32-byte slice
rows from shared memory and accumulating 16 outputs. Gluon 3.6 has no per-thread gather from shared memory,
so the reads are inline-asm ld.shared at global_smem + row offset: the slice is the kernel's first
allocation (offset 0, checked in the PTX), and `_keep_alive` keeps Triton's allocator from reusing it for
scratch while the asm reads it (without it, the reduction scratch landed at offset 0).
- `down_ws_kernel` ("csr", "csr-ablation"): per-token CSR lists (int32 unit, fp32 h).
- `down_ell_kernel` ("ell"): slot-major lists per block of tokens (one int32 a pair: bf16 h bits << 16 |
  unit), so a warp's list loads are coalesced.
MODE 1 replaces the shared-memory reads by arithmetic, MODE 2 skips the pair walk (slice loads and output
stores only). Usage: python benchmarks/stationary_down_probe.py csr|csr-ablation|ell (writes $OUT JSON).
Findings: benchmarks/NOTES-inference.md, session 11."""
import sys, time, json, os
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

DS = 16
BOX = 256
LDS2 = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $8; "
        "ld.shared.v4.b32 {$0,$1,$2,$3}, [a]; ld.shared.v4.b32 {$4,$5,$6,$7}, [a+16]; }")


@gluon.jit
def _lo(v):
    return (v << 16).to(gl.float32, bitcast=True)


@gluon.jit
def _hi(v):
    return (v & -65536).to(gl.float32, bitcast=True)


@gluon.jit
def _load_slice(w_desc, buf, s, I_PAD: gl.constexpr):
    """Columns 16 s .. 16 s + 15 of all of down^T's rows into buf, by TMA (rows past I read as zeros)."""
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, I_PAD * 32)
    for q in gl.static_range(I_PAD // 256):
        tma_load(w_desc, [q * 256, s * 16], bar, buf.index(q))
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)


@gluon.jit
def _zeros16(NT: gl.constexpr, Lt: gl.constexpr):
    z = gl.zeros([NT], gl.float32, Lt)
    return z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z


@gluon.jit
def _slice_rows(j, OFFSET: gl.constexpr, MODE: gl.constexpr):
    """Unit j's 16-column slice row (16 bf16) as 8 int32 pairs; MODE 1: arithmetic instead of the reads."""
    if MODE == 1:
        return j, j + 1, j + 2, j + 3, j + 4, j + 5, j + 6, j + 7
    else:
        return gl.inline_asm_elementwise(LDS2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [j * 32 + OFFSET],
                                         dtype=(gl.int32,) * 8, is_pure=False, pack=1)


@gluon.jit
def _accumulate(h, v0, v1, v2, v3, v4, v5, v6, v7, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """The 16 column sums += h * row, over the step's pairs (axis 1)."""
    a0 += gl.sum(h * _lo(v0), axis=1)
    a1 += gl.sum(h * _hi(v0), axis=1)
    a2 += gl.sum(h * _lo(v1), axis=1)
    a3 += gl.sum(h * _hi(v1), axis=1)
    a4 += gl.sum(h * _lo(v2), axis=1)
    a5 += gl.sum(h * _hi(v2), axis=1)
    a6 += gl.sum(h * _lo(v3), axis=1)
    a7 += gl.sum(h * _hi(v3), axis=1)
    a8 += gl.sum(h * _lo(v4), axis=1)
    a9 += gl.sum(h * _hi(v4), axis=1)
    a10 += gl.sum(h * _lo(v5), axis=1)
    a11 += gl.sum(h * _hi(v5), axis=1)
    a12 += gl.sum(h * _lo(v6), axis=1)
    a13 += gl.sum(h * _hi(v6), axis=1)
    a14 += gl.sum(h * _lo(v7), axis=1)
    a15 += gl.sum(h * _hi(v7), axis=1)
    return a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15


@gluon.jit
def _tile16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, col, NT: gl.constexpr, LO: gl.constexpr):
    """The 16 column sums as one [NT, 16] tile, a lane's 16 outputs contiguous (one store a token)."""
    o = gl.zeros([NT, 16], gl.float32, LO)
    o = gl.where(col == 0, gl.convert_layout(a0, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 1, gl.convert_layout(a1, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 2, gl.convert_layout(a2, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 3, gl.convert_layout(a3, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 4, gl.convert_layout(a4, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 5, gl.convert_layout(a5, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 6, gl.convert_layout(a6, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 7, gl.convert_layout(a7, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 8, gl.convert_layout(a8, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 9, gl.convert_layout(a9, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 10, gl.convert_layout(a10, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 11, gl.convert_layout(a11, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 12, gl.convert_layout(a12, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 13, gl.convert_layout(a13, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 14, gl.convert_layout(a14, gl.SliceLayout(1, LO))[:, None], o)
    o = gl.where(col == 15, gl.convert_layout(a15, gl.SliceLayout(1, LO))[:, None], o)
    return o


@gluon.jit
def down_ws_kernel(w_desc, ptr_ptr, units_ptr, h_ptr, out_ptr, M, D,
                   I_PAD: gl.constexpr, BT: gl.constexpr, U: gl.constexpr, OFFSET: gl.constexpr, MODE: gl.constexpr = 0):
    s = gl.program_id(0)
    b = gl.program_id(1)
    buf = gl.allocate_shared_memory(gl.bfloat16, [I_PAD // 256, 256, 16], w_desc.layout)
    _load_slice(w_desc, buf, s, I_PAD)
    L: gl.constexpr = gl.BlockedLayout([1, U], [32, 1], [gl.num_warps(), 1], [1, 0])
    Lt: gl.constexpr = gl.SliceLayout(1, L)
    Lu: gl.constexpr = gl.SliceLayout(0, L)
    LO: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [gl.num_warps(), 1], [1, 0])
    NT: gl.constexpr = 32 * gl.num_warps()
    lane = gl.arange(0, NT, Lt)
    ku = gl.arange(0, U, Lu)
    for r in range(BT // NT):
        t = b * BT + r * NT + lane
        tm = t < M
        start = gl.load(ptr_ptr + t, mask=tm, other=0)
        n = gl.load(ptr_ptr + t + 1, mask=tm, other=0) - start
        if MODE == 2:
            n = n * 0
        nmax = gl.max(n, axis=0)
        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = _zeros16(NT, Lt)
        for i in range(0, nmax, U):
            k = i + ku[None, :]
            m = k < n[:, None]
            p = start[:, None] + k
            j = gl.load(units_ptr + p, mask=m, other=0)
            h = gl.load(h_ptr + p, mask=m, other=0.0)
            v0, v1, v2, v3, v4, v5, v6, v7 = _slice_rows(j, OFFSET, MODE)
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = _accumulate(h, v0, v1, v2, v3, v4, v5, v6, v7, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
        col = gl.arange(0, 16, gl.SliceLayout(0, LO))[None, :]
        o = _tile16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, col, NT, LO)
        to = b * BT + r * NT + gl.arange(0, NT, gl.SliceLayout(1, LO))
        gl.store(out_ptr + to[:, None] * D + s * 16 + col, o.to(out_ptr.dtype.element_ty), mask=(to < M)[:, None])
    buf._keep_alive()  # read by the inline asm, which Triton's allocator does not see


@gluon.jit
def down_ell_kernel(w_desc, ell_ptr, start_ptr, nmax_ptr, out_ptr, M, D,
                    I_PAD: gl.constexpr, R: gl.constexpr, U: gl.constexpr, OFFSET: gl.constexpr, MODE: gl.constexpr):
    """v2: ELL lists per block of NT tokens, slot-major ([blk, slot, lane] int32: bf16 h bits << 16 | unit),
    so a warp's list loads are coalesced; per-block slot counts precomputed."""
    s = gl.program_id(0)
    b = gl.program_id(1)
    buf = gl.allocate_shared_memory(gl.bfloat16, [I_PAD // 256, 256, 16], w_desc.layout)
    _load_slice(w_desc, buf, s, I_PAD)
    NT: gl.constexpr = 32 * gl.num_warps()
    L: gl.constexpr = gl.BlockedLayout([1, U], [32, 1], [gl.num_warps(), 1], [0, 1])
    Lt: gl.constexpr = gl.SliceLayout(1, L)
    Lu: gl.constexpr = gl.SliceLayout(0, L)
    LO: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [gl.num_warps(), 1], [1, 0])
    lane = gl.arange(0, NT, Lt)
    ku = gl.arange(0, U, Lu)
    for r in range(R):
        blk = b * R + r
        nmax = gl.load(nmax_ptr + blk)
        if MODE == 2:
            nmax = 0
        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = _zeros16(NT, Lt)
        off0 = gl.load(start_ptr + blk)
        for i in range(0, nmax, U):
            k = i + ku[None, :]
            w = gl.load(ell_ptr + (off0 + k * NT + lane[:, None]), mask=k < nmax, other=0)
            j = w & 65535
            h = (w & -65536).to(gl.float32, bitcast=True)
            v0, v1, v2, v3, v4, v5, v6, v7 = _slice_rows(j, OFFSET, MODE)
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = _accumulate(h, v0, v1, v2, v3, v4, v5, v6, v7, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
        col = gl.arange(0, 16, gl.SliceLayout(0, LO))[None, :]
        o = _tile16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, col, NT, LO)
        to = blk * NT + gl.arange(0, NT, gl.SliceLayout(1, LO))
        gl.store(out_ptr + to[:, None] * D + s * 16 + col, o.to(out_ptr.dtype.element_ty), mask=(to < M)[:, None])
    buf._keep_alive()


def make_ell(units, h, M, NT):
    """[M, k] units and h -> slot-major ELL per block of NT tokens (uniform k here)."""
    k = units.shape[1]
    nb = triton.cdiv(M, NT)
    w = (h.to(torch.bfloat16).view(torch.int16).to(torch.int32) << 16) | units.to(torch.int32)
    w = torch.nn.functional.pad(w, (0, 0, 0, nb * NT - M)).view(nb, NT, k).permute(0, 2, 1).contiguous()
    nmax = torch.full((nb,), k, dtype=torch.int32, device=units.device)
    start = torch.arange(nb, dtype=torch.int32, device=units.device) * (k * NT)
    return w.view(-1), start, nmax


def down_ell(wt, ell, start, nmax, M, R, U, warps, mode=0):
    I, D = wt.shape
    i_pad = triton.cdiv(I, 256) * 256
    lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor.from_tensor(wt, [256, 16], lay)
    out = torch.full((M, D), float("nan"), device=wt.device, dtype=wt.dtype)
    nt = 32 * warps
    grid = (D // 16, triton.cdiv(triton.cdiv(M, nt), R))
    down_ell_kernel[grid](desc, ell, start, nmax, out, M, D, I_PAD=i_pad, R=R, U=U, OFFSET=0, MODE=mode, num_warps=warps)
    return out


def down_ws(wt, ptr, units, h, M, BT, U, warps, offset=0, mode=0):
    I, D = wt.shape
    i_pad = triton.cdiv(I, 256) * 256
    lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor.from_tensor(wt, [256, 16], lay)
    out = torch.full((M, D), float("nan"), device=wt.device, dtype=wt.dtype)
    grid = (D // 16, triton.cdiv(M, BT))
    down_ws_kernel[grid](desc, ptr, units, h, out, M, D, I_PAD=i_pad, BT=BT, U=U, OFFSET=offset, MODE=mode, num_warps=warps)
    return out


def problem(D, I, M, k, dev="cuda"):
    """down^T, each token's k active units (uniform, distinct, sorted) and h, and the fp32 reference."""
    down = torch.randn(D, I, device=dev, dtype=torch.bfloat16) / I ** 0.5
    wt = down.t().contiguous()
    units = torch.rand(M, I, device=dev).topk(k, dim=1).indices.sort(dim=1).values.to(torch.int32)
    h = torch.randn(M, k, device=dev)
    H = torch.zeros(M, I, device=dev)
    H.scatter_(1, units.long(), h)
    return wt, units, h, H


SWEEPS = {  # (BT or R, U, warps) per sweep; modes: 0 whole kernel, 1 no shared-memory reads, 2 no pair walk
    "csr": ([(bt, u, w) for bt in (512, 1024, 2048) for u in (2, 4) for w in (4, 8)], (0,), (16384, 4096)),
    "csr-ablation": ([(1024, 4, 8), (2048, 4, 8), (1024, 4, 16), (2048, 8, 8)], (0, 1, 2), (16384,)),
    "ell": ([(4, 4, 8), (8, 4, 8), (8, 8, 8), (2, 4, 16), (4, 4, 16), (16, 4, 4)], (0, 1, 2), (16384, 4096)),
}


def main():
    sweep = sys.argv[1] if len(sys.argv) > 1 else "ell"
    configs, modes, sizes = SWEEPS[sweep]
    torch.manual_seed(0)
    D, I, k = 2048, 5632, 29
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command=f"python benchmarks/stationary_down_probe.py {sweep}", rows=[])
    for M in sizes:
        wt, units, h, H = problem(D, I, M, k)
        t_dense = triton.testing.do_bench(lambda: H.to(torch.bfloat16) @ wt, warmup=25, rep=200)
        if sweep == "ell":  # h travels as bf16 there: the reference rounds it too
            H = torch.zeros_like(H).scatter_(1, units.long(), h.to(torch.bfloat16).float())
        ref = H @ wt.float()
        ptr = torch.arange(0, M + 1, device=wt.device, dtype=torch.int32) * k
        for (blocks, U, warps) in configs:
            if sweep == "ell":
                ell, start, nmax = make_ell(units, h, M, 32 * warps)
                run = lambda mode: down_ell(wt, ell, start, nmax, M, blocks, U, warps, mode=mode)
                bt = blocks * 32 * warps
            else:
                run = lambda mode: down_ws(wt, ptr, units.view(-1), h.view(-1), M, blocks, U, warps, mode=mode)
                bt = blocks
            for mode in modes:
                out = run(mode)
                err = ((out.float() - ref).norm() / ref.norm()).item() if mode == 0 else None
                t = triton.testing.do_bench(lambda: run(mode), warmup=25, rep=200)
                row = dict(kernel=sweep, D=D, I=I, M=M, k=k, BT=bt, U=U, warps=warps, mode=mode, ms=t, err=err,
                           dense_down_ms=t_dense)
                print(row, flush=True)
                res["rows"].append(row)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"stationary_down_{sweep}.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
