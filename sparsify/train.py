"""Continued training of a relufied model, `train`: the loss is the cross-entropy (with `distill`, its mix with
KL(source || model)) plus the L1 penalty on the MLP hidden activations (LossTerms); each MLP trains on the dense
path or on the TwELL hybrid kernels as its measured activity decides (Routing). Runs under accelerate (one
process, DDP, or FSDP2) and saves its state for --resume (sparsify.resume) on Ctrl-C or SIGTERM, on a
schedule, and on an error. docs/design.md ("Data and training") describes the whole."""
from __future__ import annotations

import copy
import importlib.util
import os
import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import get_cosine_schedule_with_warmup

from . import relufy
from .config import HYBRID_EXIT, LAUNCHER_GRACE_S, TrainConfig
from .errors import ConfigError, MissingDependencyError, SparsifyError
from .families import spec_for
from .report import console, timestamped, warn
from .resume import check_resume, load_data_position, load_last_fired, save_state, saved_run_name


class TrainingInterrupted(SparsifyError):
    """Ctrl-C during training: the state was saved and `--resume` continues from it."""


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
    # Where a later stage fails: saves the finished run's state for --resume (which then goes straight to
    # measuring) where it can, and says where it is (_Saver.after_training_error)
    save: Callable[[], None] = lambda: None


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


# A sharded training state above this size takes longer to write than a launcher waits after a Ctrl-C
# (docs/performance.md, "Training under FSDP")
SLOW_SAVE_GIB = 30


