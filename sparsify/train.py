"""Continued training of a relufied model: loss = cross_entropy + l1_coeff(step) * L1 (or * L1 / L1_0); with
`distill` d, (1 - d) * cross_entropy + d * KL(source || model) + the same L1 term.

L1 is the method's definition (docs twell.md section 1): the mean over layers of each ReluGatedMLP's
`stats.l1` (per layer: mean over tokens of the sum over hidden units of |relu(gate(x)) * up(x)|).
Runs through accelerate's Accelerator, so `accelerate launch` spreads it over GPUs, as DDP or, with an
FSDP config (recipes/accelerate/fsdp.yaml), as FSDP2: each decoder layer a unit whose weights are whole
tensors inside its forward, fp32 master weights, bf16 compute, gradients reduced in fp32. bf16 autocast
is on by default on GPU; AdamW, cosine schedule with warm-up, gradient accumulation, clipping, optional
gradient checkpointing. Tracks per layer the mean active units per token (L0), L1 and dead units (not
fired within the last `dead_window_tokens` tokens); every statistic is reduced over the processes, so
all of them make the same routing choices. Under FSDP the trained model stays sharded (TrainResult.model
on every process: measure(sharded=True) runs on it) until `gather_model` collects the full weights into
an unsharded model on the main process's CPU for export, so no GPU ever holds the whole model; the
`evaluate` callback runs the prepared model before the first step (the source weights' perplexities).
With `l1_relative` the coefficient weighs L1 / L1_0 (L1_0: the first micro-batch's L1), which makes
one value fit models of any width. With `swap_steps` the swap is progressive: the gate activation moves
linearly from the source's (SiLU) to ReLU over those steps (ReluGatedMLP.source_share), so training starts
from the source's function instead of the swap's jump in loss.

Each MLP trains on one of two paths with the same math: dense PyTorch, or the TwELL hybrid kernels
(twell.hybrid: sparse ELL rows plus a dense backup for rows above `hybrid_max_nnz` active units), which
are faster only when few units are active. The path is chosen per layer at every log step from the
layer's mean active units per token over the log window (summed on device, read at the log step that
already syncs: no extra host sync): hybrid below `hybrid_below`, back to dense above HYBRID_EXIT times
it (a layer near the threshold does not flip at every check). A hybrid layer also gets its hot units
from the last step's counts (twell.hybrid.hot_units: units firing in more tokens than per-pair gathers
pay for run as dense columns). A freshly relufied model starts dense. The log records each layer's path,
its backup rows per window and its hot units. Ctrl-C (SIGINT) or SIGTERM saves the complete training
state (accelerate's save_state: weights as safetensors, optimizer, scheduler, RNG; plus step, data position,
log and dead-unit windows in state.json) to `resume_dir`, from which `resume=True` continues; `save_every`
and `save_every_minutes` (default 30) also save it periodically, and in a single-process run an error in the
training loop (bad data, out of memory) saves the last completed step before it propagates. The signal is acted
on at the end of the step in progress, the same step on every process (_StopRequest): a terminal's Ctrl-C
reaches every process, and `accelerate launch` sends it to its workers again, so a KeyboardInterrupt would land
in each process at a different point, one inside a collective the others have left.
"""
from __future__ import annotations

import copy
import importlib.util
import json
from contextlib import nullcontext
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import get_cosine_schedule_with_warmup

from . import relufy
from .errors import ConfigError, SparsifyError
from .families import spec_for
from .report import console

# An absolute coefficient depends on the model's activation scale (the paper's 1.5B model: 2e-5; the 3M-parameter
# demo: 8e-2); above 1 the L1 term swamps the cross-entropy of any model. A relative one (`l1_relative`) is the
# penalty's initial weight in nats: beyond 100 it is 30 times any language model's cross-entropy.
MAX_L1 = 1.0
MAX_L1_RELATIVE = 100.0
# A layer on the hybrid kernels goes back to dense only above this multiple of `hybrid_below`. With the
# default 40 the band is 40-50 units: around the H100 block benchmark's break-even (~47), so a layer
# hovering there costs at most a few percent on either path instead of flipping at every check.
HYBRID_EXIT = 1.25


class TrainingInterrupted(SparsifyError):
    """Ctrl-C during training: the state was saved and `--resume` continues from it."""


