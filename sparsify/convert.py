"""`sparsify convert`: the whole pipeline, one call per stage.

check OUT (fail fast) -> load -> perplexity of the original -> relufy -> perplexity after the swap ->
calibrate (--calibrate-steps: each ReLU MLP fitted to the source's) -> train (L1; each layer on the hybrid kernels or
dense by its activity; with `distill`, fitted to a frozen copy
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
import signal
import tempfile
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import PartialState
from transformers.utils.hub import convert_file_size_to_int

from .calibrate import ROWS_PER_STEP, available_memory, calibrate, calibration_blocks, check_kept_memory
from .card import is_hub_id, public_name, source_license, source_license_files
from .config import RunOptions, TrainConfig, shown_value, steps_said
from .data import TextData
from .errors import ConfigError, DataError, Interrupted
from .export import ARTIFACTS, export_checkpoint
from .load import (check_device, check_weight_files, load_config, load_model, load_tokenizer, mlp_parameter_count,
                   parameter_count, require_cuda, require_tokenizer, resolve_dtype)
from .locations import (DATA_REQUIRED, check_data, check_hub_repo, check_output_dir, demo_corpus_path,
                        logging_dir_for, resolve_source, resume_dir_for, saved_state)
from .measure import measure, perplexity
from .plan import choose_measure, plan_model
from .tune import capture_mlp_inputs
from .relufy import original_mlps, relufy
from .report import console, plot_training, warn
from .resume import check_resume, discard_saved_state, recover_killed_save
from .train import (TrainResult, check_training_memory, cpu_training_warning, fsdp_launch, gather_model, hybrid_share,
                    on_cpu, train, trackers, training_state_bytes)


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
    printed at the start and by `convert --dry-run`. Of the settings only those off their defaults (the recipe's
    and the command line's), in TrainConfig's order, which keeps related ones together: all of them would bury
    these few, and the checkpoint records all (_training_record)."""
    state = training_state_bytes(parameters, processes, sharded, teacher=config.uses_teacher)
    steps = config.total_steps(processes)
    changed = "  ".join(f"{setting.name}={shown_value(getattr(config, setting.name))}" for setting in fields(config)
                        if getattr(config, setting.name) != setting.default)
    rest = "at their built-in defaults; the checkpoint's config.json records all, under twell.training"
    processes_said = f"{processes} process" + ("es" if processes > 1 else "")
    return (f"settings: {f'{changed}  (the others {rest})' if changed else f'all {rest}'}\n"
            f"{parameters / 1e6:,.1f}M parameters; {steps_said(steps)} of {config.tokens_per_step(processes):,} tokens "
            f"({_run_tokens(config, processes):,} tokens) on {processes_said}; training state "
            + (f"{state / 2**30:.1f} GiB" if state >= 2**30 else f"{state / 2**20:.0f} MiB")
            + f" a process (fp32 weights, gradients, AdamW{', bf16 teacher' if config.uses_teacher else ''}; "
            "activations come on top)")


@dataclass
class _Checked:
    """What the checks before any weight is read settle (_check_inputs)."""

    config: TrainConfig  # the settings, seq-len fitted to the source's positions where asked (_fit_positions)
    out: Path
    data: str | Path  # the data to read: --data, or the demo corpus
    inputs: dict  # what the training state depends on besides its settings: a resumed run must name the same
    saved: dict | None  # the state a resumed run continues (check_resume); None for a fresh run
    model_config: object  # the source's transformers config, which load_model then loads with (the Hub asked once)
    text: TextData | None  # the training text where --passes had it counted before the run, else None (read later)
    trackers: list[str]  # of --report-to (train.trackers)
    fsdp: bool  # launched with an FSDP config (train.fsdp_launch)
    rank0_loading: bool  # under FSDP, only the main process reads the weights (train.fsdp_launch)

    @property
    def resume_dir(self) -> Path:
        return resume_dir_for(self.out)


class _Source(NamedTuple):
    """The source as loaded for training (_load_source)."""

    model: torch.nn.Module  # fp32
    tokenizer: object
    spec: object  # its family's FamilySpec
    origin: dict  # the base model and its license, as the checkpoint records them
    license_files: dict  # the source's files of terms by name, which the checkpoint carries