def slow_save_warning(parameters: int, processes: int, save_every: float) -> str | None:
    """The warning for a multi-process run whose training state is too large to save within a launcher's
    shutdown timeout, with no periodic save (`save_every`: steps or minutes, 0 for none) to fall back on
    (None otherwise)."""
    gib = TRAINING_BYTES * parameters / 2**30
    if processes < 2 or save_every or gib <= SLOW_SAVE_GIB:
        return None
    return (f"the training state is {gib:.0f} GiB: after a Ctrl-C, `accelerate launch` and torchrun kill the "
            f"processes within {LAUNCHER_GRACE_S} s, before a state this size is written, and the run could not "
            "be resumed; pass --save-every N or --save-every-minutes M to also "
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


def distillation_kl(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || model) of the next-token distributions, summed over the vocabulary and averaged over
    the positions, in fp32."""
    target = F.log_softmax(teacher_logits.float(), dim=-1).flatten(0, -2)
    return F.kl_div(F.log_softmax(logits.float(), dim=-1).flatten(0, -2), target, log_target=True,
                    reduction="batchmean")


def hidden_distance(hidden: tuple[torch.Tensor, ...], teacher_hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The mean over decoder layers of ||h - h_teacher||^2 / ||h_teacher||^2, each layer's output summed over
    the positions, in fp32 (the embeddings, hidden[0], are the teacher's own and left out)."""
    distances = [(h.float() - t.float()).pow(2).sum() / t.float().pow(2).sum().clamp_min(1e-12)
                 for h, t in zip(hidden[1:], teacher_hidden[1:], strict=True)]
    return torch.stack(distances).mean()


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


class LossTerms(NamedTuple):
    """The terms of the training loss, each a mean over tokens: a micro-batch's (tensors, for the backward) or a
    log window's (floats, means over its micro-batches and the processes)."""

    cross_entropy: torch.Tensor | float
    kl: torch.Tensor | float  # KL(teacher || model); 0 without distillation
    hidden: torch.Tensor | float  # hidden_distance to the teacher's; 0 without distill_hidden
    l1: torch.Tensor | float  # the mean over layers of each MLP's L1

    def loss(self, l1_weight: float, config: TrainConfig):
        """The loss training minimizes, the one expression for the backward and the log."""
        return ((1 - config.distill) * self.cross_entropy + config.distill * self.kl
                + config.distill_hidden * self.hidden + l1_weight * self.l1)


def loss_terms(model, mlps: list, ids: torch.Tensor, teacher: torch.nn.Module | None,
               config: TrainConfig) -> tuple[LossTerms, torch.Tensor]:
    """A micro-batch's loss terms from the model's forward on `ids` (the distillation terms that `config` weighs
    from the `teacher`'s), and the per-layer L1 [layers] that `l1` averages."""
    hidden = config.distill_hidden > 0
    output = model(input_ids=ids, labels=ids, output_hidden_states=hidden)
    zero = torch.zeros_like(output.loss)
    kl = distance = zero
    if teacher is not None:
        with torch.no_grad():
            reference = teacher(input_ids=ids, output_hidden_states=hidden)
        if config.distill:
            kl = distillation_kl(output.logits, reference.logits)
        if hidden:
            distance = hidden_distance(output.hidden_states, reference.hidden_states)
    layer_l1 = torch.stack([m.stats.l1.float() for m in mlps])
    # returns without `output`: its logits ([batch, seq_len, vocab]) need not live through the backward
    return LossTerms(output.loss, kl, distance, layer_l1.mean()), layer_l1


@dataclass(frozen=True)
class Routing:
    """The path of each MLP until the next log step: the hybrid kernels (`hybrid`), which run the layer's
    `hot_units` as dense columns, or dense. Chosen from reduced figures: the same on every process."""

    hybrid: tuple[bool, ...]
    hot_units: tuple[torch.Tensor | None, ...]

    @classmethod
    def dense(cls, layers: int) -> Routing:
        return cls((False,) * layers, (None,) * layers)


def _apply(mlps: list, routing: Routing, source_share: float | None = None) -> None:
    """Sets each MLP's path from `routing`, and during a progressive swap the gate's `source_share` (None: the
    MLPs keep theirs); the only place the loop changes how the MLPs run."""
    for m, hybrid, hot in zip(mlps, routing.hybrid, routing.hot_units):
        m.use_hybrid, m.hot_units = hybrid, hot
        if source_share is not None:
            m.source_share = source_share


@contextmanager
def _tracked(mlps: list, max_nnz: int):
    """The MLPs record their statistics (the L1 term, the log's figures) while training runs; after it they
    run dense and untracked."""
    for m in mlps:
        m.track, m.hybrid_max_nnz = True, max_nnz
    try:
        yield
    finally:
        _apply(mlps, Routing.dense(len(mlps)))
        for m in mlps:
            m.track = False


@dataclass
class _Run:
    """A prepared run: what setup makes and the steps, the log and the saves read."""

    accelerator: Accelerator
    model: torch.nn.Module  # as accelerate prepared it
    mlps: list
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    config: TrainConfig
    schedule: TrainConfig  # `config` with its shares of the steps resolved (TrainConfig.schedule)
    total: int  # optimizer steps
    teacher: torch.nn.Module | None  # on this process's device, frozen; None without distillation
    routes: bool  # whether layers may move to the hybrid kernels

    @property
    def world(self) -> int:
        return self.accelerator.num_processes


@dataclass
class _RunState:
    """Where the run stands: what a save writes and a resumed run reads back, and when it started."""

    started: float  # time.perf_counter() at the start, less the seconds of the run before a resume
    step: int = 0
    batches: int = 0  # read over all processes
    log: list[dict] = field(default_factory=list)
    l1_reference: float | None = None  # L1_0 of `l1_relative`: measured on the first micro-batch
    last_fired: torch.Tensor | None = None  # [layers, I]: the token count at each unit's last firing
    data_position: dict | None = None  # the batch stream's state_dict after `batches`, where it has one
    # False while the weights are ahead of this state (from a step's update to its count and units' firing)
    # and during a save: then there is nothing consistent to save
    settled: bool = True

    @classmethod
    def resumed(cls, accelerator: Accelerator, resume_dir, saved: dict) -> _RunState:
        """The state saved in `resume_dir` (`saved`: its state.json), loading the weights, optimizer, scheduler
        and RNG into the prepared objects."""
        accelerator.load_state(resume_dir)
        return cls(started=time.perf_counter() - saved["seconds"], step=saved["step"], batches=saved["batches"],
                   log=saved["log"], l1_reference=saved["l1_reference"],
                   last_fired=load_last_fired(resume_dir, accelerator.device))


class _StepOutcome(NamedTuple):
    fired: torch.Tensor  # [layers, I]: tokens in which each unit fired, summed over micro-batches and processes
    l1_coeff: float  # l1_coeff() of the step
    l1_weight: float  # the factor of the L1 term: l1_coeff, or l1_coeff / L1_0 with l1_relative
    source_share: float | None  # the gate's share of the source activation; None without a progressive swap


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
    report_to: list = (),
    logging_dir: str | Path | None = None,
) -> TrainResult:
    """Train `model` (in place; under FSDP see TrainResult.model). `batches(start, rank, world)` yields
    [batch, seq_len] token ids, starting after `start` batches consumed over all ranks; a stream with
    `state_dict()` and `load_state_dict()` (TextData.train_batches') is saved at its position and a resumed run
    loads it, reading none of the consumed batches again. `evaluate(model)`, if
    given, runs on every process with the prepared model before the first step and before a resumed state
    loads. `inputs` (JSON values; convert: the source model and the data) is saved with an interrupted
    state, and a resumed run must give the same (check_resume). `teacher` (needed with `config.distill`): a
    frozen model over the same vocabulary, moved to this process's device and run under the same autocast,
    whose next-token distributions the model is fitted to (convert passes a copy of the source model); under
    FSDP it stays whole on each process, its weights broadcast from the main one (which alone may have read
    them). `report_to`: accelerate trackers (names, see `trackers`, or GeneralTracker objects) that get each log
    entry's figures, those that write files into a folder of `logging_dir` per run (its start time; a resumed
    run keeps its own).
    Returns the log (one entry per logged step) and the trained model."""
    run_name = (saved_run_name(resume_dir) if resume else None) or _new_run_name(logging_dir)
    accelerator = _accelerator(config, device, teacher, report_to, Path(logging_dir) / run_name if logging_dir else None)
    saved = check_resume(resume_dir, config, accelerator.num_processes, inputs) if resume else None  # before any work
    warning = slow_save_warning(sum(p.numel() for p in model.parameters()), accelerator.num_processes,
                                config.save_every or config.save_every_minutes)
    if warning and resume_dir is not None and accelerator.is_main_process:
        warn(warning)
    run = _prepare(accelerator, model, mlps, config, teacher)
    if evaluate is not None:
        with torch.no_grad():
            evaluate(run.model)
        run.model.train()
    state = _RunState(time.perf_counter()) if saved is None else _RunState.resumed(accelerator, resume_dir, saved)
    stream = batches(state.batches, accelerator.process_index, run.world)
    if saved is not None and (position := load_data_position(resume_dir)) is not None:
        stream.load_state_dict(position)
    # the settings as trackers store them (tensorboard's hparams take scalars: betas as text); resumed, tensorboard
    # drops the events an interrupted run wrote after its saved step
    accelerator.init_trackers("sparsify", config={k: str(v) if isinstance(v, tuple) else v
                                                  for k, v in asdict(config).items()},
                              init_kwargs={"tensorboard": {"purge_step": state.step + 1}} if saved else {})
    progress = _progress(show_progress and accelerator.is_main_process, run.total, state.step)
    saver = _Saver(run, resume_dir, inputs, run_name, progress, state.step)
    try:
        with _tracked(mlps, config.hybrid_max_nnz):
            _loop(run, state, stream, saver, progress)
    finally:
        if progress and progress.live.is_started:
            progress.stop()
        for tracker in accelerator.trackers:  # not end_training(): it ends the process group, which measuring needs
            tracker.finish()
    result = _finish(run, state)
    result.save = lambda: saver.after_training_error(state, result.seconds)
    return result


