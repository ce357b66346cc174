"""The `sparsify` command end to end on tiny random models (CliRunner, CPU): convert for a few steps for
every family and reload both ways, Ctrl-C and --resume, and every bad input: a clear message, exit code
non-zero, no traceback, nothing that looks like a complete OUT."""
import copy
import dataclasses
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import time
import sys
from pathlib import Path

import accelerate
import click
import huggingface_hub.constants
import pytest
import torch
from click.testing import CliRunner
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import cli
from cli import main
from helpers import (SMALL_CHUNK_BYTES, Killed, chunked_calls, interrupt, on_read, raising, tiny_input_ids, tiny_model,
                     tiny_tokenizer, unwritable_folder)
from sparsify import convert as convert_module
from sparsify import data as data_module
from sparsify import export
from sparsify import load as load_module
from sparsify.config import RunOptions, TrainConfig
from sparsify.errors import ConfigError, DataError, OutputError
from sparsify.families import FAMILIES
from sparsify.load import load_config
from sparsify.locations import saved_state
from twell.training import head_loss as head_loss_op

# Tiny runs: 32-token sequences, 256 held-out tokens; options on the command line override the recipe.
# every setting that pretrained.yaml sets otherwise than sparsify's defaults, stated (a recipe that extends none)
RECIPE = ("seq_len: 32\nbatch_size: 2\neval_tokens: 256\nlr: 1.0e-3\nl1: '1e-3'\nsteps: 50\nlog_every: 1\n"
          "l1_relative: false\nl1_warmup_steps: 0\nswap_steps: 0\ndistill: 0\nwarmup_steps: 0\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 6}) + "\n"
                                                for i in range(60)))
    (corpus / "valid.jsonl").write_text(json.dumps({"text": "def g(y):\n    return y + 1\n" * 20}) + "\n")
    (root / "recipe.yaml").write_text(RECIPE)
    return root


def model_folder(root, family):
    folder = root / f"tiny-{family}"
    if not folder.exists():
        model, tokenizer = tiny_model(family)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def convert(files, family, out, *extra):
    return run("convert", model_folder(files, family), "-o", out, "--data", files / "corpus",
               "--recipe", files / "recipe.yaml", "--steps", 2, *extra)


def assert_user_error(result, message):
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert message in result.output, result.output


def test_help_lists_commands():
    result = run("--help")
    assert result.exit_code == 0 and "convert" in result.output and "analyze" in result.output


def test_every_training_setting_is_an_option_with_its_help():
    """convert's training options are made from TrainConfig's fields: one each, under the field's name (or its
    `flag`), with the field's help, so that the two cannot diverge."""
    options = {option.name: option for option in main.commands["convert"].params}
    for setting in dataclasses.fields(TrainConfig):
        option = options[setting.name]
        assert option.help == setting.metadata["help"], setting.name
        assert option.opts == ["--" + setting.name.replace("_", "-")], setting.name
    assert options["l1_relative"].secondary_opts == ["--l1-absolute"]
    assert options["grad_checkpointing"].secondary_opts == ["--no-grad-checkpointing"]


def test_every_run_option_is_an_option_with_its_help():
    """convert's other options are made from RunOptions' fields likewise, with the field's default."""
    options = {option.name: option for option in main.commands["convert"].params}
    for setting in dataclasses.fields(RunOptions):
        option = options[setting.name]
        assert option.help == setting.metadata["help"], setting.name
        assert option.required == (setting.default is dataclasses.MISSING), setting.name
        assert option.required or option.default == setting.default, setting.name
    assert options["out"].opts == ["-o", "--out"] and options["quiet"].opts == ["-q", "--quiet"]
    assert options["resume"].is_flag and not options["resume"].secondary_opts
    assert (options["measure_kernels"].opts == ["--measure"]
            and options["measure_kernels"].secondary_opts == ["--no-measure"])


def help_sections(command) -> dict[str, list[list[str]]]:
    """Per section title of `command`'s --help, in order, the option names of each of its rows."""
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0, result.output
    sections = {}
    for line in result.output.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            rows = sections[line[:-1]] = []
        elif line.startswith("  -"):  # a row (its help's further lines are indented deeper)
            option = re.split(r"\s{2,}", line.strip())[0]  # "-o, --out DIRECTORY", "--resume", "--a / --no-a"
            rows.append([word for word in option.replace(",", " ").split() if word.startswith("-")])
    return sections


def test_convert_help_lists_every_option_once_in_sections_most_used_first():
    command = main.commands["convert"]
    sections = help_sections(command)
    assert list(sections) == ["Input and output", "Run", "Recipe and training budget", "Main training settings",
                              "Advanced settings"]
    options = [[*param.opts, *param.secondary_opts] for param in command.get_params(click.Context(command))
               if isinstance(param, click.Option)]
    assert sorted(row for rows in sections.values() for row in rows) == sorted(options)
    assert sections["Input and output"][:2] == [["-o", "--out"], ["--data"]]
    assert {"--device", "--resume", "--dry-run"} <= {name for row in sections["Run"] for name in row}
    assert sections["Recipe and training budget"] == [["--recipe"], ["--steps"], ["--tokens"], ["--passes"]]


def test_a_setting_added_without_a_section_is_listed_under_the_advanced_settings():
    @dataclasses.dataclass
    class Extended(TrainConfig):
        added_setting: int = dataclasses.field(default=0, metadata={"help": "A setting given no section."})

    added = cli._option(dataclasses.fields(Extended)[-1], int, recipe=True)  # a decorator, as convert's options
    command = copy.copy(main.commands["convert"])
    command.params = [*command.params, *click.command()(added(lambda **values: None)).params]
    assert ["--added-setting"] in help_sections(command)["Advanced settings"]