def convert(source: str, config: TrainConfig, options: RunOptions, fit_seq_len: bool = False,
            tokens_asked: bool = True, warnings: tuple[str, ...] = ()) -> dict | None:
    """Convert `source` into a sparse checkpoint at `options.out`; returns the summary (perplexities, per-layer
    statistics and plan, training log), or None for a dry run (`options.dry_run`: every check that reads no
    weight, the settings, the training state's size and the held-out text printed). `fit_seq_len`: the config's
    seq-len is no choice of the user's (a recipe's or the default): lower it to the source's positions where it
    is beyond them, with a warning. `tokens_asked`: the config's token count is the user's, not only a recipe's
    under steps the user gave (TrainConfig.warnings). `warnings`: the caller's about the settings, said with
    TrainConfig's by the main process."""
    check_device(options.device)
    launch = PartialState(cpu=on_cpu(options.device))
    main = launch.is_main_process
    if options.resume and main and recover_killed_save(saved := resume_dir_for(options.out)):
        console.print(f"the last save was whole but not yet in place: resuming from it ({saved})")
    launch.wait_for_everyone()
    checked = _check_inputs(source, config, options, launch.num_processes, fit_seq_len)
    config = checked.config
    for warning in (*warnings, *config.warnings(launch.num_processes, tokens_asked)) if main else ():
        warn(warning)
    if options.dry_run:
        _dry_run(source, config, options, checked, launch.num_processes)
        return None
    # starting over: an interrupted run's state must not outlive it
    if options.overwrite and not options.resume and main:
        discard_saved_state(checked.resume_dir)
    shown = not options.quiet and main
    try:
        loaded = _load_source(source, config, options, checked, launch)
        measure_kernels = choose_measure(options.measure_kernels, loaded.model.config, options.device,
                                         shown and console.print)
        text = checked.text or _read_text(checked.data, loaded.tokenizer, config, options)
        if main:
            _report_held_out(text, shown, config, launch.num_processes)
        perplexities = _Perplexities(text, config.batch_size, shown)
        result, mlps, calibration = _train(loaded.model, text, config, options, checked, perplexities)
    except KeyboardInterrupt:  # the training loop saves on Ctrl-C; before it (loading, calibration) there is none
        raise Interrupted("interrupted before the first training step (loading, measuring the source, calibration):"
                          " nothing was saved, so the same command starts over; from the first step on, Ctrl-C "
                          "saves the state for --resume") from None
    # A failure from here on keeps the trained weights (where it came while writing, in the export's dtype: what
    # the checkpoint holds anyway); --resume goes straight to measuring them.
    try:
        with _terminate_as_interrupt():
            summary = _measure_and_write(result, mlps, calibration, loaded, perplexities, config, options, checked,
                                         measure_kernels)
    except (Exception, KeyboardInterrupt) as error:
        try:
            result.save()
        except Exception as failure:  # the first error is the one to report
            warn(f"the trained state could not be saved either ({type(failure).__name__}: {failure})")
            raise error from None
        if isinstance(error, KeyboardInterrupt):
            raise Interrupted(f"interrupted after training: its state is saved in {checked.resume_dir}; the same "
                              "command with --resume measures and writes it",
                              getattr(error, "signum", signal.SIGINT)) from None
        raise
    if main:
        discard_saved_state(checked.resume_dir)
        if options.push_to_hub:
            from .push import push_to_hub as push

            summary["url"] = push(checked.out, options.push_to_hub, private=options.private)
    return summary


class _Terminated(KeyboardInterrupt):
    """SIGTERM raised as Ctrl-C's KeyboardInterrupt (_terminate_as_interrupt)."""

    signum = signal.SIGTERM