def _new_run_name(logging_dir: str | Path | None) -> str:
    """A fresh run's folder name under logging_dir: its start time (UTC), with a count where that is taken, so
    that a second run into the same OUT does not append to the first one's curves."""
    name = candidate = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    count = 1
    while logging_dir and (Path(logging_dir) / candidate).exists():
        count += 1
        candidate = f"{name}-{count}"
    return candidate


def trackers(report_to: str) -> list[str]:
    """The accelerate trackers that --report-to names, comma-separated ("all": those installed; "none": no
    tracker). ConfigError for a name accelerate does not know, MissingDependencyError for a tracker whose
    package is not installed."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
    from accelerate.utils import LoggerType

    names = [name.strip() for name in report_to.split(",") if name.strip() not in ("", "none")]
    known = ["all", *LOGGER_TYPE_TO_CLASS]  # the built-in trackers and those registered with accelerate
    installed = {tracker.value for tracker in get_available_trackers()}
    for name in names:
        if name not in known:
            raise ConfigError(f"--report-to {name}: not a tracker; use none, or one or more of {', '.join(known)} "
                              "separated by commas")
        if name in {kind.value for kind in LoggerType} - {"all"} and name not in installed:
            raise MissingDependencyError(f"--report-to {name}: the {name} package is not installed (pip install {name})")
    return names


def _accelerator(config: TrainConfig, device: str | None, teacher: torch.nn.Module | None, report_to: list,
                 logging_dir: str | Path | None) -> Accelerator:
    """accelerate's Accelerator for this process (bf16 autocast on GPU) with the trackers of `report_to`, after
    checking what it will run."""
    cpu = on_cpu(device)
    accelerator = Accelerator(cpu=cpu, mixed_precision="no" if cpu else "bf16", log_with=list(report_to) or None,
                              project_dir=logging_dir)
    _check_fsdp(accelerator)
    if config.uses_teacher and teacher is None:
        raise ConfigError("distill and distill-hidden need the source model as the teacher")
    set_seed(config.seed)
    return accelerator


def _prepare(accelerator: Accelerator, model, mlps: list, config: TrainConfig, teacher) -> _Run:
    """The model in training mode, prepared by accelerate (DDP or FSDP2) with AdamW and its cosine schedule, and
    the teacher on this process's device."""
    total = config.total_steps(accelerator.num_processes)
    config.check_swap(accelerator.num_processes)
    schedule = config.schedule(total)
    cpu = accelerator.device.type == "cpu"
    model.config.use_cache = False
    if config.grad_checkpointing:
        _activation_checkpointing(model, True)
    model.train()
    # fused on GPU: one kernel updates each tensor in place, where foreach's per-step temporaries (a copy of
    # the second moments and more) add about a weight-sized buffer to the peak.
    mlp_params = {id(p) for m in mlps for p in m.parameters()}
    groups = [{"params": [p for p in model.parameters() if id(p) not in mlp_params], "lr": config.lr},
              {"params": [p for p in model.parameters() if id(p) in mlp_params], "lr": config.mlp_lr or config.lr}]
    optimizer = torch.optim.AdamW(groups, betas=config.betas, weight_decay=config.weight_decay, fused=not cpu)
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
    if config.uses_teacher:
        teacher = teacher.to(accelerator.device).eval().requires_grad_(False)
        if accelerator.is_fsdp2 and accelerator.num_processes > 1:  # whole on each process: those that read no
            for tensor in teacher.state_dict().values():  # weights get the main one's
                torch.distributed.broadcast(tensor, src=0)
    return _Run(accelerator, model, mlps, optimizer, scheduler, config, schedule, total,
                teacher if config.uses_teacher else None,
                routes=config.hybrid_below > 0 and hybrid_kernels_run(accelerator.device))


