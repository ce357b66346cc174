"""The dense block of heavy rows (batched path): the rows that the out kernel posted instead of walking
(more than HEAVY_UNITS units each) get out[row] = (relu(x[row] @ gate^T) * (x[row] @ up^T)) @ down^T from
two Triton matmuls over the rows gathered through the device-side list, then, up to HEAVY_FEW_ROWS rows, an
ordered sum of the split reduction's partial sums. Persistent programs read the count on the device: no
host synchronization, nothing to do without heavy rows. Reference: reference.gated_mlp_reference."""

import torch

from .format import cdiv
from .launch import Launch, sm_count

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines run the reference path
    triton = None

HEAVY_PROGRAMS_PER_SM = 4  # persistent programs of the dense block of heavy rows
HEAVY_FEW_ROWS = 16  # up to this many heavy rows the dense block streams its weights over narrow tiles
HEAVY_KSPLIT = 8  # and splits its down product's reduction this many ways


def heavy_launches(x2, width, h_fp32) -> "HeavyBlock":
    """The dense block over the rows that the out kernel posted to the workspace [count, row of each slot]
    (room for every row of x2: each row posts itself at most once, so the count needs no bound):
    h[slot] = relu(x2[row] @ gate^T) * (x2[row] @ up^T), then out[row] = h[slot] @ down_t. Persistent
    programs (HEAVY_PROGRAMS_PER_SM an SM) loop over the tiles of the posted rows, whose count they read on
    the device: the block costs what its posted rows need, nothing without them, and no host
    synchronization (CUDA graphs hold it). Up to HEAVY_FEW_ROWS rows (a call's first tokens) the weights
    are streamed over narrow tiles and the down product's reduction is split, its fp32 partial sums added
    by a third launch."""
    rows, d = x2.shape
    # block sizes (rows, columns, reduction): gate/up product, down product, few rows of each
    if x2.device.type == "cuda":
        h_tiles, down_tiles, h_few, down_few, ksplit = (128, 64, 64), (128, 128, 64), (32, 128), (64, 128), HEAVY_KSPLIT
        options = dict(num_warps=8, num_stages=3)
    else:  # the interpreter: small blocks, several tiles and splits at test sizes
        h_tiles, down_tiles, h_few, down_few, ksplit = (16, 32, 32), (16, 32, 32), (16, 32), (16, 32), 2
        options = dict(num_warps=4, num_stages=1)
    dot = "ieee" if h_fp32 or x2.dtype == torch.float32 else "tf32"  # as the gate kernel's: fp32 stays exact
    programs = HEAVY_PROGRAMS_PER_SM * sm_count(x2.device)
    most_tiles = max(cdiv(rows, h_tiles[0]) * cdiv(width, h_tiles[1]), cdiv(width, h_few[0]),
                     cdiv(rows, down_tiles[0]) * cdiv(d, down_tiles[1]), cdiv(d, down_few[0]) * ksplit)
    grid = (min(programs, most_tiles), 1, 1)
    gate_up = Launch(_heavy_h_kernel, grid, dict(
        D=d, I=width, stride_xm=x2.stride(0), stride_xk=x2.stride(1), BM=h_tiles[0], BN=h_tiles[1],
        BM_FEW=HEAVY_FEW_ROWS, BN_FEW=h_few[0], BK=h_tiles[2], BK_FEW=h_few[1], H_FP32=h_fp32,
        DOT_PRECISION=dot), options)
    down = Launch(_heavy_out_kernel, grid, dict(
        D=d, I=width, BM=down_tiles[0], BN=down_tiles[1], BM_FEW=HEAVY_FEW_ROWS, BN_FEW=down_few[0],
        KSPLIT=ksplit, BK=down_tiles[2], BK_FEW=down_few[1], H_FP32=h_fp32, DOT_PRECISION=dot), options)
    finish = Launch(_heavy_finish_kernel, (min(8, cdiv(d, 256)), 1, 1), dict(
        D=d, BM_FEW=HEAVY_FEW_ROWS, KSPLIT=ksplit, BD=256), dict(num_warps=4))
    return HeavyBlock(gate_up, down, finish, ksplit, torch.float32 if h_fp32 else x2.dtype)


