"""Calibration: each layer's ReLU MLP fitted alone to the source's MLP before training (--calibrate-steps).

The swap changes every MLP's function at once, and a short conversion spends its budget recovering from that
(docs/quality.md). Post-training pruning repairs such a change layer by layer on a few thousand tokens; so does
this stage. For one layer at a time it runs the source model (`original_mlps`) over the first blocks of the
training text up to that layer's MLP, keeps the MLP's input and output rows, and fits the layer's ReLU MLP (its
gate, up and down projections) to those outputs with Adam on the relative squared error. Every layer's inputs are
the source's, so the fits are independent, and only one layer's rows are held at a time. The weights keep their
names and shapes: the checkpoint's layout does not change.

Independent fits leave each layer's error in the residual stream, where the layers above add theirs
(--calibrate-sequential instead): the layers are fitted bottom up, each on the inputs that the layers below it,
already fitted, give it, to what the stream needs from it: the source's stream after the layer minus the fitted
model's stream before the MLP. A layer so also takes up what the layers below it left, as post-training pruning's
sequential mode does. The source's stream after a layer comes from a forward with the source's projections put
back into the layers below it for the while (`SourceProjections`: each layer's kept in CPU memory before it is
fitted), so that what is held is the MLPs' weights once, not a stream of every layer over every token.

With a target sparsity (--calibrate-sparsity) the fit also sparsifies: the layer's penalty (the training's, L1 or
the log penalty, relative to its value before the fit) joins the loss with a weight that rises while more units fire
than the target allows and falls while fewer do, a multiplier adjusted each step as in constrained optimization. A
layer can take many such steps on its own rows without moving the rest of the model, which a short conversion's
training steps cannot. The log penalty's eps is measured here, on each swapped layer's rows before its fit, and
training keeps it, so that the fit and the training weigh the same penalty.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from twell.training import sparsity_penalty

from .errors import ConfigError
from .families import mlp_modules, spec_for
from .relufy import ReluGatedMLP, original_mlps
from .report import console, timestamped
from .train.loss import activity_error

# Families whose decoder layers normalize the MLP's output before the residual add: the norm's attribute of a
# decoder layer. Sequential calibration fits the MLP through it (the stream's target is the norm's output).
MLP_OUTPUT_NORMS = {"gemma2": "post_feedforward_layernorm", "gemma3_text": "post_feedforward_layernorm"}
ROWS_PER_STEP = 4096  # token rows a step: enough that a step's error is close to the whole set's
# The L1 weight's adjustment: each step it is multiplied by exp(RATE * log(active / target)), the log clamped to
# [-1, 1], so that it moves by at most e^RATE a step and settles where the layer meets its target.
L1_WEIGHT_START = 1e-2
L1_WEIGHT_RATE = 0.05
LAYER_SEEDS = 1_000_003  # a layer's generator: seed * LAYER_SEEDS + layer, distinct over any model's layers


@dataclass
class LayerFit:
    before: float  # relative squared error of the ReLU MLP against the source's on the captured rows
    after: float
    active: float  # mean units a row whose gate fires, after the fit
    l1_swap: float  # the ReLU MLP's penalty a row before the fit (the swapped model's)
    l1_eps: float | None = None  # the log penalty's eps (None: L1)


@dataclass
class CalibrationResult:
    tokens: int
    steps: int
    lr: float
    sparsity: float  # the target share of units that do not fire (0: a dense fit)
    seconds: float
    layers: list[LayerFit]
    sequential: bool = False  # fitted bottom up to the source's residual stream (module docstring)

    @property
    def l1_reference(self) -> float:
        """The swapped model's penalty term (the mean over layers of each MLP's penalty a token) before calibration:
        the reference of a relative L1 coefficient, so that it means the same pressure with or without calibration."""
        return sum(fit.l1_swap for fit in self.layers) / len(self.layers)

    @property
    def l1_eps(self) -> list[float] | None:
        """Each layer's eps of the log penalty, measured before its fit (None with L1): training keeps them."""
        return [fit.l1_eps for fit in self.layers] if self.layers and self.layers[0].l1_eps is not None else None

    def record(self) -> dict:
        """The training record's entry (config.json's twell.training and training_log.json)."""
        return {"tokens": self.tokens, "steps": self.steps, "lr": self.lr, "sparsity": self.sparsity,
                "sequential": self.sequential, "seconds": round(self.seconds, 1), "l1_reference": self.l1_reference,
                "l1_eps": self.l1_eps,
                "layers": [{k: round(v, 5) if v is not None else None for k, v in asdict(fit).items()}
                           for fit in self.layers]}


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
def run_hooked(model: nn.Module, blocks: list[torch.Tensor], hooks, source: bool) -> None:
    """Runs `model` in eval mode over `blocks` (with `source`, its original MLPs) with the forward hooks that
    hooks() gives as (module, hook) pairs (called once the MLPs are in place), each forward stopped where a hook
    raises _Captured."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with original_mlps(model) if source else nullcontext(), compute(device):
        handles = [module.register_forward_hook(hook) for module, hook in hooks()]
        try:
            for block in blocks:
                try:
                    model(input_ids=block.to(device), use_cache=False)
                except _Captured:
                    pass
        finally:
            for handle in handles:
                handle.remove()
            model.train(was_training)


def source_rows(model: nn.Module, blocks: list[torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, outputs) [rows, D] of layer `layer`'s MLP in the source model (the relufied `model` with its
    original MLPs) over `blocks`, each forward stopped after that MLP."""
    inputs, outputs = [], []

    def keep(module, args, output):
        inputs.append(args[0].flatten(0, -2))
        outputs.append(output.flatten(0, -2))
        raise _Captured

    run_hooked(model, blocks, lambda: [(mlp_modules(model, spec_for(model.config))[layer], keep)], source=True)
    return torch.cat(inputs), torch.cat(outputs)


