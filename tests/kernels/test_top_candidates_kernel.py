"""DDTree's fused vocabulary top-B (speculative/top_candidates_kernel.py) equals the torch form
(tree_build.top_candidates): the tokens of a stable descending sort of the fp32 rows (ties to the smaller token), the
log-probabilities up to the logsumexp's rounding; for fp32 and bf16 logits, budgets of 1, below and at a power of two
and the whole vocabulary, vocabularies that end inside a chunk, tied rows and the best tokens packed into one chunk or
one group. Under Triton's interpreter on CPU (root conftest; small chunks so a row spans several), natively on CUDA."""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.models.logit_scale import LogitScale  # noqa: E402
from blockspec.speculative.top_candidates_kernel import (  # noqa: E402
    MAX_FUSED_BUDGET, chunk_size, fused_top_candidates,
)
from blockspec.speculative.tree_build import build_tree, top_candidates, tree_from_candidates  # noqa: E402
from tests.support.tree_checks import assert_same_tree_up_to_ties  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def assert_matches_torch(logits: torch.Tensor, budget: int, chunk: Optional[int] = None) -> None:
    scores, tokens = fused_top_candidates(logits, budget, chunk)
    expected_scores, _ = top_candidates(logits, budget)
    # NOTE: torch's top-k order among ties is unspecified; a stable sort's is the kernel's (the smaller token first)
    expected_tokens = logits.float().sort(dim=-1, descending=True, stable=True).indices[..., :budget]
    assert scores.dtype == torch.float32 and tokens.dtype == torch.int64
    assert scores.shape == tokens.shape == (*logits.shape[:-1], budget)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-5)
    assert bool((scores[..., :-1] >= scores[..., 1:]).all())


@pytest.mark.parametrize("bs,depths,vocab,budget,chunk,dtype", [
    (1, 3, 1000, 5, 256, torch.float32),  # four chunks, the last one 232 tokens long
    (2, 1, 700, 1, 256, torch.bfloat16),  # one token
    (1, 2, 1500, 24, 512, torch.float32),  # a budget that is not a power of two (K 32)
    (1, 2, 1500, 24, 512, torch.bfloat16),
    (2, 1, 300, 16, None, torch.float32),  # the default chunk, longer than the vocabulary
    (1, 1, 40, 40, None, torch.bfloat16),  # the budget is the whole vocabulary
])
def test_fused_top_candidates_equal_the_torch_form(bs: int, depths: int, vocab: int, budget: int,
                                                    chunk: Optional[int], dtype: torch.dtype) -> None:
    torch.manual_seed(vocab + budget)
    logits = (torch.randn(bs, depths, vocab, device=DEVICE) * 3.0).to(dtype)
    assert_matches_torch(logits, budget, chunk)


# NOTE: caps above the scaled rows' largest logits (about 10 and 20 here), as a draft's are: a saturated tanh makes
# fp32 ties of distinct logits, which the kernel's tanh and torch's order by their last bits
@pytest.mark.parametrize("scale", [LogitScale(0.25), LogitScale(1.0, 8.0), LogitScale(2.0, 30.0)])
def test_raw_head_outputs_are_scaled_in_the_kernels(scale: LogitScale) -> None:
    """A draft's output multiplier and softcap, applied as the kernels read the raw bf16 rows (no fp32 copy): the
    torch form's tokens and log-probabilities of the scaled fp32 rows, whose softmax differs from the raw rows' (a
    multiplier sharpens or flattens it; the softcap squeezes the largest logits together)."""
    torch.manual_seed(7)
    raw = (torch.randn(2, 3, 1000, device=DEVICE) * 3.0).to(torch.bfloat16)
    scores, tokens = fused_top_candidates(raw, 12, 256, scale=scale)
    scaled = scale.apply(raw)
    expected_scores, _ = top_candidates(scaled, 12)
    assert torch.equal(tokens, scaled.sort(dim=-1, descending=True, stable=True).indices[..., :12])
    torch.testing.assert_close(scores, expected_scores, rtol=1e-5, atol=1e-5)
    unscaled_scores, _ = fused_top_candidates(raw, 12, 256)
    assert not torch.allclose(scores, unscaled_scores, atol=1e-2)
    tree = build_tree(raw, 12, scale)
    assert_same_tree_up_to_ties(tree, tree_from_candidates(expected_scores, tokens), expected_scores, tokens)