class HeavyBlock:
    """The dense block's three launches, called with (x2, gate, up, down_t, workspace, out). Its
    buffers are allocated at each call (they cannot be shared across streams): h [rows, I] and the few-row
    split's fp32 partial sums [splits, HEAVY_FEW_ROWS, D]; a caller may pass its own instead."""

    def __init__(self, gate_up: Launch, down: Launch, finish: Launch, splits: int, h_dtype):
        self.gate_up, self.down, self.finish, self.splits, self.h_dtype = gate_up, down, finish, splits, h_dtype

    def __call__(self, x2, gate, up, down_t, workspace, out, h=None, part=None):
        if h is None:
            h = torch.empty(x2.shape[0], gate.shape[0], dtype=self.h_dtype, device=x2.device)
        if part is None:
            part = torch.empty(self.splits, HEAVY_FEW_ROWS, x2.shape[1], dtype=torch.float32, device=x2.device)
        self.gate_up(x2, gate, up, workspace, h)
        self.down(h, down_t, workspace, out, part)
        self.finish(part, workspace, out)


if triton is not None:

    @triton.jit
    def _posted_rows(ws_ptr, block, n, BM: tl.constexpr):
        """A block of BM slots of the posted rows: (slots, their rows, mask of the posted ones)."""
        slot = block * BM + tl.arange(0, BM)
        live = slot < n
        return slot, tl.load(ws_ptr + 1 + slot, mask=live, other=0).to(tl.int64), live

    @triton.jit
    def _heavy_h_tiles(x_ptr, gate_ptr, up_ptr, ws_ptr, h_ptr, n, D, I, stride_xm, stride_xk, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, H_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """h[slot, cols] of the posted rows, [BM, BN] tiles strided over the programs."""
        n_cols = tl.cdiv(I, BN)
        for t in range(tl.program_id(0), tl.cdiv(n, BM) * n_cols, tl.num_programs(0)):
            slot, rows, live = _posted_rows(ws_ptr, t // n_cols, n, BM)
            cols = (t % n_cols) * BN + tl.arange(0, BN)
            cmask = cols < I
            g = tl.zeros((BM, BN), dtype=tl.float32)
            u = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, D, BK):
                k = k0 + tl.arange(0, BK)
                kmask = k < D
                xa = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                             mask=live[:, None] & kmask[None, :], other=0.0)
                w_off = cols[None, :].to(tl.int64) * D + k[:, None]
                w_mask = cmask[None, :] & kmask[:, None]
                g = tl.dot(xa, tl.load(gate_ptr + w_off, mask=w_mask, other=0.0), g, input_precision=DOT_PRECISION)
                u = tl.dot(xa, tl.load(up_ptr + w_off, mask=w_mask, other=0.0), u, input_precision=DOT_PRECISION)
            if not H_FP32:  # g and u rounded to the weights' precision before their product, as dense
                g = g.to(h_ptr.dtype.element_ty).to(tl.float32)
                u = u.to(h_ptr.dtype.element_ty).to(tl.float32)
            h = tl.maximum(g, 0.0) * u
            tl.store(h_ptr + slot[:, None].to(tl.int64) * I + cols[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=live[:, None] & cmask[None, :])

    @triton.jit
    def _heavy_h_kernel(x_ptr, gate_ptr, up_ptr, ws_ptr, h_ptr, D, I, stride_xm, stride_xk,
                        BM: tl.constexpr, BN: tl.constexpr, BM_FEW: tl.constexpr, BN_FEW: tl.constexpr,
                        BK: tl.constexpr, BK_FEW: tl.constexpr, H_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # up to BM_FEW posted rows the weights are streamed once, in narrow column tiles over many programs;
        # more rows take square tiles
        n = tl.load(ws_ptr)
        if n <= BM_FEW:
            _heavy_h_tiles(x_ptr, gate_ptr, up_ptr, ws_ptr, h_ptr, n, D, I, stride_xm, stride_xk, BM_FEW, BN_FEW,
                           BK_FEW, H_FP32, DOT_PRECISION)
        else:
            _heavy_h_tiles(x_ptr, gate_ptr, up_ptr, ws_ptr, h_ptr, n, D, I, stride_xm, stride_xk, BM, BN, BK,
                           H_FP32, DOT_PRECISION)

    @triton.jit
    def _heavy_out_dot(acc, h_ptr, down_ptr, slot, live, cols, cmask, k_lo, k_hi, D, I, BK: tl.constexpr,
                       H_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """acc += h[slot, k_lo:k_hi] @ down_t[k_lo:k_hi, cols]."""
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < k_hi
            ha = tl.load(h_ptr + slot[:, None].to(tl.int64) * I + k[None, :], mask=live[:, None] & kmask[None, :],
                         other=0.0)
            dw = tl.load(down_ptr + k[:, None].to(tl.int64) * D + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                         other=0.0)
            if H_FP32:  # h stays fp32: the weights widened (exactly) instead
                acc = tl.dot(ha, dw.to(tl.float32), acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(ha, dw, acc, input_precision=DOT_PRECISION)
        return acc

    @triton.jit
    def _heavy_out_kernel(h_ptr, down_ptr, ws_ptr, out_ptr, part_ptr, D, I, BM: tl.constexpr,
                          BN: tl.constexpr, BM_FEW: tl.constexpr, BN_FEW: tl.constexpr, KSPLIT: tl.constexpr,
                          BK: tl.constexpr, BK_FEW: tl.constexpr, H_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # out[row, cols] = h[slot] @ down_t[:, cols] for the posted rows. Up to BM_FEW rows the reduction over
        # I is split KSPLIT ways (a long serial loop over few programs otherwise) into fp32 partial sums
        # (part, [KSPLIT, BM_FEW, D]), which _heavy_finish_kernel adds in order (deterministic); more rows
        # take square tiles
        n = tl.load(ws_ptr)
        if n == 0:  # the split's tiles do not depend on n: without posted rows, nothing to stream
            return
        if n <= BM_FEW:
            n_cols = tl.cdiv(D, BN_FEW)
            k_chunk = tl.cdiv(tl.cdiv(I, KSPLIT), BK_FEW) * BK_FEW
            slot = tl.arange(0, BM_FEW)
            live = slot < n
            for t in range(tl.program_id(0), n_cols * KSPLIT, tl.num_programs(0)):
                cols = (t // KSPLIT) * BN_FEW + tl.arange(0, BN_FEW)
                cmask = cols < D
                k_lo = (t % KSPLIT) * k_chunk
                acc = _heavy_out_dot(tl.zeros((BM_FEW, BN_FEW), dtype=tl.float32), h_ptr, down_ptr, slot, live,
                                     cols, cmask, k_lo, tl.minimum(k_lo + k_chunk, I), D, I, BK_FEW, H_FP32,
                                     DOT_PRECISION)
                part = part_ptr + ((t % KSPLIT) * BM_FEW + slot[:, None]) * D + cols[None, :]
                tl.store(part, acc, mask=live[:, None] & cmask[None, :])
        else:
            n_cols = tl.cdiv(D, BN)
            for t in range(tl.program_id(0), tl.cdiv(n, BM) * n_cols, tl.num_programs(0)):
                slot, rows, live = _posted_rows(ws_ptr, t // n_cols, n, BM)
                cols = (t % n_cols) * BN + tl.arange(0, BN)
                cmask = cols < D
                acc = _heavy_out_dot(tl.zeros((BM, BN), dtype=tl.float32), h_ptr, down_ptr, slot, live, cols,
                                     cmask, 0, I, D, I, BK, H_FP32, DOT_PRECISION)
                tl.store(out_ptr + rows[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=live[:, None] & cmask[None, :])

    @triton.jit
    def _heavy_finish_kernel(part_ptr, ws_ptr, out_ptr, D, BM_FEW: tl.constexpr, KSPLIT: tl.constexpr,
                             BD: tl.constexpr):
        # the few-row split's partial sums, added in split order, to the posted rows of out (more rows were
        # written directly)
        n = tl.load(ws_ptr)
        if 0 < n and n <= BM_FEW:
            slot, rows, live = _posted_rows(ws_ptr, 0, n, BM_FEW)
            for c0 in range(tl.program_id(0) * BD, D, tl.num_programs(0) * BD):
                cols = c0 + tl.arange(0, BD)
                mask = live[:, None] & (cols < D)[None, :]
                acc = tl.zeros((BM_FEW, BD), dtype=tl.float32)
                for split in range(KSPLIT):
                    acc += tl.load(part_ptr + (split * BM_FEW + slot[:, None]) * D + cols[None, :], mask=mask)
                tl.store(out_ptr + rows[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
