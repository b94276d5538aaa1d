"""DFlash greedy output and per-cycle acceptance lengths equal z-lab's `dflash_generate` (CPU, fp32)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import save_tiny_draft, save_tiny_model
from tests.support.draft_training import train_tiny_draft

pytest.importorskip("dflash.model")
from tests.support.dflash_reference import assert_matches_reference  # noqa: E402


# NOTE: taps below the last layer here; a last-layer tap (the final-normed hidden, HF's hidden_states[-1]) is
# covered by test_last_layer_tap.py.
CASES = [
    ("llama", [0, 2], 4, False),
    ("llama", [0, 1, 2], 16, False),
    ("qwen3", [1, 2], 4, False),
    ("qwen3", [0, 1, 2], 16, False),
    ("llama", [0, 2], 8, True),
    ("qwen3", [1, 2], 8, True),
]


@pytest.mark.parametrize("kind,layer_ids,block,trained", CASES)
def test_matches_dflash_reference(tmp_path: Path, kind: str, layer_ids: list[int], block: int, trained: bool) -> None:
    target = save_tiny_model(kind, tmp_path / "target", residual_scale=0.3 if trained else 1.0)
    draft = save_tiny_draft(tmp_path / "draft", target, layer_ids, block, num_layers=2 if trained else len(layer_ids))
    if trained:
        train_tiny_draft(draft, target, steps=200)
        draft.save_pretrained(tmp_path / "draft")
    lengths = assert_matches_reference(draft, target, tmp_path, block)
    if trained:  # the comparison must cover multi-token acceptance, not only rejections
        assert max(n for cycle_lengths in lengths for n in cycle_lengths) >= 3
