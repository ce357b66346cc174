"""Calibration: each layer's ReLU MLP fitted alone to the source's MLP before training (--calibrate-steps).

The swap changes every MLP's function at once, and a short conversion spends its budget recovering from that
(docs/quality.md). Post-training pruning repairs such a change layer by layer on a few thousand tokens; so does
this stage. For one layer at a time it runs the source model (`original_mlps`) over the first blocks of the
training text up to that layer's MLP, keeps the MLP's input and output rows, and fits the layer's ReLU MLP (its
gate, up and down projections) to those outputs with Adam on the relative squared error. Every layer's inputs are
the source's, so the fits are independent, and only one layer's rows are held at a time. The weights keep their
names and shapes: the checkpoint's layout does not change.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Iterable

import torch
from torch import nn

from .families import mlp_modules, spec_for
from .relufy import ReluGatedMLP, original_mlps
from .report import console

ROWS_PER_STEP = 4096  # token rows a step: enough that a step's error is close to the whole set's


@dataclass
class LayerFit:
    before: float  # relative squared error of the ReLU MLP against the source's on the captured rows
    after: float


@dataclass
class CalibrationResult:
    tokens: int
    steps: int
    lr: float
    seconds: float
    layers: list[LayerFit]

    def record(self) -> dict:
        """The training record's entry (config.json's twell.training and training_log.json)."""
        return {"tokens": self.tokens, "steps": self.steps, "lr": self.lr, "seconds": round(self.seconds, 1),
                "layers": [{k: round(v, 5) for k, v in asdict(fit).items()} for fit in self.layers]}


def compute(device: torch.device):
    """The training's arithmetic: bf16 autocast on GPU, fp32 on CPU."""
    return torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()


class _Captured(Exception):
    """Raised by the capture hook once a layer's MLP has run: the rest of the forward is not needed."""


def calibration_blocks(batches: Iterable[torch.Tensor], tokens: int) -> list[torch.Tensor]:
    """The first batches of `batches` holding at least `tokens` tokens (whole batches)."""
    taken, count = [], 0
    for batch in batches:
        taken.append(batch)
        count += batch.numel()
        if count >= tokens:
            break
    return taken


@torch.no_grad()
def source_rows(model: nn.Module, blocks: list[torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, outputs) [rows, D] of layer `layer`'s MLP in the source model (the relufied `model` with its
    original MLPs) over `blocks`, each forward stopped after that MLP."""
    device = next(model.parameters()).device
    inputs, outputs = [], []

    def keep(module, args, output):
        inputs.append(args[0].flatten(0, -2))
        outputs.append(output.flatten(0, -2))
        raise _Captured

    was_training = model.training
    model.eval()
    with original_mlps(model), compute(device):
        handle = mlp_modules(model, spec_for(model.config))[layer].register_forward_hook(keep)
        try:
            for block in blocks:
                try:
                    model(input_ids=block.to(device), use_cache=False)
                except _Captured:
                    pass
        finally:
            handle.remove()
            model.train(was_training)
    return torch.cat(inputs), torch.cat(outputs)


def squared_error_ratio(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """||out - target||^2 / ||target||^2 in fp32: the loss calibration minimizes."""
    target = target.float()
    return (out.float() - target).square().sum() / target.square().sum().clamp_min(1e-30)


def fit_error(mlp: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 16384) -> float:
    """squared_error_ratio of mlp(x) against y over all rows, in chunks."""
    with torch.no_grad(), compute(x.device):
        err = sum(float((mlp(xc).float() - yc.float()).square().sum()) for xc, yc in zip(x.split(chunk), y.split(chunk)))
        return err / max(float(y.float().square().sum()), 1e-30)


def fit_layer(mlp: ReluGatedMLP, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
              generator: torch.Generator) -> LayerFit:
    """Fits `mlp`'s parameters to y = source_mlp(x) by `steps` Adam steps (lr cosine from `lr` to 0), each on
    ROWS_PER_STEP rows drawn at random."""
    before = fit_error(mlp, x, y)
    params = [p for p in mlp.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    for _ in range(steps):
        rows = torch.randint(len(x), (min(ROWS_PER_STEP, len(x)),), generator=generator).to(x.device)
        with compute(x.device):
            out = mlp(x[rows])
        loss = squared_error_ratio(out, y[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    for p in params:
        p.grad = None
    return LayerFit(before, fit_error(mlp, x, y))


def calibrate(model: nn.Module, mlps: list[ReluGatedMLP], blocks: list[torch.Tensor], steps: int, lr: float,
              seed: int = 0, shown: bool = True) -> CalibrationResult:
    """Fits each of `mlps` (the relufied `model`'s, in layer order) to the source's MLP on `blocks`, one layer at
    a time; the other parameters are left as they are."""
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    fits = []
    for layer, mlp in enumerate(mlps):
        x, y = source_rows(model, blocks, layer)
        with console.status(f"calibrating layer {layer + 1}/{len(mlps)}") if shown else nullcontext():
            fits.append(fit_layer(mlp, x, y, steps, lr, generator))
        del x, y
        if shown:
            console.print(f"calibrated layer {layer + 1}/{len(mlps)}: relative error of its MLP "
                          f"{fits[-1].before:.4f} -> {fits[-1].after:.4f}")
    tokens = sum(block.numel() for block in blocks)
    return CalibrationResult(tokens, steps, lr, time.perf_counter() - started, fits)