def _hidden(output) -> torch.Tensor:
    """A decoder layer's output hidden states [rows, D] (some layers return a tuple led by them)."""
    return (output[0] if isinstance(output, tuple) else output).flatten(0, -2)


def available_memory() -> int | None:
    """The bytes of CPU memory the kernel reports available (Linux's MemAvailable), None where it does not."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class SourceProjections:
    """The source's MLP projections of the layers fitted so far, in CPU memory: the source's MLPs share their
    projections with the ReLU MLPs, so the source's stream above a fitted layer needs them put back for the while."""

    def __init__(self, mlps: list[ReluGatedMLP]):
        self.mlps = mlps
        self.kept: dict[int, list[torch.Tensor]] = {}

    def keep(self, layer: int) -> None:
        """Keeps layer `layer`'s projections as they are (the source's, before its fit)."""
        self.kept[layer] = [p.detach().to("cpu", copy=True) for p in self.mlps[layer].parameters()]

    @torch.no_grad()
    def _exchange(self) -> None:
        # tensor by tensor, so that CPU memory holds one projection beyond the kept ones at a time
        for layer, tensors in self.kept.items():
            for index, param in enumerate(self.mlps[layer].parameters()):
                held = param.detach().to("cpu", copy=True)
                param.copy_(tensors[index])
                tensors[index] = held

    @contextmanager
    def in_place(self):
        """While active, the kept layers compute with the source's projections; the fitted ones return after."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()


def check_kept_memory(needed: int, available: int | None) -> None:
    """ConfigError where the source's projections that sequential calibration keeps (every MLP's by the last
    layer: `needed` bytes) exceed `available` bytes of CPU memory."""
    if available is not None and needed > available:
        raise ConfigError(f"--calibrate-sequential keeps the source's MLP projections in CPU memory, "
                          f"{needed / 2**30:.1f} GiB, and {available / 2**30:.1f} GiB is available: calibrate each "
                          f"layer alone (--calibrate-independent)")


def source_stream(model: nn.Module, blocks: list[torch.Tensor], layer: int) -> torch.Tensor:
    """The source model's residual stream [rows, D] after decoder layer `layer` over `blocks`, in CPU memory, each
    forward stopped there: `model` run with its original MLPs, so the source's only where the projections of the
    layers up to `layer` are (SourceProjections.in_place)."""
    kept = []

    def keep(module, args, output):
        kept.append(_hidden(output).to("cpu", copy=True))
        raise _Captured

    run_hooked(model, blocks, lambda: [(model.get_submodule(spec_for(model.config).layers)[layer], keep)], source=True)
    return torch.cat(kept)


def output_norm(model: nn.Module, layer: int) -> nn.Module | None:
    """The norm that layer `layer` applies to its MLP's output before the residual add (MLP_OUTPUT_NORMS), or
    None."""
    name = MLP_OUTPUT_NORMS.get(model.config.model_type)
    return getattr(model.get_submodule(spec_for(model.config).layers)[layer], name) if name else None


def stream_rows(model: nn.Module, blocks: list[torch.Tensor], layer: int, source_after: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) [rows, D] of layer `layer`'s ReLU MLP in `model` as it is (the layers below fitted): its
    inputs, and the source's residual stream after the layer (`source_after`, source_stream's) minus `model`'s
    before the MLP's contribution (the MLP's output, through output_norm where the family has one), each forward
    stopped after that layer."""
    decoder = model.get_submodule(spec_for(model.config).layers)[layer]
    tail = output_norm(model, layer)
    tail = nn.Identity() if tail is None else tail
    inputs, contributions, after = [], [], []

    def keep_mlp(module, args, output):
        inputs.append(args[0].flatten(0, -2))
        contributions.append(tail(output).flatten(0, -2))

    def keep_layer(module, args, output):
        after.append(_hidden(output))
        raise _Captured

    run_hooked(model, blocks, lambda: [(mlp_modules(model, spec_for(model.config))[layer], keep_mlp),
                                       (decoder, keep_layer)], source=False)
    before_mlp = torch.cat(after).float() - torch.cat(contributions).float()
    x = torch.cat(inputs)
    return x, (source_after.to(x.device).float() - before_mlp).to(x.dtype)