def _loop(run: _Run, state: _RunState, stream: Iterator[torch.Tensor], saver: _Saver, progress) -> None:
    """Steps to the end of the run, logging and routing at each log step, saving when due or asked to stop."""
    # Resumed: the paths that followed the last log entry; else dense until the first measurement.
    routing = Routing(tuple(hybrid_paths(state.log[-1], run.config.hybrid_below)), (None,) * len(run.mlps)) \
        if run.routes and state.log else Routing.dense(len(run.mlps))
    window = _Window(len(run.mlps), run.accelerator.device, time.perf_counter())
    stop = _StopRequest(run.world)
    try:
        while state.step < run.total:
            outcome = _step(run, state, stream, routing, window)
            if state.step % run.config.log_every == 0 or state.step == run.total:
                now = time.perf_counter()  # the end of this window and the start of the next
                routing = _log_and_route(run, state, window, outcome, routing, progress, now)
                window = _Window(len(run.mlps), run.accelerator.device, now)
            if progress:
                progress.update(0, completed=state.step)
            saver.after_step(state, stop)
    except Exception:
        saver.after_error(state)
        raise
    finally:
        stop.close()


def _step(run: _Run, state: _RunState, stream: Iterator[torch.Tensor], routing: Routing, window: _Window) -> _StepOutcome:
    """One optimizer step over `grad_accum` micro-batches on the paths of `routing`: each micro-batch's figures
    go to the log `window`, and `state` moves to the step's end (step, batches read, the units' last firing)."""
    accelerator, config = run.accelerator, run.config
    coeff = l1_coeff(run.schedule, state.step)
    share = source_share(run.schedule, state.step) if run.schedule.swap_steps else None
    _apply(run.mlps, routing, share)
    step_fired = None
    for micro in range(config.grad_accum):
        ids = next(stream).to(accelerator.device)
        sync = micro == config.grad_accum - 1
        with accelerator.no_sync(run.model) if not sync else nullcontext(), accelerator.autocast():
            terms, layer_l1 = loss_terms(run.model, run.mlps, ids, run.teacher, config)
            if config.l1_relative and state.l1_reference is None:  # once per run: one host sync
                state.l1_reference = max(accelerator.reduce(terms.l1.detach(), reduction="mean").item(), 1e-12)
            weight = coeff / state.l1_reference if config.l1_relative else coeff
            # ce, kl and l1 are means over this micro-batch's tokens; dividing them by grad_accum (and DDP
            # averaging over ranks) makes the step's gradient that of the mean over all tokens of the step,
            # for every term alike.
            accelerator.backward(terms.loss(weight, config) / config.grad_accum)
        fired = torch.stack([m.stats.fired for m in run.mlps])
        step_fired = fired if step_fired is None else step_fired + fired
        window.add(terms, layer_l1, torch.stack([m.stats.active.float() for m in run.mlps]),
                   torch.stack([m.backup_rows for m in run.mlps]), ids.numel())
    accelerator.clip_grad_norm_(run.model.parameters(), config.max_grad_norm)
    state.settled = False
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.batches += config.grad_accum * run.world
    if hasattr(stream, "state_dict"):
        state.data_position = stream.state_dict()

    # Dead units, at optimizer-step granularity: fired counts summed over micro-batches and ranks.
    step_fired = accelerator.reduce(step_fired, reduction="sum")
    tokens = state.step * config.tokens_per_step(run.world)
    if state.last_fired is None:
        state.last_fired = torch.zeros_like(step_fired)
    state.last_fired = torch.where(step_fired > 0, tokens, state.last_fired)  # a masked assignment would sync the host
    state.settled = True
    return _StepOutcome(step_fired, coeff, weight, share)


