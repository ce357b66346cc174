"""The batched gate kernel of batched.py for Hopper, written in Gluon: the same TwELL, bit for bit, with the
packing epilogue hidden behind the tensor cores' work. Each persistent program splits into warp groups: a
producer warp streams x and gate-weight blocks through TMA into a ring of STAGES shared buffers, and two
consumer warp groups take alternate output tiles, their main loops strictly alternating, so that one packs
its tile (epilogues.pack_store's loop, on the MMA accumulator) while the other's MMAs run. With the fp8 gate
(fp8_gate.py) x and the weight are e4m3, in K blocks of the same bytes, and the scales multiply the
accumulator before the packing. Gluon is experimental and has no interpreter: where it is missing, or off an
sm_90 GPU, the Triton kernel runs (the one CI tests).
"""
import os
import warnings

import torch

from .format import HOPPER_TILES_PER_SM as TILES_PER_SM, cdiv, tma_ok

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # TMA load into shared memory: Triton 3.6 has only async_copy_global_to_shared, 3.9 only async_load
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # a Triton without Gluon's Hopper API, or none at all
    gluon = None

BM, BN, BK = 128, 128, 64  # a consumer's tile (the TwELL tile is BN wide) and the K block of the ring
STAGES = 4  # ring depth (4 x 32 KB)
GROUP_M = 8  # row blocks that sweep the columns together, so x blocks stay in L2
MAXNREG = 168  # 12 warps (3 groups) x 32 x 168 fits the register file; the consumers take 232 each


def usable(x2: torch.Tensor, w: torch.Tensor, tile: int, vals_dtype: torch.dtype, fp8: bool = False) -> bool:
    """Whether this kernel can replace the Triton one: Gluon present, an sm_90 GPU (wgmma), a 128-unit
    tile, 16-bit x and stored values, a weight of x's dtype (fp8: e4m3, and D a multiple of 16 for the
    quantized x's rows), and TMA-addressable x and weight."""
    if gluon is None or not x2.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    weight_ok = (w.dtype == torch.float8_e4m3fn and x2.shape[1] % 16 == 0 and tma_ok(w) if fp8
                 else w.dtype == x2.dtype and tma_ok(x2, w))
    return (torch.cuda.get_device_capability(x2.device) == (9, 0) and tile == BN and weight_ok
            and x2.dtype == vals_dtype and vals_dtype in (torch.bfloat16, torch.float16))


def hopper_gate_launch(x2: torch.Tensor, w: torch.Tensor, tile: int, s: int, vals_dtype: torch.dtype,
                       fp8: bool = False):
    """(kernel, grid, scalar arguments, options, per-call arguments) of this kernel in place of batched.py's
    batched gate launch, or None where the Triton kernel runs: where not usable, and below TILES_PER_SM
    output tiles an SM (each program takes a fixed share of the tiles; with few a program, the uneven
    shares cost more than the ping-pong saves). With `fp8` (w the gate's e4m3 copy) it is called as
    batched.gate_launch's fp8 launch, with x quantized and the scales appended."""
    if not usable(x2, w, tile, vals_dtype, fp8):
        return None
    (m, d), width = x2.shape, w.shape[0]
    sms = torch.cuda.get_device_properties(x2.device).multi_processor_count
    if cdiv(m, BM) * cdiv(width, BN) < TILES_PER_SM * sms:
        return None
    dt = gl.float8e4nv if fp8 else gl.bfloat16 if x2.dtype == torch.bfloat16 else gl.float16
    bk = BK * 2 if fp8 else BK  # the same bytes a K block
    x_layout = gl.NVMMASharedLayout.get_default_for([BM, bk], dt)  # made once: each costs host time
    w_layout = gl.NVMMASharedLayout.get_default_for([BN, bk], dt)

    def descriptors(x2, w, up, down, values, indices, counts, partials, *quantized):  # at each call: the
        # pointers change. Without fp8 the gate reads x2 and the scales are unused placeholders
        head = () if fp8 else (x2, x2, x2)
        return (*head, TensorDescriptor.from_tensor(quantized[0] if fp8 else x2, [BM, bk], x_layout),
                TensorDescriptor.from_tensor(w, [BN, bk], w_layout))

    # wgmma's K: 16 for 16-bit operands, 32 for 8-bit ones
    scalars = dict(M=m, N=width, K=d, S=s, RING=STAGES, GROUP=GROUP_M, FP8=fp8, INSTR_K=32 if fp8 else 16)
    options = dict(num_warps=4, maxnreg=MAXNREG)
    if not _compiles(x2, w, descriptors, scalars, options, (sms, 1, 1), fp8):
        return None
    return gate_pack_kernel, (sms, 1, 1), scalars, options, descriptors


