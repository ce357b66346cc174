"""The training loop, `train`: accelerate's setup (one process, DDP or FSDP2; AdamW with a cosine schedule), the
optimizer steps over micro-batches, and at each log step the log entry, the revival of dead units where it is on,
and the routing that follows from the entry."""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import get_cosine_schedule_with_warmup
from twell.decoder import fuse_norms_and_rotary, unfuse_norms_and_rotary

from ..config import TrainConfig
from ..errors import ConfigError
from ..families import spec_for
from ..report import console, warn
from ..resume import check_resume, load_data_position, saved_run_name
from .fsdp import check_fsdp
from .log import Window, log_entry, log_line, progress_bar, progress_text
from .loss import L1_SCALE_RANGE, allowed_active, l1_coeff, loss_terms, source_share, steered_l1_scale, term_weights
from .memory import on_cpu, slow_save_warning
from .routing import Routing, apply_routing, decoder_kernels_run, hybrid_kernels_run, hybrid_paths, route, tracked
from .revive import check_revive, revive_dead
from .saving import Saver, StopRequest
from .state import Run, RunState, StepOutcome, TrainingInterrupted, TrainResult
from .trackers import new_run_name, tracker_values


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


def train(
    model,
    mlps: list,
    batches: Callable[[int, int, int], Iterator[torch.Tensor]],
    config: TrainConfig,
    *,
    resume_dir: str | Path | None = None,
    resume: bool | dict | None = False,
    device: str | None = None,
    show_progress: bool = True,
    evaluate: Callable[[torch.nn.Module], None] | None = None,
    inputs: dict | None = None,
    before_training: dict | None = None,
    l1_reference: float | None = None,
    l1_eps: list[float] | None = None,
    teacher: torch.nn.Module | None = None,
    report_to: list = (),
    logging_dir: str | Path | None = None,
) -> TrainResult:
    """Train `model` (in place; under FSDP see TrainResult.model). `batches(start, rank, world)` yields
    [batch, seq_len] token ids, starting after `start` batches consumed over all ranks; a stream with
    `state_dict()` and `load_state_dict()` (TextData.train_batches') is saved at its position and a resumed run
    loads it, reading none of the consumed batches again. `evaluate(model)`, if
    given, runs on every process with the prepared model before the first step and before a resumed state
    loads. `resume`: continue from the state in `resume_dir`, True to check it against this run here
    (check_resume), or the state that check_resume returned (convert checks it before reading any weight).
    `inputs` (JSON values; convert: the source model and the data) is saved with an interrupted
    state, and a resumed run must give the same (check_resume). `before_training` (JSON values; convert: the
    calibration's record) is saved with the state too, for a resumed run, which does not do that work again, to
    report (the state check_resume returns holds it). `l1_reference` and `l1_eps` (convert: the calibration's):
    the relative L1's reference and each layer's eps of the log penalty, else measured at the first step.
    `teacher` (needed with `config.distill`): a frozen model over the same vocabulary, moved to this process's
    device and run under the same autocast, whose next-token distributions the model is fitted to (convert passes
    a copy of the source model); under FSDP it stays whole on each process, its weights broadcast from the main
    one (which alone may have read them). `report_to`: accelerate trackers (names, see `trackers`, or
    GeneralTracker objects) that get each log entry's figures, those that write files into a folder of
    `logging_dir` per run (its start time; a resumed run keeps its own).
    Returns the log (one entry per logged step) and the trained model."""
    run_name = (saved_run_name(resume_dir) if resume else None) or new_run_name(logging_dir)
    accelerator = _accelerator(config, device, teacher, report_to,
                               Path(logging_dir) / run_name if logging_dir else None)
    saved = check_resume(resume_dir, config, accelerator.num_processes, inputs) if resume is True else resume or None
    warning = slow_save_warning(sum(p.numel() for p in model.parameters()), accelerator.num_processes,
                                config.save_every or config.save_every_minutes)
    if warning and resume_dir is not None and accelerator.is_main_process:
        warn(warning)
    run = _prepare(accelerator, model, mlps, config, teacher)
    if evaluate is not None:
        with torch.no_grad():
            evaluate(run.model)
        run.model.train()
    state = RunState(time.perf_counter(), l1_reference=l1_reference, l1_eps=l1_eps) if saved is None else \
        RunState.resumed(accelerator, resume_dir, saved)
    if saved is not None and show_progress and accelerator.is_main_process:
        console.print(f"resuming from step {state.step} of {run.total} ({resume_dir})", soft_wrap=True)  # a path whole
    for i, m in enumerate(mlps):  # the log penalty's eps: given, the saved state's, or measured at the first step
        m.l1_log_scale, m.l1_eps = config.l1_log_scale, state.l1_eps[i] if state.l1_eps else None
    stream = batches(state.batches, accelerator.process_index, run.world)
    if saved is not None and (position := load_data_position(resume_dir)) is not None:
        stream.load_state_dict(position)
    # the settings as trackers store them (tensorboard's hparams take scalars: betas as text); resumed, tensorboard
    # drops the events an interrupted run wrote after its saved step
    accelerator.init_trackers("sparsify", config={k: str(v) if isinstance(v, tuple) else v
                                                  for k, v in asdict(config).items()},
                              init_kwargs={"tensorboard": {"purge_step": state.step + 1}} if saved else {})
    progress = progress_bar(show_progress and accelerator.is_main_process, run.total, state.step)
    saver = Saver(run, resume_dir, inputs, before_training, run_name, progress, state.step)
    try:
        with tracked(mlps, config.hybrid_max_nnz):
            _loop(run, state, stream, saver, progress)
    finally:
        if progress and progress.live.is_started:
            progress.stop()
        for tracker in accelerator.trackers:  # not end_training(): it ends the process group, which measuring needs
            tracker.finish()
    if accelerator.is_main_process and (shortfall := _target_shortfall(run, state)):
        warn(shortfall)
    result = _finish(run, state)
    result.save = lambda: saver.after_training_error(state, result.seconds)
    return result


