"""Upload a converted checkpoint folder to the Hugging Face Hub: the repo is created if needed and the
whole folder goes up in one commit, so the Hub never shows a half-uploaded model."""
from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from .errors import OutputError


def push_to_hub(out_dir: str | Path, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Upload `out_dir` (written by export_checkpoint) to model repo `repo_id`; returns the repo URL."""
    folder = Path(out_dir)
    if not (folder / "config.json").is_file():
        raise OutputError(f"{folder}: not a checkpoint folder (no config.json), nothing to push")
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                          commit_message=f"Upload {folder.name} converted by sparsify")
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise OutputError(f"push to the Hub repo {repo_id!r} failed: {error}") from error
    return str(url)
