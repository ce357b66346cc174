"""`sparsify convert`: the whole pipeline, one call per stage.

check OUT (fail fast) -> load -> perplexity of the original -> relufy -> perplexity after the swap ->
train (L1; each layer on the hybrid kernels or dense by its activity; with `distill`, fitted to a frozen copy
of the source model's next-token distributions) -> measure on held-out text
(perplexity after training) -> plan -> export (+ training log JSON and sparsity PNG) -> optional push.
Weights are trained in fp32 (AdamW updates of ~lr are below bf16's resolution; bf16 autocast on GPU
does the arithmetic) and exported in the dtype a plain load would use (bf16 on GPU, fp32 on CPU).
Ctrl-C (and `save_every`, or in a single-process run an error during or after training; with several processes
the end of training) keeps the training state in `OUT.resume/`, a sibling that never looks like a checkpoint;
`--resume` continues from it and a finished conversion deletes it.
The checkpoint, which may be pushed, records its source and data without local paths: a folder by its name (a
source folder by the Hub id it was saved from, where its config.json has one).
Under `accelerate launch` every process trains, the main one alone exports and reports. Under FSDP no
GPU holds the whole model: it loads into CPU memory (only on the main process with
fsdp_cpu_ram_efficient_loading, the others get their shards from it), the perplexity and measurement
passes run on the sharded model with the held-out batches split over the processes, and the trained
weights are gathered into the main process's CPU memory for the plan and the export.
"""
from __future__ import annotations

import copy
import json
import tempfile
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch
from accelerate import PartialState
from transformers.utils.hub import convert_file_size_to_int

from .card import is_hub_id, public_name, source_license
from .config import TrainConfig
from .data import TextData, resolve as resolve_data
from .errors import ConfigError, DataError
from .export import ARTIFACTS, check_output_dir, export_checkpoint
from .load import (check_device, demo_corpus_path, load_config, load_model, load_tokenizer, parameter_count,
                   require_cuda, require_tokenizer, resolve_dtype, resolve_source)
from .measure import measure, perplexity
from .plan import choose_measure, plan_model
from .tune import capture_mlp_inputs
from .relufy import original_mlps, relufy
from .report import console, plot_training, warn
from .resume import check_resume, discard_saved_state, recover_killed_save
from .train import (TrainResult, check_training_memory, fsdp_launch, gather_model, hybrid_share, on_cpu, train,
                    trackers, training_state_bytes)


def _identity(where: str | Path) -> str:
    """A source or data argument as a resumed run compares it: a local path made absolute, else as given."""
    return str(Path(where).resolve()) if Path(where).exists() else str(where)


def _base_model(source: str) -> str:
    """The model `source` was converted from, as the checkpoint records it: a Hub id or "demo" as given; a local
    folder as the Hub id its config.json records in `_name_or_path` (written by save_pretrained before
    transformers 5), else by its name."""
    if source == "demo" or not Path(source).expanduser().exists():
        return source
    config = json.loads((Path(source).expanduser() / "config.json").read_text())
    origin = config.get("_name_or_path")
    return origin if is_hub_id(origin) else public_name(source)


def run_summary(parameters: int, config: TrainConfig, processes: int = 1, sharded: bool = False) -> str:
    """The resolved settings of a conversion of a model of `parameters` and what its training state will take:
    printed at the start and by `convert --dry-run`."""
    state = training_state_bytes(parameters, processes, sharded, teacher=config.distill > 0)
    steps = config.total_steps(processes)
    settings = "  ".join(f"{k}={v}" for k, v in asdict(config).items())
    return (f"settings: {settings}\n"
            f"{parameters / 1e6:,.1f}M parameters; {steps:,} steps of {config.tokens_per_step(processes):,} tokens "
            f"({steps * config.tokens_per_step(processes):,} tokens) on {processes} process(es); training state "
            + (f"{state / 2**30:.1f} GiB" if state >= 2**30 else f"{state / 2**20:.0f} MiB")
            + f" a process (fp32 weights, gradients, AdamW{', bf16 teacher' if config.distill else ''}; activations "
            "come on top)")


def _beside(out: str | Path, suffix: str) -> Path:
    out = Path(out).expanduser().resolve()
    return out.with_name(out.name + suffix)


def resume_dir_for(out: str | Path) -> Path:
    return _beside(out, ".resume")


def logging_dir_for(out: str | Path) -> Path:
    """Where the trackers of --report-to that write files (tensorboard) write them: beside OUT, not in the checkpoint."""
    return _beside(out, ".logs")