_failures = {}  # by fp8: None where the kernel compiled in this process, else why it did not


def _compiles(x2, w, descriptors, scalars, options, grid, fp8: bool) -> bool:
    """Compile the kernel for this call's argument types (Triton caches it for the launch) and say whether
    that worked. Gluon's API changes between Triton releases (3.9 removed tma.async_copy_global_to_shared,
    the only name 3.6 has): on a release this file does not fit, the Triton kernel runs instead, with one
    warning."""
    if fp8 not in _failures:
        counts = torch.empty(1, dtype=torch.int32, device=x2.device)
        tensors = (x2, w, w, w, x2, counts, counts, x2)
        if fp8:  # x quantized (one row block: the compile needs its type and row stride, not the call's rows)
            scale = torch.empty(1, dtype=torch.float32, device=x2.device)
            tensors += (torch.empty((BM, x2.shape[1]), dtype=w.dtype, device=x2.device), scale, scale)
        try:
            gate_pack_kernel.warmup(*tensors, *descriptors(*tensors), *scalars.values(), grid=grid, **options)
            _failures[fp8] = None
        except Exception as error:  # noqa: BLE001 (any compiler error: the fallback is always correct)
            _failures[fp8] = error
            warnings.warn(f"twell: the Hopper gate kernel{' (fp8)' if fp8 else ''} does not compile with this "
                          f"Triton ({error!r:.300}); using the Triton kernel", RuntimeWarning)
    return _failures[fp8] is None


