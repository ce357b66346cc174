"""Write a converted model as a standard Hugging Face checkpoint that also runs on the TwELL kernels.

OUT holds the safetensors weights under the original names (save_pretrained), config.json with the ReLU
activation, an `auto_map` to modeling_twell.py and the `twell` section (docs/design.md), the modeling
file with its base class patched in, generation.py and the inference runtime's kernel files flat beside it,
tokenizer and generation config, the model card and the trainer's artifacts. Everything is written to a
temporary sibling folder and renamed into place at the end, so a failure never leaves an OUT that looks
complete.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from twell.layer_plan import FORMAT_VERSION, LayerPlan, layer_plans

from .card import is_license_file, model_card
from .errors import OutputError
from .families import FamilySpec
from .locations import check_output_dir

MODELING_FILE = Path(__file__).parent / "remote" / "modeling_twell.py"
GENERATION_FILE = MODELING_FILE.with_name("generation.py")  # imported by the modeling file
AUTO_MAP = {"AutoModelForCausalLM": "modeling_twell.TwellForCausalLM"}


def kernel_dir() -> Path:
    """Folder of the `twell` kernel package, whose files are copied into checkpoints."""
    found = importlib.util.find_spec("twell")
    folder = Path(found.origin).parent if found else Path(__file__).resolve().parents[1] / "kernels"
    if not (folder / "gated_mlp.py").is_file():
        raise OutputError(f"the twell kernel files are missing (looked in {folder}); reinstall sparsify")
    return folder


def runtime_files(kernels: Path) -> list[Path]:
    """The inference runtime: every file at the top of the kernel package but its __init__.py (the training
    kernels live in its training/ sub-package)."""
    return sorted(path for path in kernels.glob("*.py") if path.name != "__init__.py")


def shipped_files(kernels: Path) -> list[Path]:
    """The source files a checkpoint carries beside its weights: the modeling file (written with the family's
    BASE_MODEL), generation.py and the runtime kernel files."""
    return [MODELING_FILE, GENERATION_FILE, *runtime_files(kernels)]


def modeling_source(spec: FamilySpec) -> str:
    """modeling_twell.py with BASE_MODEL set to the family's transformers CausalLM."""
    source, count = re.subn(
        r'^BASE_MODEL = ".*"$', f'BASE_MODEL = "{spec.causal_lm}"', MODELING_FILE.read_text(), flags=re.M
    )
    assert count == 1, "modeling_twell.py must have exactly one BASE_MODEL line"
    return source


def twell_section(spec: FamilySpec, plan: list[LayerPlan], training: dict) -> dict:
    return {"format_version": FORMAT_VERSION, "family": spec.family, "mlp": spec.layout(),
            "layers": [layer.to_json() for layer in plan], "training": training}


def _check_layout(model: nn.Module, spec: FamilySpec, plan: list[LayerPlan]) -> None:
    """The model has a ReLU gate, saves under exactly the parameter names of the family's own class (so that
    both the plain and the remote-code load find every weight), and the plan covers every layer."""
    if getattr(model.config, spec.act_key) != "relu":
        raise ValueError(f"config.{spec.act_key} is {getattr(model.config, spec.act_key)!r}: export a relufied model")
    with torch.device("meta"):
        reference = spec.causal_lm_class()(copy.deepcopy(model.config))
    expected, actual = set(reference.state_dict()), set(model.state_dict())
    if expected != actual:
        raise ValueError(f"state-dict keys differ from {type(reference).__name__}: "
                         f"missing {sorted(expected - actual)[:5]}, "
                         f"extra {sorted(actual - expected)[:5]}")
    layers = len(model.get_submodule(spec.layers))
    if len(plan) != layers:
        raise ValueError(f"the plan has {len(plan)} layers, the model {layers}")


def _write(folder: Path, model, tokenizer, spec, plan, training, artifacts, kernels: Path, max_shard_size) -> None:
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.update({"auto_map": AUTO_MAP, "twell": twell_section(spec, plan, training)})
    config_file.write_text(_config_text(config))
    (folder / "modeling_twell.py").write_text(modeling_source(spec))
    shutil.copy2(GENERATION_FILE, folder / GENERATION_FILE.name)
    for kernel_file in runtime_files(kernels):
        shutil.copy2(kernel_file, folder / kernel_file.name)
    for name, path in artifacts.items():
        shutil.copy2(path, folder / name)
    _card(config, plan, tuple(artifacts)).save(folder / "README.md")


def _card(config: dict, plan: list[LayerPlan], artifacts: tuple[str, ...]):
    """The model card of a converted checkpoint: `config` (its config.json, twell section included) with `plan`,
    naming the files `artifacts` beside it."""
    section = config["twell"]
    return model_card(family=section["family"], architecture=config["architectures"][0], plan=plan,
                      training=section["training"], intermediate_size=config["intermediate_size"], artifacts=artifacts)


