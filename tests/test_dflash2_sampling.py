"""A DFlash2 draft at temperature > 0 keeps the target's distribution: proposals are drawn from the selector's softmax
over the top-k candidates (a strict subset of the vocabulary here), and rejection sampling reads that q."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import pytest
import torch

from blockspec import Engine
from dflash2_drafts import build_dflash2_draft, save_published
from test_dflash_sampling import NEW_TOKENS, PROMPT, VOCAB, exact_distribution, marginal, total_variation
from tiny_models import save_tiny_model
from verify_cycling import CyclingVerifyLength

pytest.importorskip("dflash.model")

SAMPLES = 6000


@pytest.mark.parametrize("params, verify_lengths", [
    ({"temperature": 0.7, "top_p": 0.9}, None), ({"temperature": 1.0, "top_p": 1.0}, [2, 4, 1, 3, 4]),
], ids=["t0.7-p0.9", "t1-changing-verify-length"])
def test_sampled_continuations_follow_target(
    tmp_path: Path, params: dict[str, float], verify_lengths: Optional[list[int]]
) -> None:
    target = save_tiny_model("llama", tmp_path / "target", vocab_size=VOCAB, residual_scale=0.5)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo the test models' sharpening: a spread-out distribution
    target.save_pretrained(tmp_path / "target")
    # NOTE: 3 candidates of 6 tokens and a sharp draft: q is far from p and zero on half the vocabulary, so a wrong
    # accept rule or residual shows up clearly in the sampled distribution.
    draft = build_dflash2_draft(target, [0, 2], 4, num_layers=1, top_k=3, output_multiplier=3.0)
    save_published(draft, tmp_path / "draft")
    engine = Engine(
        model_path=str(tmp_path / "target"), device="cpu", dtype="float32", max_total_tokens=8192,
        max_running_requests=256, skip_tokenizer_init=True, speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(tmp_path / "draft"),
    )
    if verify_lengths is not None:
        engine.worker.verify_policy = CyclingVerifyLength(verify_lengths)
    sampling = [
        {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "seed": seed, **params} for seed in range(SAMPLES)
    ]
    outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=sampling)
    counts = Counter(tuple(o["output_ids"]) for o in outputs)
    empirical = Counter({seq: n / SAMPLES for seq, n in counts.items()})
    exact = exact_distribution(target, params)
    stats = engine.get_server_info()["internal_states"][0]
    assert stats["avg_spec_accept_length"] > 1.2  # the draft's proposals were really accepted sometimes
    for positions, bound in [((0,), 0.03), ((1,), 0.03), ((2,), 0.03), ((1, 2), 0.06)]:
        tv = total_variation(marginal(exact, positions), marginal(empirical, positions))
        assert tv < bound, f"positions {positions}: total variation {tv:.3f}"
    info = engine.get_server_info()["kv_cache"]
    assert info["free_slots"] == info["total_slots"]
