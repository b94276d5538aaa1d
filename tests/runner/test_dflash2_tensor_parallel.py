"""A DFlash2 draft at TP=2 on CPU (gloo): the convolutions and the selector are replicated, the draft layers sharded;
greedy, penalised (host propose + verify), logprob and seeded sampled outputs equal TP=1's."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dflash2_drafts import build_dflash2_draft, save_published
from tests.support.tiny_models import save_tiny_model
from tests.support.tp_testing import check_tp2_matches_tp1, cpu_flags

pytest.importorskip("dflash.model")


def test_dflash2_tp2_matches_tp1(tmp_path: Path) -> None:
    """Qwen3 target with an odd vocabulary (the lm_head's last shard padded: the selector's top-k reads the gathered
    logits), random DFlash2 draft, prefill chunks mixed into verify steps."""
    target = save_tiny_model("qwen3", tmp_path / "target", vocab_size=95)
    save_published(build_dflash2_draft(target, [0, 2], 4, top_k=5), tmp_path / "draft")
    flags = cpu_flags(tmp_path / "target", speculative_algorithm="DFLASH",
                      speculative_draft_model_path=str(tmp_path / "draft"), enable_mixed_chunk=True)
    check_tp2_matches_tp1(flags)