def _log_and_route(run: _Run, state: _RunState, window: _Window, outcome: _StepOutcome, routing: Routing,
                   progress, now: float) -> Routing:
    """Logs the window's figures (its end: `now`) and shows them, and returns the routing until the next log
    step: chosen from them where layers may move to the hybrid kernels, else `routing` unchanged."""
    entry = _log_entry(run, state, window, outcome, now)
    state.log.append(entry)
    if run.routes:  # the same reduced figures on every rank: all ranks choose the same paths
        routing = _route(run, entry, outcome.fired)
    run.accelerator.log(_tracker_values(entry), step=entry["step"])  # with the layers' hot units the route added
    if progress:
        progress.stats = _progress_text(entry)
        if not progress.console.is_terminal:  # logs to a file: one whole line per log step
            progress.console.print(_log_line(entry, run.total, time.perf_counter() - state.started), soft_wrap=True)
    return routing


def _tracker_values(entry: dict) -> dict:
    """A log entry as trackers take it: its figures, each layer's under layers/INDEX/ (its path as `hybrid`, 1 or
    0), the step aside."""
    values = {name: value for name, value in entry.items() if name not in ("step", "layers")}
    for index, layer in enumerate(entry["layers"]):
        values.update({f"layers/{index}/{name}": value for name, value in layer.items() if name != "path"})
        values[f"layers/{index}/hybrid"] = int(layer["path"] == "hybrid")
    return values


