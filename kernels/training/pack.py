"""`pack`: the TwELL (the runtime's format.py) of a dense activation, by a Triton kernel whose programs each pack
one [16 rows, T] tile with the gate kernel's packing epilogue (the runtime's epilogues.pack_store). No runtime path
runs it (the gate kernels pack in their epilogue), so no checkpoint carries it: the tests pack with it. Reference:
the runtime's reference.pack_reference, which CPU tensors without the Triton interpreter take."""
import torch

from ..format import TwELL, empty_twell, on_device, use_triton
from ..reference import pack_reference

try:
    import triton
    import triton.language as tl

    from ..epilogues import pack_store
except ImportError:  # CPU-only machines run the reference path
    triton = None


def pack(g: torch.Tensor, tile: int = 128, compression: int = 8) -> TwELL:
    """Pack the positives of a dense [M, I] activation (Triton on GPU / interpreter, else reference)."""
    if g.dim() != 2:
        raise ValueError(f"pack expects [M, I], got {tuple(g.shape)}")
    if not use_triton(g):
        return pack_reference(g, tile, compression)
    m, width = g.shape
    tw = empty_twell(m, width, tile, compression, g.dtype, g.device)
    block_m = 16
    grid = (triton.cdiv(m, block_m), triton.cdiv(width, tile))
    with on_device(g):
        _pack_kernel[grid](g, tw.values, tw.indices, tw.counts, m, width, g.stride(0), g.stride(1),
                           T=tile, S=tw.values.shape[2], BM=block_m)
    return tw


if triton is not None:

    @triton.jit
    def _pack_kernel(g_ptr, vals_ptr, idx_ptr, cnt_ptr, M, N, stride_gm, stride_gn,
                     T: tl.constexpr, S: tl.constexpr, BM: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * T + tl.arange(0, T)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        g = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_gm + cols[None, :] * stride_gn,
                    mask=mask, other=0.0).to(tl.float32)
        pack_store(g, g, rows, cols, pid_n, pid_n * T, M, N, vals_ptr, idx_ptr, cnt_ptr, tl.cdiv(N, T), S)
