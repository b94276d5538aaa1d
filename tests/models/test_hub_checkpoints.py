"""`model_path` as a Hugging Face id (`org/name`): resolved through huggingface_hub's cache (offline here: a snapshot
laid out as the hub writes it), and a clear error naming the id and HF_HUB_OFFLINE when it is not there."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from blockspec import Engine
from blockspec.models.hub import is_repo_id
from tests.support.tiny_models import save_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_from_the_cache(offline_cache: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    save_tiny_model("llama", local)
    repo = offline_cache / "models--tiny-org--tiny-llama"
    shutil.copytree(local, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    flags = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_total_tokens=512)
    by_id = Engine(model_path="tiny-org/tiny-llama", **flags)
    by_dir = Engine(model_path=str(local), **flags)
    assert by_id.model_id == "tiny-org/tiny-llama" and Path(by_id.config.model_path).is_dir()
    params = {"temperature": 0, "max_new_tokens": 6}
    assert by_id.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"] == \
        by_dir.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]


def test_missing_hub_id_offline_names_the_id_and_hf_hub_offline(offline_cache: Path) -> None:
    with pytest.raises(ValueError, match=r"model_path 'no-org/no-model'.*HF_HUB_OFFLINE"):
        Engine(model_path="no-org/no-model", device="cpu", skip_tokenizer_init=True)


def test_local_paths_are_not_hub_ids(tmp_path: Path) -> None:
    assert is_repo_id("Qwen/Qwen3-8B") and not is_repo_id("/abs/path") and not is_repo_id("./rel/dir")
    assert not is_repo_id("a/b/c")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not is_repo_id(str(tmp_path / "org" / "name"))