def _log_entry(run: _Run, state: _RunState, window: _Window, outcome: _StepOutcome, now: float) -> dict:
    """The log entry of the steps since the last one: the window's means over its micro-batches and the
    processes, the dead units, each layer's path and (GPU) the busiest GPU's peak memory."""
    accelerator, config = run.accelerator, run.config
    terms, layer_l1, layer_active, backup_rows = window.reduced(accelerator)
    tokens = state.step * config.tokens_per_step(run.world)
    dead_window = config.dead_window_tokens or config.tokens_per_step(run.world)
    dead = ((tokens - state.last_fired) >= dead_window).float().mean(dim=1).tolist()
    layers = len(layer_active)
    entry = {
        "step": state.step,
        "tokens": tokens,
        "lr": run.scheduler.get_last_lr()[0],
        "l1_coeff": outcome.l1_weight,
        "loss": terms.loss(outcome.l1_weight, config),
        "cross_entropy": terms.cross_entropy,
        **({"kl": terms.kl} if config.distill else {}),
        **({"hidden": terms.hidden} if config.distill_hidden else {}),
        "l1": terms.l1,
        "mean_active": sum(layer_active) / layers,
        "dead_frac": sum(dead) / layers,
        "layers": [
            {"active": a, "l1": v, "dead_frac": d, "units": state.last_fired.shape[1],
             "path": "hybrid" if m.runs_hybrid else "dense", "backup_rows": b}
            for a, v, d, m, b in zip(layer_active, layer_l1, dead, run.mlps, backup_rows)
        ],
        **_peak_memory(accelerator),
    }
    if config.l1_relative:
        entry["l1_relative"], entry["l1_reference"] = outcome.l1_coeff, state.l1_reference
    if outcome.source_share is not None:
        entry["source_share"] = outcome.source_share
    entry["tokens_per_s"] = window.tokens * run.world / (now - window.started)
    entry["seconds"] = now - state.started
    return entry


def _peak_memory(accelerator: Accelerator) -> dict:
    """{"max_memory_gib": the busiest GPU's peak since the last log step} on GPU, {} on CPU."""
    if accelerator.device.type != "cuda":
        return {}
    peak = torch.tensor([torch.cuda.max_memory_allocated(accelerator.device)], device=accelerator.device)
    gib = accelerator.reduce(peak, reduction="max").item() / 2**30
    torch.cuda.reset_peak_memory_stats(accelerator.device)
    return {"max_memory_gib": gib}


def _route(run: _Run, entry: dict, step_fired: torch.Tensor) -> Routing:
    """The routing from a log entry: each layer's path by its activity (hybrid_paths) and, on the hybrid path,
    the units busy in the last step's counts as dense columns; records each layer's count of those in `entry`."""
    config = run.config
    hybrid = tuple(hybrid_paths(entry, config.hybrid_below))
    hot = tuple(relufy.hot_units(fired, config.tokens_per_step(run.world), config.hybrid_hot_rate) if on else None
                for on, fired in zip(hybrid, step_fired))
    for layer, units in zip(entry["layers"], hot):
        layer["hot_units"] = 0 if units is None else units.numel()
    return Routing(hybrid, hot)


