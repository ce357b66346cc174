"""The `sparsify` command: thin Click wrappers over sparsify.convert, sparsify.sample, sparsify.analyze and
sparsify.bench. User errors (SparsifyError) print their message on stderr and exit with status 1, without a
traceback (where a signal stopped the command, a shell's status for it: 130 for Ctrl-C, 143 for SIGTERM). Each command
checks what needs no model (its options, the paths it reads and writes) before it imports those modules (torch and
transformers, slow to import), so that a mistyped command fails, and --help shows, at once."""
from __future__ import annotations

import functools
import re
import signal
import sys
from dataclasses import MISSING, Field, fields
from importlib.metadata import PackageNotFoundError, entry_points, version
from importlib.util import find_spec
from typing import get_args, get_origin, get_type_hints

import click
from click.formatting import term_len

from sparsify.config import (BENCH_ON_CPU, TEXT_COLUMN_HELP, RunOptions, SampleOptions, TrainConfig, close_names,
                             measure_help, option_name, overlay, value_type)
from sparsify.errors import ConfigError, DataError, Interrupted, MissingDependencyError, SparsifyError
from sparsify.recipe import load_recipe, recipe_gaps, recipe_names
from sparsify.locations import (DATA_REQUIRED, SAMPLE_DATA_REQUIRED, check_data, check_hub_repo, check_output_dir,
                                family_config, no_saved_state, resolve_source, resume_dir_for, saved_state)

# The device types torch.device takes (c10/core/Device.cpp's, which its error for any other lists: tests/test_cli.py
# checks that they agree), so that a --device of none of them (gpu) is said before torch is imported.
DEVICE_TYPES = frozenset({"cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
                          "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone"})
# The packages of accelerate's trackers, by --report-to name (accelerate.utils.imports' is_*_available: either
# package serves tensorboard), so that an unknown name or a tracker not installed is said before torch is imported
# (tests/test_cli.py checks that the names are accelerate's).
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), **{
    name: (name,) for name in ("aim", "comet_ml", "mlflow", "wandb", "clearml", "dvclive", "swanlab", "trackio")}}
# Recipes (by name) whose lr is their 120M test bases' choice: a conversion of another source on them without --lr
# warns (a published model was pretrained at another peak)
TEST_BASE_LR_RECIPES = ("pretrained", "small-budget")


def signal_status(signum: int) -> int:
    """What a shell reports for a command that signal `signum` stopped: 130 for Ctrl-C (SIGINT), 143 for SIGTERM."""
    return 128 + signum


def user_errors(command):
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except SparsifyError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(signal_status(e.signum) if isinstance(e, Interrupted) else 1)
        except KeyboardInterrupt:
            click.echo("\nAborted!", err=True)  # Click's words for it
            sys.exit(signal_status(signal.SIGINT))

    return wrapper


