"""DFlash at temperature > 0 samples exactly the target's distribution (rejection sampling is lossless)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from tests.support.sampling_distribution import VOCAB, assert_samples_follow_target, save_spread_target
from tests.support.tiny_models import save_tiny_draft

pytest.importorskip("dflash.model")


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("params, verify_lengths", [
    ({"temperature": 1.0, "top_p": 1.0}, None), ({"temperature": 0.7, "top_p": 0.9}, None),
    ({"temperature": 1.0, "top_p": 1.0}, [1, 2, 4, 3, 1, 4]),
], ids=["t1", "t0.7-p0.9", "t1-changing-verify-length"])
def test_sampled_continuations_follow_target(
    tmp_path: Path, params: dict[str, float], verify_lengths: Optional[list[int]], kind: str
) -> None:
    """Also with the verify length changing every cycle (1: a plain sampled target step); a dense and an MoE target."""
    target = save_spread_target(tmp_path / "target", kind)
    # NOTE: a sharp draft (output_multiplier) proposes from a distribution far from the target's, so a wrong
    # accept rule or residual shows up clearly in the sampled distribution.
    save_tiny_draft(tmp_path / "draft", target, [0, 2], 4, num_layers=1, mask_token_id=VOCAB - 1, output_multiplier=6.0)
    assert_samples_follow_target(target, tmp_path, params, verify_lengths)