@contextmanager
def _terminate_as_interrupt():
    """Inside (in the main thread), SIGTERM stops the run as Ctrl-C does, so that the trained state is saved
    before the process ends (a job scheduler's stop while the checkpoint is measured or written)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_inputs(source: str, config: TrainConfig, options: RunOptions, processes: int,
                  fit_seq_len: bool) -> _Checked:
    """Fails fast, before any weight is read, on what would stop the conversion later: OUT, the data, the
    settings against the source's config (its seq-len first fitted to the source's positions with
    `fit_seq_len`; --passes resolved into tokens by counting the training text) and `processes`, a resumed state
    against them, --report-to, --push-to-hub's id and login."""
    out = check_output_dir(options.out, options.overwrite)
    if options.push_to_hub:
        check_hub_repo(options.push_to_hub)
    for what, path in (("the source model", source), ("the data", options.data)):
        if path is not None and Path(path).exists() and (
                Path(path).resolve() == out.resolve() or out.resolve() in Path(path).resolve().parents):
            raise ConfigError(f"-o {out}: the output would replace {what} {path}; write elsewhere")
    try:
        convert_file_size_to_int(options.max_shard_size)
    except ValueError:
        raise ConfigError(f"--max-shard-size {options.max_shard_size!r}: use a number and a unit, e.g. 5GB or "
                          "500MB") from None
    if options.measure_kernels:
        require_cuda(options.device, "--measure")
    resume_dir = resume_dir_for(out)
    if not options.resume and not options.overwrite and (saved := saved_state(resume_dir)) is not None:
        raise ConfigError(f"{saved} holds the training state of an interrupted conversion to {out}: pass "
                          f"--resume to continue it, or --overwrite to start over (deleting it)")
    model_config = load_config(source)[0]  # a wrong source named first: --data would not make it right
    if options.data is None and source != "demo":
        raise DataError(DATA_REQUIRED)
    data = options.data or demo_corpus_path()
    positions = getattr(model_config, "max_position_embeddings", None)
    if fit_seq_len:
        config = _fit_positions(source, config, positions)
    config.validate(positions)
    check_data(data, config.passes)
    text = None
    if config.passes is not None:
        text, config = _resolve_passes(source, data, config, options, model_config)
    config.check_processes(processes)
    fsdp, rank0_loading = fsdp_launch()
    if fsdp and config.calibrate_steps:
        raise ConfigError("--calibrate-steps under FSDP: calibration runs on the whole model on each process's GPU; "
                          "launch without the FSDP config (DDP) where the model's training fits a GPU, else set "
                          "--calibrate-steps 0")
    inputs = {"source": _identity(source), "data": _identity(data), "text_column": options.text_column}
    saved = check_resume(resume_dir, config, processes, inputs) if options.resume else None
    return _Checked(config, out, data, inputs, saved, model_config, text, trackers(options.report_to), fsdp,
                    rank0_loading)


def _read_text(data, tokenizer, config: TrainConfig, options: RunOptions) -> TextData:
    """The run's text, cut into its training blocks and held-out head as the settings say."""
    return TextData(data, tokenizer, config.seq_len, config.eval_tokens, options.text_column)


def _resolve_passes(source: str, data: str | Path, config: TrainConfig, options: RunOptions, model_config
                    ) -> tuple[TextData, TrainConfig]:
    """The training text, read with the source's tokenizer before any weight, and `config` with its tokens set to
    --passes times the text's (counted, or estimated from its length beyond its head), said by the main process.
    Every process counts the same text the same way, so that they agree on the run's steps; a resumed run counts
    again and finds the tokens it saved."""
    tokenizer = load_tokenizer(resolve_source(source))
    require_tokenizer(tokenizer, source, model_config)
    text = _read_text(data, tokenizer, config, options)
    shown = PartialState().is_main_process and (options.dry_run or not options.quiet)
    with console.status(f"counting the training text's tokens for --passes ({data})") if shown else nullcontext():
        tokens, estimated = text.training_tokens()  # a large text is read whole
    config = replace(config, tokens=max(1, round(config.passes * tokens)))
    if shown:
        console.print(f"--passes {config.passes:g}: {config.passes:g} x {'about ' if estimated else ''}{tokens:,} "
                      f"tokens of the training text = {config.tokens:,} tokens")
    return text, config


def _check_source(config: TrainConfig, options: RunOptions, checked: _Checked, processes: int, show: bool) -> None:
    """What the source's config decides before any weight is read: the run's settings and training state size
    (printed where `show`), that state against the GPUs, and the source's MLP projections that sequential
    calibration keeps (fp32, as trained) against the CPU memory available."""
    parameters = parameter_count(checked.model_config)
    if show:
        console.print(run_summary(parameters, config, processes, checked.fsdp))
    check_training_memory(parameters, options.device, processes, checked.fsdp, teacher=config.uses_teacher)
    calibration = config.calibrate_steps * ROWS_PER_STEP * mlp_parameter_count(checked.model_config)
    if (warning := cpu_training_warning(parameters, _run_tokens(config, processes), options.device,
                                        teacher=config.uses_teacher, calibration=calibration)) and \
            PartialState().is_main_process:
        warn(warning)
    if config.calibrate_steps and config.calibrate_sequential and checked.saved is None:
        check_kept_memory(4 * mlp_parameter_count(checked.model_config), available_memory())


