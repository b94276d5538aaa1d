"""A draft tap on the target's last layer is the final-normed hidden (HF `hidden_states[-1]`, what z-lab's
`dflash_generate` and its drafts use); other taps stay the output of layer i (CPU, fp32).

Two checks: the captured aux equals HF's `hidden_states[i + 1]` column by column (eager forward and the piecewise
segments on static buffers), and DFlash per-cycle acceptance equals the reference with last-layer taps, for Llama
and Qwen3 targets, with and without a sliding-window draft layer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from blockspec import Engine
from blockspec.batch import ForwardMode, build_batch
from blockspec.request import Req, SamplingParams
from tests.support.draft_training import train_tiny_draft
from tests.support.tiny_models import save_tiny_draft, save_tiny_model
from blockspec.runner.piecewise_graph import PiecewiseGraphRunner

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("dflash.model")
from tests.support.dflash_reference import assert_matches_reference  # noqa: E402

LAST = 3  # the tiny targets have 4 layers


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("capture", [(0, 2, LAST), (LAST, 1), (LAST,)])
def test_aux_equals_hf_hidden_states(tmp_path: Path, kind: str, capture: tuple[int, ...]) -> None:
    hf = save_tiny_model(kind, tmp_path)
    engine = Engine(model_path=str(tmp_path), device="cpu", dtype="float32", page_size=16, max_total_tokens=512,
                    skip_tokenizer_init=True)
    runner = engine.runner
    tokens = [5, 17, 33, 8, 61, 2, 44, 90, 12, 7, 3]
    req = Req(tokens, SamplingParams())
    req.pool_row = runner.req_to_token.acquire()
    runner.allocator.grow(req, len(tokens), runner.req_to_token)
    batch = build_batch(
        ForwardMode.EXTEND, [tokens], [0], [req.pool_row], runner.req_to_token.table, [len(tokens) - 1], capture
    )
    pcg = PiecewiseGraphRunner(runner.model, runner.attention, [16], capture, runner.device)
    with torch.inference_mode():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        expected = torch.cat([states[i + 1][0] for i in capture], dim=-1)
        eager = runner.model(batch, runner.attention)
        piecewise = pcg.forward(batch, use_graphs=False)
    torch.testing.assert_close(eager.aux_hidden, expected)
    torch.testing.assert_close(piecewise.aux_hidden, expected)
    h = hf.config.hidden_size
    last_column = capture.index(LAST)
    torch.testing.assert_close(eager.aux_hidden[:, last_column * h:(last_column + 1) * h], eager.hidden)
    runner.allocator.release(req)
    runner.req_to_token.release(req.pool_row)


SLIDING: dict[str, Any] = {
    "use_sliding_window": True, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
}

# kind, taps, block, sliding-window first draft layer
CASES = [
    ("llama", [0, 2, LAST], 8, False),
    ("qwen3", [1, LAST], 8, False),
    ("llama", [0, 2, LAST], 8, True),
    ("qwen3", [1, LAST], 8, True),
]


@pytest.mark.parametrize("kind,layer_ids,block,sliding", CASES)
def test_last_layer_tap_matches_dflash_reference(
    tmp_path: Path, kind: str, layer_ids: list[int], block: int, sliding: bool
) -> None:
    target = save_tiny_model(kind, tmp_path / "target", residual_scale=0.3)
    overrides = SLIDING if sliding else {}
    draft = save_tiny_draft(tmp_path / "draft", target, layer_ids, block, num_layers=2, **overrides)
    if sliding:
        assert draft.layers[0].self_attn.sliding_window == SLIDING["sliding_window"]
    train_tiny_draft(draft, target, steps=200)  # NOTE: trained on hidden_states[i + 1], the reference's features
    draft.save_pretrained(tmp_path / "draft")
    lengths = assert_matches_reference(draft, target, tmp_path, block)
    # NOTE: the comparison must cover multi-token acceptance, or a wrong feature would go unnoticed
    assert max(n for cycle_lengths in lengths for n in cycle_lengths) >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_captured_piecewise_graphs_tap_the_final_norm(tmp_path: Path, kind: str) -> None:
    """Replayed piecewise CUDA graphs (static buffers) leave the final-normed hidden in the last layer's column."""
    from tests.support.extend_batches import extend_batch, release

    save_tiny_model(kind, tmp_path)
    engine = Engine(model_path=str(tmp_path), device="cuda", dtype="float32", max_total_tokens=2048,
                    skip_tokenizer_init=True)
    runner = engine.runner
    capture = (1, LAST)
    pcg = PiecewiseGraphRunner(runner.model, runner.attention, [16, 64], capture, runner.device)
    pcg.capture()
    h = runner.target_config.hidden_size
    for total in (5, 16, 40):
        batch, reqs = extend_batch(engine, [0], [total], capture)
        with torch.inference_mode():
            expected = runner.model(batch, runner.attention)
            got = pcg.forward(batch)
        assert got.aux_hidden is not None and expected.aux_hidden is not None
        torch.testing.assert_close(got.aux_hidden, expected.aux_hidden, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.aux_hidden[:, h:], got.hidden)  # NOTE: the same normed tensor, copied in the graph
        release(engine, reqs)