def _accelerator(config: TrainConfig, device: str | None, teacher: torch.nn.Module | None, report_to: list,
                 logging_dir: str | Path | None) -> Accelerator:
    """accelerate's Accelerator for this process (bf16 autocast on GPU) with the trackers of `report_to`, after
    checking what it will run."""
    cpu = on_cpu(device)
    accelerator = Accelerator(cpu=cpu, mixed_precision="no" if cpu else "bf16", log_with=list(report_to) or None,
                              project_dir=logging_dir)
    check_fsdp(accelerator)
    if config.uses_teacher and teacher is None:
        raise ConfigError("distill and distill-hidden need the source model as the teacher")
    set_seed(config.seed)
    return accelerator


def _parameter_groups(model, mlps: list, config: TrainConfig) -> list[dict]:
    """AdamW's parameter groups: one at `lr`, or with `mlp_lr` the MLPs' weights apart at theirs (one group
    otherwise, so that a training state saved without mlp_lr keeps its optimizer's layout)."""
    if config.mlp_lr is None:
        return [{"params": list(model.parameters()), "lr": config.lr}]
    mlp_params = {id(p) for m in mlps for p in m.parameters()}
    return [{"params": [p for p in model.parameters() if id(p) not in mlp_params], "lr": config.lr},
            {"params": [p for p in model.parameters() if id(p) in mlp_params], "lr": config.mlp_lr}]