def test_convert_help_shows_the_training_defaults_without_importing_torch():
    """--help shows the value each training option takes when not given (the default recipe's, and the demo's
    where it differs) and stays fast: neither the command nor its help imports torch."""
    code = ("import sys\nfrom click.testing import CliRunner\nfrom cli import main\n"
            "print(CliRunner().invoke(main, ['convert', '--help']).output)\nassert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    text = " ".join(done.stdout.split())
    assert "--seq-len INTEGER Tokens per training sequence (packed blocks). [default: (1024; demo: 256)]" in text
    assert "--betas <FLOAT FLOAT>... AdamW betas. [default: (0.9 0.95)]" in text
    assert "[default: (one optimizer step's tokens)]" in text and "None" not in text  # a default of None, named
    assert "[default: (--l1-relative; demo: --l1-absolute)]" in text and "(True" not in text  # a switch by its flag
    assert text.count("[default: (") == len(dataclasses.fields(TrainConfig))
    # --measure's help and the usage guide name the cost model's fitted shapes, which the CLI does not import
    from twell.cost_model import FITTED_MIN_HIDDEN, FITTED_MIN_INTERMEDIATE
    shapes = f"(hidden size {FITTED_MIN_HIDDEN}, {FITTED_MIN_INTERMEDIATE} units)"
    assert shapes in text and shapes in " ".join((Path(__file__).parents[1] / "docs/usage.md").read_text().split())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_convert_every_family_and_reload_both_ways(files, family, tmp_path, monkeypatch):
    from accelerate import PartialState

    out = tmp_path / "out"
    ended = []  # a launched process ends its process group before it exits (here, one process: none to end)
    monkeypatch.setattr(PartialState, "destroy_process_group", lambda self, group=None: ended.append(group))
    result = convert(files, family, out)
    assert result.exit_code == 0, result.output
    assert ended == [None]
    assert "after training" in result.output and "setting" in result.output
    # the tiny layers are too narrow for the cost model: the table says why they are dense, then what to do next
    assert "; dense everywhere: D 64 / I 160 is narrower than the cost model's shapes" in result.output
    assert f"next: `sparsify analyze {out} --data TEXT` measures it on other text; " in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["twell"]["training"]["steps"] == 2 and config["twell"]["training"]["tokens"] == 2 * 2 * 32
    assert len(config["twell"]["layers"]) == 2
    log = json.loads((out / "training_log.json").read_text())
    assert [e["step"] for e in log["log"]] == [1, 2] and (out / "sparsity.png").stat().st_size > 0
    assert not (tmp_path / "out.resume").exists()
    ids = tiny_input_ids()
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()(ids).logits
    torch.testing.assert_close(remote, plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())


def test_checkpoint_is_readable_and_held_out_text_is_named(files, tmp_path):
    out = tmp_path / "out"
    result = convert(files, "llama", out, "--eval-tokens", 64)
    assert result.exit_code == 0, result.output
    assert f"held out: 64 tokens of {files / 'corpus' / 'valid.jsonl'}" in " ".join(result.output.split())
    # few held-out tokens, but the number given: the only warning is that two steps end far from sparse
    assert [w.split(" sparse ")[1][:20] for w in " ".join(result.output.split()).split("warning: ")[1:]] == [
        "on the held-out text"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not the staging folder's 0700
    for path in out.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o777 if path.is_dir() else 0o666) & ~umask, path


@pytest.mark.parametrize("recipe,lr,warned", [(None, None, True), ("small-budget", None, True),
                                               ("small-budget", "1e-4", False)])
def test_a_bundled_recipes_lr_on_another_source_warns(files, tmp_path, monkeypatch, recipe, lr, warned):
    """The pretrained and small-budget recipes' lr is their 120M test bases' choice: without --lr a conversion of
    another source says so (the demo's own recipe, or a recipe file of the user's, does not)."""
    monkeypatch.setattr(convert_module, "load_model", None)  # no weight is read
    options = ["--recipe", recipe] * (recipe is not None) + ["--lr", lr] * (lr is not None)
    output = run("convert", model_folder(files, "llama"), "-o", tmp_path / "out", "--data", files / "corpus",
                 "--steps", 2, "--dry-run", *options).output
    name = recipe or "pretrained"
    assert (f"--lr not given: the {name} recipe's" in " ".join(output.split())) is warned, output


def test_dry_run_prints_the_resolved_settings_and_stops(files, tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "load_model", None)  # no weight is read
    result = convert(files, "llama", tmp_path / "out", "--dry-run", "--lr", "3e-4", "--swap-steps", "20%")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "lr=0.0003" in text and "swap_steps=20%" in text and "seq_len=32" in text  # command line over recipe
    assert re.search(r"parameters; 2 steps of 64 tokens \(128 tokens\) on 1 process; training state \d+ MiB", text)
    assert re.search(r"held out: [\d,]+ tokens of", text)  # read as the run would
    assert "never reaches its set value" not in text and "stops at its" not in text
    assert text.endswith("dry run: the checks passed; no weight was read and nothing was written")
    assert not (tmp_path / "out").exists()
    output = convert(files, "llama", tmp_path / "out", "--dry-run", "--tokens", 1000).output
    assert ("warning: --tokens 1,000: the run stops at its 2 steps first, after 128 tokens "
            "(--steps 16 trains on all of them)\n" in output)
    # --steps alone ends the run before a recipe's tokens by choice: no warning about tokens never asked for
    (tmp_path / "tokens.yaml").write_text(RECIPE.replace("steps: 50", "tokens: 100_000"))
    output = run("convert", model_folder(files, "llama"), "-o", tmp_path / "out", "--data", files / "corpus",
                 "--recipe", tmp_path / "tokens.yaml", "--steps", 2, "--dry-run").output
    assert "2 steps of 64 tokens" in output and "stops at its" not in output, output
    output = convert(files, "llama", tmp_path / "out", "--dry-run", "--l1-warmup-steps", 5, "--warmup-steps", 2).output
    # outside a terminal each warning is one whole line (a log file), however long
    assert ("warning: --l1-warmup-steps 5 is not below the run's 2 steps: the L1 weight never reaches its set value "
            "(a share of the run, such as --l1-warmup-steps 12.5%, scales with it)\n" in output)
    assert ("warning: --warmup-steps 2 is not below the run's 2 steps: the learning rate never reaches its set value "
            "(fewer steps, such as --warmup-steps 0)\n" in output)
    # each warning's suggestion is a value its option takes (--warmup-steps takes no share of the run)
    for suggested in re.findall(r"such as (--\S+ \S+)\)", output):
        result = convert(files, "llama", tmp_path / "out", "--dry-run", *suggested.split())
        assert result.exit_code == 0 and "never reaches its set value" not in result.output, result.output


def test_defaults_fit_the_model_and_the_data(files, tmp_path, monkeypatch):
    """A recipe's seq-len beyond the model's positions is lowered to them, said once (one given on the command line
    stops, as above); a run longer than the text says how many passes it makes over it."""
    monkeypatch.setattr(convert_module, "load_model", None)
    (tmp_path / "long.yaml").write_text(RECIPE.replace("seq_len: 32", "seq_len: 512"))
    result = run("convert", model_folder(files, "llama"), "-o", tmp_path / "out", "--data", files / "corpus",
                 "--recipe", tmp_path / "long.yaml", "--steps", 2, "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output.count("seq-len 512 (the recipe's) is beyond the 128 positions of") == 1
    assert "seq_len=128" in result.output and "2 steps of 256 tokens" in result.output
    result = convert(files, "llama", tmp_path / "out", "--dry-run", "--steps", 1000)  # 64,000 tokens
    assert result.exit_code == 0, result.output
    warning = re.search(r"warning: the training text holds ([\d,]+) tokens and the run trains on 64,000: "
                        r"([\d.]+) passes over it", result.output)
    assert warning and float(warning[2]) == pytest.approx(64_000 / int(warning[1].replace(",", "")), abs=0.05)


def training_text_tokens(corpus, seq_len):
    """The tokens of a folder's train.jsonl in whole blocks of `seq_len`, counted by hand: the tiny tokenizer makes a
    token of each byte (the texts are ASCII) and an EOS after each document."""
    return sum(len(json.loads(line)["text"]) + 1 for line in open(corpus / "train.jsonl")) // seq_len * seq_len


def test_passes_replace_the_recipes_tokens_and_the_dry_run_says_them(files, tmp_path, monkeypatch):
    """--passes N sets the run's tokens to N times the training text's, counted (the held-out file apart), in place of
    the recipe's tokens; the dry run says what it resolved to and makes no passes warning of its own. With --steps
    the first to end stops the run."""
    monkeypatch.setattr(convert_module, "load_model", None)
    text_tokens = training_text_tokens(files / "corpus", 128)  # pretrained.yaml's seq-len fitted to the positions
    result = run("convert", model_folder(files, "llama"), "-o", tmp_path / "out", "--data", files / "corpus",
                 "--recipe", "pretrained", "--passes", 2, "--dry-run")
    assert result.exit_code == 0, result.output
    said = f"--passes 2: 2 x {text_tokens:,} tokens of the training text = {2 * text_tokens:,} tokens\n"
    assert said in result.output
    steps = -(-2 * text_tokens // (128 * 16))
    assert f"tokens={2 * text_tokens:,}  passes=2  " in result.output and "100,000,000" not in result.output
    assert f"{steps:,} steps of 2,048 tokens ({steps * 2048:,} tokens)" in result.output
    assert "passes over it" not in result.output
    text_tokens = training_text_tokens(files / "corpus", 32)
    result = convert(files, "llama", tmp_path / "out", "--dry-run", "--passes", 1.5)  # the recipe's 32 x 2, 2 steps
    assert result.exit_code == 0, result.output
    tokens = round(1.5 * text_tokens)
    assert f"--passes 1.5: 1.5 x {text_tokens:,} tokens of the training text = {tokens:,} tokens\n" in result.output
    assert (f"warning: --passes 1.5 ({tokens:,} tokens): the run stops at its 2 steps first, after 128 tokens "
            f"(--steps {-(-tokens // 64)} trains on all of them)\n" in result.output)


def test_passes_need_local_text(files, tmp_path):
    result = run("convert", model_folder(files, "llama"), "-o", tmp_path / "out", "--data", "someone/dataset",
                 "--recipe", files / "recipe.yaml", "--passes", 2)
    assert_user_error(result, "--passes counts the training text, and --data someone/dataset is a `datasets` name, "
                              "streamed rather than counted: it needs local text; give --tokens instead")


def test_a_passes_run_trains_that_many_tokens_and_resumes(files, tmp_path, monkeypatch):
    """A run of --passes 1.5 over a small text (counted exactly) trains 1.5 times its tokens, records them, and
    resumes with the same --passes (the text counted again to the same tokens); other passes stop the resume."""
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 2}) + "\n"
                                                for i in range(4)))
    shutil.copy(files / "corpus" / "valid.jsonl", corpus)
    text_tokens = training_text_tokens(corpus, 32)
    tokens = round(1.5 * text_tokens)
    steps = -(-tokens // 64)  # the recipe's 32 x 2 tokens a step
    command = ["convert", model_folder(files, "llama"), "-o", out, "--data", corpus, "--recipe", files / "recipe.yaml"]
    real = data_module.TrainingBatches.__next__
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", on_read(real, 1, interrupt))
    assert_user_error(run(*command, "--passes", 1.5), f"interrupted at step 2 of {steps}")
    saved = json.loads((tmp_path / "out.resume" / "state.json").read_text())["config"]
    assert (saved["passes"], saved["tokens"]) == (1.5, tokens)
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", real)
    assert_user_error(run(*command, "--passes", 2, "--resume"),
                      f"other training settings (--tokens {tokens} -> {2 * text_tokens}; --passes 1.5 -> 2.0)")
    result = run(*command, "--passes", 1.5, "--resume")
    assert result.exit_code == 0, result.output
    assert f"--passes 1.5: 1.5 x {text_tokens:,} tokens of the training text = {tokens:,} tokens\n" in result.output
    assert f"resuming from step 2 of {steps}" in result.output and "passes over it" not in result.output
    training = json.loads((out / "config.json").read_text())["twell"]["training"]
    assert (training["passes"], training["max_tokens"], training["steps"], training["tokens"]) == (
        1.5, tokens, steps, steps * 64)


def test_dry_run_names_a_cut_weight_file(files, tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "load_model", None)
    source = shutil.copytree(model_folder(files, "llama"), tmp_path / "cut")
    size = (source / "model.safetensors").stat().st_size
    os.truncate(source / "model.safetensors", size - 1)
    result = run("convert", source, "-o", tmp_path / "out", "--data", files / "corpus", "--recipe",
                 files / "recipe.yaml", "--steps", 2, "--dry-run")
    assert_user_error(result, f"model.safetensors: truncated ({size - 1:,} of {size:,} bytes; download it again)")


def test_missing_data_is_said_before_torch_is_imported(files, tmp_path):
    """Without --data, or with a --data path that is not there, a supported source is told so at once, before torch
    is imported: a folder, or a Hub id whose config.json is in the local cache (the Hub is not asked). Any other
    source names its own problem first: an unsupported one (test_bad_input), or a Hub id whose config is not
    cached."""
    snapshot = tmp_path / "hub" / "models--someone--tiny-llama" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    shutil.copy(model_folder(files, "llama") / "config.json", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    missing, out = str(tmp_path / "missing"), str(tmp_path / "out")
    code = ("import sys\nfrom click.testing import CliRunner\nfrom cli import main\n"
            f"for source in ({str(model_folder(files, 'llama'))!r}, 'someone/tiny-llama'):\n"
            f"    for data in ([], ['--data', {missing!r}]):\n"
            f"        print(CliRunner().invoke(main, ['convert', source, '-o', {out!r}, *data]).output)\n"
            f"print(CliRunner().invoke(main, ['sample', source, '-o', {out!r}, '--tokens', '64',\n"
            f"                               '--data', {missing!r}]).output)\n"
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub")}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("error: --data is required") == 2, done.stdout
    assert done.stdout.count(f"error: data path {missing} does not exist") == 3, done.stdout
    assert_user_error(run("convert", "someone/not-cached", "-o", tmp_path / "out"),
                      "someone/not-cached: not a local folder, and offline (HF_HUB_OFFLINE=1) the Hugging Face "
                      "cache holds no copy of it")


def test_a_dataset_offline_that_the_cache_lacks_is_said_before_torch_is_imported(files, tmp_path):
    """Offline, a --data that names no local path and no dataset in datasets' cache (here a mistyped folder) stops
    each command at once, saying how to get the text."""
    source, out = str(model_folder(files, "llama")), str(tmp_path / "out")
    commands = [["convert", source, "-o", out], ["sample", source, "-o", out, "--tokens", "64"], ["analyze", source]]
    shown = said_before_torch(f"for command in {commands!r}:\n"
                              "    print(CliRunner().invoke(main, [*command, '--data', 'corpus']).output)",
                              HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    message = ("error: --data corpus: no local file or folder of that name, and offline (HF_HUB_OFFLINE=1) the "
               "datasets cache holds no copy of it: download the dataset first (`hf download corpus --repo-type "
               "dataset --local-dir DIR`) and give --data DIR, or give --data a local file or folder\n")
    assert shown.count(message) == 3, shown


def test_a_dataset_offline_that_the_cache_holds_passes_the_check(monkeypatch):
    """Offline, a dataset that datasets finds in its cache (its own lookup, here a stand-in) is left to it."""
    import datasets

    from sparsify import locations

    looked_up = []
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets, "load_dataset_builder", lambda name, config: looked_up.append((name, config)))
    locations.check_hub_dataset("someone/cached:en@validation")
    assert looked_up == [("someone/cached", "en")]


def test_bad_settings_are_said_before_torch_is_imported(files, tmp_path):
    """A setting impossible for any model fails at once, before torch is imported, named by its option, and so does
    a --seq-len beyond the positions of a supported source whose config.json is at hand."""
    command = ["convert", str(model_folder(files, "llama")), "-o", str(tmp_path / "out"), "--data",
               str(files / "corpus")]
    code = ("import sys\nfrom click.testing import CliRunner\nfrom cli import main\n"
            "for bad in (['--tokens', '-5'], ['--target-sparsity', '1.5'], ['--lr', '-1'], ['--seq-len', '0'],\n"
            "            ['--seq-len', '4096'], ['--passes', '0'], ['--passes', '-1'], ['--passes', '2', '--tokens', "
            "'1000']):\n"
            f"    print(CliRunner().invoke(main, {command!r} + bad).output)\n"
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for message in ("error: --tokens must be a positive integer, got -5\n",
                    "error: --target-sparsity must be in [0, 1) (a share of units, such as 0.99; 0: off), got 1.5\n",
                    "error: --lr must be in (0, 1], got -1.0\n",
                    "error: --seq-len must be a positive integer, got 0\n",
                    "error: --seq-len 4096 is beyond the model's maximum of 128 positions\n",
                    "error: --passes must be a number above 0 (passes over the training text, such as 2 or 1.5), got "
                    "0\n",
                    "error: --passes must be a number above 0 (passes over the training text, such as 2 or 1.5), got "
                    "-1\n",
                    "error: --passes 2 and --tokens 1000 both set the training tokens (on the command line or in one "
                    "recipe): give one (--passes N trains on N times the training text's tokens)\n"):
        assert message in done.stdout, done.stdout
    assert not (tmp_path / "out").exists()


def said_before_torch(code: str, **env) -> str:
    """What `code` (after importing the CLI's main) prints in a fresh interpreter, which must not import torch."""
    code = "import sys\nfrom click.testing import CliRunner\nfrom cli import main\n" + code + \
        "\nassert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_device_errors_are_said_before_torch_is_imported(files, tmp_path):
    """A --device that torch would not take, or a CUDA one where the installed torch is a CPU build (its version's
    local tag; here a stand-in's metadata, found first), fails at once in each command that takes one; so do
    --measure and `sparsify bench`, which need a GPU, on a CPU build or another device."""
    build = tmp_path / "cpu-build"
    (build / "torch-2.13.0+cpu.dist-info").mkdir(parents=True)
    (build / "torch-2.13.0+cpu.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\n"
                                                                  "Version: 2.13.0+cpu\n")
    source, out = str(model_folder(files, "llama")), str(tmp_path / "out")
    commands = [["convert", source, "-o", out, "--data", str(files / "corpus")],
                ["sample", source, "-o", out, "--tokens", "64"], ["analyze", source]]
    shown = said_before_torch(f"for device in ('gpu', 'cuda:01', 'cuda:1'):\n    for command in {commands!r}:\n"
                              "        print(CliRunner().invoke(main, [*command, '--device', device]).output)",
                              PYTHONPATH=os.pathsep.join(filter(None, (str(build), os.environ.get("PYTHONPATH")))))
    assert shown.count("error: --device gpu: not a device (use cpu, cuda or cuda:N)\n") == 3, shown
    assert shown.count("error: --device cuda:01: not a device (use cpu, cuda or cuda:N)\n") == 3, shown
    assert shown.count("error: --device cuda:1: no CUDA GPU here (a CPU build of torch); use --device cpu or leave it "
                       "out\n") == 3, shown
    needs_gpu = [["convert", source, "-o", out, "--data", str(files / "corpus"), "--measure"],
                 ["analyze", source, "--measure"], ["bench", out]]
    shown = said_before_torch(f"for command in {needs_gpu!r}:\n    print(CliRunner().invoke(main, command).output)\n"
                              f"print(CliRunner().invoke(main, {needs_gpu[0]!r} + ['--device', 'cpu']).output)",
                              PYTHONPATH=os.pathsep.join(filter(None, (str(build), os.environ.get("PYTHONPATH")))))
    assert shown.count("error: --measure needs a CUDA GPU, and torch (2.13.0+cpu, a CPU build) sees none\n") == 2, shown
    assert ("error: sparsify bench needs a CUDA GPU, and torch (2.13.0+cpu, a CPU build) sees none (a CPU runs every "
            "layer dense: `sparsify analyze CHECKPOINT --data TEXT` measures its sparsity there)\n") in shown
    assert "error: --measure needs a CUDA GPU, not --device cpu\n" in shown


def test_the_device_check_before_torch_takes_what_torch_takes(monkeypatch):
    """The CLI's --device check refuses what load.check_device (torch.device) refuses as no device, in its words,
    and takes the rest; its device types are those that torch lists."""
    with pytest.raises(RuntimeError) as refused:
        torch.device("gpu")
    assert set(re.search(r"Expected one of (.*) device type", str(refused.value))[1].split(", ")) == cli.DEVICE_TYPES

    def refusal(check, device) -> str | None:
        try:
            check(device)
        except ConfigError as error:
            return str(error)
        return None

    monkeypatch.setattr(cli, "_cpu_build_of_torch", lambda: False)  # the syntax alone
    for device in ("cpu", "cpu:0", "cuda", "cuda:0", "cuda:12", "mps", "xpu:1", "meta", "gpu", "CUDA", "cuda:01",
                   "cuda:-1", "cuda:", "cuda:a", " cuda", "cuda:0:1", "tpu:x", ""):
        late = refusal(load_module.check_device, device)  # its other refusals (no GPU, too few) wait for torch
        assert refusal(cli._check_device, device) == (late if late and "not a device" in late else None), device


def test_a_cpu_build_of_torch_is_told_by_its_version_tag(monkeypatch):
    for installed, cpu in (("2.13.0+cpu", True), ("2.1.0+cpu.cxx11.abi", True), ("2.13.0", False),
                           ("2.13.0+cu128", False), ("2.5.1+rocm6.2", False)):
        monkeypatch.setattr(cli, "version", lambda name: installed)
        assert cli._cpu_build_of_torch() == cpu, installed


def test_an_unknown_tracker_or_one_not_installed_is_said_before_torch_is_imported(files, tmp_path):
    command = ["convert", str(model_folder(files, "llama")), "-o", str(tmp_path / "out"), "--data",
               str(files / "corpus"), "--report-to"]
    shown = said_before_torch("sys.modules['tensorboard'] = sys.modules['tensorboardX'] = None  # not installed\n"
                              f"print(CliRunner().invoke(main, {command!r} + ['none,tensorboard']).output)\n"
                              f"print(CliRunner().invoke(main, {command!r} + ['wandbb']).output)")
    assert "error: --report-to tensorboard: the tensorboard package is not installed (pip install tensorboard)\n" \
        in shown, shown
    assert ("error: --report-to wandbb: not a tracker; use none, or one or more of all, tensorboard, aim, comet_ml, "
            "mlflow, wandb, clearml, dvclive, swanlab, trackio separated by commas\n") in shown, shown


def test_the_trackers_known_before_torch_are_accelerates():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    assert set(cli.TRACKER_PACKAGES) == set(LOGGER_TYPE_TO_CLASS)


def test_resume_without_a_state_is_said_before_torch_is_imported(files, tmp_path):
    """--resume where OUT.resume/ holds no state to continue stops at once, in the words of the library's check, which
    names what a save killed before it was whole left; a whole one left in the staging folder is continued
    (test_a_save_killed_before_its_rename_resumes)."""
    command = ["convert", str(model_folder(files, "llama")), "-o", str(tmp_path / "out"), "--data",
               str(files / "corpus"), "--resume"]
    shown = said_before_torch(f"print(CliRunner().invoke(main, {command!r}).output)\n"
                              f"import os\nos.mkdir({str(tmp_path / 'out.resume.tmp')!r})\n"
                              f"print(CliRunner().invoke(main, {command!r}).output)")
    said = f"error: --resume: no saved training state in {tmp_path / 'out.resume'}"
    assert f"{said}\n" in shown and f"{said} ({tmp_path / 'out.resume.tmp'} holds a save that was killed" in shown


def test_the_state_to_resume_is_a_whole_save_or_a_killed_one_that_was_whole(tmp_path):
    resume_dir, staging = tmp_path / "out.resume", tmp_path / "out.resume.tmp"
    assert saved_state(resume_dir) is None
    staging.mkdir()  # a save killed before it was whole
    assert saved_state(resume_dir) is None
    resume_dir.mkdir()
    (resume_dir / "state.json").write_text("{}")
    assert saved_state(resume_dir) == resume_dir
    (staging / "state.json").write_text("{}")  # whole, killed before it replaced the older one
    assert saved_state(resume_dir) == staging


def no_hub_login(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # online: a login is what is missing
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def test_push_to_hub_without_a_login_stops_before_any_weight_is_read(files, tmp_path, monkeypatch):
    no_hub_login(monkeypatch, tmp_path)
    monkeypatch.setattr(convert_module, "load_model", None)
    message = ("--push-to-hub me/tiny-sparse: not logged in to the Hub: run `hf auth login`, or set HF_TOKEN to a "
               "token with write access")
    for dry_run in ((), ("--dry-run",)):
        assert_user_error(convert(files, "llama", tmp_path / "out", "--push-to-hub", "me/tiny-sparse", *dry_run),
                          message)
    options = RunOptions(tmp_path / "out", data=str(files / "corpus"), push_to_hub="me/tiny-sparse")
    with pytest.raises(OutputError, match=re.escape(message)):  # convert's own checks, for a caller of its API
        convert_module._check_inputs(str(model_folder(files, "llama")), TrainConfig(steps=2), options, 1, False)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    result = convert(files, "llama", tmp_path / "out", "--push-to-hub", "me/tiny-sparse", "--dry-run")
    assert result.exit_code == 0, result.output


def test_push_to_hub_offline_stops_before_any_weight_is_read(files, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(convert_module, "load_model", None)
    for dry_run in ((), ("--dry-run",)):
        assert_user_error(convert(files, "llama", tmp_path / "out", "--push-to-hub", "me/tiny-sparse", *dry_run),
                          "--push-to-hub me/tiny-sparse: offline (HF_HUB_OFFLINE=1) nothing can be uploaded")
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_of_another_model_stops_before_training(files, tmp_path, monkeypatch):
    folder = tmp_path / "small-vocab"
    tiny_model("llama", vocab_size=200, bos_token_id=1, eos_token_id=2, pad_token_id=3)[0].save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)  # ids up to 258
    for extra in ((), ("--dry-run",), ("--passes", "1")):
        result = run("convert", folder, "-o", tmp_path / "out", "--data", files / "corpus", "--recipe",
                     files / "recipe.yaml", *extra)
        assert_user_error(result, "the tokenizer does not fit the model")
        monkeypatch.setattr(convert_module, "load_model", None)  # the dry run and --passes read no weight
    assert not (tmp_path / "out").exists()


def test_the_source_config_is_read_once(files, tmp_path, monkeypatch):
    """Fitting the seq-len and checking the settings read the source's config once (a Hub source: one request)."""
    reads = []
    monkeypatch.setattr(convert_module, "load_config", lambda source: reads.append(source) or load_config(source))
    result = convert(files, "llama", tmp_path / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert len(reads) == 1


@pytest.mark.parametrize("passes, asked_for", [
    ((), ["config", "weights", "tokenizer"]),
    (("--passes", 1), ["config", "tokenizer", "weights"]),  # the tokenizer that counted the text is the run's
], ids=["tokens", "passes"])
def test_a_hub_source_is_asked_for_once(files, tmp_path, monkeypatch, passes, asked_for):
    """A conversion of a Hub id asks the Hub for its config once: the checks' is the one loaded with the weights;
    and for its tokenizer once, also where --passes counted the text with it before the weights.
    (The Hub here: the tiny model's folder behind an id, each thing asked of it noted.)"""
    folder, repo_id, asked = model_folder(files, "llama"), "someone/tiny-llama", []

    def served(read, what):
        def from_pretrained(where, *args, **kwargs):
            if where == repo_id:
                asked.append(what)
                where = folder
            return read(where, *args, **kwargs)
        return from_pretrained

    monkeypatch.setattr(load_module, "check_hub_source", lambda where, source: asked.append("check"))
    for what, auto in (("config", load_module.AutoConfig), ("weights", load_module.AutoModelForCausalLM),
                       ("tokenizer", load_module.AutoTokenizer)):
        monkeypatch.setattr(auto, "from_pretrained", served(auto.from_pretrained, what))
    result = run("convert", repo_id, "-o", tmp_path / "out", "--data", files / "corpus", "--recipe",
                 files / "recipe.yaml", "--steps", 2, *passes)
    assert result.exit_code == 0, result.output
    assert asked == ["check", *asked_for]


def test_the_launch_is_read_once(files, tmp_path, monkeypatch):
    """The FSDP launch settings are read once, by the checks, also where a process that is not the main one loads
    the source (and asks whether it must read the weights)."""
    reads = []
    monkeypatch.setattr(convert_module, "fsdp_launch", lambda: reads.append(None) or (False, False))
    source, options = str(model_folder(files, "llama")), RunOptions(tmp_path / "out", data=str(files / "corpus"),
                                                                    device="cpu", quiet=True)
    checked = convert_module._check_inputs(source, TrainConfig(steps=2, seq_len=32), options, 2, False)
    not_main = dataclasses.make_dataclass("Launch", [("is_main_process", bool), ("num_processes", int)])(False, 2)
    convert_module._load_source(source, checked.config, options, checked, not_main)
    assert len(reads) == 1


def test_dry_run_fails_where_the_run_would(files, tmp_path, monkeypatch):
    """Everything that would stop a run before its first step stops the dry run, no weight read."""
    monkeypatch.setattr(convert_module, "load_model", None)
    (tmp_path / "afile").write_text("")
    for extra, message in ((["-o", tmp_path / "afile" / "out"], "afile is a file"),
                           (["--report-to", "nosuch"], "nosuch"),
                           (["--swap-steps", 2], "--swap-steps 2 must be below the 2 training steps"),
                           (["--seq-len", 4096], "--seq-len 4096 is beyond the model's maximum of"),
                           (["--data", tmp_path / "nowhere.jsonl"], "nowhere.jsonl does not exist")):
        assert_user_error(convert(files, "llama", tmp_path / "out", "--dry-run", *extra), message)


@pytest.mark.parametrize("flag,expected", [([], None), (["--measure"], True), (["--no-measure"], False)])
def test_measure_flag_reaches_convert_unset_by_default(files, tmp_path, monkeypatch, flag, expected):
    """Unset, convert decides (it times the kernels on a GPU where the cost model does not reach)."""
    seen = {}

    def run(source, config, options, **kwargs):
        seen.update(vars(options))
        raise SystemExit(0)

    monkeypatch.setattr(convert_module, "convert", run)
    monkeypatch.setattr(cli, "_cpu_build_of_torch", lambda: False)  # --measure on a CPU build stops before convert
    convert(files, "llama", tmp_path / "out", *flag)
    assert seen["measure_kernels"] is expected


def test_convert_refuses_to_replace_its_source_or_data(files, tmp_path):
    source = tmp_path / "model"
    shutil.copytree(model_folder(files, "llama"), source)
    for out in (source, tmp_path):
        assert_user_error(run("convert", source, "-o", out, "--data", files / "corpus", "--steps", 1, "--overwrite"),
                          "the output would replace the source model")
    assert (source / "config.json").is_file()
    corpus = tmp_path / "work" / "corpus"  # --overwrite would delete the text it trains on
    shutil.copytree(files / "corpus", corpus)
    assert_user_error(run("convert", source, "-o", tmp_path / "work", "--data", corpus, "--steps", 1, "--overwrite"),
                      "the output would replace the data")
    assert any(corpus.iterdir())


def test_device_and_out_of_memory_errors_are_one_line(files, tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        assert_user_error(convert(files, "llama", tmp_path / "out", "--device", "cuda"),
                          "--device cuda: no CUDA GPU here")
    assert_user_error(convert(files, "llama", tmp_path / "out", "--device", "tpu:x"), "--device tpu:x: not a device")

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(convert_module, "train", out_of_memory)
    assert_user_error(convert(files, "llama", tmp_path / "out", "--batch-size", 3),
                      "out of GPU memory training 3 x 32 tokens a micro-batch: lower --batch-size")
    assert not (tmp_path / "out").exists()


def two_processes(files, out, *args, env=None):
    """`sparsify convert` of the tiny Llama under torchrun, 2 CPU processes of batch 2, through tests/chunked_cli.py
    (the LM head in chunks of 5 tokens; `env` may hold its SPARSIFY_TEST_SIGNAL)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               Path(__file__).parent / "chunked_cli.py", "convert", model_folder(files, "llama"), "-o", out,
               "--data", files / "corpus", "--recipe", files / "recipe.yaml", "--batch-size", "2", *args]
    return subprocess.run([str(c) for c in command], cwd=Path(__file__).parents[1], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def test_two_processes_calibrate_and_train_like_one_with_both_batches(files, tmp_path, monkeypatch):
    # torchrun (what `accelerate launch` starts) with 2 CPU processes of batch 2 == 1 process of batch 4:
    # calibration fits layer l on process l % 2 (the log penalty's eps too) and shares the fits; then rank r reads
    # batches r, r+2, ...; DDP averages the two ranks' gradients. Both runs take the LM head and loss in chunks of 5
    # tokens (tests/chunked_cli.py), through DDP's wrapper in the two processes.
    calibration = ["--calibrate-steps", "3", "--calibrate-tokens", "512", "--calibrate-sparsity", "0.5",
                   "--l1-log-scale", "0.2", "--swap-steps", "0"]
    done = two_processes(files, tmp_path / "two", "--steps", "2", *calibration)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calibrated layer 1 (layers 0-1, process 1)" in done.stderr
    assert chunked_calls(done.stdout) == [2, 2]  # a micro-batch a step on each process
    monkeypatch.setattr(head_loss_op, "CHUNK_BYTES", SMALL_CHUNK_BYTES)
    assert convert(files, "llama", tmp_path / "one", "--batch-size", "4", *calibration).exit_code == 0
    two, one = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    for name in one:  # within rounding: torchrun runs a thread a process, and Adam's normalized steps carry it
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5, msg=name)
    records = [json.loads((tmp_path / run / "config.json").read_text())["twell"]["training"] for run in ("two", "one")]
    assert records[0]["tokens"] == 2 * 2 * 2 * 32
    two_fits, one_fits = (record["calibration"] for record in records)
    assert len(one_fits["layers"]) == 2 and all(one_fits["l1_eps"])
    for key in ("l1_eps", "l1_reference"):
        assert two_fits[key] == pytest.approx(one_fits[key], rel=1e-5)
    for two_layer, one_layer in zip(two_fits["layers"], one_fits["layers"]):
        assert two_layer == pytest.approx(one_layer, rel=1e-4)


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_in_training_then_after_it_each_resumes(files, tmp_path):
    """A job scheduler's SIGTERM under two torchrun processes. To the second alone while it reads its batch of step
    2: both stop after step 2 (they agree at each step's end) once the state is saved (a collective), with
    SIGTERM's status (128 + 15; the launcher may end the main process by its own SIGTERM once the other has exited).
    Resumed, to the main process alone as it starts measuring: with two processes nothing can be saved then, and the
    state of the last step, saved as training ended, stands. Resumed again: the uninterrupted run's weights."""
    def three_steps(out, *extra, signal_at=None):
        env = {"SPARSIFY_TEST_SIGNAL": f"{signal_at}:SIGTERM"} if signal_at is not None else {}
        done = two_processes(files, out, "--steps", "3", *extra, env=env)
        return done, set(re.findall(r"exitcode\s*:\s*(-?\d+)", done.stderr))  # torchrun's report of each process

    out, resume = tmp_path / "out", tmp_path / "out.resume"
    stopped, statuses = three_steps(out, signal_at="1:1")
    output = " ".join((stopped.stdout + stopped.stderr).split())
    assert stopped.returncode != 0 and "interrupted at step 2 of 3" in output, output[-3000:]
    assert "143" in statuses and statuses <= {"143", "-15"}, output[-3000:]
    assert json.loads((resume / "state.json").read_text())["step"] == 2 and not out.exists()

    stopped, statuses = three_steps(out, "--resume", signal_at="0:measure")
    output = " ".join((stopped.stdout + stopped.stderr).split())
    assert stopped.returncode != 0 and "143" in statuses, output[-3000:]
    assert f"the training state of step 3 of 3 is saved in {resume}" in output, output[-3000:]
    assert chunked_calls(stopped.stdout) and set(chunked_calls(stopped.stdout)) == {1}  # each process that got to
    # exit trained step 3 alone (the launcher may have ended the other)
    assert json.loads((resume / "state.json").read_text())["step"] == 3 and not out.exists()

    resumed, _ = three_steps(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert chunked_calls(resumed.stdout) == [0, 0]  # nothing left to train
    whole, _ = three_steps(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    for name, weight in load_file(tmp_path / "whole" / "model.safetensors").items():
        torch.testing.assert_close(load_file(out / "model.safetensors")[name], weight, msg=name)
    assert not resume.exists()


def test_calibration_under_fsdp_is_an_error(files, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert_user_error(convert(files, "llama", tmp_path / "out", "--calibrate-steps", 1, "--swap-steps", 0),
                      "--calibrate-steps under FSDP")


def test_ctrl_c_then_resume(files, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = data_module.TrainingBatches.__next__
    # Ctrl-C during step 3 (its read): it ends, then training stops
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", on_read(real, 2, interrupt))
    result = convert(files, "llama", out, "--steps", 5)
    assert_user_error(result, "interrupted at step 3 of 5")
    assert result.exit_code == 130  # a shell's status for Ctrl-C: 128 + SIGINT
    assert "is saved in" not in result.output  # the error says where the state is, once
    assert not out.exists() and (tmp_path / "out.resume" / "state.json").is_file()
    assert torch.load(tmp_path / "out.resume" / "data_position.pt")["documents"]  # where the text stream stands

    monkeypatch.setattr(data_module.TrainingBatches, "__next__", real)
    # without --resume the saved state is not silently replaced
    assert_user_error(convert(files, "llama", out, "--steps", 5),
                      "holds the training state of an interrupted conversion")
    assert (tmp_path / "out.resume" / "state.json").is_file()
    assert_user_error(convert(files, "llama", out, "--steps", 8, "--resume"),
                      "other training settings (--steps 5 -> 8)")
    other_data = run("convert", model_folder(files, "llama"), "-o", out, "--data", files / "corpus" / "train.jsonl",
                     "--recipe", files / "recipe.yaml", "--steps", 5, "--resume")
    assert_user_error(other_data, f"other inputs (--data {str(files / 'corpus')!r} -> "
                                  f"{str(files / 'corpus' / 'train.jsonl')!r})")
    result = convert(files, "llama", out, "--steps", 5, "--resume")
    assert result.exit_code == 0, result.output
    assert f"resuming from step 3 of 5 ({tmp_path / 'out.resume'})\n" in result.output
    log = json.loads((out / "training_log.json").read_text())["log"]
    assert [e["step"] for e in log] == [1, 2, 3, 4, 5]
    assert not (tmp_path / "out.resume").exists()


def test_a_resumed_run_reports_the_source_perplexities_it_saved(files, tmp_path, monkeypatch):
    """The saved state holds the source's perplexities (and after the swap): resuming does not measure them again."""
    out = tmp_path / "out"
    real = data_module.TrainingBatches.__next__
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", on_read(real, 1, interrupt))
    assert_user_error(convert(files, "llama", out, "--steps", 3), "interrupted at step 2 of 3")
    saved = json.loads((tmp_path / "out.resume" / "state.json").read_text())["before_training"]["perplexity"]
    assert set(saved) == {"original", "after swap"}
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", real)
    measured = []
    monkeypatch.setattr(convert_module, "perplexity", lambda *args, **kwargs: measured.append(args))
    result = convert(files, "llama", out, "--steps", 3, "--resume")
    assert result.exit_code == 0, result.output
    assert not measured
    record = json.loads((out / "config.json").read_text())["twell"]["training"]["perplexity"]
    assert {key: record[key] for key in saved} == saved


def test_a_recipe_file_that_extends_none_is_told_what_it_leaves_to_the_defaults(files, tmp_path):
    """A user's recipe without `extends` runs on sparsify's defaults where it is silent, not the default recipe's:
    the run says which settings differ and how to start from that recipe; with `extends`, nothing."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("lr: 3.0e-4\ntokens: 5_000\n")
    result = run("convert", model_folder(files, "llama"), "-o", tmp_path / "out", "--data", files / "corpus",
                 "--recipe", mine, "--batch-size", 16, "--dry-run")
    said = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert (f"recipe {mine} extends no recipe: the settings it leaves out are sparsify's defaults, not the pretrained "
            "recipe's: l1 2e-05 (pretrained.yaml: 3.5), l1_relative False (pretrained.yaml: True), l1_warmup_steps 0 "
            "(pretrained.yaml: 50%), swap_steps 0 (pretrained.yaml: 20%), distill 0 (pretrained.yaml: 0.5), "
            "warmup_steps 0 (pretrained.yaml: 30), eval_tokens 65,536 (pretrained.yaml: 262,144); add `extends: "
            "pretrained` to the file to start from that recipe") in said  # batch_size, lr, tokens given
    mine.write_text("extends: pretrained\nlr: 3.0e-4\ntokens: 5_000\n")
    result = run("convert", model_folder(files, "llama"), "-o", tmp_path / "out", "--data", files / "corpus",
                 "--recipe", mine, "--dry-run")
    assert result.exit_code == 0 and "extends no recipe" not in result.output, result.output


def test_sigterm_in_training_saves_and_exits_with_143(files, tmp_path, monkeypatch):
    """SIGTERM (a job scheduler's stop) saves as Ctrl-C does, and the status is a shell's for SIGTERM, not Ctrl-C's."""
    terminate = lambda: os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", on_read(data_module.TrainingBatches.__next__, 0,
                                                                         terminate))
    result = convert(files, "llama", tmp_path / "out")
    assert_user_error(result, "interrupted at step 1 of 2")
    assert result.exit_code == 143  # 128 + SIGTERM
    assert (tmp_path / "out.resume" / "state.json").is_file()


def test_ctrl_c_in_the_last_step_stops_and_resume_writes_the_checkpoint(files, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = data_module.TrainingBatches.__next__
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", on_read(real, 1, interrupt))  # step 2 of 2
    assert_user_error(convert(files, "llama", out), "interrupted at step 2 of 2")
    assert not out.exists() and (tmp_path / "out.resume" / "state.json").is_file()
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", real)
    result = convert(files, "llama", out, "--resume")
    assert result.exit_code == 0, result.output
    assert [e["step"] for e in json.loads((out / "training_log.json").read_text())["log"]] == [1, 2]
    assert not (tmp_path / "out.resume").exists()


def failing_batches(n, error):
    """TrainingBatches.__next__, raising `error` when the (n+1)-th batch is read."""
    return on_read(data_module.TrainingBatches.__next__, n, raising(error))


def test_a_killed_conversion_resumes_from_its_periodic_save(files, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = data_module.TrainingBatches.__next__
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", failing_batches(3, Killed()))  # dies in step 4
    with pytest.raises(Killed):
        convert(files, "llama", out, "--steps", 5, "--save-every", 2)
    assert not out.exists()
    assert json.loads((tmp_path / "out.resume" / "state.json").read_text())["step"] == 2
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", real)
    partial = tmp_path / "out.resume.tmp"  # what a later save killed midway would leave
    partial.mkdir()
    (partial / "optimizer_0").write_bytes(b"\0" * 1024)
    result = convert(files, "llama", out, "--steps", 5, "--resume")  # save_every may differ on resume
    assert result.exit_code == 0, result.output
    assert [e["step"] for e in json.loads((out / "training_log.json").read_text())["log"]] == [1, 2, 3, 4, 5]
    assert not (tmp_path / "out.resume").exists() and not partial.exists()


def test_an_error_mid_run_saves_the_state_and_resume_finishes(files, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = data_module.TrainingBatches.__next__
    monkeypatch.setattr(data_module.TrainingBatches, "__next__",
                        failing_batches(2, DataError("train.jsonl: line 40: bad row")))  # in step 3
    result = convert(files, "llama", out, "--steps", 5)
    assert_user_error(result, "error: train.jsonl: line 40: bad row")
    assert (f"the training state of step 2 of 5 is saved in {tmp_path / 'out.resume'}: run the same command with "
            "--resume to continue from it") in " ".join(result.output.split())
    assert not out.exists() and json.loads((tmp_path / "out.resume" / "state.json").read_text())["step"] == 2
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", real)
    result = convert(files, "llama", out, "--steps", 5, "--resume")
    assert result.exit_code == 0, result.output
    assert [e["step"] for e in json.loads((out / "training_log.json").read_text())["log"]] == [1, 2, 3, 4, 5]


def test_text_column_reads_rows_from_another_column(files, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": i, "content": f"def h{i}(z):\n    return z - {i}\n" * 6}) + "\n"
                            for i in range(60)))
    common = ["convert", model_folder(files, "llama"), "--data", data, "--recipe", files / "recipe.yaml", "--steps", 1]
    assert_user_error(run(*common, "-o", tmp_path / "text"),
                      f"{data}: a row has no 'text' column (its columns: id, content); name the one that holds the "
                      "text with --text-column")
    result = run(*common, "-o", tmp_path / "content", "--text-column", "content")
    assert result.exit_code == 0, result.output
    assert (json.loads((tmp_path / "content" / "config.json").read_text())["twell"]["training"]["text_column"]
            == "content")


@pytest.mark.parametrize("name_or_path, base_model", [("someone/base-model", "someone/base-model"),
                                                      ("/home/me/models/base", None), (None, None)])
def test_a_local_source_is_named_without_local_paths(files, tmp_path, name_or_path, base_model):
    """A source folder is recorded as the Hub id its config.json was saved from (the card's base_model, a
    finetune of it), else by its name, and the data by its name: no local path in what may be pushed."""
    source = tmp_path / "my-llama"
    shutil.copytree(model_folder(files, "llama"), source)
    if name_or_path:  # written by save_pretrained before transformers 5
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "_name_or_path": name_or_path}))
    result = run("convert", source, "-o", tmp_path / "out", "--data", files / "corpus",
                 "--recipe", files / "recipe.yaml", "--steps", 1)
    assert result.exit_code == 0, result.output
    training = json.loads((tmp_path / "out" / "config.json").read_text())["twell"]["training"]
    assert training["base_model"] == (base_model or "my-llama") and training["data"] == "corpus"
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.base_model == base_model
    assert card.data.to_dict().get("base_model_relation") == ("finetune" if base_model else None)
    assert card.data.license is None and training["license"] is None  # the source's card declares none
    for name in ("README.md", "config.json", "training_log.json"):
        text = (tmp_path / "out" / name).read_text()
        assert str(tmp_path) not in text and str(files) not in text and "/home/me" not in text, name


def test_the_source_cards_license_carries_over(files, tmp_path):
    """The license the source's model card declares is the converted checkpoint's (its weights are the
    source's, trained further), in the card's metadata and the training record; the source's files of terms
    (LICENSE, USE_POLICY.md, ...) are copied beside the weights and named in the card."""
    source = tmp_path / "licensed"
    shutil.copytree(model_folder(files, "llama"), source)
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a base model\n")
    terms = {"LICENSE": b"the terms\n", "USE_POLICY.md": b"# use policy\n"}
    for name, content in terms.items():
        (source / name).write_bytes(content)
    result = run("convert", source, "-o", tmp_path / "out", "--data", files / "corpus",
                 "--recipe", files / "recipe.yaml", "--steps", 1)
    assert result.exit_code == 0, result.output
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.license == "apache-2.0"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["twell"]["training"]["license"] == "apache-2.0"
    assert {name: (tmp_path / "out" / name).read_bytes() for name in terms} == terms
    assert "Its files of terms are beside the weights: `LICENSE`, `USE_POLICY.md`." in card.text


def test_push_to_hub_uploads_the_finished_folder(files, tmp_path, monkeypatch):
    import sparsify.push

    calls = []

    def push(out, repo_id, private=False):
        calls.append((out, repo_id, private, (out / "config.json").is_file()))
        return f"https://huggingface.co/{repo_id}"

    monkeypatch.setattr(sparsify.push, "push_to_hub", push)
    monkeypatch.setenv("HF_TOKEN", "hf_test")  # a login, which a push needs before training
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # and the Hub within reach
    result = convert(files, "llama", tmp_path / "out", "--push-to-hub", "me/tiny-sparse", "--private")
    assert result.exit_code == 0, result.output
    assert calls == [(tmp_path / "out", "me/tiny-sparse", True, True)]
    assert "pushed to https://huggingface.co/me/tiny-sparse" in result.output


def test_a_save_killed_before_its_rename_resumes(files, tmp_path, monkeypatch):
    """Killed after the staging folder was whole (state.json written last) but before it replaced the old state,
    partly removed: --resume continues from the staging folder."""
    out = tmp_path / "out"
    real = data_module.TrainingBatches.__next__
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", on_read(real, 1, interrupt))
    assert_user_error(convert(files, "llama", out, "--steps", 3), "interrupted at step 2 of 3")
    (tmp_path / "out.resume").rename(tmp_path / "out.resume.tmp")
    (tmp_path / "out.resume").mkdir()  # what a half-done removal of the old state leaves
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", real)
    # without --resume that save is not silently replaced either
    assert_user_error(convert(files, "llama", out, "--steps", 3), "out.resume.tmp holds the training state of an "
                                                                  "interrupted conversion")
    result = convert(files, "llama", out, "--steps", 3, "--resume")
    assert result.exit_code == 0, result.output
    assert "resuming from it" in result.output
    assert [e["step"] for e in json.loads((out / "training_log.json").read_text())["log"]] == [1, 2, 3]
    assert not (tmp_path / "out.resume").exists() and not (tmp_path / "out.resume.tmp").exists()


def test_resume_without_state(files, tmp_path):
    assert_user_error(convert(files, "llama", tmp_path / "out", "--resume"), "no saved training state")
    (tmp_path / "out.resume.tmp").mkdir()  # a save killed midway
    assert_user_error(convert(files, "llama", tmp_path / "out", "--resume"), "killed before it finished")


def test_failure_while_writing_leaves_no_output_but_the_trained_state(files, tmp_path, monkeypatch):
    real = export._write

    def fail(folder, *args):
        (folder / "config.json").write_text("{}")
        raise OSError("No space left on device")

    monkeypatch.setattr(export, "_write", fail)
    result = convert(files, "llama", tmp_path / "out")
    assert_user_error(result, "No space left on device")
    assert "the training state of step 2 of 2 is saved" in " ".join(result.output.split())
    assert [p.name for p in tmp_path.iterdir()] == ["out.resume"]
    monkeypatch.setattr(export, "_write", real)
    result = convert(files, "llama", tmp_path / "out", "--resume")  # trains nothing: measures, plans and writes
    assert result.exit_code == 0, result.output
    assert [e["step"] for e in json.loads((tmp_path / "out" / "training_log.json").read_text())["log"]] == [1, 2]
    assert convert(files, "llama", tmp_path / "again").exit_code == 0
    written, again = (load_file(tmp_path / name / "model.safetensors") for name in ("out", "again"))
    for name in again:
        torch.testing.assert_close(written[name], again[name], rtol=0, atol=0, msg=name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "out"]


def test_ctrl_c_outside_the_training_loop_says_what_was_kept(files, tmp_path, monkeypatch):
    """Before the first step (here in calibration) nothing is saved, and the message says so; after the last
    (measuring) the trained state is, and the message names it and --resume."""
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    real = convert_module.calibrate
    monkeypatch.setattr(convert_module, "calibrate", ctrl_c)
    result = convert(files, "llama", tmp_path / "out", "--calibrate-steps", 1, "--swap-steps", 0)
    assert_user_error(result, "interrupted before the first training step (loading, measuring the source, "
                              "calibration): nothing was saved")
    assert result.exit_code == 130
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(convert_module, "calibrate", real)
    monkeypatch.setattr(convert_module, "measure", ctrl_c)
    result = convert(files, "llama", tmp_path / "out")
    assert_user_error(result, f"interrupted after training: its state is saved in {tmp_path / 'out.resume'}; the "
                              "same command with --resume measures and writes it")
    assert result.exit_code == 130
    assert (tmp_path / "out.resume" / "state.json").is_file()


def test_sigterm_after_training_saves_the_trained_state_and_exits_with_143(files, tmp_path, monkeypatch):
    """A SIGTERM while the checkpoint is measured (a job scheduler's stop) keeps the trained state as Ctrl-C does;
    the status is SIGTERM's, and SIGTERM's own handler is back after the run."""
    real = convert_module.measure

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    def past_the_run(signum, frame):  # what a SIGTERM the run does not take would meet (not the test's death)
        raise RuntimeError("SIGTERM went past the run")

    monkeypatch.setattr(convert_module, "measure", terminated)
    before = signal.signal(signal.SIGTERM, past_the_run)
    try:
        result = convert(files, "llama", tmp_path / "out")
        assert signal.getsignal(signal.SIGTERM) is past_the_run
    finally:
        signal.signal(signal.SIGTERM, before)
    assert_user_error(result, f"interrupted after training: its state is saved in {tmp_path / 'out.resume'}")
    assert result.exit_code == 143
    assert (tmp_path / "out.resume" / "state.json").is_file() and not (tmp_path / "out").exists()


def test_ctrl_c_in_any_command_exits_with_130_and_other_errors_with_1(files, monkeypatch):
    def ctrl_c():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_quiet_loading", ctrl_c)  # as the command imports torch
    result = run("analyze", model_folder(files, "llama"), "--data", files / "corpus")
    assert result.exit_code == 130 and result.output.endswith("\nAborted!\n"), result.output
    assert run("analyze", model_folder(files, "llama"), "--tokens", 0).exit_code == 1


def test_a_failure_while_measuring_keeps_the_trained_state(files, tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        time.sleep(2)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(convert_module, "measure", out_of_memory)
    result = convert(files, "llama", tmp_path / "out")
    assert isinstance(result.exception, torch.cuda.OutOfMemoryError)
    assert not (tmp_path / "out").exists()
    state = json.loads((tmp_path / "out.resume" / "state.json").read_text())
    assert state["step"] == 2
    assert state["seconds"] - state["log"][-1]["seconds"] < 1.0  # the training's time, not the measuring's


def test_a_save_that_fails_after_training_leaves_the_first_error_and_no_partial_state(files, tmp_path, monkeypatch):
    def fail(folder, *args):
        raise OSError(28, "No space left on device")

    def half_a_save(self, folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device (saving)")

    monkeypatch.setattr(export, "_write", fail)
    monkeypatch.setattr(accelerate.Accelerator, "save_state", half_a_save)
    result = convert(files, "llama", tmp_path / "out")
    assert_user_error(result, "No space left on device")
    output = " ".join(result.output.split())
    assert ("the trained state could not be saved either (OSError: [Errno 28] No space left on device (saving))"
            in output)
    assert list(tmp_path.iterdir()) == []


def gpt2_folder(root):
    folder = root / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=260)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "args, message",
    [
        (["convert", "./no-such-model", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1"], "no such folder"),
        (["convert", "{tmp}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1"], "no config.json"),
        (["convert", "{gpt2}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1"], "supported families"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{tmp}/missing.jsonl", "--steps", "1", "--seq-len", "32"],
         "does not exist"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{tmp}/empty.txt", "--steps", "1", "--seq-len", "32"],
         "empty"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{tmp}/data.csv", "--steps", "1", "--seq-len", "32"],
         "unknown data format"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{tmp}/short.txt", "--steps", "1", "--seq-len", "32"],
         "shorter than one sequence"),
        (["convert", "{llama}", "--data", "{corpus}", "--steps", "1"], "Missing option '-o' / '--out'"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--steps", "1"], "--data is required"),
        (["convert", "./no-such-model", "-o", "{tmp}/out", "--steps", "1"], "no such folder"),  # before --data
        (["convert", "no-such-model/", "-o", "{tmp}/out", "--steps", "1"], "no-such-model/: no such folder"),
        (["convert", "my model", "-o", "{tmp}/out", "--steps", "1"],
         "my model: not a local folder, and not a Hub model id ("),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--push-to-hub", "me/a b"],
         "--push-to-hub me/a b: not a Hub repository id ("),
        (["convert", "{gpt2}", "-o", "{tmp}/out", "--steps", "1"], "supported families"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--l1", "-1e-5"],
         "--l1 (relative) must be between"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--l1", "3", "--l1-absolute"],
         "got 3.0; for the L1 term's initial weight in nats (recipes: 3.5) add --l1-relative"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--distill", "2"],
         "--distill must be in [0, 1]"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--distill-hidden", "-1"],
         "--distill-hidden must be a number >= 0"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--distill-hidden", "x"],
         "'x' is not a valid float"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--mlp-lr", "2"],
         "--mlp-lr must be in (0, 1]"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--mlp-lr", "fast"],
         "'fast' is not a valid float"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "9", "--calibrate-steps", "5",
          "--swap-steps", "3"],
         "set --swap-steps 0 (it is 3)"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "0"],
         "--steps must be a positive integer"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--recipe", "{tmp}/lr.yaml"],
         "set the training length"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--seq-len", "4096"],
         "--seq-len 4096 is beyond the model's maximum of 128 positions"),
        (["convert", "{llama}", "-o", "{tmp}/full", "--data", "{corpus}", "--steps", "1"],
         "not empty (pass --overwrite"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--recipe", "nonexistent"],
         "recipe nonexistent not found"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--max-shard-size", "big"],
         "--max-shard-size"),
        (["analyze", "{llama}"], "--data is required"),
        (["analyze", "{llama}", "--data", "{corpus}", "--tokens", "0"], "--tokens must be at least 1, got 0"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--l1-warmup-steps", "abc"],
         "--l1-warmup-steps: 'abc' is not an int or a share of the run's steps such as 50%"),
        (["convert", "{llama}", "-o", "{tmp}/out", "--data", "{corpus}", "--steps", "1", "--measure",
          "--device", "cpu"],
         "--measure needs a CUDA GPU"),
        (["analyze", "{llama}", "--data", "{corpus}", "--measure", "--device", "cpu"], "--measure needs a CUDA GPU"),
        (["bench", "{tmp}/no-such-checkpoint"], "sparsify bench needs a CUDA GPU, and torch ("),
    ],
)
def test_bad_input(files, tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "data.csv").write_text("text\nhello\n")
    (tmp_path / "short.txt").write_text("too short")
    (tmp_path / "lr.yaml").write_text("lr: 1.0e-4\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "something").write_text("x")
    paths = {"tmp": tmp_path, "corpus": files / "corpus", "llama": model_folder(files, "llama")}
    if "{gpt2}" in args:
        paths["gpt2"] = gpt2_folder(tmp_path)
    result = run(*(a.format(**paths) for a in args))
    assert_user_error(result, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, said", [
    (["convert", "demo", "-o", "out", "--lr-rate", "1"], "No such option '--lr-rate'. Did you mean '--lr'?"),
    (["convert", "demo", "-o", "out", "--learning-rate", "1"],
     "No such option '--learning-rate'. Did you mean '--lr'?"),
    (["convert", "demo", "-o", "out", "--l1-weight", "1"], "No such option '--l1-weight'. Did you mean '--l1'?"),
    (["convert", "demo", "-o", "out", "--max-steps", "1"], "No such option '--max-steps'. Did you mean '--steps'?"),
    (["analyze", "demo", "--seq_len", "8"], "No such option '--seq_len'. Did you mean '--seq-len'?"),
    (["convert", "demo", "-o", "out", "--distil", "1"],  # no shared word: Click's spelling match
     "No such option '--distil'. (Did you mean one of: '--distill', '--distill-hidden'?)"),
    (["convert", "demo", "demo-out"], "Got unexpected extra argument (demo-out): the output folder is an option, "
                                      "-o demo-out"),
    (["sample", "demo", "samples"], "Got unexpected extra argument (samples): the output folder is an option, "
                                    "-o samples"),
    (["convert", "demo", "demo-out", "-o", "out"], "Got unexpected extra argument (demo-out)\n"),
])
def test_usage_errors_point_to_what_was_meant(args, said):
    result = run(*args)
    assert result.exit_code == 2 and said in result.output, result.output


def test_distillation_from_the_source(files, tmp_path):
    """--distill trains against a frozen copy of the source: the log carries the KL term and the checkpoint's
    training record the weight."""
    out = tmp_path / "out"
    result = convert(files, "qwen3", out, "--distill", 0.5)
    assert result.exit_code == 0, result.output
    log = json.loads((out / "training_log.json").read_text())
    assert log["training"]["distill"] == 0.5
    assert all(e["kl"] > 0 and e["loss"] > 0.5 * e["kl"] for e in log["log"])


def test_hybrid_routing_options(files, tmp_path):
    # A threshold above the tiny model's activity (~80 of 160 units) puts every layer on the hybrid kernels
    # after the first log step; --no-hybrid keeps them dense. The recipe's E = 4 sends every row to the
    # dense backup (no hot units as dense columns either), and micro-batches of one sequence give the backup's
    # kernels fewer rows, which keeps the Triton interpreter fast (the kernels are tested elsewhere).
    recipe = tmp_path / "hybrid.yaml"
    recipe.write_text(RECIPE + "hybrid_max_nnz: 4\nhybrid_hot_rate: 1.0\n")
    args = ["convert", model_folder(files, "llama"), "--data", files / "corpus", "--recipe", recipe, "--steps", 2,
            "--batch-size", 1, "--hybrid-below", 1000]
    result = run(*args, "-o", tmp_path / "hybrid")
    assert result.exit_code == 0, result.output
    log = json.loads((tmp_path / "hybrid" / "training_log.json").read_text())["log"]
    assert [[l["path"] for l in e["layers"]] for e in log] == [["dense", "dense"], ["hybrid", "hybrid"]]
    assert [l["backup_rows"] for l in log[1]["layers"]] == [32, 32]
    assert "hybrid 2/2" in " ".join(result.output.split())  # the progress line (wrapped at 80 columns)
    # The per-layer table's last column: 50% of the steps on the hybrid path, for both layers.
    assert len(re.findall(r"│\s+50 │$", result.output, re.MULTILINE)) == 2, result.output
    result = run(*args, "--no-hybrid", "-o", tmp_path / "dense")
    assert result.exit_code == 0, result.output
    log = json.loads((tmp_path / "dense" / "training_log.json").read_text())
    assert log["training"]["hybrid_below"] == 0 and all(l["path"] == "dense" for e in log["log"] for l in e["layers"])
    shown = [line for line in result.output.replace(str(tmp_path), "").splitlines() if not line.startswith("settings:")]
    assert "hybr" not in "\n".join(shown)  # no hybrid column or progress figure (the settings line names the option)


def test_output_outside_a_terminal_is_whole_timestamped_lines_and_quiet_keeps_warnings_and_summary(files, tmp_path):
    """Where the output is no terminal (CliRunner's, like nohup's or a batch job's), the evaluations and the
    training steps print whole lines with the time and the time left; --quiet prints neither, nor the settings,
    but the warnings and the summary."""
    result = convert(files, "llama", tmp_path / "out")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  "
    for what in ("perplexity of the source", "perplexity after the ReLU swap", "measuring the trained model"):
        shown = [line for line in lines if what in line]  # 256 held-out tokens: 4 batches of 2 x 32, in a second
        assert [re.fullmatch(rf"{stamp}{what} \(256 held-out tokens\): (\d)/4 batches  eta \d+:\d\d:\d\d", line)[1]
                for line in shown] == ["4"], shown
    assert len([line for line in lines if re.match(rf"{stamp}step \d/2  .* eta \d+:\d\d:\d\d$", line)]) == 2
    quiet = convert(files, "llama", tmp_path / "quiet", "--quiet", "--eval-tokens", 100_000)
    assert quiet.exit_code == 0, quiet.output
    assert "warning: only 512 held-out tokens" in quiet.output and "trained 2 steps" in quiet.output
    assert "perplexity on held-out text" in quiet.output
    for shown in ("settings:", "held out:", "batches", "step 1/2", "eta"):
        assert shown not in quiet.output


def test_report_to_sends_each_log_entry_to_accelerate_trackers(files, tmp_path, monkeypatch):
    """--report-to NAME: an accelerate tracker (here a recording one registered under its name) gets the settings
    and, at each log step, the figures of the training log's entry."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker

    class Recorder(GeneralTracker):
        name, requires_logging_directory, runs = "recorder", False, []

        def __init__(self, project):
            super().__init__()
            self.project, self.config, self.logged, self.finished = project, None, [], False
            self.runs.append(self)

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            self.config = values

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, values))

        def finish(self):
            self.finished = True

    monkeypatch.setitem(LOGGER_TYPE_TO_CLASS, "recorder", Recorder)
    monkeypatch.setitem(cli.TRACKER_PACKAGES, "recorder", ("accelerate",))  # the names the CLI knows before torch
    result = convert(files, "llama", tmp_path / "out", "--report-to", "recorder", "--quiet")
    assert result.exit_code == 0, result.output
    [run] = Recorder.runs
    assert run.finished and run.config["lr"] == 1e-3 and run.config["betas"] == "(0.9, 0.95)"
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())["log"]
    assert [step for step, _ in run.logged] == [entry["step"] for entry in log] == [1, 2]
    for (_, values), entry in zip(run.logged, log):
        for name in ("loss", "cross_entropy", "l1", "l1_coeff", "lr", "mean_active", "dead_frac", "tokens",
                     "tokens_per_s"):
            assert values[name] == entry[name], name
        assert values["layers/1/active"] == entry["layers"][1]["active"] and values["layers/0/hybrid"] == 0


def test_report_to_names_a_tracker_that_is_unknown_or_not_installed(files, tmp_path, monkeypatch):
    import accelerate.tracking

    monkeypatch.setattr(convert_module, "load_model", None)  # stops before any weight is read
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    assert_user_error(convert(files, "llama", tmp_path / "out", "--report-to", "tensorboard"),
                      "error: --report-to tensorboard: the tensorboard package is not installed "
                      "(pip install tensorboard)")
    assert_user_error(convert(files, "llama", tmp_path / "out", "--report-to", "none,tensorbord"),
                      "error: --report-to tensorbord: not a tracker; use none, or one or more of all, ")


def test_an_unwritable_output_folder_stops_convert_before_any_weight_is_read(files, tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "load_model", None)  # no weight is read
    with unwritable_folder(tmp_path, monkeypatch) as locked:
        assert_user_error(convert(files, "llama", locked / "out"), f"{locked} is not writable")
        assert list(locked.iterdir()) == []


def test_overwrite_discards_an_interrupted_runs_state_before_training(files, tmp_path, monkeypatch):
    """--overwrite starts over: the saved state of an interrupted run goes, even where the new run then fails
    before its first step (which saves nothing of its own), so that no --resume continues the old run."""
    out = tmp_path / "out"
    real = data_module.TrainingBatches.__next__
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", on_read(real, 2, interrupt))  # Ctrl-C in step 3
    assert_user_error(convert(files, "llama", out, "--steps", 5), "interrupted at step 3 of 5")
    assert json.loads((tmp_path / "out.resume" / "state.json").read_text())["step"] == 3
    monkeypatch.setattr(data_module.TrainingBatches, "__next__", failing_batches(0, DataError("train.jsonl: bad row")))
    result = convert(files, "llama", out, "--steps", 5, "--overwrite")  # fails on its first read
    assert_user_error(result, "error: train.jsonl: bad row")
    assert "is saved in" not in result.output  # no step completed: nothing of this run to keep
    assert not (tmp_path / "out.resume").exists() and not (tmp_path / "out.resume.tmp").exists()
    assert not out.exists()
    assert_user_error(convert(files, "llama", out, "--steps", 5, "--resume"), "no saved training state")