def convert(
    source: str,
    out: str | Path,
    config: TrainConfig,
    *,
    data: str | None = None,
    text_column: str = "text",
    device: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    max_shard_size: str = "5GB",
    push_to_hub: str | None = None,
    private: bool = False,
    measure_kernels: bool | None = None,
    show_progress: bool = True,
    report_to: str = "none",
    dry_run: bool = False,
    fit_seq_len: bool = False,
) -> dict | None:
    """Convert `source` into a sparse checkpoint at `out`; returns the summary (perplexities, per-layer
    statistics and plan, training log). `text_column`: the column of the data's rows that holds the text.
    `measure_kernels` plans each layer by timing the kernel settings on this GPU (sparsify.tune) instead of by
    the cost model (None: where the cost model does not cover the layer shape, on a GPU). `show_progress` False
    prints only warnings (no settings, progress bars or log lines).
    `report_to`: the accelerate trackers that get the training log's figures (train.trackers).
    `dry_run`: run every check that reads no weight, print the settings, the training state's size and the
    held-out text, and stop (returns None). `fit_seq_len`: the config's seq-len is no choice of the user's (a
    recipe's or the default): lower it to the source's positions where it is beyond them, with a warning."""
    check_device(device)
    launch = PartialState(cpu=on_cpu(device))
    main, processes = launch.is_main_process, launch.num_processes
    if resume and main and recover_killed_save(saved := resume_dir_for(out)):
        console.print(f"the last save was whole but not yet in place: resuming from it ({saved})")
    launch.wait_for_everyone()
    if fit_seq_len:
        config = _fit_positions(source, config, main)
    out, resume_dir, data_spec, inputs = _check_inputs(source, out, config, data, text_column, device, resume, overwrite,
                                                       max_shard_size, measure_kernels, processes)
    run_tokens = config.total_steps(processes) * config.tokens_per_step(processes)
    report_trackers, fsdp = trackers(report_to), fsdp_launch()[0]
    for warning in config.warnings(processes) if main else ():
        warn(warning)
    if dry_run:
        _check_source(source, config, device, processes, fsdp, show=True)
        tokenizer = load_tokenizer(resolve_source(source))
        require_tokenizer(tokenizer, source)
        _report_held_out(TextData(data_spec, tokenizer, config.seq_len, config.eval_tokens, text_column), True,
                         run_tokens)
        return None
    if overwrite and not resume and main:  # starting over: an interrupted run's state must not outlive it
        discard_saved_state(resume_dir)
    model, tokenizer, spec, origin = _load_source(source, config, device, launch, show_progress)
    shown = show_progress and main
    measure_kernels = choose_measure(measure_kernels, model.config, device, shown and console.print)
    text = TextData(data_spec, tokenizer, config.seq_len, config.eval_tokens, text_column)
    ppl = {}
    if main:
        _report_held_out(text, shown, run_tokens)
    eval_tokens = sum(block.numel() for block in text.eval_blocks)
    labels = [f"{what} ({eval_tokens:,} held-out tokens)" if shown else None
              for what in ("perplexity of the source", "perplexity after the ReLU swap", "measuring the trained model")]

    def source_perplexities(model, sharded=False):
        with original_mlps(model):
            ppl["original"] = perplexity(model, text.eval_blocks, config.batch_size, sharded, label=labels[0])
        ppl["after swap"] = perplexity(model, text.eval_blocks, config.batch_size, sharded, label=labels[1])

    # the dtype the training computes in (bf16 autocast on GPU): the teacher's and the export's
    compute_dtype = resolve_dtype(None, torch.device("cpu" if on_cpu(device) else "cuda"))
    result, mlps = _train(model, text, config, source_perplexities, compute_dtype, fsdp=fsdp, resume_dir=resume_dir,
                          resume=resume, device=device, shown=shown, inputs=inputs, report_to=report_trackers,
                          logging_dir=logging_dir_for(out))
    # A failure from here on keeps the trained weights (where it came while writing, in the export's dtype: what
    # the checkpoint holds anyway); --resume goes straight to measuring them.
    try:
        model = result.model
        stats = measure(model, spec, text.eval_blocks, config.batch_size, sharded=result.sharded, label=labels[2])
        ppl["after training"] = stats["perplexity"]
        captured = None
        if result.sharded:
            if measure_kernels:  # every process runs the forwards; the main one times the layers on them
                captured = capture_mlp_inputs(model, spec, text.eval_blocks, keep=main)
            with console.status("gathering the trained weights into CPU memory") if shown else nullcontext():
                model = gather_model(model, mlps)
            if model is None:  # another process: the main one plans and exports
                return {"perplexity": ppl, "layers": stats["layers"], "log": result.log}
        plan = plan_model(model, spec, stats, text.eval_blocks, measure_kernels=measure_kernels and main,
                          device=device, mlp_inputs=captured)
        training = _training_record(origin, data, text_column, config, result, stats["tokens"], ppl)
        summary = {"perplexity": ppl, "layers": stats["layers"], "plan": plan, "training": training,
                   "log": result.log, "hybrid_share": hybrid_share(result.log)}
        if not main:
            return summary

        model.to(compute_dtype)  # as trained
        _write(model, tokenizer, out, spec, plan, training, result.log, max_shard_size=max_shard_size,
               overwrite=overwrite)
    except (Exception, KeyboardInterrupt):
        try:
            result.save()
        except Exception as error:  # the first error is the one to report
            warn(f"the trained state could not be saved either ({type(error).__name__}: {error})")
        raise
    discard_saved_state(resume_dir)
    if push_to_hub:
        from .push import push_to_hub as push

        summary["url"] = push(out, push_to_hub, private=private)
    return summary


