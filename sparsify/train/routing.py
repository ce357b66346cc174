"""Which path each MLP trains on until the next log step: the TwELL hybrid kernels, while its measured activity
is below `hybrid_below` (back to dense above HYBRID_EXIT times it), with the units busy in the last step run as
dense columns; or dense. Chosen from figures reduced over the processes, so that every process chooses alike."""
from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from twell.training import hot_units

from .. import relufy
from ..config import HYBRID_EXIT
from .state import Run


def hybrid_kernels_run(device: torch.device) -> bool:
    """Whether twell.training runs its kernels (not its dense reference) for tensors on `device`: CUDA with
    triton, or CPU under the Triton interpreter (tests)."""
    return (relufy.hybrid_gated_mlp is not None and importlib.util.find_spec("triton") is not None
            and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


def decoder_kernels_run(device: torch.device) -> bool:
    """Whether training runs the decoder's norms and rotary on twell's kernels (config.fused_decoder): CUDA with
    triton. (On CPU the interpreter would serve them too, but slowly: the tests turn it on where they check it.)"""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def hybrid_paths(entry: dict, below: float) -> list[bool]:
    """Per layer, whether it trains on the hybrid kernels until the next log step, from a log entry (the
    window's mean active units and the path it ran on)."""
    return [l["active"] < below or (l["path"] == "hybrid" and l["active"] <= HYBRID_EXIT * below)
            for l in entry["layers"]]


def hybrid_share(log: list[dict]) -> list[float]:
    """Per layer, the fraction of logged training steps it spent on the hybrid kernels."""
    if not log:
        return []
    steps = [e["step"] - previous for e, previous in zip(log, [0] + [e["step"] for e in log])]
    return [sum(n for n, e in zip(steps, log) if e["layers"][i]["path"] == "hybrid") / log[-1]["step"]
            for i in range(len(log[0]["layers"]))]


@dataclass(frozen=True)
class Routing:
    """The path of each MLP until the next log step: the hybrid kernels (`hybrid`), which run the layer's
    `hot_units` as dense columns, or dense. Chosen from reduced figures: the same on every process."""

    hybrid: tuple[bool, ...]
    hot_units: tuple[torch.Tensor | None, ...]

    @classmethod
    def dense(cls, layers: int) -> Routing:
        return cls((False,) * layers, (None,) * layers)


def apply_routing(mlps: list, routing: Routing, source_share: float | None = None) -> None:
    """Sets each MLP's path from `routing`, and during a progressive swap the gate's `source_share` (None: the
    MLPs keep theirs); the only place the loop changes how the MLPs run."""
    for m, hybrid, hot in zip(mlps, routing.hybrid, routing.hot_units):
        m.use_hybrid, m.hot_units = hybrid, hot
        if source_share is not None:
            m.source_share = source_share


@contextmanager
def tracked(mlps: list, max_nnz: int):
    """The MLPs record their statistics (the L1 term, the log's figures) while training runs; after it they
    run dense and untracked."""
    for m in mlps:
        m.track, m.hybrid_max_nnz = True, max_nnz
    try:
        yield
    finally:
        apply_routing(mlps, Routing.dense(len(mlps)))
        for m in mlps:
            m.track = False


def route(run: Run, entry: dict, step_fired: torch.Tensor) -> Routing:
    """The routing from a log entry: each layer's path by its activity (hybrid_paths) and, on the hybrid path,
    the units busy in the last step's counts as dense columns; records each layer's count of those in `entry`."""
    config = run.config
    hybrid = tuple(hybrid_paths(entry, config.hybrid_below))
    hot = tuple(hot_units(fired, config.tokens_per_step(run.world), config.hybrid_hot_rate) if on else None
                for on, fired in zip(hybrid, step_fired))
    for layer, units in zip(entry["layers"], hot):
        layer["hot_units"] = 0 if units is None else units.numel()
    return Routing(hybrid, hot)
