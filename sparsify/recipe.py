"""Recipes: YAML files of training settings (TrainConfig's fields), named in recipes/ or given as a path; `extends`
takes another recipe's settings under a file's own. A file of the user's that extends none is told which settings it
leaves to TrainConfig's defaults where the default recipe sets them otherwise (recipe_gaps)."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import yaml

from .config import LENGTHS, TrainConfig, overlay, shown_value, unknown_settings
from .errors import ConfigError


def recipes_dir():
    """The folder of named recipes. The repository keeps them in a top-level recipes/, which pyproject
    installs as sparsify/recipes (package data), so a regular install reads them from the package; a
    checkout or editable install has no sparsify/recipes and reads the repository's folder."""
    installed = files("sparsify") / "recipes"
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "recipes"


RECIPES = recipes_dir()  # a Path, or an importlib.resources Traversable (is_file, iterdir, read_text)


def recipe_names() -> list[str]:
    if not RECIPES.is_dir():
        return []
    return sorted(p.name[:-len(".yaml")] for p in RECIPES.iterdir() if p.name.endswith(".yaml"))


def load_recipe(recipe: str | Path | None, source: str, _extended: tuple = ()) -> dict:
    """Training settings of a recipe: a YAML path, or a name in recipes/ ("small" or "small.yaml" ->
    recipes/small.yaml).
    Without one, `demo` uses recipes/demo.yaml and other sources recipes/pretrained.yaml. A recipe's `extends: NAME`
    takes that recipe's settings under its own: a YAML path relative to the extending file's folder, else as above."""
    if recipe is None:
        # missing only in a broken install: reported below, never skipped
        path = recipe = RECIPES / ("demo.yaml" if source == "demo" else "pretrained.yaml")
    else:
        path = Path(recipe)
        name = str(recipe).removesuffix(".yaml")
        if not path.is_file() and Path(name).name == name and (RECIPES / f"{name}.yaml").is_file():
            path = RECIPES / f"{name}.yaml"  # a name in recipes/, with or without its .yaml
    if not path.is_file():
        names = recipe_names()
        known = f"one of: {', '.join(names)}" if names else f"no named recipes are installed at {RECIPES}"
        extending = f"recipe {_extended[-1]}: extends {recipe}, which is" if _extended else f"recipe {recipe}"
        raise ConfigError(f"{extending} not found (a YAML file, or {known})")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {path}: not valid YAML ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"recipe {path}: expected a mapping of training settings")
    if problem := unknown_settings(set(values) - {"extends"}):
        raise ConfigError(f"recipe {path}: {problem}")
    if "extends" not in values:
        return values
    base = values.pop("extends")
    beside = path.parent / str(base)
    if beside.is_file():
        base = beside
    if path.resolve() in _extended:
        raise ConfigError(f"recipe {path}: extends {base}, which extends it again")
    return overlay(load_recipe(base, source, (*_extended, path.resolve())), values)


def recipe_gaps(recipe: str | Path | None, source: str, given) -> str | None:
    """Where `recipe` is a YAML file of the user's (not one in recipes/) that extends no recipe: what says which of
    the settings it leaves out (nor `given`, the run's settings, sets) take sparsify's defaults where the source's
    default recipe sets them otherwise, both values beside each; else None. (A file read by load_recipe already.)"""
    path = Path(recipe) if recipe is not None else None
    if path is None or not path.is_file() or path.resolve().parent == Path(str(RECIPES)).resolve():
        return None
    if "extends" in (yaml.safe_load(path.read_text()) or {}):
        return None
    name = "demo" if source == "demo" else "pretrained"
    default = load_recipe(None, source)
    ours, theirs = TrainConfig(), TrainConfig.from_dict(default)
    shown = lambda value: "unset" if value is None else shown_value(value)  # noqa: E731
    if {"steps", *LENGTHS} & set(given):  # the run's length is set
        given = {*given, *LENGTHS}
    gaps = [f"{setting} {shown(getattr(ours, setting))} ({name}.yaml: {shown(getattr(theirs, setting))})"
            for setting in default
            if setting not in given and getattr(ours, setting) != getattr(theirs, setting)]
    if not gaps:
        return None
    return (f"recipe {path} extends no recipe: the settings it leaves out are sparsify's defaults, not the {name} "
            f"recipe's: {', '.join(gaps)}; add `extends: {name}` to the file to start from that recipe")