class CommandWithHints(click.Command):
    """A command whose usage errors point to what was meant: a mistyped option's close options by shared words
    (close_names) where there are any, and a second positional argument (`convert demo demo-out`) as -o's."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, list(args))  # a copy: Click's parser consumes it, the hint reads it again
        except click.NoSuchOption as error:
            options = [name for param in self.get_params(ctx) for name in (*param.opts, *param.secondary_opts)
                       if name.startswith("--")]
            error.possibilities = close_names(error.option_name, options) or error.possibilities
            raise
        except click.MissingParameter as error:
            extra = self.make_parser(ctx).parse_args(list(args))[1]
            if error.param is not None and error.param.name == "out" and len(extra) == 1:
                raise click.UsageError(f"Got unexpected extra argument ({extra[0]}): the output folder is an option, "
                                       f"-o {extra[0]}", ctx) from None
            raise


# convert --help's sections by key, most used first. An option is listed under the one that its field's `section`
# metadata (sparsify/config.py) names, or convert's table for the options without a field; any other under the
# advanced settings, so that no option (a setting added to TrainConfig without a section, say) goes unlisted.
HELP_SECTIONS = {"io": "Input and output", "run": "Run", "budget": "Recipe and training budget",
                 "main": "Main training settings", "advanced": "Advanced settings"}


class SectionedCommand(CommandWithHints):
    """A command whose --help lists its options under HELP_SECTIONS' titles: `sections` names an option's section
    by the option's name; the options it does not name go to the advanced settings."""

    def __init__(self, *args, sections: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = sections

    def format_options(self, ctx, formatter):
        listed = {section: [] for section in HELP_SECTIONS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)  # None for a hidden option
            if record is not None and not isinstance(param, click.Argument):  # arguments: the usage line names them
                listed[self.sections.get(param.name, "advanced")].append(record)
        listed = {section: records for section, records in listed.items() if records}
        # write_dl starts the help after a section's longest option (30 characters at most: longer ones take a line
        # of their own): each section's padded to the longest of all, so that the help of all sections lines up
        widest = {section: min(max(term_len(option) for option, _ in records), 30)
                  for section, records in listed.items()}
        for section, records in listed.items():
            with formatter.section(HELP_SECTIONS[section]):
                formatter.write_dl(records, col_spacing=2 + max(widest.values()) - widest[section])


def _sections(*config_classes) -> dict[str, str]:
    """Per option made from the `config_classes`' fields, the --help section that its `section` metadata names."""
    return {setting.name: setting.metadata["section"] for config_class in config_classes
            for setting in fields(config_class) if "section" in setting.metadata}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sparsify")
def main():
    """Convert gated-MLP Hugging Face language models to >99% activation sparsity (ReLU gate + L1
    penalty) and run them on TwELL Triton kernels."""


main.command_class = CommandWithHints  # every command's usage errors point to what was meant


def _check_before_loading(source: str, data, data_required: str | None = None, passes=None) -> dict | None:
    """What needs no model, before torch is imported: the source's path or id, its family where its config.json
    is at hand (an unsupported one said at once), and then --data (missing where `data_required` says so, else
    locations.check_data); returns that config, or None where it is not at hand. The library checks all again
    with the rest, and a source whose config is not at hand names its own problem first."""
    family = family_config(resolve_source(source))
    if family is not None and data is None and data_required and source != "demo":
        raise DataError(data_required)
    if family is not None and data is not None:
        check_data(data, passes)
    return family


def _check_device(device: str | None, cuda_for: str | None = None, instead: str = "") -> None:
    """ConfigError for a --device that torch.device would not take (gpu, cuda:01), or a CUDA one where the installed
    torch is a CPU build, told without importing torch; with `cuda_for` (what needs a GPU: --measure), also any other
    device or a CPU build, in load.require_cuda's words (and `instead`, what a CPU can do). load.check_device and
    require_cuda judge the rest once torch is imported (no GPU visible, an index beyond the GPUs)."""
    kind = None
    if device is not None:
        # torch.device's grammar (c10/core/Device.cpp). A type it does not build in may be a device backend's, which
        # torch loads on import from an installed package's entry point (torch_npu's npu): torch judges that one.
        syntax = re.fullmatch(r"([a-zA-Z_]+)(?::(?:[1-9][0-9]*|0))?", device)
        if not syntax or syntax[1] not in DEVICE_TYPES and not entry_points(group="torch.backends"):
            raise ConfigError(f"--device {device}: not a device (use cpu, cuda or cuda:N)")
        kind = syntax[1]
    if cuda_for and kind not in (None, "cuda"):
        raise ConfigError(f"{cuda_for} needs a CUDA GPU, not --device {device}" + instead)
    if (cuda_for or kind == "cuda") and _cpu_build_of_torch():
        raise ConfigError(f"{cuda_for} needs a CUDA GPU, and torch ({version('torch')}, a CPU build) sees none"
                          + instead if cuda_for else
                          f"--device {device}: no CUDA GPU here (a CPU build of torch); use --device cpu or leave it "
                          "out")


def _cpu_build_of_torch() -> bool:
    """Whether the installed torch is a CPU build, as its version's local tag says (2.13.0+cpu, 2.1.0+cpu.cxx11.abi:
    the CPU wheels'), read from its metadata. False where no tag says so: a build without one may have CUDA or not,
    which torch tells once imported."""
    try:
        return version("torch").partition("+")[2].split(".")[0] == "cpu"
    except PackageNotFoundError:  # torch run from a source tree
        return False


def _check_trackers(report_to: str) -> None:
    """ConfigError for a name of --report-to (comma-separated) that is none of all, none and accelerate's trackers
    (TRACKER_PACKAGES), in train.trackers' words; MissingDependencyError for a tracker none of whose packages is
    installed, looked up without importing them. train.trackers checks the names again through accelerate."""
    known = ["all", *TRACKER_PACKAGES]
    for name in (name.strip() for name in report_to.split(",")):
        if name not in ("", "none", *known):
            raise ConfigError(f"--report-to {name}: not a tracker; use none, or one or more of {', '.join(known)} "
                              "separated by commas")
        if name in TRACKER_PACKAGES and not any(find_spec(package) for package in TRACKER_PACKAGES[name]):
            raise MissingDependencyError(f"--report-to {name}: the {name} package is not installed (pip install "
                                         f"{name})")


def _quiet_loading() -> None:
    """Turns transformers' loading and saving bars off, which would bury the training progress and tables: each
    command calls it once its arguments are checked (transformers is slow to import)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


@functools.cache
def _unset_values() -> dict[str, str]:
    """Per training setting, the value it takes when not given, as --help shows it: the default recipe's
    (pretrained; demo for `demo`), or TrainConfig's where the recipe has none."""
    settings = {setting.name: setting for setting in fields(TrainConfig)}

    def shown(name, value) -> str:  # as the command line takes it: a switch by its flag, a tuple's values apart
        if value is None and settings[name].metadata.get("unset"):
            return settings[name].metadata["unset"]
        if isinstance(value, bool):
            return _declarations(settings[name], switch=True)[-1].split("/")[not value]
        if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
            return f"{value:_}"  # as recipes and the docs write counts
        return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)

    pretrained, demo = (vars(TrainConfig.from_dict(load_recipe(None, source))) for source in ("any", "demo"))
    return {name: shown(name, value) if value == demo[name]
            else f"{shown(name, value)}; demo: {shown(name, demo[name])}" for name, value in pretrained.items()}


