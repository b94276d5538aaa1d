"""Checkpoints from where users have them: a local directory, or a Hugging Face model id (`org/name`) fetched into
(or found in) the Hugging Face cache with `huggingface_hub.snapshot_download`."""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blockspec.config.engine_config import EngineConfig

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# NOTE: what loading a checkpoint reads; no optimizer states, other weight formats or media
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.md", "LICENSE*"]


def is_repo_id(path_or_id: str) -> bool:
    return bool(_REPO_ID.match(path_or_id)) and not Path(path_or_id).expanduser().exists()


def resolve_checkpoint(path_or_id: str, flag: str) -> str:
    """A local directory for `path_or_id`: itself when it is one (or not an `org/name` id: the loader then reports
    what is missing), else the id's snapshot in the Hugging Face cache, downloaded unless offline. ValueError naming
    the id and HF_HUB_OFFLINE when it cannot be had."""
    if not is_repo_id(path_or_id):
        return path_or_id
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(path_or_id, allow_patterns=CHECKPOINT_FILES)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if constants.HF_HUB_OFFLINE:
            raise ValueError(
                f"{flag} {path_or_id!r} is not a local directory and not in the Hugging Face cache, and HF_HUB_OFFLINE "
                f"is set so nothing is downloaded ({reason}); download it first (`hf download {path_or_id}`) or unset "
                "HF_HUB_OFFLINE"
            ) from exc
        raise ValueError(
            f"{flag} {path_or_id!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"({reason}); check the id and the network (a gated model needs HF_TOKEN), or set HF_HUB_OFFLINE=1 to use "
            "the cache only"
        ) from exc


def with_local_checkpoints(config: "EngineConfig") -> "EngineConfig":
    """`config` with its model, tokenizer and draft paths resolved to local directories (resolve_checkpoint)."""
    import dataclasses

    draft = config.speculative_draft_model_path
    return dataclasses.replace(
        config,
        model_path=resolve_checkpoint(config.model_path, "model_path"),
        tokenizer_path=(
            None if config.tokenizer_path is None else resolve_checkpoint(config.tokenizer_path, "tokenizer_path")
        ),
        speculative_draft_model_path=(
            None if draft is None else resolve_checkpoint(draft, "speculative_draft_model_path")
        ),
    )