def test_ties_go_to_the_smaller_token() -> None:
    """Integer logits (a handful of values, so ties across groups and chunks), -0.0 next to 0.0 (equal in torch):
    the kernel's order is the stable sort's."""
    torch.manual_seed(1)
    logits = torch.randint(-2, 2, (2, 1, 1100), device=DEVICE).float()
    logits[0, 0, ::7] = -0.0
    assert_matches_torch(logits, 20, 512)
    assert_matches_torch(logits.bfloat16(), 3, 256)


@pytest.mark.parametrize("where", ["one chunk", "one group", "chunk edges"])
def test_best_tokens_packed_anywhere(where: str) -> None:
    """The top-B all in one chunk, all in one group (and its neighbours), or one at each end of every chunk: a chunk
    hands over K groups, the merge takes K groups, wherever they lie."""
    torch.manual_seed(2)
    logits = torch.randn(1, 1, 1200, device=DEVICE)
    if where == "one chunk":
        logits[0, 0, 520:560] += 10.0
    elif where == "one group":
        logits[0, 0, 272:288] += 10.0
        logits[0, 0, 288:300] += 9.0
    else:
        logits[0, 0, 255::256] += 10.0
        logits[0, 0, 0::256] += 10.0
    assert_matches_torch(logits, 24, 512)


def test_scratch_content_is_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every scratch entry the merge reads was written by the first launch: poisoned buffers change nothing."""
    real_empty = torch.empty

    def poisoned_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor.fill_(2 ** 40 + 7)

    torch.manual_seed(3)
    logits = torch.randn(1, 2, 900, device=DEVICE)
    expected = fused_top_candidates(logits, 9, 256)
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    got = fused_top_candidates(logits, 9, 256)
    monkeypatch.undo()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_budgets_out_of_range_and_above_the_fused_limit() -> None:
    logits = torch.randn(1, 2, 300, device=DEVICE)
    for budget in (0, 301):
        with pytest.raises(ValueError):
            fused_top_candidates(logits, budget)
    with pytest.raises(ValueError):
        fused_top_candidates(logits, 20, 256)  # NOTE: K 32 needs chunks of at least 32 groups
    with pytest.raises(ValueError, match="up to"):
        fused_top_candidates(logits, MAX_FUSED_BUDGET + 1)  # NOTE: build_tree takes the torch form there


def test_chunks_grow_to_bound_the_merge() -> None:
    assert chunk_size(49152, 16) == 4096 and chunk_size(49152, 128) == 4096
    assert chunk_size(151936, 32) == 4096 and chunk_size(151936, 128) == 8192
    assert chunk_size(40, 128) == 4096


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab,budget", [(49152, 64), (128256, 128), (151936, 32)])
def test_native_shapes_in_a_cuda_graph(vocab: int, budget: int) -> None:
    """At real vocabularies (default chunks) in bf16: equal to the torch form, and captured in a CUDA graph and
    replayed on fresh logits, equal to the eager launch; build_tree on CUDA gives the tree from these candidates."""
    torch.manual_seed(vocab)
    logits = torch.randn(8, 15, vocab, device="cuda").to(torch.bfloat16) * 3.0
    assert_matches_torch(logits, budget)
    static = logits.clone()
    fused_top_candidates(static, budget)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scores, tokens = fused_top_candidates(static, budget)
    static.copy_(torch.randn_like(logits) * 3.0)
    graph.replay()
    expected = fused_top_candidates(static, budget)
    assert torch.equal(scores, expected[0]) and torch.equal(tokens, expected[1])
    candidates = fused_top_candidates(logits, budget)
    # NOTE: bf16 logits over 150k tokens tie within a depth's candidates; the build orders ties its own way
    assert_same_tree_up_to_ties(build_tree(logits, budget), tree_from_candidates(*candidates), *candidates)