if gluon is not None:

    @gluon.jit
    def _tile_coords(tile, n_m, n_n, GROUP: gl.constexpr):
        in_group = GROUP * n_n
        first_m = (tile // in_group) * GROUP
        group_m = gl.minimum(n_m - first_m, GROUP)
        return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m

    @gluon.jit
    def _load_partition(x_desc, w_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP: gl.constexpr):
        """Producer: every K block of the program's tiles, in order, into the ring."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        RING: gl.constexpr = a_bufs.type.shape[0]
        n_m = gl.cdiv(M, BLOCK_M)
        n_n = gl.cdiv(N, BLOCK_N)
        it = 0
        for tile in range(gl.program_id(0), n_m * n_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, n_m, n_n, GROUP)
            for k in range(0, K, BLOCK_K):
                s = it % RING
                mbarrier.wait(empty.index(s), ((it // RING) & 1) ^ 1)  # fresh barriers pass parity 1
                bar = ready.index(s)
                mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma_load(x_desc, [pid_m * BLOCK_M, k], bar, a_bufs.index(s))
                tma_load(w_desc, [pid_n * BLOCK_N, k], bar, b_bufs.index(s))
                it += 1

    @gluon.jit
    def _pack(acc, off_m, pid_n, M, N, NT, vals_ptr, idx_ptr, cnt_ptr, S: gl.constexpr):
        """epilogues.pack_store for 16-bit values, on the MMA accumulator's layout: each row's positives in
        column order, one key min (column << 16 | value bits) a slot, up to the block's fullest row."""
        layout: gl.constexpr = acc.type.layout
        BLOCK_M: gl.constexpr = acc.shape[0]
        BLOCK_N: gl.constexpr = acc.shape[1]
        vt: gl.constexpr = vals_ptr.dtype.element_ty
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        local = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        pos = (acc > 0) & gl.expand_dims(rows < M, 1) & gl.expand_dims(pid_n * BLOCK_N + local < N, 0)
        count = gl.sum(pos.to(gl.int32), axis=1)
        bits = acc.to(vt).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        key = gl.where(pos, (gl.expand_dims(local, 0) << 16) | bits, 0x7FFFFFFF)
        row_tile = rows.to(gl.int64) * NT + pid_n
        prev = gl.full([BLOCK_M], -1, gl.int32, layout=gl.SliceLayout(1, layout))
        for s in range(0, gl.minimum(gl.max(count, axis=0), S)):
            nxt = gl.min(gl.where(key > gl.expand_dims(prev, 1), key, 0x7FFFFFFF), axis=1)
            keep = (s < count) & (rows < M)
            gl.store(vals_ptr + row_tile * S + s, (nxt & 0xFFFF).to(gl.int16).to(vt, bitcast=True), mask=keep)
            gl.store(idx_ptr + row_tile * S + s, (nxt >> 16) + pid_n * BLOCK_N, mask=keep)
            prev = nxt
        gl.store(cnt_ptr + row_tile, count, mask=rows < M)

    @gluon.jit
    def _mma_partition(CONSUMER: gl.constexpr, a_bufs, b_bufs, ready, empty, turn, vals_ptr, idx_ptr, cnt_ptr,
                       xs_ptr, ws_ptr, M, N, K, S: gl.constexpr, GROUP: gl.constexpr, FP8: gl.constexpr,
                       INSTR_K: gl.constexpr):
        """Consumer CONSUMER (0 or 1): the program's tiles CONSUMER, CONSUMER + 2, ...: main loop, then pack
        (with FP8, the accumulator times the rows' and the units' scales first, as batched.py's kernel)."""
        RING: gl.constexpr = a_bufs.type.shape[0]
        BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, INSTR_K])
        n_m = gl.cdiv(M, BLOCK_M)
        n_n = gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        pid = gl.program_id(0)
        progs = gl.num_programs(0)
        for tile in range(pid + CONSUMER * progs, n_m * n_n, 2 * progs):
            j = (tile - pid) // progs  # the tile's place in the program's list
            pid_m, pid_n = _tile_coords(tile, n_m, n_n, GROUP)
            # my turn once the other consumer's previous main loop is issued (consumer 0 starts)
            mbarrier.wait(turn.index(CONSUMER), ((j // 2) & 1) ^ (1 - CONSUMER))
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
            it = j * k_steps
            for kk in range(k_steps):
                s = it % RING
                mbarrier.wait(ready.index(s), (it // RING) & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc, ))  # the previous block's MMA is done: free its stage
                mbarrier.arrive(empty.index((it + RING - 1) % RING), pred=kk > 0)
                it += 1
            mbarrier.arrive(turn.index(1 - CONSUMER))
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + RING - 1) % RING))
            if FP8:
                rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
                cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
                acc = (acc * gl.expand_dims(gl.load(xs_ptr + rows % M), 1)
                       * gl.expand_dims(gl.load(ws_ptr + cols % N), 0))
            _pack(acc, pid_m * BLOCK_M, pid_n, M, N, n_n, vals_ptr, idx_ptr, cnt_ptr, S)

    @gluon.jit
    def gate_pack_kernel(x_ptr, w_ptr, up_ptr, down_ptr, vals_ptr, idx_ptr, cnt_ptr, part_ptr, xg_ptr, xs_ptr,
                         ws_ptr, x_desc, w_desc, M, N, K, S: gl.constexpr, RING: gl.constexpr, GROUP: gl.constexpr,
                         FP8: gl.constexpr, INSTR_K: gl.constexpr):
        """relu(x @ w^T) packed into TwELL (values, indices, counts), with batched.py's gate kernel's signature:
        x_ptr, w_ptr, up_ptr, down_ptr, part_ptr and xg_ptr are unused (x and w are read through the
        descriptors); xs_ptr and ws_ptr are the scales of the fp8 gate (FP8)."""
        dtype: gl.constexpr = x_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [RING] + x_desc.block_type.shape, x_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [RING] + w_desc.block_type.shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(RING):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        gl.warp_specialize([
            (_mma_partition, (0, a_bufs, b_bufs, ready, empty, turn, vals_ptr, idx_ptr, cnt_ptr, xs_ptr, ws_ptr,
                              M, N, K, S, GROUP, FP8, INSTR_K)),
            (_mma_partition, (1, a_bufs, b_bufs, ready, empty, turn, vals_ptr, idx_ptr, cnt_ptr, xs_ptr, ws_ptr,
                              M, N, K, S, GROUP, FP8, INSTR_K)),
            (_load_partition, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP)),
        ], [4, 1], [232, 40])