def _dry_run(source: str, config: TrainConfig, options: RunOptions, checked: _Checked, processes: int) -> None:
    """The rest of the checks that read no weight (the training state against the GPUs, the weight files' headers,
    the tokenizer, the held-out text), with the settings and the held-out text printed."""
    _check_source(config, options, checked, processes, show=True)
    where = resolve_source(source)
    check_weight_files(where, source)
    text = checked.text
    if text is None:
        tokenizer = load_tokenizer(where)
        require_tokenizer(tokenizer, source, checked.model_config)
        text = _read_text(checked.data, tokenizer, config, options)
    _report_held_out(text, True, config, processes)


def _run_tokens(config: TrainConfig, processes: int) -> int:
    """The tokens the run trains on: its steps' on `processes` processes."""
    return config.total_steps(processes) * config.tokens_per_step(processes)


def _fit_positions(source: str, config: TrainConfig, positions: int | None) -> TrainConfig:
    """`config` with its seq-len lowered to the source's `positions` where it is beyond them, said once (by the
    main process)."""
    if positions is None or config.seq_len <= positions:
        return config
    if PartialState().is_main_process:
        warn(f"seq-len {config.seq_len} (the recipe's) is beyond the {positions} positions of {source}: training at "
             f"seq-len {positions} (--seq-len sets it)")
    return replace(config, seq_len=positions)


def _report_held_out(text: TextData, shown: bool, config: TrainConfig, processes: int) -> None:
    """What is held out (where `shown`) and the warnings about it and about the passes the run makes over the rest
    (none where --passes set them: said already)."""
    held_out, warnings = text.held_out(None if config.passes is not None else _run_tokens(config, processes))
    if shown:
        console.print(held_out)
    for warning in warnings:
        warn(warning)


def _load_source(source: str, config: TrainConfig, options: RunOptions, checked: _Checked,
                 launch: PartialState) -> _Source:
    """`source` in fp32, after printing the run's settings and checking that its training state fits the GPUs
    (under FSDP: loaded into CPU memory, only by the main process where the launch config loads on rank 0), with
    the base model and its license as the checkpoint will record them (read now: the source folder may change
    while the conversion trains)."""
    main = launch.is_main_process
    _check_source(config, options, checked, launch.num_processes, show=main and not options.quiet)
    model, tokenizer, spec = load_model(source, dtype=torch.float32, device="cpu" if checked.fsdp else options.device,
                                        weights=main or not checked.rank0_loading, config=checked.model_config,
                                        tokenizer=checked.text.tokenizer if checked.text is not None else None)
    require_tokenizer(tokenizer, source, checked.model_config)
    where = resolve_source(source)
    origin = {"base_model": _base_model(source), "license": source_license(where)}
    license_files = source_license_files(where) if main else {}  # the main process writes the checkpoint
    if license_files is None:
        warn(f"{source}: its license files could not be listed (offline?); a checkpoint shared from OUT should carry "
             "them: copy the source's LICENSE and similar files into OUT")
    return _Source(model, tokenizer, spec, origin, license_files or {})


class _Perplexities:
    """The held-out perplexities a conversion reports: of the source and after the ReLU swap (`of_source`), and
    after training (measure's), with the progress labels of each pass where `shown`."""

    def __init__(self, text: TextData, batch_size: int, shown: bool):
        self.text, self.batch_size, self.shown, self.values = text, batch_size, shown, {}
        eval_tokens = sum(block.numel() for block in text.eval_blocks)
        self.labels = [f"{what} ({eval_tokens:,} held-out tokens)" if shown else None for what in (
            "perplexity of the source", "perplexity after the ReLU swap", "measuring the trained model",
            "perplexity after calibration")]

    def after_calibration(self, model) -> None:
        self.values["after calibration"] = perplexity(model, self.text.eval_blocks, self.batch_size,
                                                      label=self.labels[3])

    def of_source(self, model, record: dict, sharded: bool = False) -> None:
        """The source's perplexity (its original MLPs) and after the swap, of a relufied `model`, ahead of any
        figure already in `values` (under FSDP it is measured after calibration); also into `record` (the saved
        state's, so that a resumed run does not measure them again)."""
        with original_mlps(model):
            original = perplexity(model, self.text.eval_blocks, self.batch_size, sharded, label=self.labels[0])
        swapped = perplexity(model, self.text.eval_blocks, self.batch_size, sharded, label=self.labels[1])
        for figures in (self.values, record):  # in the order of the run's stages
            later = dict(figures)
            figures.clear()
            figures.update({"original": original, "after swap": swapped, **later})