def _prepare(accelerator: Accelerator, model, mlps: list, config: TrainConfig, teacher) -> Run:
    """The model in training mode, prepared by accelerate (DDP or FSDP2) with AdamW and its cosine schedule, and
    the teacher on this process's device."""
    total = config.total_steps(accelerator.num_processes)
    config.check_swap(accelerator.num_processes)
    check_revive(config, accelerator)
    schedule = config.schedule(total)
    cpu = accelerator.device.type == "cpu"
    model.config.use_cache = False
    if config.grad_checkpointing:
        _activation_checkpointing(model, True)
    if config.fused_decoder and decoder_kernels_run(accelerator.device):
        fuse_norms_and_rotary(model, model.get_submodule(spec_for(model.config).layers))
    model.train()
    # fused on GPU: one kernel updates each tensor in place, where foreach's per-step temporaries (a copy of
    # the second moments and more) add about a weight-sized buffer to the peak.
    optimizer = torch.optim.AdamW(_parameter_groups(model, mlps, config), betas=config.betas,
                                  weight_decay=config.weight_decay, fused=not cpu)
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
    return Run(accelerator, model, mlps, optimizer, scheduler, config, schedule, total,
               teacher if config.uses_teacher else None,
               routes=config.hybrid_below > 0 and hybrid_kernels_run(accelerator.device))


def _loop(run: Run, state: RunState, stream: Iterator[torch.Tensor], saver: Saver, progress) -> None:
    """Steps to the end of the run, logging and routing at each log step, saving when due or asked to stop."""
    # Resumed: the paths that followed the last log entry; else dense until the first measurement.
    routing = Routing(tuple(hybrid_paths(state.log[-1], run.config.hybrid_below)), (None,) * len(run.mlps)) \
        if run.routes and state.log else Routing.dense(len(run.mlps))
    window = Window(len(run.mlps), run.accelerator.device, time.perf_counter())
    stop = StopRequest(run.world)
    try:
        while state.step < run.total:
            outcome = _step(run, state, stream, routing, window)
            if state.step % run.config.log_every == 0 or state.step == run.total:
                now = time.perf_counter()  # the end of this window and the start of the next
                routing = _log_and_route(run, state, window, outcome, routing, progress, now)
                window = Window(len(run.mlps), run.accelerator.device, now)
            if progress:
                progress.update(0, completed=state.step)
            saver.after_step(state, stop)
    except TrainingInterrupted:
        raise  # saved, and its message says where and how to resume
    except Exception:
        saver.after_error(state)
        raise
    finally:
        stop.close()


def _step(run: Run, state: RunState, stream: Iterator[torch.Tensor], routing: Routing, window: Window) -> StepOutcome:
    """One optimizer step over `grad_accum` micro-batches on the paths of `routing`: each micro-batch's figures
    go to the log `window`, and `state` moves to the step's end (step, batches read, the units' last firing)."""
    accelerator, config = run.accelerator, run.config
    coeff = l1_coeff(run.schedule, state.step) * state.l1_scale
    share = source_share(run.schedule, state.step) if run.schedule.swap_steps else None
    apply_routing(run.mlps, routing, share)
    step_fired = None
    for micro in range(config.grad_accum):
        ids = next(stream).to(accelerator.device)
        sync = micro == config.grad_accum - 1
        with accelerator.no_sync(run.model) if not sync else nullcontext(), accelerator.autocast():
            terms, layer_l1 = loss_terms(run.model, run.mlps, ids, run.teacher, config)
            if config.l1_log_scale and state.l1_eps is None:  # once per run: the processes' mean eps for all
                eps = torch.tensor([m.l1_eps for m in run.mlps], device=accelerator.device)
                state.l1_eps = accelerator.reduce(eps, reduction="mean").tolist()
                for m, e in zip(run.mlps, state.l1_eps):
                    m.l1_eps = e
            if config.l1_relative and state.l1_reference is None:  # once per run: one host sync
                state.l1_reference = max(accelerator.reduce(terms.l1.detach(), reduction="mean").item(), 1e-12)
            weight = coeff / state.l1_reference if config.l1_relative else coeff
            # the terms are means over this micro-batch's tokens; dividing them by grad_accum (and DDP
            # averaging over ranks) makes the step's gradient that of the mean over all tokens of the step,
            # for every term alike.
            accelerator.backward(terms.loss(term_weights(config, weight)) / config.grad_accum)
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
    return StepOutcome(step_fired, coeff, weight, share)


