"""Upload a converted checkpoint folder to the Hugging Face Hub: the repo is created if needed and the
whole folder goes up in one commit that also deletes the repo's other files (a shard of an earlier upload
would be loaded beside the new ones), so the Hub never shows a half-uploaded or mixed model."""
from __future__ import annotations

import shlex
from pathlib import Path

from huggingface_hub import HfApi

from .card import name_repo
from .errors import OutputError


def push_to_hub(out_dir: str | Path, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Upload `out_dir` (written by export_checkpoint) to model repo `repo_id`; returns the repo URL."""
    folder = Path(out_dir)
    if not (folder / "config.json").is_file():
        raise OutputError(f"{folder}: not a checkpoint folder (no config.json), nothing to push")
    name_repo(folder, repo_id)
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", delete_patterns="*",
                          commit_message=f"Upload {folder.name} converted by sparsify")
    except Exception as error:  # HTTP, connection, authentication, local file errors alike: the folder stays
        retry = shlex.join(["hf", "upload", repo_id, str(folder), "--delete", "*"] + (["--private"] if private else []))
        raise OutputError(f"push to the Hub repo {repo_id!r} failed ({type(error).__name__}: {error}); the "
                          f"checkpoint in {folder} is complete: upload it with `{retry}`") from error
    return str(url)
