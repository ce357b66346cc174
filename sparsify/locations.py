"""Where a command reads and writes: the model source (the demo, a checkpoint folder or a Hub id), the demo's
files and the output folder. Imports no torch or transformers, so that the CLI checks these paths before it imports
the modules that load models: a mistyped path fails at once."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import OutputError, SourceError

# The model_types of families.FAMILIES, here without torch, so that the CLI tells a supported source from its
# config.json before importing it (tests/test_families.py checks that the two agree).
FAMILY_NAMES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"})

DATA_REQUIRED = "--data is required (local .txt/.json/.jsonl/.parquet files or folder, or a datasets name)"
SAMPLE_DATA_REQUIRED = ("--data is required: the text whose training blocks give the prompts and whose held-out text "
                        "the folder keeps")


def demo_model_path() -> Path:
    """The embedded small SiLU Llama (made by recipes/make_demo.py)."""
    return Path(__file__).parent / "demo" / "model"


def demo_corpus_path() -> Path:
    """The embedded demo corpus folder (train.jsonl, valid.jsonl)."""
    return Path(__file__).parent / "demo" / "corpus"


def resolve_source(source: str | Path) -> str:
    """A local folder path or a Hub id for `source`; SourceError for a folder that cannot be a checkpoint."""
    if str(source) == "demo":
        path = demo_model_path()
        if not (path / "config.json").is_file():
            raise SourceError(f"the demo model is missing at {path}; remake it with recipes/make_demo.py")
        return str(path)
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SourceError(f"{source}: not a folder (expected a checkpoint folder with config.json)")
        if not (path / "config.json").is_file():
            raise SourceError(f"{source}: no config.json in this folder, so it is not a model checkpoint")
        return str(path)
    # Hub ids are "name" or "owner/name"; anything else that does not exist is a mistyped path.
    if str(source).startswith((".", "/", "~")) or str(source).endswith("/") or str(source).count("/") > 1 or \
            "\\" in str(source):
        raise SourceError(f"{source}: no such folder")
    if problem := hub_id_problem(str(source)):  # now, not after importing torch
        raise SourceError(f"{source}: not a local folder, and not a Hub model id ({problem})")
    return str(source)


def family_config(where: str) -> dict | None:
    """The config.json of `where` (resolve_source's: a folder, or a Hub id, read from the local cache without asking
    the Hub) where it names a family in FAMILY_NAMES; None where it does not, is not at hand or does not read."""
    config = Path(where) / "config.json"
    if not Path(where).is_dir():
        from huggingface_hub import try_to_load_from_cache  # no torch, no request

        cached = try_to_load_from_cache(where, "config.json")
        if not isinstance(cached, str):
            return None
        config = Path(cached)
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) and values.get("model_type") in FAMILY_NAMES else None


def hub_id_problem(repo_id: str) -> str | None:
    """Why the Hub cannot hold a repository named `repo_id` (huggingface_hub's first line), or None."""
    from huggingface_hub.errors import HFValidationError  # imports no torch
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        return str(error).splitlines()[0]
    return None


def check_hub_repo(repo_id: str) -> None:
    """OutputError where `repo_id` (--push-to-hub) is no id the Hub can hold, or no Hub token is at hand to push
    with: said before training, not after it."""
    if problem := hub_id_problem(repo_id):
        raise OutputError(f"--push-to-hub {repo_id}: not a Hub repository id ({problem})")
    from huggingface_hub import get_token  # HF_TOKEN, else the file `hf auth login` writes

    if get_token() is None:
        raise OutputError(f"--push-to-hub {repo_id}: not logged in to the Hub: run `hf auth login`, or set HF_TOKEN "
                          "to a token with write access")


def check_output_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """OUT as a Path; OutputError if it is a file, a non-empty folder and `overwrite` is False, or cannot be
    written (checked before a conversion trains: the nearest existing folder above it must be writable)."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"{out}: exists and is not empty (pass --overwrite to replace it)")
    above = out.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise OutputError(f"{out}: cannot be written, {above} is a file")
    if not os.access(above, os.W_OK | os.X_OK):  # the checkpoint is staged beside OUT and renamed into place
        raise OutputError(f"{out}: cannot be written, {above} is not writable")
    return out