def squared_error_ratio(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """||out - target||^2 / ||target||^2 in fp32: the loss calibration minimizes."""
    target = target.float()
    return (out.float() - target).square().sum() / target.square().sum().clamp_min(1e-30)


def fit_figures(mlp: ReluGatedMLP, x: torch.Tensor, y: torch.Tensor, chunk: int = 16384,
                tail: nn.Module | None = None) -> tuple[float, float, float]:
    """Over all rows, in chunks: squared_error_ratio of mlp(x) (through `tail` where given) against y, the mean
    units a row whose gate fires, and the mean penalty of a row (the training's: the sum over units of
    |relu(gate) * up|, or of the log penalty once the layer's eps is measured)."""
    tail = nn.Identity() if tail is None else tail
    err = active = l1 = 0.0
    with torch.no_grad(), compute(x.device):
        for xc, yc in zip(x.split(chunk), y.split(chunk)):
            gate, up = mlp.gate_up(xc)
            h = F.relu(gate) * up
            active += float((gate > 0).sum())
            l1 += float(sparsity_penalty(h, mlp.penalty_eps)) * len(xc)
            out = getattr(mlp, mlp.spec.down)(h)
            err += float((tail(out).float() - yc.float()).square().sum())
    return err / max(float(y.float().square().sum()), 1e-30), active / len(x), l1 / len(x)


def fit_layer(mlp: ReluGatedMLP, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
              generator: torch.Generator, sparsity: float = 0.0, tail: nn.Module | None = None) -> LayerFit:
    """Fits `mlp`'s parameters so that mlp(x), through `tail` where given (its parameters left as they are),
    matches y by `steps` Adam steps (lr cosine from `lr` to 0), each on ROWS_PER_STEP rows drawn at random; with
    `sparsity` > 0 under the penalty, with a weight that steers the share of units that do not fire towards it
    (module docstring). With the log penalty on (mlp.l1_log_scale) and its eps unmeasured, the layer's first
    tracked forward measures it on the rows before the fit."""
    tail = nn.Identity() if tail is None else tail
    if mlp.l1_log_scale and mlp.l1_eps is None:
        tracked, mlp.track = mlp.track, True
        with torch.no_grad(), compute(x.device):
            mlp(x[:ROWS_PER_STEP])
        mlp.track, mlp.stats = tracked, None
    before, _, l1_swap = fit_figures(mlp, x, y, tail=tail)
    params = [p for p in mlp.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    target = (1 - sparsity) * mlp.weights()[0].shape[0]  # firing units a row allowed
    weight = L1_WEIGHT_START
    tracked, mlp.track = mlp.track, sparsity > 0
    try:
        for _ in range(steps):
            rows = torch.randint(len(x), (min(ROWS_PER_STEP, len(x)),), generator=generator).to(x.device)
            with compute(x.device):
                out = tail(mlp(x[rows]))
            loss = squared_error_ratio(out, y[rows])
            if sparsity:
                loss = loss + weight * mlp.stats.l1 / max(l1_swap, 1e-12)
                weight *= math.exp(L1_WEIGHT_RATE * activity_error(float(mlp.stats.active), target))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        mlp.track, mlp.stats = tracked, None
        for p in (*params, *tail.parameters()):
            p.grad = None
    after, active, _ = fit_figures(mlp, x, y, tail=tail)
    return LayerFit(before, after, active, l1_swap, mlp.l1_eps if mlp.l1_log_scale else None)


def share_fits(mlps: list[ReluGatedMLP], fits: dict[int, LayerFit], world: int) -> dict[int, LayerFit]:
    """Every process's fits ({layer: LayerFit}, layer l fitted by process l % world), with each layer's parameters
    and log-penalty eps made its fitting process's on every process."""
    gathered = [None] * world
    dist.all_gather_object(gathered, fits)
    fits = {layer: fit for part in gathered for layer, fit in part.items()}
    for layer, mlp in enumerate(mlps):
        for param in mlp.parameters():
            dist.broadcast(param.data, src=layer % world)
        if mlp.l1_log_scale:
            mlp.l1_eps = fits[layer].l1_eps
    return fits


def _report(layer: int, fit: LayerFit, mlps: list[ReluGatedMLP], world: int, started: float, done: int,
            total: int) -> None:
    """The line of a fitted layer; in a log with the time and the time left (`done` of this process's `total`)."""
    units = mlps[layer].weights()[0].shape[0]
    where = f", process {layer % world}" if world > 1 else ""
    line = (f"calibrated layer {layer} (layers 0-{len(mlps) - 1}{where}): relative error of its MLP "
            f"{fit.before:.4f} (swapped) -> {fit.after:.4f}, {fit.active:.1f} of {units} units "
            f"active ({1 - fit.active / units:.2%} sparse)")
    console.print(line if console.is_terminal else timestamped(line, time.perf_counter() - started, done, total),
                  soft_wrap=True)


def calibrate(model: nn.Module, mlps: list[ReluGatedMLP], blocks: list[torch.Tensor], steps: int, lr: float,
              seed: int = 0, shown: bool = True, sparsity: float = 0.0, sequential: bool = False,
              l1_log_scale: float = 0.0, rank: int = 0, world: int = 1) -> CalibrationResult:
    """Fits each of `mlps` (the relufied `model`'s, in layer order) on `blocks`, one layer at a time, towards
    `sparsity` (0: a dense fit) under the penalty (`l1_log_scale` > 0: the log penalty, its eps measured here): to
    the source's MLP on its inputs, or `sequential`ly to the source's residual stream (module docstring); the other
    parameters are left as they are. The result lists the layers in order. Each layer draws its rows from a
    generator of its own (seed, layer), so that the fits do not depend on which process makes them: of `world`
    processes (torch.distributed, each holding the whole model and the same blocks; independent fits only) process
    `rank` fits every world-th layer from layer `rank`, and each layer's fitted parameters are then broadcast from
    its process."""
    if sequential and world > 1:
        raise ConfigError(f"--calibrate-sequential runs on one process, not {world}")
    started = time.perf_counter()
    fits = {}
    # Independent: last layer first, since the source's MLPs share their projections with the ReLU MLPs, so a
    # layer's source inputs are the source's only while the layers below it are not fitted yet. Sequential: each
    # layer needs the ones below it fitted.
    if sequential:
        check_kept_memory(sum(p.numel() * p.element_size() for mlp in mlps for p in mlp.parameters()),
                          available_memory())
    for mlp in mlps:
        mlp.l1_log_scale, mlp.l1_eps = l1_log_scale, None
    if shown and sparsity:
        console.print(f"sparse calibration: each layer's ReLU MLP fitted to the source's until {sparsity:.0%} of its "
                      "units are silent" + ("" if sequential else " (the last layer first: each reads the source's "
                                                                   "stream, which the layers below it still give)")
                      + "; its error against the source rises from the dense swap's, and training brings the model "
                      "back", soft_wrap=True)
    source = SourceProjections(mlps)
    layers = range(len(mlps)) if sequential else list(reversed(range(rank, len(mlps), world)))
    for layer in layers:
        mlp = mlps[layer]
        if sequential:
            with source.in_place():
                after = source_stream(model, blocks, layer)
            source.keep(layer)
            x, y = stream_rows(model, blocks, layer, after)
            del after
        else:
            x, y = source_rows(model, blocks, layer)
        with console.status(f"calibrating layer {layer} (layers 0-{len(mlps) - 1})") if shown else nullcontext():
            generator = torch.Generator().manual_seed(seed * LAYER_SEEDS + layer)
            fits[layer] = fit_layer(mlp, x, y, steps, lr, generator, sparsity,
                                    output_norm(model, layer) if sequential else None)
        del x, y
        if shown:
            _report(layer, fits[layer], mlps, world, started, len(fits), len(layers))
    if world > 1:
        fitted_here = set(fits)
        fits = share_fits(mlps, fits, world)
        for layer in sorted(set(fits) - fitted_here) if shown else ():
            _report(layer, fits[layer], mlps, world, started, len(layers), len(layers))
    tokens = sum(block.numel() for block in blocks)
    return CalibrationResult(tokens, steps, lr, sparsity, time.perf_counter() - started,
                             [fits[layer] for layer in range(len(mlps))], sequential)