def _check_inputs(source: str, out, config: TrainConfig, data: str | None, text_column: str, device: str | None,
                  resume: bool, overwrite: bool, max_shard_size: str, measure_kernels: bool | None,
                  processes: int) -> tuple[Path, Path, str | Path, dict]:
    """Fails fast, before any weight is read, on what would stop the conversion later; returns OUT checked, the
    folder of its training state, the data to read and the inputs a resumed run must name again."""
    out = check_output_dir(out, overwrite)
    for what, path in (("the source model", source), ("the data", data)):
        if path is not None and Path(path).exists() and (
                Path(path).resolve() == out.resolve() or out.resolve() in Path(path).resolve().parents):
            raise ConfigError(f"-o {out}: the output would replace {what} {path}; write elsewhere")
    try:
        convert_file_size_to_int(max_shard_size)
    except ValueError:
        raise ConfigError(f"--max-shard-size {max_shard_size!r}: use a number and a unit, e.g. 5GB or 500MB") from None
    config.validate(world=processes)
    if measure_kernels:
        require_cuda(device, "--measure")
    resume_dir = resume_dir_for(out)
    if not resume and not overwrite and (resume_dir / "state.json").is_file():
        raise ConfigError(f"{resume_dir} holds the training state of an interrupted conversion to {out}: pass "
                          f"--resume to continue it, or --overwrite to start over (deleting it)")
    if data is None and source != "demo":
        raise DataError("--data is required (local .txt/.jsonl/.parquet files or folder, or a datasets name)")
    data_spec = data or demo_corpus_path()
    # what the training state depends on besides its settings: a resumed run must name the same
    inputs = {"source": _identity(source), "data": _identity(data_spec), "text_column": text_column}
    if resume:
        check_resume(resume_dir, config, processes, inputs)
    resolve_data(data_spec)  # missing / empty / unknown format
    return out, resume_dir, data_spec, inputs


def _fit_positions(source: str, config: TrainConfig, main: bool) -> TrainConfig:
    """`config` with its seq-len lowered to the source's positions where it is beyond them, said once (by the main
    process)."""
    positions = getattr(load_config(source)[0], "max_position_embeddings", None)
    if positions is None or config.seq_len <= positions:
        return config
    if main:
        warn(f"seq-len {config.seq_len} (the recipe's) is beyond the {positions} positions of {source}: training at "
             f"seq-len {positions} (--seq-len sets it)")
    return replace(config, seq_len=positions)


def _check_source(source: str, config: TrainConfig, device: str | None, processes: int, fsdp: bool,
                  show: bool) -> None:
    """What the source's config decides before any weight is read: seq-len against its positions, the run's
    settings and training state size (printed where `show`), and that state against the GPUs."""
    model_config = load_config(source)[0]
    parameters = parameter_count(model_config)
    config.validate(getattr(model_config, "max_position_embeddings", None))
    if show:
        console.print(run_summary(parameters, config, processes, fsdp), soft_wrap=True)
    check_training_memory(parameters, device, processes, fsdp, teacher=config.distill > 0)


def _report_held_out(text: TextData, shown: bool, run_tokens: int) -> None:
    """What is held out (where `shown`) and the warnings about it and about the run's `run_tokens` on the rest."""
    held_out, warnings = text.held_out(run_tokens)
    if shown:
        console.print(held_out)
    for warning in warnings:
        warn(warning)