ARTIFACTS = ("training_log.json", "sparsity.png")  # files of a conversion that the card shows or names


def _config_text(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def converted_config(folder: str | Path) -> dict:
    """config.json of a converted checkpoint folder, checked to hold a plan this version reads (OutputError
    naming what is missing otherwise)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise OutputError(f"{folder}: cannot read its config.json ({error})") from error
    if "twell" not in config:
        raise OutputError(f"{folder}: its config.json has no \"twell\" section: not a checkpoint written by "
                          "`sparsify convert`")
    try:
        layer_plans(config["twell"])  # its layers, in a format version this runtime reads
        complete = ({"family", "training"} <= set(config["twell"])
                    and {"intermediate_size", "architectures"} <= set(config))
    except (KeyError, TypeError, ValueError) as error:
        raise OutputError(f"{folder} is not a converted checkpoint this version reads "
                          f"(config.json: {error!r})") from error
    if not complete:
        raise OutputError(f"{folder}: config.json lacks twell.family, twell.training, intermediate_size or "
                          "architectures")
    return config


def replace_plan(folder: str | Path, plan: list[LayerPlan]) -> Path:
    """Gives a converted checkpoint `plan` (one LayerPlan per layer) in place of its own: config.json's twell
    layers and the card's table; the weights and the runtime files stay. Both files are written beside the
    old ones first, then renamed over them, config.json (what loading reads) last: a failure leaves the old
    plan in force."""
    folder = Path(folder)
    config = converted_config(folder)
    section = config["twell"]
    if len(plan) != len(section["layers"]):
        raise ValueError(f"the plan has {len(plan)} layers, the checkpoint {len(section['layers'])}")
    section["layers"] = [layer.to_json() for layer in plan]
    card = _card(config, plan, tuple(sorted(path.name for path in folder.iterdir()
                                            if path.name in ARTIFACTS or is_license_file(path.name))))
    files = {"README.md": str(card), "config.json": _config_text(config)}  # renamed in this order
    staged = {name: folder / f".{name}.partial" for name in files}
    try:
        for name, text in files.items():
            staged[name].write_text(text, encoding="utf-8")
            staged[name].chmod((folder / "config.json").stat().st_mode & 0o777)
        for name in files:
            os.replace(staged[name], folder / name)
    except OSError as error:
        raise OutputError(f"writing the plan into {folder} failed ({error})") from error
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)
    return folder


def _as_umask_allows(folder: Path) -> None:
    """Permissions as a plain save_pretrained leaves them (the umask's), not the private ones of the staging
    folder (mkdtemp: 0700), so that a server under another user can read the checkpoint."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextmanager
def staged_output(out: Path):
    """A hidden folder beside `out` to write into: `out` becomes it when the block completes (a previous `out`,
    empty or overwritten, moved aside first and deleted only then), and it is deleted when the block fails, so
    that a failed write never leaves a half-written `out` that looks complete."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as error:
        raise OutputError(f"{out}: cannot write there ({error})") from error
    try:
        yield staging
        _as_umask_allows(staging)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(old / out.name)
            try:
                staging.rename(out)
            except BaseException as failed:
                try:
                    (old / out.name).rename(out)
                except OSError as error:  # the user's previous OUT must not be lost in a hidden folder
                    raise OutputError(f"writing {out} failed ({failed}), and its previous contents could not be "
                                      f"put back: they are in {old / out.name} ({error})") from error
                old.rmdir()
                raise
            shutil.rmtree(old)
        else:
            staging.rename(out)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError):  # disk full, permissions: the user's to fix
            raise OutputError(f"writing {out} failed ({error}); nothing was written") from error
        raise


def export_checkpoint(model: nn.Module, tokenizer, out_dir: str | Path, *, spec: FamilySpec, plan: list[LayerPlan],
                      training: dict, artifacts: dict[str, str | Path] | None = None,
                      max_shard_size: str | int = "5GB", overwrite: bool = False) -> Path:
    """Write the relufied `model` (its MLPs keep the original parameter names) with `plan` (one LayerPlan per
    decoder layer) and `training` (settings and tokens used) to `out_dir`; returns it.
    `artifacts` maps file names in OUT to files to copy there (training log, plots, the source's license files)."""
    out = check_output_dir(out_dir, overwrite)
    _check_layout(model, spec, plan)
    artifacts = {name: Path(path) for name, path in (artifacts or {}).items()}
    for name, path in artifacts.items():
        if not path.is_file():
            raise OutputError(f"artifact {name}: {path} does not exist")
    kernels = kernel_dir()
    with staged_output(out) as staging:
        _write(staging, model, tokenizer, spec, plan, training, artifacts, kernels, max_shard_size)
    return out