class _Saver:
    """Saves the training state to `resume_dir` (None: never): when the processes are asked to stop, every
    `save_every` steps, once `save_every_minutes` have passed since the last save, and on an error."""

    def __init__(self, run: _Run, resume_dir, inputs: dict | None, run_name: str, progress, step: int):
        self.run, self.resume_dir, self.inputs, self.progress = run, resume_dir, inputs, progress
        self.run_name = run_name  # the trackers' folder under logging_dir, which a resumed run keeps
        self.saved_step = step  # the step of the state in resume_dir, if any
        self.last_save = time.perf_counter()
        # An error after training can save in a single process; under FSDP its optimizer state is dropped by
        # then (_finish), and with several processes no save can be collective: those save their last step.
        self.saves_after_training = run.world == 1 and not run.accelerator.is_fsdp2

    def save(self, state: _RunState) -> None:
        progress = self.progress  # reported: a large sharded state is long to write
        if progress:
            progress.console.print(f"step {state.step}: saving the training state to {self.resume_dir}")
        saving, state.settled = time.perf_counter(), False
        save_state(self.run.accelerator, self.resume_dir,
                   {"step": state.step, "batches": state.batches, "log": state.log,
                    "seconds": time.perf_counter() - state.started, "l1_reference": state.l1_reference,
                    "processes": self.run.world, "inputs": self.inputs, "run_name": self.run_name},
                   state.last_fired, self.run.config,
                   state.data_position)
        self.saved_step, state.settled = state.step, True
        if progress:
            progress.console.print(f"saved in {time.perf_counter() - saving:.1f} s")

    def after_step(self, state: _RunState, stop: _StopRequest) -> None:
        """At the end of each step (collective: every process calls it): saves and raises TrainingInterrupted
        when a process was asked to stop, saves when a periodic save is due, and saves the last step where
        periodic saves are on and an error after training could not save (saves_after_training)."""
        config, total = self.run.config, self.run.total
        # the main process's clock decides, so that every process saves at the same step
        due = bool(config.save_every_minutes) and time.perf_counter() - self.last_save >= 60 * config.save_every_minutes
        # a stop asked for in the last step stops too: a second Ctrl-C during the measuring and export that
        # follow would lose the run, where --resume from this state goes straight to them
        stopping, due = stop.agreed(due)
        if stopping:
            if self.resume_dir is None:
                raise KeyboardInterrupt
            self.save(state)
            raise TrainingInterrupted(f"interrupted at step {state.step} of {total}; the training state is in "
                                      f"{self.resume_dir}: run the same command with --resume to continue")
        periodic = due or config.save_every and state.step % config.save_every == 0
        periodic_on = bool(config.save_every or config.save_every_minutes)
        last = state.step == total and periodic_on and not self.saves_after_training
        if (periodic and state.step < total or last) and self.resume_dir is not None:
            self.save(state)
            self.last_save = time.perf_counter()

    def after_error(self, state: _RunState) -> None:
        """An error in training (bad data, out of memory) saves the last completed step, in single-process runs
        only: the save is collective, and the other processes wait in a collective of the step that the failed
        one never reaches (or fail at other points), so they would never join it. There the last periodic save
        stands. Says where the state of the last completed step is, if it is saved."""
        if self.resume_dir is None or not state.settled:
            return
        if self.run.world == 1 and state.step > self.saved_step:
            self.save(state)
        self._say_saved(state)

    def after_training_error(self, state: _RunState, seconds: float) -> None:
        """An error (or Ctrl-C) in a stage after training, `seconds` of it: saves the trained state where it
        can (saves_after_training), recording the training's time, not the stages' after it, with SIGINT and
        SIGTERM held off (a second Ctrl-C would cut the save short and lose the weights)."""
        if self.resume_dir is None:
            return
        if self.saves_after_training and state.step > self.saved_step:
            state.started = time.perf_counter() - seconds
            held = _StopRequest(1)  # notes the signals instead of acting on them
            try:
                self.save(state)
            finally:
                held.close()
        self._say_saved(state)

    def _say_saved(self, state: _RunState) -> None:
        if 0 < state.step == self.saved_step and self.run.accelerator.is_main_process:
            console.print(f"the training state of step {state.step} of {self.run.total} is saved in {self.resume_dir}: "
                          "run the same command with --resume to continue from it", soft_wrap=True)  # a path whole


