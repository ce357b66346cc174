"""Named recipes: found from the checkout (editable install) and shipped in the wheel (pyproject maps
recipes/ to sparsify/recipes with its YAMLs, and the accelerate launch configs in recipes/accelerate/, as
package data; sparsify.recipe.recipes_dir finds either); a recipe's mistyped setting or missing parent named
with its file, as the command line's mistyped options are."""
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from sparsify.config import overlay
from sparsify.recipe import load_recipe, recipe_names
from sparsify.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_named_recipes_resolve():
    assert {"demo", "paper", "small", "midsize"} <= set(recipe_names())
    assert load_recipe(None, "demo") == load_recipe("demo", "other")
    assert load_recipe(None, "org/model") == load_recipe("pretrained", "demo")  # every other source
    assert load_recipe("small-budget.yaml", "other") == load_recipe("small-budget", "other")  # the file's name too
    with pytest.raises(ConfigError, match="recipe nope not found .*one of: demo"):
        load_recipe("nope", "other")
    with pytest.raises(ConfigError, match="recipe elsewhere/small.yaml not found"):  # a path is a path
        load_recipe("elsewhere/small.yaml", "other")


def test_a_recipe_extends_another_under_its_own_settings(tmp_path):
    small_budget, pretrained = load_recipe("small-budget", "org/model"), load_recipe("pretrained", "org/model")
    assert "extends" not in small_budget and small_budget["weight_decay"] == pretrained["weight_decay"]
    assert (small_budget["distill"], small_budget["l1_log_scale"], small_budget["target_sparsity"]) == (1, 0.2, 0.99)
    assert (small_budget["lr"], small_budget["calibrate_sparsity"]) == (3e-4, 0.95) != (pretrained["lr"], None)
    (tmp_path / "a.yaml").write_text(f"extends: {tmp_path / 'b.yaml'}\nl1: 1\n")
    (tmp_path / "b.yaml").write_text(f"extends: {tmp_path / 'a.yaml'}\nl1: 2\n")
    with pytest.raises(ConfigError, match="a.yaml: extends .*b.yaml, which extends it again"):
        load_recipe(tmp_path / "a.yaml", "org/model")


def test_a_training_length_replaces_the_one_under_it(tmp_path):
    """tokens and passes both set the run's length: either, in a recipe or on the command line, replaces the other
    under it (a recipe extending pretrained with passes runs no 100M tokens); neither leaves it."""
    (tmp_path / "passes.yaml").write_text("extends: small-budget\npasses: 4\n")
    settings = load_recipe(tmp_path / "passes.yaml", "org/model")
    assert settings["passes"] == 4 and "tokens" not in settings
    assert overlay({"tokens": 100, "steps": 5}, {"passes": 2}) == {"steps": 5, "passes": 2}
    assert overlay({"passes": 2}, {"tokens": 100}) == {"tokens": 100}
    assert overlay({"tokens": 100}, {"lr": 1e-4}) == {"tokens": 100, "lr": 1e-4}
    assert overlay({"tokens": 100}, {"passes": 2, "tokens": 50}) == {"passes": 2, "tokens": 50}  # validate refuses


def test_extends_reads_a_path_beside_the_extending_recipe_wherever_it_runs(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "base.yaml").write_text("extends: small-budget\nl1: 5\nlr: 1.0e-4\n")
    (tmp_path / "mine" / "child.yaml").write_text("extends: base.yaml\nlr: 3.0e-4\n")
    monkeypatch.chdir(tmp_path)  # base.yaml is not in the working directory
    child = load_recipe("mine/child.yaml", "org/model")
    assert (child["l1"], child["lr"], child["calibrate_sparsity"]) == (5, 3e-4, 0.95)


def test_pyproject_ships_every_recipe():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"]["sparsify.recipes"] == "recipes" and "sparsify.recipes" in setuptools["packages"]
    assert setuptools["package-data"]["sparsify.recipes"] == ["*.yaml", "accelerate/*.yaml"]
    assert sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")) == recipe_names()  # not accelerate/
    # every subpackage of sparsify and of twell (kernels/; a folder with __init__.py) installs with it
    subpackages = {f"{package}." + ".".join(p.parent.relative_to(ROOT / folder).parts)
                   for package, folder in (("sparsify", "sparsify"), ("twell", "kernels"))
                   for p in (ROOT / folder).glob("*/**/__init__.py")}
    assert "twell.training" in subpackages and subpackages <= set(setuptools["packages"])


def convert_with(recipe):
    return CliRunner().invoke(main, ["convert", "demo", "-o", str(recipe.parent / "out"), "--recipe", str(recipe),
                                     "--dry-run"])


def test_a_mistyped_recipe_setting_names_its_file_and_the_setting_meant(tmp_path):
    (tmp_path / "mine.yaml").write_text("extends: demo\nlearning_rate: 1.0e-3\nl1_warmup: 5\n")
    result = convert_with(tmp_path / "mine.yaml")
    assert result.exit_code == 1
    assert result.output == (f"error: recipe {tmp_path / 'mine.yaml'}: unknown training settings: l1_warmup (did you "
                             "mean l1_warmup_steps?), learning_rate (did you mean lr?)\n")


def test_a_mistyped_setting_in_an_extended_recipe_names_that_recipe(tmp_path):
    (tmp_path / "base.yaml").write_text("extends: demo\nwarmup: 5\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nlr: 1.0e-3\n")
    result = convert_with(tmp_path / "child.yaml")
    assert result.exit_code == 1
    assert f"error: recipe {tmp_path / 'base.yaml'}: unknown training settings: warmup (did you mean" in result.output


def test_a_setting_close_to_none_lists_them_all(tmp_path):
    (tmp_path / "mine.yaml").write_text("extends: demo\nfoo: 1\n")
    result = convert_with(tmp_path / "mine.yaml")
    assert result.exit_code == 1
    assert "unknown training settings: foo (known: batch_size, betas," in result.output


def test_a_recipe_that_extends_a_missing_one_is_named(tmp_path):
    (tmp_path / "mine.yaml").write_text("extends: pretrainde\nlr: 1.0e-3\n")
    result = convert_with(tmp_path / "mine.yaml")
    assert result.exit_code == 1
    assert result.output.startswith(f"error: recipe {tmp_path / 'mine.yaml'}: extends pretrainde, which is not found "
                                    "(a YAML file, or one of: "), result.output