def _load_source(source: str, config: TrainConfig, device: str | None, launch: PartialState, show_progress: bool):
    """(model, tokenizer, family spec) of `source` in fp32, after printing the run's settings and checking that
    its training state fits the GPUs (under FSDP: loaded into CPU memory, only by the main process where the
    launch config loads on rank 0), and the base model and its license as the checkpoint will record them
    (read now: the source folder may change while the conversion trains)."""
    fsdp, rank0_loading = fsdp_launch()
    main = launch.is_main_process
    _check_source(source, config, device, launch.num_processes, fsdp, show=main and show_progress)
    model, tokenizer, spec = load_model(source, dtype=torch.float32, device="cpu" if fsdp else device,
                                        weights=main or not rank0_loading)
    require_tokenizer(tokenizer, source)
    origin = {"base_model": _base_model(source), "license": source_license(resolve_source(source))}
    return model, tokenizer, spec, origin


def _train(model, text: TextData, config: TrainConfig, source_perplexities: Callable, compute_dtype: torch.dtype, *,
           fsdp: bool, resume_dir: Path, resume: bool, device: str | None, shown: bool, inputs: dict,
           report_to: list[str], logging_dir: Path):
    """Relufies `model` and trains it on `text` (train.train's result, and the model's ReluGatedMLPs), the
    source's perplexities measured after the swap: here, or under FSDP on the sharded model before the first
    step; the log's figures go to the trackers of `report_to`. Running out of GPU memory is a ConfigError naming
    what lowers it."""
    # the distillation teacher: the source model as loaded, frozen; under FSDP (loaded into CPU memory) whole
    # on every process, train broadcasting the main process's weights
    teacher = copy.deepcopy(model).to(compute_dtype) if config.distill else None
    mlps = relufy(model)
    if not fsdp:
        source_perplexities(model)
    try:
        result = train(
            model, mlps, lambda start, rank, world: text.train_batches(
                config.batch_size, start, rank, world, shuffle_buffer=config.shuffle_buffer, seed=config.seed), config,
            resume_dir=resume_dir, resume=resume, device=device, show_progress=shown,
            evaluate=(lambda prepared: source_perplexities(prepared, sharded=True)) if fsdp else None, inputs=inputs,
            teacher=teacher, report_to=report_to, logging_dir=logging_dir,
        )
    except torch.cuda.OutOfMemoryError:
        raise ConfigError(
            f"out of GPU memory training {config.batch_size} x {config.seq_len} tokens a micro-batch: lower "
            f"--batch-size (raise --grad-accum to keep the step's tokens), add --grad-checkpointing"
            + (", or --distill 0 (the teacher's copy)" if config.distill else "")
            + ("" if fsdp else ", or shard over GPUs with recipes/accelerate/fsdp.yaml")) from None
    return result, mlps


def _training_record(origin: dict, data: str | None, text_column: str, config: TrainConfig, result: TrainResult,
                     eval_tokens: int, ppl: dict) -> dict:
    """The checkpoint's record of the training (config.json's twell.training, training_log.json), without local
    paths: the checkpoint may be pushed. `origin`: the base model and its license (_load_source)."""
    return {
        **origin,
        "data": public_name(data) if data else "demo corpus",
        "text_column": text_column,
        "tokens": result.tokens,
        "steps": result.steps,
        "seconds": round(result.seconds, 1),
        "perplexity": ppl,
        **{k: v for k, v in asdict(config).items() if k not in ("steps", "tokens", "eval_tokens")},
        "eval_tokens": eval_tokens,  # held out and measured on: the setting's count, or less where the text was short
        "max_steps": config.steps,
        "max_tokens": config.tokens,
        "max_eval_tokens": config.eval_tokens,
    }


def _write(model, tokenizer, out: Path, spec, plan, training: dict, log: list[dict], *, max_shard_size: str,
           overwrite: bool) -> None:
    """Exports the checkpoint to `out` with training_log.json and the sparsity plot of the `log`."""
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = {name: Path(tmp) / name for name in ARTIFACTS}
        artifacts["training_log.json"].write_text(json.dumps({"training": training, "log": log}, indent=1))
        plot_training(log, artifacts["sparsity.png"])
        export_checkpoint(
            model, tokenizer, out, spec=spec, plan=plan, training=training, artifacts=artifacts,
            max_shard_size=max_shard_size, overwrite=overwrite,
        )
