"""TwELL inference for a non-gated ReLU MLP: out = down(relu(up(x))).

The same two kernels as the gated block (gated_mlp.py): the up matmul packs relu(x @ up^T) into TwELL
in its epilogue, and the TwELL-to-dense kernel, built without the up gather (GATED=False), accumulates
out += g_j * down_t[j] per active unit; overflowing tiles are recomputed densely from up (at decode size,
read back from the dense copy of g that the up matmul wrote for them).
"""
from typing import Optional

import torch

from .gated_mlp import forward, register_ops


def mlp_reference(x, up_weight, down_weight):
    """fp32 reference of the block, returned in x's dtype."""
    return (torch.relu(x.float() @ up_weight.float().t()) @ down_weight.float().t()).to(x.dtype)


def _mlp_forward(x, up_weight, down_weight, tile, compression, precision, overflow=None):
    return forward(x, up_weight, None, down_weight, tile, compression, precision, overflow)


_mlp_call = register_ops(
    "mlp", _mlp_forward, "Tensor x, Tensor up_weight, Tensor down_weight, int tile, int compression, str precision")


def mlp(x, up_weight, down_weight, *, tile: int = 128, compression: int = 8, precision: str = "default",
        overflow: Optional[torch.Tensor] = None) -> torch.Tensor:
    """down(relu(up(x))) through TwELL. HF layouts: up [I, D], down [D, I]; x [..., D]."""
    return _mlp_call(x, up_weight, down_weight, tile, compression, precision, overflow=overflow)