class TrainOption(click.Option):
    """A training option whose --help shows the value it takes when not given, read from the recipes only when
    help is shown."""

    def get_help_record(self, ctx):
        self.show_default = _unset_values().get(self.name, False)
        return super().get_help_record(ctx)


def _declarations(setting: Field, switch: bool) -> list[str]:
    """The option's declarations: its `flag` (default --NAME), a `switch`'s last one an --on/--off pair."""
    declarations = setting.metadata.get("flag", option_name(setting.name)).split()
    if switch and "/" not in declarations[-1]:
        declarations[-1] += "/--no-" + declarations[-1][2:]
    return declarations


def _option(setting: Field, hint, *, recipe: bool = False):
    """The option of a TrainConfig or RunOptions field of type `hint`: its `flag` declarations (default
    --NAME), its help and metavar. A training setting (`recipe`) is None when not given, so that a recipe's value
    (or the default) stands, and its boolean is an --on/--off pair; a run option defaults to the field's default
    (none: required) and its boolean False is a plain flag."""
    if get_origin(hint) is tuple:
        kind = get_args(hint)  # a fixed number of values: click's tuple type
    elif str in get_args(hint):
        kind = str  # a count or a share ("20%"): TrainConfig.from_dict reads either; or a path
    else:
        kind = value_type(hint)
    declarations = _declarations(setting, switch=recipe and kind is bool)
    if setting.metadata.get("folder"):
        kind = click.Path(file_okay=False)
    if recipe:
        settings = dict(cls=TrainOption, default=None)
    else:
        # A required option gets no default at all: recent Click (8.5) counts an explicit default=None as a value.
        required = setting.default is MISSING
        shown = setting.metadata.get("unset", False) if setting.default is None else (
            not required and not isinstance(setting.default, bool))  # what None stands for, where a field says
        settings = dict(required=required, show_default=shown,
                        is_flag=True if kind is bool and setting.default is False else None)
        if not required:
            settings["default"] = setting.default
    return click.option(*declarations, setting.name, type=None if kind is bool else kind,
                        metavar=setting.metadata.get("metavar"), help=setting.metadata["help"], **settings)


def _options(config_class, **kind) -> list:
    hints = get_type_hints(config_class)
    return [_option(setting, hints[setting.name], **kind) for setting in fields(config_class)]


TRAIN_OPTIONS = _options(TrainConfig, recipe=True) + [
    click.option("--no-hybrid", is_flag=True, help="Train every layer on the dense path (same as --hybrid-below 0)."),
]
RUN_OPTIONS = _options(RunOptions)