def _compute_dtype(device: str | None) -> torch.dtype:
    """The dtype the training computes in (bf16 autocast on GPU): the teacher's and the export's."""
    return resolve_dtype(None, torch.device("cpu" if on_cpu(device) else "cuda"))


def _train(model, text: TextData, config: TrainConfig, options: RunOptions, checked: _Checked,
           perplexities: _Perplexities):
    """Relufies `model`, calibrates its MLPs (--calibrate-steps, unless resuming: the saved state holds them, with
    the calibration's record and the perplexity after it) and trains it on `text`; returns train.train's result,
    the model's ReluGatedMLPs and the calibration's record (CalibrationResult.record; None without). The source's
    perplexities are measured after the swap (unless the saved state holds them): here, or under FSDP on the
    sharded model before the first step; the log's figures go to the trackers of --report-to. Running out of GPU
    memory is a ConfigError naming what lowers it."""
    # the distillation teacher: the source model as loaded, frozen; under FSDP (loaded into CPU memory) whole
    # on every process, train broadcasting the main process's weights
    teacher = copy.deepcopy(model).to(_compute_dtype(options.device)) if config.uses_teacher else None
    mlps = relufy(model)
    saved = checked.saved["before_training"] if checked.saved is not None else None
    measure_source = saved is None or "original" not in saved["perplexity"]
    source_record = {}
    if measure_source and not checked.fsdp:
        perplexities.of_source(model, source_record)
    if saved is not None:
        before_training = saved
        perplexities.values.update(before_training["perplexity"])
    elif config.calibrate_steps:
        blocks = calibration_blocks(text.train_batches(config.batch_size, shuffle_buffer=config.shuffle_buffer,
                                                       seed=config.seed), config.calibrate_tokens)
        processes = PartialState()
        calibration = calibrate(model, mlps, blocks, config.calibrate_steps, config.calibrate_lr or config.lr,
                                config.seed, perplexities.shown, config.calibrate_sparsity,
                                config.calibrate_sequential, config.l1_log_scale, processes.process_index,
                                processes.num_processes)
        perplexities.after_calibration(model)
        before_training = {"calibration": calibration.record(),
                           "perplexity": {"after calibration": perplexities.values["after calibration"]}}
    else:
        before_training = {"calibration": None, "perplexity": {}}
    before_training["perplexity"] = {**source_record, **before_training["perplexity"]}  # in the stages' order
    try:
        result = train(
            model, mlps, lambda start, rank, world: text.train_batches(
                config.batch_size, start, rank, world, shuffle_buffer=config.shuffle_buffer, seed=config.seed), config,
            resume_dir=checked.resume_dir, resume=checked.saved, device=options.device,
            show_progress=perplexities.shown,
            evaluate=(lambda prepared: perplexities.of_source(prepared, before_training["perplexity"], sharded=True))
            if checked.fsdp and measure_source else None,
            inputs=checked.inputs, before_training=before_training, teacher=teacher,
            l1_reference=(before_training["calibration"] or {}).get("l1_reference"),
            l1_eps=(before_training["calibration"] or {}).get("l1_eps"), report_to=checked.trackers,
            logging_dir=logging_dir_for(checked.out),
        )
    except torch.cuda.OutOfMemoryError:
        raise ConfigError(
            f"out of GPU memory training {config.batch_size} x {config.seq_len} tokens a micro-batch: lower "
            f"--batch-size (raise --grad-accum to keep the step's tokens), add --grad-checkpointing"
            + (", or --distill 0 and --distill-hidden 0 (the teacher's copy)" if config.uses_teacher else "")
            + ("" if checked.fsdp else ", or shard over GPUs with recipes/accelerate/fsdp.yaml")) from None
    return result, mlps, before_training["calibration"]


