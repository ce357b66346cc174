"""Reviving dead units (`revive_dead_tokens`): a ReLU unit whose gate pre-activation is negative on every token gets
no gradient and never fires again. At each log step each layer's units that have not fired for that many tokens
each take a live unit of the layer split in two as Net2Net widens a layer (Chen et al., 2016): the copy fires where
its source fires, the two share the source's output weights, and the layer computes what it did but for a little
noise on the copy's gate, which breaks the symmetry so that the two can diverge."""
from __future__ import annotations

import torch
from accelerate import Accelerator

from ..config import TrainConfig
from ..errors import ConfigError
from ..relufy import ReluGatedMLP
from .state import Run, RunState, StepOutcome

# The revived unit's gate row is its source's plus gaussian noise of this share of that row's RMS: enough to break
# the symmetry, small enough that the layer's output (and the loss) barely moves.
REVIVE_NOISE = 1e-2


def check_revive(config: TrainConfig, accelerator: Accelerator) -> None:
    """ConfigError where `revive_dead_tokens` cannot run: under FSDP (each process holds a shard of the rows that a
    split reads and writes), or a window below one step's tokens on these processes."""
    if config.revive_dead_tokens is None:
        return
    if accelerator.is_fsdp2:
        raise ConfigError("--revive-dead-tokens does not run under FSDP yet (its parameters are sharded): leave it "
                          "off, or launch without the FSDP config")
    config.check_revive(accelerator.num_processes)


def revive_dead(run: Run, state: RunState, outcome: StepOutcome, entry: dict) -> None:
    """Splits into each layer's units that have not fired in `revive_dead_tokens` tokens a distinct unit that fired
    in the step just made (`outcome.fired`), both chosen at random, as many as there are of the fewer; resets the
    revived units' last firing to now, so that they do not count dead at once, and records in the log `entry` the
    units revived, per layer and in all. The same on every process (the figures are reduced over them, the random
    choices seeded from the run's seed, the step and the layer)."""
    tokens = entry["tokens"]
    idle = (tokens - state.last_fired).cpu()
    fired = outcome.fired.cpu()
    for index, (mlp, layer) in enumerate(zip(run.mlps, entry["layers"])):
        generator = _generator(run.config.seed, state.step, index)
        dead = (idle[index] >= run.config.revive_dead_tokens).nonzero().flatten()
        live = (fired[index] > 0).nonzero().flatten()
        count = min(len(dead), len(live))
        targets = dead[torch.randperm(len(dead), generator=generator)[:count]]
        sources = live[torch.randperm(len(live), generator=generator)[:count]]
        if count:
            split_units(mlp, sources, targets, generator, optimizer=run.optimizer)
            state.last_fired[index, targets.to(state.last_fired.device)] = tokens
        layer["revived"] = count
    entry["revived"] = sum(layer["revived"] for layer in entry["layers"])


def _generator(seed: int, step: int, layer: int) -> torch.Generator:
    """A CPU generator of the layer's revival at this step: the same draws on every process and in a resumed run,
    and the global RNG (the data order, dropout) left as it was."""
    # A tuple of ints hashes the same in every process and run (only str and bytes hashes are salted).
    return torch.Generator().manual_seed(hash((seed, step, layer)) % 2**64)


def split_units(mlp: ReluGatedMLP, sources: torch.Tensor, targets: torch.Tensor, generator: torch.Generator,
                noise: float = REVIVE_NOISE, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Splits each unit of `sources` in two, its copy overwriting the unit of `targets` at the same place (distinct
    units, none of them a source): the copy's gate row is the source's plus gaussian noise (from `generator`, CPU)
    of `noise` times that row's RMS, its up row and gate and up biases the source's, and the two units' down
    columns each half of the source's, so that without noise the layer's output is what it was while the targets
    added nothing to it (dead units). With `optimizer` (AdamW), once it holds moments for the MLP's parameters: the
    copies' moments are zeroed, so that their updates differ from their sources' and the two diverge; the sources'
    gate and up rows, whose gradient the halved down column halves, have theirs scaled to match (exp_avg by 1/2,
    exp_avg_sq by 1/4: AdamW's update goes on as before); a source's down column keeps its moments, its gradient
    unchanged (its activation and the layer's output gradient are)."""
    with torch.no_grad():
        gate, up, down = mlp.weights()
        gate_bias, up_bias = _gate_up_biases(mlp)
        sources, targets = sources.to(gate.device), targets.to(gate.device)
        source_gate = gate.index_select(0, sources)
        rms = source_gate.float().square().mean(1, keepdim=True).sqrt()
        jitter = torch.randn(len(targets), gate.shape[1], generator=generator).to(gate.device) * rms * noise
        gate.index_copy_(0, targets, (source_gate + jitter).to(gate.dtype))
        for rows in (up, gate_bias, up_bias):
            if rows is not None:
                rows.index_copy_(0, targets, rows.index_select(0, sources))
        half = down.index_select(1, sources) / 2
        down.index_copy_(1, sources, half)
        down.index_copy_(1, targets, half)
        if optimizer is None:
            return
        params = {p.untyped_storage().data_ptr(): p for p in mlp.parameters()}
        for view, dim, source_scale in ((gate, 0, 0.5), (up, 0, 0.5), (gate_bias, 0, 0.5), (up_bias, 0, 0.5),
                                        (down, 1, 1.0)):
            if view is None:
                continue
            for moment, power in zip(_moments(optimizer, params, view), (1, 2)):
                moment.index_fill_(dim, targets, 0)
                if source_scale != 1:
                    moment.index_copy_(dim, sources, moment.index_select(dim, sources) * source_scale ** power)


def _gate_up_biases(mlp: ReluGatedMLP) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gate bias [I], up bias [I]) as mlp.weights() gives the weights (views into a fused bias), None for none."""
    spec = mlp.spec
    if spec.gate_up:
        bias = getattr(mlp, spec.gate_up).bias
        return bias.chunk(2) if bias is not None else (None, None)
    return getattr(mlp, spec.gate).bias, getattr(mlp, spec.up).bias


def _moments(optimizer: torch.optim.Optimizer, params: dict, view: torch.Tensor) -> list[torch.Tensor]:
    """[exp_avg, exp_avg_sq] of the parameter that `view` views (`params`: by their storage), viewed the same way:
    AdamW makes them in the parameter's shape and layout; none before the optimizer's first step."""
    param = params[view.untyped_storage().data_ptr()]
    state = optimizer.state.get(param, {})
    offset = view.storage_offset() - param.storage_offset()
    return [torch.as_strided(state[name], view.size(), view.stride(), state[name].storage_offset() + offset)
            for name in ("exp_avg", "exp_avg_sq") if name in state]