def with_options(options: list):
    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


text_column_option = _option(RunOptions.__dataclass_fields__["text_column"], str)  # convert's, for bench


def measure_option(what: str):
    return click.option("--measure/--no-measure", "measure_kernels", default=None, help=measure_help(what))


@main.command(cls=SectionedCommand, sections={**_sections(RunOptions, TrainConfig), "recipe": "budget"})
@click.argument("source")
@with_options(RUN_OPTIONS)
@click.option("--recipe", help=("Training settings YAML: a path, or a name in recipes/ (" + ", ".join(recipe_names())
                                + "); options given here override it. Default: demo for `demo`, pretrained for every "
                                  "other source."))
@with_options(TRAIN_OPTIONS)
@user_errors
def convert(source, recipe, **values):
    """Convert SOURCE (a Hub id, a checkpoint folder, or `demo`) into a >99%-sparse ReLU checkpoint in OUT."""
    options = RunOptions(**{name: values.pop(name) for name in RunOptions.__dataclass_fields__})
    if values.pop("no_hybrid"):
        values["hybrid_below"] = 0
    # --passes replaces the recipe's tokens (and --tokens a recipe's passes); both given here: validate says so
    settings = overlay(load_recipe(recipe, source), {k: v for k, v in values.items() if v is not None})
    config = TrainConfig.from_dict(settings)
    config.validate()  # what needs no model config, at once (convert checks again against the source's config)
    _check_device(options.device, "--measure" if options.measure_kernels else None)
    _check_trackers(options.report_to)
    if options.push_to_hub:
        check_hub_repo(options.push_to_hub)
    check_output_dir(options.out, options.overwrite)
    if options.resume and saved_state(resume_dir := resume_dir_for(options.out)) is None:
        raise ConfigError(no_saved_state(resume_dir))
    family = _check_before_loading(source, options.data, DATA_REQUIRED, config.passes)
    if family is not None and values["seq_len"] is not None:  # else convert fits the seq-len to the positions
        config.validate(family.get("max_position_embeddings"))
    _quiet_loading()
    from sparsify.convert import convert as run
    from sparsify.report import console, layer_table, perplexity_table

    # --steps alone on the command line ends the run before a recipe's tokens by the user's choice
    tokens_asked = values["steps"] is None or values["tokens"] is not None or values["passes"] is not None
    warnings = [gaps] if (gaps := recipe_gaps(recipe, source, settings)) else []
    if source != "demo" and values["lr"] is None and (recipe or "pretrained") in TEST_BASE_LR_RECIPES:
        warnings.append(f"--lr not given: the {recipe or 'pretrained'} recipe's {config.lr:g} is its 120M test "
                        "bases' choice; a source pretrained at another peak learning rate wants its own (about that "
                        "peak with pretrained, a third of it with small-budget on a few percent of its pretraining "
                        "tokens: README, \"Convert your own model\")")
    summary = run(source, config, options, fit_seq_len=values["seq_len"] is None, tokens_asked=tokens_asked,
                  warnings=tuple(warnings))
    if options.dry_run:
        if _is_main():
            console.print("dry run: the checks passed; no weight was read and nothing was written")
        return
    if _is_main():
        t = summary["training"]
        console.print(perplexity_table(summary["perplexity"]))
        console.print(layer_table(summary["layers"], summary["plan"],
                                  f"sparsity on {summary['layers'][0]['tokens']:,} held-out tokens",
                                  hybrid_share=summary["hybrid_share"]))
        console.print(f"trained {t['steps']} steps, {t['tokens']:,} tokens in {t['seconds']:.0f} s; "
                      f"wrote {options.out}")
        console.print(f"next: `sparsify analyze {options.out} --data TEXT` measures it on other text; "
                      f"AutoModelForCausalLM.from_pretrained({str(options.out)!r}, trust_remote_code=True) loads it, "
                      "its MLPs on the TwELL kernels on a GPU (docs/usage.md)", soft_wrap=True)
        if "url" in summary:
            console.print(f"pushed to {summary['url']}")
    _end_process_group()