def _measure_and_write(result: TrainResult, mlps: list, calibration: dict | None, loaded: _Source,
                       perplexities: _Perplexities, config: TrainConfig, options: RunOptions, checked: _Checked,
                       measure_kernels: bool) -> dict:
    """Measures the trained model on the held-out text, plans its layers and (main process) exports it to OUT;
    returns the summary. Under FSDP the trained weights are gathered into the main process's CPU memory first
    (with `measure_kernels`, the layers' inputs captured on the way, as every process runs the forwards)."""
    model, spec, text, ppl = result.model, loaded.spec, perplexities.text, perplexities.values
    main = PartialState().is_main_process
    stats = measure(model, spec, text.eval_blocks, config.batch_size, sharded=result.sharded,
                    label=perplexities.labels[2])
    ppl["after training"] = stats["perplexity"]
    captured = None
    if result.sharded:
        if measure_kernels:  # every process runs the forwards; the main one times the layers on them
            captured = capture_mlp_inputs(model, spec, text.eval_blocks, keep=main)
        with console.status("gathering the trained weights into CPU memory") if perplexities.shown else nullcontext():
            model = gather_model(model, mlps)
        if model is None:  # another process: the main one plans and exports
            return {"perplexity": ppl, "layers": stats["layers"], "log": result.log}
    plan = plan_model(model, spec, stats, text.eval_blocks, measure_kernels=measure_kernels and main,
                      device=options.device, mlp_inputs=captured)
    training = _training_record(loaded.origin, options, config, result, stats["tokens"], ppl)
    if calibration is not None:
        training["calibration"] = calibration
    summary = {"perplexity": ppl, "layers": stats["layers"], "plan": plan, "training": training,
               "log": result.log, "hybrid_share": hybrid_share(result.log)}
    if main:
        for hint in (_sparsity_hint, _dead_units_hint):
            if warning := hint(stats["layers"], config):
                warn(warning)
        model.to(_compute_dtype(options.device))  # as trained
        _write(model, loaded.tokenizer, checked.out, spec, plan, training, result.log, options, loaded.license_files)
    return summary


# Below this held-out sparsity a converted model's MLPs seldom beat dense on the kernels (docs/performance.md)
HINT_BELOW = 0.95


def _sparsity_hint(layers: list[dict], config: TrainConfig) -> str | None:
    """What to say where a run without --target-sparsity ends less than HINT_BELOW sparse on the held-out text
    (a run with it warns where it falls short: train.loop), and what to change; else None."""
    sparsity = sum(layer["sparsity"] for layer in layers) / len(layers)  # every layer has as many units
    if config.target_sparsity or sparsity >= HINT_BELOW:
        return None
    return (f"the model ends {sparsity:.2%} sparse on the held-out text: the sparse kernels pay near 99%, so most of "
            "its layers are planned dense; more tokens, a larger --l1, or --target-sparsity 0.99 take it further")


# A layer with more of its units dead than this has lost most of its capacity (docs/quality.md, "Dead units revived":
# the deadest layers measured, under half dead, cost nothing measurable)
DEAD_HINT_ABOVE = 0.75


def _dead_units_hint(layers: list[dict], config: TrainConfig) -> str | None:
    """What to say where layers end with more than DEAD_HINT_ABOVE of their units dead (silent on all the held-out
    text), and the option that revives them; else None."""
    dead = [f"{index} ({layer['dead_frac']:.1%})" for index, layer in enumerate(layers)
            if layer["dead_frac"] > DEAD_HINT_ABOVE]
    if not dead:
        return None
    fix = ("" if config.revive_dead_tokens else
           f"; --revive-dead-tokens {10 * config.tokens_per_step(1)} (about ten optimizer steps' tokens) gives silent "
           "units a live unit's weights to train again")
    which = (f"layers {', '.join(dead)} ended with most of their" if len(dead) > 1 else
             f"layer {dead[0]} ended with most of its")
    return f"{which} units dead, silent on all the held-out text: that capacity is lost{fix}"


def _training_record(origin: dict, options: RunOptions, config: TrainConfig, result: TrainResult,
                     eval_tokens: int, ppl: dict) -> dict:
    """The checkpoint's record of the training (config.json's twell.training, training_log.json), without local
    paths: the checkpoint may be pushed. `origin`: the base model and its license (_load_source)."""
    return {
        **origin,
        "data": public_name(options.data) if options.data else "demo corpus",
        "text_column": options.text_column,
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


def _write(model, tokenizer, out: Path, spec, plan, training: dict, log: list[dict], options: RunOptions,
           license_files: dict[str, bytes]) -> None:
    """Exports the checkpoint to OUT with training_log.json, the sparsity plot of the `log` and the source's
    `license_files`."""
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = {name: Path(tmp) / name for name in (*ARTIFACTS, *license_files)}
        artifacts["training_log.json"].write_text(json.dumps({"training": training, "log": log}, indent=1))
        plot_training(log, artifacts["sparsity.png"])
        for name, content in license_files.items():
            artifacts[name].write_bytes(content)
        export_checkpoint(
            model, tokenizer, out, spec=spec, plan=plan, training=training,
            artifacts=artifacts, max_shard_size=options.max_shard_size, overwrite=options.overwrite,
        )
