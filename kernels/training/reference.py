"""Plain PyTorch reference of the hybrid training block (hybrid.py): its output and `HybridStats`, the
statistics that both return, from the dense math."""
from typing import NamedTuple

import torch

from .penalty import sparsity_penalty


class HybridStats(NamedTuple):
    l1: torch.Tensor  # scalar, differentiable: mean over tokens of sum over units of the penalty of h (penalty.py)
    active: torch.Tensor  # scalar float: mean active units per token (detached)
    fired: torch.Tensor  # int64 [I]: tokens in which each unit fired (detached)
    backup_rows: torch.Tensor  # int64 scalar: rows that went to the dense backup


def _stats(pre, l1, max_nnz, hot_units=None):
    pos = (pre > 0).reshape(-1, pre.shape[-1])
    per_row = pos.sum(1)
    cold = per_row if hot_units is None else per_row - pos[:, hot_units].sum(1)  # the backup's row budget
    return HybridStats(l1, (per_row.sum().float() / pos.shape[0]).detach(), pos.sum(0).long(),
                       (cold > max_nnz).sum())


def hybrid_gated_mlp_reference(x, gate_weight, up_weight, down_weight, *, max_nnz=128, hot_units=None, l1_eps=0.0):
    """Plain PyTorch (dense) block with the same outputs and stats as hybrid_gated_mlp."""
    pre = x @ gate_weight.t()
    h = torch.relu(pre) * (x @ up_weight.t())
    return h @ down_weight.t(), _stats(pre.detach(), sparsity_penalty(h, l1_eps), max_nnz, hot_units)