@main.command()
@click.argument("source")
@with_options(_options(SampleOptions))
@user_errors
def sample(source, **values):
    """Write a data folder of text sampled from SOURCE (a Hub id, a checkpoint folder, or `demo`), continuing prompts
    from --data, for a conversion with little text of its own: `sparsify convert SOURCE --data OUT ...`."""
    _check_device(values["device"])
    check_output_dir(values["out"], values["overwrite"])
    family = _check_before_loading(source, values["data"], SAMPLE_DATA_REQUIRED)
    if family is not None:
        positions = family.get("max_position_embeddings")
        SampleOptions(**values).fit_seq_len(positions).validate(positions)
    _quiet_loading()
    from sparsify.report import console
    from sparsify.sample import sample as run

    record = run(source, SampleOptions(**values))
    data = f" and {record['data_tokens']:,} tokens of --data" if values["with_data"] else ""
    texts = f"{record['samples']:,} text" + ("s" if record["samples"] != 1 else "")
    console.print(f"sampled {texts}, {record['sampled_tokens']:,} tokens{data} in "
                  f"{record['seconds']:.0f} s ({record['sampled_tokens_per_s']:,.0f} tokens/s); wrote {values['out']}")
    # the demo's recipe lr is its own; any other source's is a third of its pretraining peak (convert warns without)
    own_lr = source != "demo"
    lr_meaning = ", LR about a third of the source's pretraining peak" if own_lr else ""
    console.print(f"next, four passes over it with the small-budget recipe (docs/usage.md){lr_meaning}: sparsify "
                  f"convert {source} -o OUT --data {values['out']} --recipe small-budget --passes 4"
                  + (" --lr LR" if own_lr else ""), soft_wrap=True)  # copyable


@main.command()
@click.argument("model")
@click.option("--data", help="Text to measure on (as for convert). Default for demo models: the demo corpus's held-out "
                             "file; for another converted checkpoint: the data it was converted on, where a file or "
                             "folder of the name it records is in the current folder.")
@click.option("--text-column", metavar="NAME",
              help=TEXT_COLUMN_HELP + " (default: text; without --data, the column the checkpoint's data was read "
                                      "from).")
@click.option("--tokens", type=int, default=65536, show_default=True, help="Tokens to measure on.")
@click.option("--seq-len", type=int, help="Sequence length (capped at the model's; default: the checkpoint's training "
                                         "seq-len, else convert's: 1024, demo 256).")
@click.option("--batch-size", type=int, default=8, show_default=True, help="Sequences per forward pass.")
@click.option("--device", help="cpu or cuda (default: cuda if available).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write all statistics to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Write a heatmap PNG (layers x token position).")
@measure_option("Recommend kernel settings")
@click.option("--write-plan", is_flag=True,
              help="Give the checkpoint (a local converted one) the recommended settings in place of its own: "
                   "config.json's plan and the model card; the weights stay. With --measure: planned for this GPU.")