@dataclass
class TrainConfig:
    """Training settings; a recipe YAML holds any of these keys, command-line options override it."""

    l1: float = field(default=2e-5, metadata={"help": "L1 coefficient on the MLP hidden activations (paper: 2e-5)."})
    l1_relative: bool = field(default=False, metadata={"help": (
        "Read `l1` as the weight of L1 / L1_0, where L1_0 is the L1 term of the first micro-batch (mean over "
        "ranks): the penalty's weight in nats at the start, the same for any width and activation scale "
        "(docs/quality.md: 7 converts both the 192-wide demo and a 1024-wide model).")})
    l1_warmup_steps: int | str = field(default=0, metadata={"help": (
        "Raise the L1 coefficient linearly from 0 over this many optimizer steps, or this share of them (\"50%\").")})
    swap_steps: int | str = field(default=0, metadata={"help": (
        "Move the gate activation linearly from the source's (SiLU) to ReLU over this many optimizer steps, or "
        "this share of them (\"20%\"), instead of swapping it at once (0). Layers train dense until the swap is "
        "complete.")})
    steps: int | None = field(default=None, metadata={"help": "Optimizer steps; with `tokens`, whichever ends first."})
    tokens: int | None = field(default=None, metadata={"help": "Training tokens; with `steps`, whichever ends first."})
    seq_len: int = field(default=1024, metadata={"help": "Tokens per sequence (packed blocks)."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per micro-batch and device."})
    grad_accum: int = field(default=1, metadata={"help": "Micro-batches accumulated per optimizer step."})
    lr: float = field(default=2e-5, metadata={"help": "Peak learning rate of AdamW."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={"help": "AdamW betas."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear learning-rate warm-up steps before the cosine decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm."})
    grad_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward to save memory."})
    hybrid_below: float = field(default=40.0, metadata={"help": (
        "Train a layer's MLP on the TwELL hybrid kernels while its mean active units per token are below this "
        f"(back to dense above {HYBRID_EXIT}x it), re-checked at every log step; on CUDA with triton only; 0: "
        "always dense. Default 40: the H100 block benchmark (I=5632, E=128) is 1.85x faster than dense at 29 "
        "uniform active units, 0.74x at ~96 with uneven units and 1.28x there with hot units as dense columns.")})
    hybrid_max_nnz: int = field(default=128, metadata={"help": "E of the hybrid format: token rows with more active units run in the dense backup (paper: 128)."})
    hybrid_hot_rate: float = field(default=0.013, metadata={"help": (
        "On the hybrid path, units that fired in more than this share of the last step's tokens run as dense "
        "columns (re-chosen at every log step; 1: never). Default 0.013: the H100 break-even of a dense column "
        "against per-pair gathers (twell.hybrid.HOT_RATE).")})
    dead_window_tokens: int | None = field(default=None, metadata={"help": "A unit is dead when it has not fired in this many tokens (default: one optimizer step's tokens)."})
    shuffle_buffer: int = field(default=1024, metadata={"help": "Training blocks drawn at random from a buffer of this many (0: the data's own order)."})
    eval_tokens: int = field(default=65536, metadata={"help": "Held-out tokens for perplexity and sparsity measurement."})
    seed: int = field(default=0, metadata={"help": "Random seed."})
    log_every: int = field(default=10, metadata={"help": "Log (JSON and progress bar) every this many steps."})
    distill: float = field(default=0.0, metadata={"help": (
        "Weight of distillation from the source model: the cross-entropy term becomes (1 - distill) * CE + "
        "distill * KL(source || trained) over the next-token distributions at every position, the source's "
        "from a frozen copy of the original model (one more forward a micro-batch; its weights whole in bf16 "
        "on each GPU, also under FSDP). 0: off.")})
    save_every_minutes: float = field(default=30.0, metadata={"help": (
        "Also save the training state for --resume when this many minutes have passed since the start or the "
        "last save (0: off), so that a crash or a killed job loses at most that much.")})
    save_every: int = field(default=0, metadata={"help": (
        "Also save the training state for --resume every this many optimizer steps (0: only on Ctrl-C or "
        "SIGTERM), for runs that may be killed without time to save: a preempted job, or a large sharded "
        "state under `accelerate launch`, which kills its processes 30 s after Ctrl-C.")})

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """From a recipe's or the command line's values, with YAML's quirks mended ("2e-5" reads as a
        string in YAML 1.1, "1e9" tokens as a float)."""
        defaults = {f.name: f.default for f in fields(cls)}
        unknown = set(values) - set(defaults)
        if unknown:
            raise ConfigError(f"unknown training settings: {', '.join(sorted(unknown))} (known: {', '.join(sorted(defaults))})")
        config = {}
        for name, value in values.items():
            kind = type(defaults[name]) if defaults[name] is not None else int
            try:
                if name in SHARE_OF_STEPS and _percent(str(value).strip()) is not None:
                    value = str(value).strip()
                elif kind is float:
                    value = float(value)
                elif kind is int and not isinstance(value, bool) and float(value) == int(float(value)):
                    value = int(float(value))
                elif kind is tuple:
                    value = tuple(float(v) for v in value)
            except (TypeError, ValueError):
                raise ConfigError(f"{name}: {value!r} is not a {kind.__name__}") from None
            config[name] = value
        return cls(**config)

    def tokens_per_step(self, world: int = 1) -> int:
        return self.seq_len * self.batch_size * self.grad_accum * world

    def total_steps(self, world: int = 1) -> int:
        bounds = [self.steps] if self.steps is not None else []
        if self.tokens is not None:
            bounds.append(math.ceil(self.tokens / self.tokens_per_step(world)))
        return min(bounds)

    def validate(self, max_positions: int | None = None) -> None:
        def bad(message):
            raise ConfigError(message)

        if self.l1_relative:
            if not (isinstance(self.l1, (int, float)) and 0 <= self.l1 <= MAX_L1_RELATIVE):
                bad(f"l1 (relative) must be between 0 and {MAX_L1_RELATIVE} (the initial weight of the L1 term "
                    f"in nats), got {self.l1}")
        elif not (isinstance(self.l1, (int, float)) and 0 <= self.l1 <= MAX_L1):
            bad(f"l1 must be between 0 and {MAX_L1} (the paper uses 2e-5; or use l1_relative), got {self.l1}")
        if self.steps is None and self.tokens is None:
            bad("set the training length: --steps or --tokens (or a recipe that sets them)")
        for name in ("steps", "tokens", "seq_len", "batch_size", "grad_accum", "log_every", "dead_window_tokens", "eval_tokens", "hybrid_max_nnz"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                bad(f"{name.replace('_', '-')} must be a positive integer, got {value}")
        for name in ("warmup_steps", "shuffle_buffer", "save_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                bad(f"{name.replace('_', '-')} must be an integer >= 0, got {getattr(self, name)}")
        for name in SHARE_OF_STEPS:
            value = getattr(self, name)
            share = _percent(value)
            if not (isinstance(value, int) and value >= 0 or share is not None and 0 <= share < 100):
                bad(f"{name.replace('_', '-')} must be an integer >= 0 or a share of the steps below 100%, got {value}")
        if not 0 < self.lr <= 1:
            bad(f"lr must be in (0, 1], got {self.lr}")
        if not 0 < self.hybrid_hot_rate <= 1:
            bad(f"hybrid-hot-rate must be in (0, 1], got {self.hybrid_hot_rate}")
        if not 0 <= self.hybrid_below < math.inf:
            bad(f"hybrid-below must be a number >= 0 (0: dense only), got {self.hybrid_below}")
        if not 0 <= self.weight_decay <= 1:
            bad(f"weight-decay must be in [0, 1], got {self.weight_decay}")
        if not self.max_grad_norm > 0:
            bad(f"max-grad-norm must be > 0, got {self.max_grad_norm}")
        if not 0 <= self.save_every_minutes < math.inf:
            bad(f"save-every-minutes must be a number >= 0 (0: off), got {self.save_every_minutes}")
        if not 0 <= self.distill <= 1:
            bad(f"distill must be in [0, 1] (the share of the KL term; 0: off), got {self.distill}")
        if self.seq_len < 2:
            bad(f"seq-len must be at least 2, got {self.seq_len}")
        if max_positions is not None and self.seq_len > max_positions:
            bad(f"seq-len {self.seq_len} is beyond the model's maximum of {max_positions} positions")

    def schedule(self, total: int) -> TrainConfig:
        """This config with the step counts given as a share of the run ("20%") resolved for `total` steps."""
        return replace(self, **{name: steps_of(getattr(self, name), total) for name in SHARE_OF_STEPS})


# Schedule lengths that a recipe may give as a share of the training steps ("20%"), so that it fits any length.
SHARE_OF_STEPS = ("l1_warmup_steps", "swap_steps")


def _percent(value) -> float | None:
    """P of a "P%" string; None for anything else."""
    try:
        return float(value[:-1]) if isinstance(value, str) and value.endswith("%") else None
    except ValueError:
        return None


def steps_of(value: int | str, total: int) -> int:
    """A step count, or a share of `total` steps written "P%", as a step count."""
    return round(total * float(value[:-1]) / 100) if isinstance(value, str) else value


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    log: list[dict]
    # The trained model in eval mode: the one passed in, or under FSDP (`sharded`) the prepared model whose
    # weights are sharded over the processes (gather_model makes a whole one).
    model: torch.nn.Module | None = None
    sharded: bool = False


TRAINING_BYTES = 16  # a parameter's fp32 weight and gradient and its two fp32 AdamW moments
TEACHER_BYTES = 2  # a parameter of the distillation teacher (bf16)


def training_state_bytes(parameters: int, processes: int, sharded: bool, teacher: bool = False) -> float:
    """Bytes of training state on each process before any activation: the whole state, or under FSDP
    (`sharded`) its share, and a distillation `teacher` whole on each."""
    return TRAINING_BYTES * parameters / (processes if sharded else 1) + (TEACHER_BYTES * parameters if teacher else 0)


def check_training_memory(parameters: int, device: str | None, processes: int, sharded: bool,
                          teacher: bool = False) -> None:
    """ConfigError when the training state alone (TRAINING_BYTES a parameter, before any activation; with a
    distillation `teacher` TEACHER_BYTES more) exceeds the GPU's memory: the whole state on each GPU, or
    under FSDP (`sharded`) its share. Nothing on CPU."""
    if on_cpu(device):
        return
    index = torch.device(device).index if device else None
    total = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).total_memory
    need = training_state_bytes(parameters, processes, sharded, teacher)
    if need > total:
        fix = (f"use more than {processes} GPUs" if sharded else
               "shard it over several GPUs: accelerate launch --config_file recipes/accelerate/fsdp.yaml "
               "--num_processes N -m cli convert ...")
        raise ConfigError(f"training {parameters / 1e9:.2f}B parameters needs {need / 2**30:.0f} GiB on each GPU for the "
                          f"weights, gradients and AdamW state{' and the distillation teacher' if teacher else ''} alone, "
                          f"and this GPU has {total / 2**30:.0f} GiB: {fix}")


LAUNCHER_GRACE_S = 30  # accelerate launch and torchrun kill their processes this long after a Ctrl-C
# A sharded training state above this size takes longer than that to write (6.5B parameters, 97 GiB: 87 s on
# 2 H100s, benchmarks/results/fsdp_scale_check_save_h100x2.json)
SLOW_SAVE_GIB = 30


def slow_save_warning(parameters: int, processes: int, save_every: float) -> str | None:
    """The warning for a multi-process run whose training state is too large to save within a launcher's
    shutdown timeout, with no periodic save (`save_every`: steps or minutes, 0 for none) to fall back on
    (None otherwise)."""
    gib = TRAINING_BYTES * parameters / 2**30
    if processes < 2 or save_every or gib <= SLOW_SAVE_GIB:
        return None
    return (f"the training state is {gib:.0f} GiB: after a Ctrl-C, `accelerate launch` and torchrun kill the "
            f"processes within {LAUNCHER_GRACE_S} s, before a state this size is written (97 GiB took 87 s on "
            "2 H100s), and the run could not be resumed; pass --save-every N or --save-every-minutes M to also "
            "save it periodically")


def on_cpu(device: str | None) -> bool:
    """Whether training runs on CPU. accelerate must be told (`cpu=True`) even without a GPU, else
    processes started by torchrun do not join one CPU (gloo) process group."""
    return device == "cpu" or not torch.cuda.is_available()


def hybrid_kernels_run(device: torch.device) -> bool:
    """Whether twell.hybrid runs its kernels (not its dense reference) for tensors on `device`: CUDA with
    triton, or CPU under the Triton interpreter (tests)."""
    return (relufy.hybrid_gated_mlp is not None and importlib.util.find_spec("triton") is not None
            and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


def hybrid_paths(entry: dict, below: float) -> list[bool]:
    """Per layer, whether it trains on the hybrid kernels until the next log step, from a log entry (the
    window's mean active units and the path it ran on)."""
    return [l["active"] < below or (l["path"] == "hybrid" and l["active"] <= HYBRID_EXIT * below) for l in entry["layers"]]


def hybrid_share(log: list[dict]) -> list[float]:
    """Per layer, the fraction of logged training steps it spent on the hybrid kernels."""
    if not log:
        return []
    steps = [e["step"] - previous for e, previous in zip(log, [0] + [e["step"] for e in log])]
    return [sum(n for n, e in zip(steps, log) if e["layers"][i]["path"] == "hybrid") / log[-1]["step"]
            for i in range(len(log[0]["layers"]))]


def _activation_checkpointing(model, on: bool):
    """Turns activation checkpointing (non-reentrant) on or off, under the name the installed transformers
    has: activation_checkpointing_* from 5.23, gradient_checkpointing_* (to be removed in v6) before."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def distillation_kl(logits: torch.Tensor, teacher: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """KL(teacher || model) of the next-token distributions, summed over the vocabulary and averaged over
    the positions of `ids`, in fp32; `logits` are the model's on `ids`."""
    with torch.no_grad():
        target = F.log_softmax(teacher(input_ids=ids).logits.float(), dim=-1).flatten(0, -2)
    return F.kl_div(F.log_softmax(logits.float(), dim=-1).flatten(0, -2), target, log_target=True,
                    reduction="batchmean")


def l1_coeff(config: TrainConfig, step: int) -> float:
    """Coefficient at optimizer step `step` (0-based): linear from l1/warm-up to l1, then constant (relative
    to L1_0 with `l1_relative`); `config` with its step counts resolved (TrainConfig.schedule)."""
    if config.l1_warmup_steps == 0:
        return config.l1
    return config.l1 * min(1.0, (step + 1) / config.l1_warmup_steps)


def source_share(config: TrainConfig, step: int) -> float:
    """Weight of the source activation in the gate at optimizer step `step` (0-based): 1 at the first step,
    falling linearly to 0 (plain ReLU) at `swap_steps`; `config` resolved as for l1_coeff."""
    return max(0.0, 1.0 - step / config.swap_steps) if config.swap_steps else 0.0


def train(
    model,
    mlps: list,
    batches: Callable[[int, int, int], Iterator[torch.Tensor]],
    config: TrainConfig,
    *,
    resume_dir: str | Path | None = None,
    resume: bool = False,
    device: str | None = None,
    show_progress: bool = True,
    evaluate: Callable[[torch.nn.Module], None] | None = None,
    inputs: dict | None = None,
    teacher: torch.nn.Module | None = None,
) -> TrainResult:
    """Train `model` (in place; under FSDP see TrainResult.model). `batches(start, rank, world)` yields
    [batch, seq_len] token ids, starting after `start` batches consumed over all ranks. `evaluate(model)`, if
    given, runs on every process with the prepared model before the first step and before a resumed state
    loads. `inputs` (JSON values; convert: the source model and the data) is saved with an interrupted
    state, and a resumed run must give the same (check_resume). `teacher` (needed with `config.distill`): a
    frozen model over the same vocabulary, moved to this process's device and run under the same autocast,
    whose next-token distributions the model is fitted to (convert passes a copy of the source model); under
    FSDP it stays whole on each process, its weights broadcast from the main one (which alone may have read
    them).
    Returns the log (one entry per logged step) and the trained model."""
    cpu = on_cpu(device)
    accelerator = Accelerator(cpu=cpu, mixed_precision="no" if cpu else "bf16")
    _check_fsdp(accelerator)
    if config.distill and teacher is None:
        raise ConfigError("distill needs the source model as the teacher")
    set_seed(config.seed)
    world = accelerator.num_processes
    saved = check_resume(resume_dir, config, world, inputs) if resume else None  # before any work
    warning = slow_save_warning(sum(p.numel() for p in model.parameters()), world,
                                config.save_every or config.save_every_minutes)
    if warning and resume_dir is not None and accelerator.is_main_process:
        console.print(f"[yellow]warning:[/] {warning}")
    total = config.total_steps(world)
    schedule = config.schedule(total)
    if schedule.swap_steps >= total:  # the trained model must be the ReLU model the export describes
        raise ConfigError(f"swap-steps {config.swap_steps} must be below the {total} training steps")
    dead_window = config.dead_window_tokens or config.tokens_per_step(world)

    model.config.use_cache = False
    if config.grad_checkpointing:
        _activation_checkpointing(model, True)
    model.train()
    # fused on GPU: one kernel updates each tensor in place, where foreach's per-step temporaries (a copy of
    # the second moments and more) add about a weight-sized buffer to the peak.
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay,
                                  fused=not cpu)
    # The scheduler is not passed to prepare(): accelerate would step it once per process per step.
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, total)
    if accelerator.is_fsdp2 and not cpu:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # bf16 compute over the fp32 master weights, as autocast does under DDP; accelerate's default policy
        # would also reduce gradients in bf16, whose 8-bit mantissa loses the small updates.
        accelerator.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    if config.distill:
        teacher = teacher.to(accelerator.device).eval().requires_grad_(False)
        if accelerator.is_fsdp2 and world > 1:  # whole on each process: those that read no weights get the main one's
            for tensor in teacher.state_dict().values():
                torch.distributed.broadcast(tensor, src=0)
    if evaluate is not None:
        with torch.no_grad():
            evaluate(model)
        model.train()

    last_fired: torch.Tensor | None = None  # [layers, I]: token count at each unit's last firing
    step, log, elapsed, consumed = 0, [], 0.0, 0  # consumed: batches read over all ranks
    l1_reference = None  # L1_0 of `l1_relative`: measured on the first micro-batch
    if saved is not None:
        accelerator.load_state(resume_dir)
        step, log, elapsed, consumed = saved["step"], saved["log"], saved["seconds"], saved["batches"]
        l1_reference = saved.get("l1_reference")
        fired = torch.load(Path(resume_dir) / "last_fired.pt")
        if fired is not None:
            last_fired = fired.to(accelerator.device)
    routing = config.hybrid_below > 0 and hybrid_kernels_run(accelerator.device)
    # Resumed: the paths that followed the last log entry; else dense until the first measurement.
    paths = hybrid_paths(log[-1], config.hybrid_below) if routing and log else [False] * len(mlps)
    for m, hybrid in zip(mlps, paths):
        m.track, m.use_hybrid, m.hybrid_max_nnz = True, hybrid, config.hybrid_max_nnz

    stream = batches(consumed, accelerator.process_index, world)
    window = _Window(len(mlps), accelerator.device)
    progress = _progress(show_progress and accelerator.is_main_process, total, step)
    started, window_started = time.perf_counter() - elapsed, time.perf_counter()

    saved_step = step  # the step of the state in resume_dir, if any
    settled = True  # False from a step's update of the weights to its count and units' firing, and during a save

    def save():  # reported: a large sharded state is long to write
        nonlocal saved_step, settled
        if progress:
            progress.console.print(f"step {step}: saving the training state to {resume_dir}")
        saving, settled = time.perf_counter(), False
        _save(accelerator, resume_dir, {"step": step, "batches": consumed, "log": log,
                                        "seconds": time.perf_counter() - started, "last_fired": last_fired,
                                        "l1_reference": l1_reference, "processes": world, "inputs": inputs}, config)
        saved_step, settled = step, True
        if progress:
            progress.console.print(f"saved in {time.perf_counter() - saving:.1f} s")

    stop = _StopRequest(world)
    last_save = time.perf_counter()
    try:
        while step < total:
            coeff = l1_coeff(schedule, step)
            if schedule.swap_steps:
                share = source_share(schedule, step)
                for m in mlps:
                    m.source_share = share
            step_fired = None
            for micro in range(config.grad_accum):
                ids = next(stream).to(accelerator.device)
                sync = micro == config.grad_accum - 1
                with accelerator.no_sync(model) if not sync else nullcontext(), accelerator.autocast():
                    output = model(input_ids=ids, labels=ids)
                    ce = output.loss
                    kl = distillation_kl(output.logits, teacher, ids) if config.distill else torch.zeros_like(ce)
                    del output  # its logits ([batch, seq_len, vocab]) need not live through the backward
                    layer_l1 = torch.stack([m.stats.l1.float() for m in mlps])
                    l1 = layer_l1.mean()
                    if config.l1_relative and l1_reference is None:  # once per run: one host sync
                        l1_reference = max(accelerator.reduce(l1.detach(), reduction="mean").item(), 1e-12)
                    weight = coeff / l1_reference if config.l1_relative else coeff
                    # ce, kl and l1 are means over this micro-batch's tokens; dividing them by grad_accum
                    # (and DDP averaging over ranks) makes the step's gradient that of the mean over all
                    # tokens of the step, for every term alike.
                    loss = (1 - config.distill) * ce + config.distill * kl + weight * l1
                    accelerator.backward(loss / config.grad_accum)
                fired = torch.stack([m.stats.fired for m in mlps])
                step_fired = fired if step_fired is None else step_fired + fired
                window.add(ce, kl, l1, layer_l1, torch.stack([m.stats.active.float() for m in mlps]),
                           torch.stack([m.backup_rows for m in mlps]))
            accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            settled = False
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            consumed += config.grad_accum * world

            # Dead units, at optimizer-step granularity: fired counts summed over micro-batches and ranks.
            step_fired = accelerator.reduce(step_fired, reduction="sum")
            tokens = step * config.tokens_per_step(world)
            if last_fired is None:
                last_fired = torch.zeros_like(step_fired)
            last_fired = torch.where(step_fired > 0, tokens, last_fired)  # a masked assignment would sync the host
            settled = True
            if step % config.log_every == 0 or step == total:
                now = time.perf_counter()
                entry = window.entry(accelerator, step, tokens, weight, scheduler.get_last_lr()[0], last_fired, dead_window,
                                     [m.runs_hybrid for m in mlps], config.distill)
                if config.l1_relative:
                    entry["l1_relative"], entry["l1_reference"] = coeff, l1_reference
                if schedule.swap_steps:
                    entry["source_share"] = share
                entry["tokens_per_s"] = window.count * ids.numel() * world / (now - window_started)
                entry["seconds"] = now - started
                log.append(entry)
                if routing:  # the same reduced figures on every rank: all ranks choose the same paths
                    for m, hybrid, fired, layer in zip(mlps, hybrid_paths(entry, config.hybrid_below), step_fired,
                                                       entry["layers"]):
                        m.use_hybrid = hybrid
                        # busy units (from the last step's counts) run as dense columns on the hybrid path
                        m.hot_units = relufy.hot_units(fired, config.tokens_per_step(world), config.hybrid_hot_rate) \
                            if hybrid else None
                        layer["hot_units"] = 0 if m.hot_units is None else m.hot_units.numel()
                window, window_started = _Window(len(mlps), accelerator.device), now
                if progress:
                    progress.stats = _progress_text(entry)
                    if not progress.console.is_terminal:  # logs to a file: one whole line per log step
                        progress.console.print(_log_line(entry, total, time.perf_counter() - started),
                                               soft_wrap=True)
            if progress:
                progress.update(0, completed=step)
            # the main process's clock decides, so that every process saves at the same step
            due = bool(config.save_every_minutes) and time.perf_counter() - last_save >= 60 * config.save_every_minutes
            stopping, due = stop.agreed(due) if step < total else (False, False)
            if stopping:
                if resume_dir is None:
                    raise KeyboardInterrupt
                save()
                raise TrainingInterrupted(f"interrupted at step {step} of {total}; the training state is in "
                                          f"{resume_dir}: run the same command with --resume to continue")
            if (due or config.save_every and step % config.save_every == 0) and step < total and resume_dir is not None:
                save()
                last_save = time.perf_counter()
    except Exception:
        # An error (bad data, out of memory) saves the last completed step, in single-process runs only: the save
        # is collective, and the other processes wait in a collective of the step that the failed one never
        # reaches (or fail at other points), so they would never join it. There the last periodic save stands.
        if world == 1 and resume_dir is not None and settled and step > saved_step:
            save()
            console.print(f"the training state of step {step} of {total} is saved in {resume_dir}: run the same "
                          "command with --resume to continue from it", soft_wrap=True)  # a path whole, for copying
        raise
    finally:
        stop.close()
        for m in mlps:
            m.track = m.use_hybrid = False
            m.hot_units = None
        if progress:
            progress.stop()
    seconds = time.perf_counter() - started
    if accelerator.is_fsdp2:
        optimizer.state.clear()  # the AdamW moments: GPU memory for the measurement passes
    else:
        model = accelerator.unwrap_model(model)
    model.eval()
    if config.grad_checkpointing:
        _activation_checkpointing(model, False)
    model.config.use_cache = True
    return TrainResult(steps=step, tokens=step * config.tokens_per_step(world), seconds=seconds, log=log, model=model,
                       sharded=accelerator.is_fsdp2)


def fsdp_launch() -> tuple[bool, bool]:
    """(FSDP, rank-0 loading): whether `accelerate launch` started this process with an FSDP config
    (_check_fsdp makes sure it runs as FSDP2), and whether that config has fsdp_cpu_ram_efficient_loading
    (accelerate's preparation then broadcasts the main process's weights, so the others need not read them)."""
    def flag(name):
        return os.environ.get(name, "false").lower() == "true"

    fsdp = flag("ACCELERATE_USE_FSDP")
    return fsdp, fsdp and flag("FSDP_CPU_RAM_EFFICIENT_LOADING")


def _check_fsdp(accelerator: Accelerator) -> None:
    """An FSDP config that accelerate would not run as FSDP2 is an error, not a silent fallback."""
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ConfigError("FSDP: sparsify trains with FSDP2 only; set fsdp_version: 2 in the accelerate config "
                          "(as recipes/accelerate/fsdp.yaml does)")
    if fsdp_launch()[0] and not accelerator.is_fsdp2:
        raise ConfigError(f"FSDP runs on GPUs only: accelerate runs these {accelerator.device.type} processes as "
                          f"{accelerator.distributed_type.value} (use `accelerate launch` without the FSDP config, or GPUs)")


def gather_model(model, mlps: list):
    """The whole model from one that FSDP shards over the processes (a collective: every process calls it):
    an unsharded model of the same family, relufied, on the main process's CPU (full weights gathered shard
    by shard into CPU memory, never onto one GPU); None on the other processes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {name: b.detach().cpu() for name, b in model.named_buffers()}  # not sharded (rotary tables)
    if torch.distributed.get_rank() != 0:
        return None
    spec = spec_for(model.config)
    config = copy.deepcopy(model.config)
    setattr(config, spec.act_key, mlps[0]._original_act)  # relufy below records it and sets "relu"
    with torch.device("meta"):
        full = spec.causal_lm_class()(config)
    relufy.relufy(full)
    full.load_state_dict(state, assign=True)
    for name, buffer in buffers.items():  # non-persistent buffers are in no state dict
        owner, _, attr = name.rpartition(".")
        setattr(full.get_submodule(owner), attr, buffer)
    full.tie_weights()
    full.generation_config = model.generation_config
    return full.eval()


class _Window:
    """Sums over the micro-batches since the last log entry (on device: no host sync per step)."""

    def __init__(self, layers: int, device):
        self.count = 0
        self.sums = torch.zeros(3 + 2 * layers, device=device)
        self.backup_rows = torch.zeros(layers, dtype=torch.int64, device=device)

    def add(self, ce, kl, l1, layer_l1, layer_active, backup_rows):
        self.count += 1
        self.sums += torch.cat([ce.detach().float().view(1), kl.detach().float().view(1), l1.detach().view(1),
                                layer_l1.detach(), layer_active])
        self.backup_rows += backup_rows

    def entry(self, accelerator, step, tokens, coeff, lr, last_fired, dead_window, hybrid, distill=0.0) -> dict:
        means = accelerator.reduce(self.sums / self.count, reduction="mean").tolist()
        backup_rows = accelerator.reduce(self.backup_rows, reduction="sum").tolist()
        layers = len(means[3:]) // 2
        ce, kl, l1, layer_l1, layer_active = means[0], means[1], means[2], means[3 : 3 + layers], means[3 + layers :]
        dead = ((tokens - last_fired) >= dead_window).float().mean(dim=1).tolist()
        memory = {}
        if accelerator.device.type == "cuda":  # the busiest GPU's peak since the last log step
            peak = torch.tensor([torch.cuda.max_memory_allocated(accelerator.device)], device=accelerator.device)
            memory["max_memory_gib"] = accelerator.reduce(peak, reduction="max").item() / 2**30
            torch.cuda.reset_peak_memory_stats(accelerator.device)
        return {
            "step": step,
            "tokens": tokens,
            "lr": lr,
            "l1_coeff": coeff,
            "loss": (1 - distill) * ce + distill * kl + coeff * l1,
            "cross_entropy": ce,
            **({"kl": kl} if distill else {}),
            "l1": l1,
            "mean_active": sum(layer_active) / layers,
            "dead_frac": sum(dead) / layers,
            "layers": [
                {"active": a, "l1": v, "dead_frac": d, "units": last_fired.shape[1],
                 "path": "hybrid" if h else "dense", "backup_rows": b}
                for a, v, d, h, b in zip(layer_active, layer_l1, dead, hybrid, backup_rows)
            ],
            **memory,
        }


class _Progress(Progress):
    """A bar line with the latest logged figures on the line below (one line cannot hold both)."""

    stats = "waiting for the first log step"

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        yield self.stats


def _progress(enabled: bool, total: int, step: int) -> _Progress | None:
    if not enabled:
        return None
    progress = _Progress(TextColumn("[bold]training"), BarColumn(bar_width=None), MofNCompleteColumn(),
                         TimeElapsedColumn(), TimeRemainingColumn(), console=console)
    progress.add_task("train", total=total, completed=step)
    progress.start()
    return progress


def _progress_text(e: dict) -> str:
    hybrid = sum(l["path"] == "hybrid" for l in e["layers"])
    return (
        f"{e['tokens']:,} tok  {e['tokens_per_s']:,.0f} tok/s  loss {e['loss']:.3f}  "
        f"ce {e['cross_entropy']:.3f}  " + (f"kl {e['kl']:.3f}  " if "kl" in e else "")
        + f"L1 {e['l1']:.3g}  active {e['mean_active']:.1f}  dead {100 * e['dead_frac']:.1f}%"
        + (f"  hybrid {hybrid}/{len(e['layers'])}" if hybrid else "")
        + (f"  mem {e['max_memory_gib']:.1f} GiB" if "max_memory_gib" in e else "")
    )


def _log_line(entry: dict, total: int, seconds: float) -> str:
    """The line a log step writes where the output is no terminal (a file, nohup, a batch job): wall-clock
    time, step, the figures and the time left at this run's pace (`seconds` for its steps so far)."""
    step = entry["step"]
    left = seconds / step * (total - step)
    return (f"{time.strftime('%Y-%m-%d %H:%M:%S')}  step {entry['step']}/{total}  {_progress_text(entry)}  "
            f"eta {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}")


class _StopRequest:
    """SIGINT and SIGTERM during training, as a request to stop after the step in progress. The handlers only
    note the signal; at each step's end the processes agree (a one-int all-reduce over a CPU process group,
    no GPU sync), so that all of them stop after the same step even when the signal reaches them at
    different points of it, or reaches only some of them. Further signals while the state is saved are
    noted and ignored."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, world: int):
        self.requested = False
        self.group = torch.distributed.new_group(backend="gloo") if world > 1 else None
        # handlers can be set only from the main thread; elsewhere signals keep their own effect
        main = threading.current_thread() is threading.main_thread()
        self.previous = {sig: signal.signal(sig, self._note) for sig in self.SIGNALS} if main else {}

    def _note(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, save_due: bool = False) -> tuple[bool, bool]:
        """(stop, save): whether any process has been asked to stop, and whether the main process finds a
        periodic save due (collective: every process calls it at each step)."""
        if self.group is None:
            return self.requested, save_due
        flags = torch.tensor([int(self.requested), int(save_due) if torch.distributed.get_rank() == 0 else 0])
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1])

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _staging_dir(resume_dir) -> Path:
    """Where a save is written before it replaces `resume_dir`: what a process killed while saving leaves."""
    resume_dir = Path(resume_dir)
    return resume_dir.with_name(resume_dir.name + ".tmp")


def discard_saved_state(resume_dir) -> None:
    """Removes the saved training state and whatever a save killed midway left beside it."""
    for folder in (resume_dir, _staging_dir(resume_dir)):
        shutil.rmtree(folder, ignore_errors=True)


def _save(accelerator: Accelerator, resume_dir, state: dict, config: TrainConfig) -> None:
    # Written beside and renamed into place: a process killed while saving (a launcher's shutdown timeout)
    # leaves the previous state, never a half-written one.
    # Every process writes its part (its RNG state; under FSDP its shards): the main one alone clears the
    # folder before and renames it after all are done.
    resume_dir = Path(resume_dir)
    tmp = _staging_dir(resume_dir)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(state.pop("last_fired"), tmp / "last_fired.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "config": asdict(config)}, indent=1))
        shutil.rmtree(resume_dir, ignore_errors=True)
        tmp.rename(resume_dir)
    accelerator.wait_for_everyone()


# Settings a resumed run may change: they touch no saved state (log and save cadence). eval_tokens may not:
# where the held-out blocks are the head of the training text, it moves where training starts.
RESUME_FREE = ("log_every", "save_every", "save_every_minutes")


def check_resume(resume_dir, config: TrainConfig, processes: int, inputs: dict | None = None) -> dict:
    """The saved state (state.json) of `resume_dir`, after checking that this run continues it: the training
    settings it was saved with (but RESUME_FREE: another batch size, schedule or L1 would make a run that is
    neither), as many processes (under FSDP each holds its shards; the batches per step depend on it) and
    the same `inputs` (see train). ConfigError naming what differs otherwise."""
    path = Path(resume_dir) / "state.json" if resume_dir is not None else None
    if path is None or not path.is_file():
        staging = _staging_dir(resume_dir) if resume_dir is not None else None
        raise ConfigError(f"--resume: no saved training state in {resume_dir}" + (
            f" ({staging} holds a save that was killed before it finished, which cannot be resumed from: a "
            f"launcher kills its processes {LAUNCHER_GRACE_S} s after a Ctrl-C; see --save-every)"
            if staging is not None and staging.is_dir() else ""))
    state = json.loads(path.read_text())

    def differences(saved: dict | None, current: dict) -> str:
        current = json.loads(json.dumps(current))  # as state.json holds it (tuples as lists)
        return "; ".join(f"{name} {saved[name]!r} -> {value!r}" for name, value in current.items()
                         if name in (saved or {}) and name not in RESUME_FREE and saved[name] != value)

    for what, key, current in (("with other training settings", "config", asdict(config)),
                               ("by a run on other inputs", "inputs", inputs or {})):
        changed = differences(state.get(key), current)
        if changed:
            raise ConfigError(f"--resume: the state in {resume_dir} was saved {what} ({changed}); resume with the "
                              "same, or start again without --resume")
    saved_processes = state.get("processes", processes)
    if saved_processes != processes:
        raise ConfigError(f"--resume: the state in {resume_dir} was saved by {saved_processes} processes and this "
                          f"run has {processes}: launch {saved_processes}")
    return state
