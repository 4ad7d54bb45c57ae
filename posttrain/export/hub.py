"""Pushing an export folder to the Hugging Face hub (private), or listing what would be pushed.

The token comes from the `HF_TOKEN` environment variable only; it is never printed, logged or
written, and is scrubbed from any error message the hub client raises.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TOKEN_ENV = "HF_TOKEN"


def folder_files(folder: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """Relative paths (POSIX) of every file under `folder`, plus `extra` names, sorted."""
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    return sorted(files | set(extra))


def hub_token() -> str:
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise RuntimeError(
            f"export.push_to_hub is set and export.dry_run is false, but {TOKEN_ENV} is not set; "
            f"export a write token as {TOKEN_ENV} (or set export.dry_run: true)"
        )
    return token


def push_plan(folder: Path, repo_id: str, dry_run: bool, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """What a push uploads: repo, visibility, files (`extra` names files not written yet)."""
    return {"repo_id": repo_id, "private": True, "dry_run": dry_run, "files": folder_files(folder, extra)}


def push_folder(folder: Path, plan: dict[str, Any], commit_message: str) -> str:
    """Create the private repo if needed and upload `folder`; returns the commit URL."""
    from huggingface_hub import HfApi

    token = hub_token()
    api = HfApi(token=token)
    try:
        api.create_repo(plan["repo_id"], private=True, exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=plan["repo_id"], folder_path=str(folder), commit_message=commit_message,
                                   repo_type="model")
    except Exception as err:  # the hub client raises many types; report one, without the token
        message = f"{type(err).__name__}: {err}".replace(token, "***")
        raise RuntimeError(f"push of {folder} to {plan['repo_id']} failed: {message}") from None
    return str(getattr(commit, "commit_url", commit))