def _finish(run: _Run, state: _RunState) -> TrainResult:
    """The result: the trained model in eval mode, unwrapped from accelerate but under FSDP, where it stays
    sharded and the optimizer state is dropped."""
    seconds = time.perf_counter() - state.started
    model = run.model
    if run.accelerator.is_fsdp2:
        run.optimizer.state.clear()  # the AdamW moments: GPU memory for the measurement passes
    else:
        model = run.accelerator.unwrap_model(model)
    model.eval()
    if run.config.grad_checkpointing:
        _activation_checkpointing(model, False)
    model.config.use_cache = True
    return TrainResult(steps=state.step, tokens=state.step * run.config.tokens_per_step(run.world), seconds=seconds,
                       log=state.log, model=model, sharded=run.accelerator.is_fsdp2)


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

    def __init__(self, layers: int, device, started: float):
        self.started = started  # time.perf_counter() at the window's start
        self.count = self.tokens = 0
        self.sums = torch.zeros(len(LossTerms._fields) + 2 * layers, device=device)
        self.backup_rows = torch.zeros(layers, dtype=torch.int64, device=device)

    def add(self, terms: LossTerms, layer_l1, layer_active, backup_rows, tokens: int) -> None:
        self.count += 1
        self.tokens += tokens
        self.sums += torch.cat([*(term.detach().float().view(1) for term in terms), layer_l1.detach(), layer_active])
        self.backup_rows += backup_rows

    def reduced(self, accelerator: Accelerator) -> tuple[LossTerms, list[float], list[float], list[int]]:
        """The loss terms, per-layer L1 and per-layer active units as means over the window's micro-batches and
        the processes, and per layer the backup rows summed over them."""
        means = accelerator.reduce(self.sums / self.count, reduction="mean").tolist()
        backup_rows = accelerator.reduce(self.backup_rows, reduction="sum").tolist()
        layers, start = len(backup_rows), len(LossTerms._fields)
        return LossTerms(*means[:start]), means[start : start + layers], means[start + layers :], backup_rows


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
    if console.is_terminal:  # elsewhere (a file, a batch job) each log step prints a whole line instead
        progress.start()
    return progress


def _progress_text(e: dict) -> str:
    hybrid = sum(l["path"] == "hybrid" for l in e["layers"])
    return (
        f"{e['tokens']:,} tok  {e['tokens_per_s']:,.0f} tok/s  loss {e['loss']:.3f}  "
        f"ce {e['cross_entropy']:.3f}  " + (f"kl {e['kl']:.3f}  " if "kl" in e else "")
        + (f"hidden {e['hidden']:.3f}  " if "hidden" in e else "")
        + f"L1 {e['l1']:.3g}  active {e['mean_active']:.1f}  dead {100 * e['dead_frac']:.1f}%"
        + (f"  hybrid {hybrid}/{len(e['layers'])}" if hybrid else "")
        + (f"  mem {e['max_memory_gib']:.1f} GiB" if "max_memory_gib" in e else "")
    )


def _log_line(entry: dict, total: int, seconds: float) -> str:
    """The line a log step writes where the output is no terminal: the step and its figures, timestamped with
    the time left at this run's pace (`seconds` for its steps so far)."""
    return timestamped(f"step {entry['step']}/{total}  {_progress_text(entry)}", seconds, entry["step"], total)


class _StopRequest:
    """SIGINT and SIGTERM during training, as a request to stop after the step in progress. The handlers only
    note the signal; at each step's end the processes agree (a two-int all-reduce over a CPU process group,
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


