"""A DFlash2 draft at temperature > 0 keeps the target's distribution: proposals are drawn from the selector's softmax
over the top-k candidates (a strict subset of the vocabulary here), and rejection sampling reads that q."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from tests.support.dflash2_drafts import build_dflash2_draft, save_published
from tests.support.sampling_distribution import assert_samples_follow_target, save_spread_target

pytest.importorskip("dflash.model")


@pytest.mark.parametrize("params, verify_lengths", [
    ({"temperature": 0.7, "top_p": 0.9}, None), ({"temperature": 1.0, "top_p": 1.0}, [2, 4, 1, 3, 4]),
], ids=["t0.7-p0.9", "t1-changing-verify-length"])
def test_sampled_continuations_follow_target(
    tmp_path: Path, params: dict[str, float], verify_lengths: Optional[list[int]]
) -> None:
    target = save_spread_target(tmp_path / "target")
    # NOTE: 3 candidates of 6 tokens and a sharp draft: q is far from p and zero on half the vocabulary, so a wrong
    # accept rule or residual shows up clearly in the sampled distribution.
    draft = build_dflash2_draft(target, [0, 2], 4, num_layers=1, top_k=3, output_multiplier=3.0)
    save_published(draft, tmp_path / "draft")
    assert_samples_follow_target(target, tmp_path, params, verify_lengths)