def _log_and_route(run: Run, state: RunState, window: Window, outcome: StepOutcome, routing: Routing,
                   progress, now: float) -> Routing:
    """Logs the window's figures (its end: `now`), revives the dead units (with `revive_dead_tokens`), shows the
    figures, and returns the routing until the next log step: chosen from them where layers may move to the hybrid
    kernels, else `routing` unchanged."""
    entry = log_entry(run, state, window, outcome, now)
    state.log.append(entry)
    # The entry's figures are those before the revival, which it counts; none at the last step, where a copy would
    # never train and would only hide a dead unit from the measurement that follows.
    if run.config.revive_dead_tokens and state.step < run.total:
        state.settled = False  # a failure within it leaves weights that no save may hold
        revive_dead(run, state, outcome, entry)
        state.settled = True
    _steer_l1(run, state)
    if run.routes:  # the same reduced figures on every rank: all ranks choose the same paths
        routing = route(run, entry, outcome.fired)
    run.accelerator.log(tracker_values(entry), step=entry["step"])  # with the layers' hot units the route added
    if progress:
        progress.stats = progress_text(entry)
        if not progress.console.is_terminal:  # logs to a file: one whole line per log step
            progress.console.print(log_line(entry, run.total, time.perf_counter() - state.started), soft_wrap=True)
    return routing


def _mean_units(entry: dict) -> float:
    return sum(layer["units"] for layer in entry["layers"]) / len(entry["layers"])


def _steer_l1(run: Run, state: RunState) -> None:
    """With `target_sparsity`, moves the L1 weight's factor towards the path of allowed units (loss.allowed_active)
    by the figures of the log entry just made (the same reduced figures on every rank), over its steps; the entry
    gets the units allowed at its step (`allowed_active`)."""
    if not run.config.target_sparsity:
        return
    entry, first = state.log[-1], state.log[0]
    entry["allowed_active"] = allowed = allowed_active(run.schedule, entry["step"], first["step"], first["mean_active"],
                                                       _mean_units(entry))
    steps = entry["step"] - (state.log[-2]["step"] if len(state.log) > 1 else 0)
    state.l1_scale = steered_l1_scale(state.l1_scale, entry["mean_active"], allowed, steps, run.total)


def _target_shortfall(run: Run, state: RunState) -> str | None:
    """With `target_sparsity`, what to say where the run ended well short of it (more than a tenth more firing
    units than it allows), and what to change; else None."""
    target = run.config.target_sparsity
    if not target or not state.log:
        return None
    entry = state.log[-1]
    units = _mean_units(entry)
    if entry["mean_active"] <= 1.1 * (1 - target) * units:
        return None
    bound = state.l1_scale >= L1_SCALE_RANGE[1]
    return (f"training ended at {100 * (1 - entry['mean_active'] / units):.2f}% sparse, short of --target-sparsity "
            f"{target:g}, with the L1 weight at {state.l1_scale:.2f} times --l1" +
            (": its bound; raise --l1" if bound else "; a longer run (--tokens) steers it further"))


def _finish(run: Run, state: RunState) -> TrainResult:
    """The result: the trained model in eval mode, unwrapped from accelerate but under FSDP, where it stays
    sharded and the optimizer state is dropped."""
    seconds = time.perf_counter() - state.started
    model = run.model
    if run.accelerator.is_fsdp2:
        run.optimizer.state.clear()  # the AdamW moments: GPU memory for the measurement passes
    else:
        model = run.accelerator.unwrap_model(model)
    model.eval()
    unfuse_norms_and_rotary(model)
    if run.config.grad_checkpointing:
        _activation_checkpointing(model, False)
    model.config.use_cache = True
    return TrainResult(steps=state.step, tokens=state.step * run.config.tokens_per_step(run.world), seconds=seconds,
                       log=state.log, model=model, sharded=run.accelerator.is_fsdp2)