@user_errors
def analyze(model, data, text_column, tokens, seq_len, batch_size, device, json_path, plot_path, measure_kernels,
            write_plan):
    """Per-layer gate-activation sparsity of MODEL (a converted checkpoint or an original SiLU model)."""
    for option, value, least in (("--tokens", tokens, 1), ("--seq-len", seq_len, 2), ("--batch-size", batch_size, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{option} must be at least {least}, got {value}")
    _check_device(device, "--measure" if measure_kernels else None)
    if not write_plan:  # --write-plan names a source that is no local checkpoint its own way (analyze)
        _check_before_loading(model, data)
    _quiet_loading()
    from sparsify.analyze import analyze as run
    from sparsify.report import console, layer_table, plot_activity

    result = run(model, data=data, text_column=text_column, tokens=tokens, seq_len=seq_len, batch_size=batch_size,
                 device=device, json_path=json_path, measure_kernels=measure_kernels, write_plan=write_plan)
    console.print(layer_table(result["layers"], [l["recommended"] for l in result["layers"]],
                              f"{model}: gate activity on {result['tokens']:,} tokens of {result['data']} "
                              f"(seq-len {result['seq_len']}, perplexity {result['perplexity']:.3f})"))
    if not result["converted"]:
        console.print(f"{model} is not converted (gate activation {result['activation']}): active means gate "
                      "pre-activation > 0, and no kernel setting applies; "
                      "`sparsify convert` makes a sparse ReLU model.")
    if write_plan:
        console.print(f"wrote the recommended settings into {model}/config.json and its model card")
    if plot_path:
        plot_activity(result["layers"], plot_path)
    written = [path for path in (json_path, plot_path) if path]
    if written:
        console.print(f"wrote {' and '.join(map(str, written))}")


@main.command()
@click.argument("checkpoint")
@click.option("--seq-len", type=int, default=2048, show_default=True, help="Tokens per prefill sequence.")
@click.option("--prefill-batch", multiple=True, default=("1", "8", "64"), show_default=True,
              help="Sequences in a prefill forward, of --seq-len tokens or BATCHxLENGTH (64x64: batched short "
                   "prompts); repeat the option for several rows.")
@click.option("--generate-batch", type=int, multiple=True, default=(1, 8), show_default=True,
              help="Sequences decoded together in eager generate and the CUDA-graph step (repeatable).")
@click.option("--compiled-batch", type=int, multiple=True, default=(1, 8), show_default=True,
              help="Sequences decoded together in compiled static-cache generate, the compiled CUDA-graph "
                   "step and generate_graphed (repeatable).")
@click.option("--no-compiled", is_flag=True,
              help="Skip compiled generate, the compiled step and generate_graphed (each batch size compiles "
                   "both models three times).")
@click.option("--compiled-prefill-batch", type=int, multiple=True, default=(), show_default=True,
              help="Sequences in a prefill through torch.compile (repeatable; each compiles both models).")
@click.option("--decode-tokens", type=int, default=64, show_default=True, help="New tokens per greedy generation.")
@click.option("--decode-context", type=int, default=512, show_default=True,
              help="Tokens in the KV cache at the CUDA-graph decode step.")
@click.option("--repeats", type=int, default=3, show_default=True,
              help="Timed calls per path and load at least (median); short calls repeat until 0.5 s of them.")
@click.option("--generate-repeats", type=int, default=7, show_default=True,
              help="Timed calls per load of the generate paths (host-bound: their time varies more).")
@click.option("--data", help="Text to feed the model (as for convert: its held-out blocks); without it random token "
                             "ids, which misstate a trained model's activity.")
@text_column_option
@click.option("--fp8-gate", is_flag=True,
              help="Time the TwELL load with its gate pass in fp8 (model.use_fp8_gate(): e4m3 weights and inputs, "
                   "a scale a unit and a token); the dense load stays as it is.")
@click.option("--fp8-up-down", is_flag=True,
              help="Time the TwELL load with its out pass on e4m3 up and down rows (model.use_fp8_up_down(): a scale a "
                   "unit; the larger batched calls: prefill); with --fp8-gate, both.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write all figures to this JSON file.")
@user_errors
def bench(checkpoint, seq_len, prefill_batch, generate_batch, compiled_batch, no_compiled, compiled_prefill_batch,
          decode_tokens, decode_context, repeats, generate_repeats, data, text_column, fp8_gate, fp8_up_down,
          json_path):
    """Dense vs TwELL speed of a converted CHECKPOINT on a GPU, in one process, with a logits check: decoder
    prefill, eager generate, compiled static-cache generate and one decode step replayed as a CUDA graph,
    each with a per-component GPU time breakdown."""
    _check_device(None, "sparsify bench", BENCH_ON_CPU)
    _quiet_loading()
    from sparsify.bench import bench_checkpoint, bench_table, write_json
    from sparsify.report import console

    result = bench_checkpoint(checkpoint, seq_len=seq_len, prefill_batches=prefill_batch,
                              generate_batches=generate_batch, compiled_batches=() if no_compiled else compiled_batch,
                              compiled_prefill_batches=compiled_prefill_batch,
                              decode_tokens=decode_tokens, decode_context=decode_context, repeats=repeats,
                              generate_repeats=generate_repeats, data=data, text_column=text_column, fp8_gate=fp8_gate,
                              fp8_up_down=fp8_up_down)
    result["command"] = " ".join(["sparsify", *sys.argv[1:]])
    console.print(bench_table(result))
    if json_path:
        write_json(result, json_path)


def _end_process_group() -> None:
    """This process's end of a launched run's process group (none: nothing), before it exits: left to the
    interpreter's teardown, gloo's worker threads can abort the process, which fails the whole launch."""
    from accelerate import PartialState

    PartialState().destroy_process_group()


def _is_main() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


if __name__ == "__main__":  # python -m cli, as under accelerate launch
    main(prog_name="sparsify")
