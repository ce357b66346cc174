"""The training-time model change: ReLU gate, and the per-layer statistics the L1 loss needs.

`relufy` swaps each family MLP for a `ReluGatedMLP` that adopts the original nn.Linear children under
the same names (no weight copy, state-dict keys unchanged, like Liger's modules), so the trained model
saves as a standard checkpoint. It sets the config's activation key to "relu", so a plain load of the
saved folder builds the same function. `unrelufy` puts the original modules and activation back (an
undoable conversion, as in PEFT); `original_mlps` does so for a while, also on a model that FSDP has
sharded since (the modules share the projections).

With `track = True` each forward stores `MLPStats`: l1 (differentiable: mean over tokens of the sum over
units of |relu(gate(x)) * up(x)|, the paper's penalty for one layer, or of the log penalty: twell's
sparsity_penalty), active (mean units per token whose gate pre-activation is > 0) and fired (tokens in which each
unit fired), and `backup_rows`: the token rows that went to the hybrid kernels' dense backup (0 on the dense
path). With `use_hybrid = True` the forward goes through `twell.hybrid_gated_mlp` (sparse Triton kernels on CUDA
and under the interpreter, its dense reference elsewhere), which returns the same output and statistics.
Training (sparsify/train/routing.py) sets `use_hybrid` per layer from the measured activity, and `hot_units`:
the units that fire in so many tokens that the hybrid path runs them as dense columns. `source_share` s > 0 (a
progressive swap, set by training) makes the gate (1 - s) * relu + s * the source's activation; only s = 0, plain
ReLU, runs on the kernels.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from twell.training import hybrid_gated_mlp, sparsity_penalty

from .families import FamilySpec, down_weight, gate_weight, has_bias, spec_for, up_weight


class MLPStats(NamedTuple):
    l1: torch.Tensor  # scalar, differentiable
    active: torch.Tensor  # scalar float, detached: mean active units per token
    fired: torch.Tensor  # int64 [I], detached: tokens in which each unit fired


class ReluGatedMLP(nn.Module):
    """down(relu(gate(x)) * up(x)) over the original projections of one family MLP."""

    def __init__(self, original: nn.Module, spec: FamilySpec, original_act: str):
        super().__init__()
        for name in spec.projections:
            self.add_module(name, getattr(original, name))
        self.spec = spec
        self.track = False
        self.stats: MLPStats | None = None
        # Kept beside the stats (MLPStats is the same for both paths): int64 scalar, 0 on the dense path.
        self.backup_rows: torch.Tensor | None = None
        self.use_hybrid = False
        self.hybrid_max_nnz = 128
        self.hot_units: torch.Tensor | None = None  # units the hybrid path runs as dense columns
        self.source_share = 0.0  # weight of the source activation in the gate (progressive swap)
        # The log penalty (l1_log_scale > 0): its eps, None until the first tracked forward measures it (the layer's
        # mean |h| over its firing units, times the scale), or calibration's; training then sets the processes' mean.
        self.l1_log_scale = 0.0
        self.l1_eps: float | None = None
        # Kept outside the module tree (no extra state-dict keys) so that unrelufy can put it back.
        object.__setattr__(self, "_original", original)
        self.original_act = original_act  # the source's activation: the progressive swap's, and what unrelufy restores

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, D], up [I, D], down [D, I]); views into the fused weight for fused families."""
        return gate_weight(self, self.spec), up_weight(self, self.spec), down_weight(self, self.spec)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate pre-activation and up projection of x."""
        if self.spec.gate_up:
            return getattr(self, self.spec.gate_up)(x).chunk(2, dim=-1)
        return getattr(self, self.spec.gate)(x), getattr(self, self.spec.up)(x)

    @property
    def penalty_eps(self) -> float:
        """The penalty's eps: 0 for L1 (also while the log penalty's eps is unmeasured: the dense path measures it)."""
        return (self.l1_eps or 0.0) if self.l1_log_scale else 0.0

    @property
    def runs_hybrid(self) -> bool:
        """Whether forward goes through the hybrid kernels: asked for, no projection bias, plain ReLU, and the log
        penalty's eps measured if it is on."""
        return (self.use_hybrid and self.source_share == 0 and not has_bias(self, self.spec)
                and (not self.l1_log_scale or self.l1_eps is not None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_hybrid:
            out, stats = hybrid_gated_mlp(x, *self.weights(), max_nnz=self.hybrid_max_nnz, hot_units=self.hot_units,
                                          l1_eps=self.penalty_eps)
            if self.track:
                self.stats, self.backup_rows = MLPStats(stats.l1, stats.active, stats.fired), stats.backup_rows
            return out
        gate, up = self.gate_up(x)
        act = F.relu(gate)
        if self.source_share:
            act = torch.lerp(act, ACT2FN[self.original_act](gate), self.source_share)
        h = act * up
        if self.track:
            fired = (gate > 0).reshape(-1, gate.shape[-1])
            if self.l1_log_scale and self.l1_eps is None:  # once per run: one host sync
                firing = h.detach().reshape(fired.shape)[fired]
                self.l1_eps = self.l1_log_scale * float(firing.abs().float().mean()) if firing.numel() else 0.0
            self.stats = MLPStats(
                l1=sparsity_penalty(h, self.penalty_eps),
                active=fired.sum(-1, dtype=torch.float32).mean(),
                fired=fired.sum(0),
            )
            self.backup_rows = self.stats.fired.new_zeros(())
        return getattr(self, self.spec.down)(h)


def relufy(model: nn.Module) -> list[ReluGatedMLP]:
    """Replace every family MLP of `model` by a ReluGatedMLP in place; returns them in layer order.
    Idempotent: an already relufied model returns its existing modules."""
    spec = spec_for(model.config)
    original_act = getattr(model.config, spec.act_key)
    modules = []
    for layer in model.get_submodule(spec.layers):
        mlp = getattr(layer, spec.mlp)
        if not isinstance(mlp, ReluGatedMLP):
            mlp = ReluGatedMLP(mlp, spec, original_act)
            setattr(layer, spec.mlp, mlp)
        modules.append(mlp)
    setattr(model.config, spec.act_key, "relu")
    return modules


def unrelufy(model: nn.Module) -> nn.Module:
    """Undo `relufy`: the original MLP modules (with the current, possibly trained, projections) and the
    original activation come back."""
    spec = spec_for(model.config)
    for layer in model.get_submodule(spec.layers):
        mlp = getattr(layer, spec.mlp)
        if isinstance(mlp, ReluGatedMLP):
            for name in spec.projections:
                setattr(mlp._original, name, getattr(mlp, name))
            setattr(layer, spec.mlp, mlp._original)
            setattr(model.config, spec.act_key, mlp.original_act)
    return model


@contextmanager
def original_mlps(model: nn.Module):
    """While active, each layer computes with its original MLP module (the same projections, the original
    activation), as before relufy; the ReluGatedMLPs return afterwards. The config is left as it is."""
    spec = spec_for(model.config)
    layers = model.get_submodule(spec.layers)
    relu = [getattr(layer, spec.mlp) for layer in layers]
    for layer, mlp in zip(layers, relu):
        if isinstance(mlp, ReluGatedMLP):
            setattr(layer, spec.mlp, mlp._original)
    try:
        yield
    finally:
        for layer, mlp in zip(layers, relu):
            setattr(layer, spec.mlp, mlp)
