"""push_to_hub: final/ (with merged/) uploaded by the main process at the end; its preflight runs before
anything loads."""

from __future__ import annotations

import os

from finetune.config import RunConfig, hub_repo_id
from finetune.report.trackers import run_name


class PushFailed(RuntimeError):
    """The upload to the Hub failed; the model is saved locally (the message says where and how to upload)."""


def hub_preflight(cfg: RunConfig) -> list[tuple[str, str]]:
    """push_to_hub on the main process, before anything loads: the Hub answers and the token may write."""
    if not cfg.train.push_to_hub:
        return []
    from huggingface_hub import HfApi, constants

    try:
        who = HfApi().whoami()
    except Exception as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 401:
            return [("push_to_hub", "the Hugging Face token was refused (401); log in again (`hf auth login`)")]
        first = (str(e).splitlines() or [""])[0][:200]
        return [
            (
                "push_to_hub",
                f"cannot reach the Hub at {constants.ENDPOINT} ({type(e).__name__}: {first}); check the network, "
                "or set push_to_hub: false and upload final/ later (`hf upload`)",
            )
        ]
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        return [("push_to_hub", "the Hugging Face token is read-only; use a token with write access")]
    return []


def push(cfg: RunConfig, final_dir: str) -> str:
    """Upload final/ (model or adapter, tokenizer, card, run config; merged/ inside it) to hub_model_id."""
    from huggingface_hub import HfApi

    t = cfg.train
    api = HfApi()
    repo_id = hub_repo_id(t)
    try:
        url = api.create_repo(repo_id, private=t.hub_private_repo, exist_ok=True, repo_type="model")
        api.upload_folder(
            repo_id=url.repo_id,
            folder_path=final_dir,
            repo_type="model",
            commit_message=f"finetune: {run_name(t)}",
        )
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:300]
        raise PushFailed(
            f"the upload to the Hub ({repo_id}) failed: {type(e).__name__}: {first}. The model is saved in "
            f"{os.path.abspath(final_dir)}; upload it with `hf upload {repo_id} {os.path.abspath(final_dir)}`"
        ) from None
    return f"{url}"
