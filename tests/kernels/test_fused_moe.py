"""The fused MoE kernels (layers/fused_moe.py) equal the torch reference experts (layers/moe.py): the expert sort,
the gate/up + SiLU·mul and down grouped GEMMs and the weighted combine. Under Triton's interpreter on CPU (root
conftest; fp32 and fp16: the interpreter's bf16 dot is wrong), natively on CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.layers.fused_moe import (  # noqa: E402
    ExpertTiles, choose_tiles, fused_experts, fused_route, sort_by_expert, tile_choices,
)
from blockspec.layers.kernel_mode import KernelMode  # noqa: E402
from blockspec.layers.moe import ExpertRouting, SparseMoe, experts_reference, route  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def routed(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights, ids = route(torch.randn(tokens, experts, generator=generator), ExpertRouting(experts, top_k, False))
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [
    (1, 8, 2, 16), (7, 8, 3, 16), (40, 4, 2, 16), (9, 64, 8, 32),
    (70, 160, 3, 16),  # more pairs than one count chunk (64 at 256 expert lanes), more experts than a chunk of blocks
    (700, 128, 8, 16),  # a wide verify's routing: 44 count chunks of 128 pairs, 2 sentinel chunks of 4,096 rows
])
def test_sort_groups_pairs_by_expert_in_padded_blocks(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    """Every pair exactly once, in its expert's block; groups in ascending expert order, padded with the sentinel
    after the group's pairs; blocks past the used ones marked -1; the buffer as large as the worst case needs."""
    _, ids = routed(tokens, experts, top_k, seed=tokens)
    pair_rows, block_experts = sort_by_expert(ids, experts, block_m)
    num_pairs = tokens * top_k
    assert pair_rows.shape[0] % block_m == 0 and block_experts.shape[0] == pair_rows.shape[0] // block_m
    assert pair_rows.shape[0] >= num_pairs + min(experts, num_pairs) * (block_m - 1)
    rows, blocks, flat = pair_rows.cpu().tolist(), block_experts.cpu().tolist(), ids.flatten().cpu().tolist()
    real = [p for p in rows if p < num_pairs]
    assert sorted(real) == list(range(num_pairs))
    hit = sorted(set(flat))
    used = [b for b in blocks if b >= 0]
    assert sorted(set(used)) == hit and used == sorted(used)  # only the experts hit, ascending
    assert all(b == -1 for b in blocks[len(used):])
    for index, expert in enumerate(used):
        block = rows[index * block_m:(index + 1) * block_m]
        assert all(flat[p] == expert for p in block if p < num_pairs)
        assert all(p == num_pairs for p in block[block.index(num_pairs):]) if num_pairs in block else True
    for expert in hit:  # each expert's pairs padded to whole blocks
        assert used.count(expert) == -(-flat.count(expert) // block_m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden,intermediate,experts,top_k", [
    (1, 32, 16, 8, 2),  # a decode step: 2 experts read
    (5, 48, 24, 8, 3),  # hidden and intermediate not powers of two (masked tiles)
    (33, 32, 16, 4, 2),  # more rows than one 16-row block per expert
    (20, 64, 80, 16, 4),  # several column tiles of the intermediate size
    (50, 32, 16, 8, 3),  # more pairs than one 128-pair chunk of the sort
    (8, 48, 24, 128, 8),  # Qwen3-30B-A3B's routing (128 experts, top 8): more blocks than one chunk of the count
])
def test_fused_experts_equal_reference(dtype: torch.dtype, tokens: int, hidden: int, intermediate: int,
                                       experts: int, top_k: int) -> None:
    generator = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype).to(DEVICE)
    gate_up = (torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5).to(dtype).to(DEVICE)
    down = (torch.randn(experts, hidden, intermediate, generator=generator) / intermediate**0.5).to(dtype).to(DEVICE)
    weights, ids = routed(tokens, experts, top_k, seed=tokens)
    expected = experts_reference(x.float(), gate_up.float(), down.float(), weights, ids)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused_experts(x, gate_up, down, weights, ids).float(), expected, **tolerance)
    out = torch.full_like(x, float("nan"))
    assert fused_experts(x, gate_up, down, weights, ids, out) is out
    torch.testing.assert_close(out.float(), expected, **tolerance)
    tall = fused_experts(x, gate_up, down, weights, ids, tiles=ExpertTiles(32, 16, 16))  # other tiles, same sums
    torch.testing.assert_close(tall.float(), expected, **tolerance)
    # NOTE: one pair per block, no sort: what a single token runs, right for any batch (an expert hit twice is read
    # twice)
    direct = fused_experts(x, gate_up, down, weights, ids, tiles=ExpertTiles(16, 16, 16, direct=True))
    torch.testing.assert_close(direct.float(), expected, **tolerance)
    folded = fused_experts(x, gate_up, down, weights, ids, tiles=ExpertTiles(16, 16, 16, direct=True, down_columns=16))
    torch.testing.assert_close(folded.float(), expected, **tolerance)
    # NOTE: on CUDA with PDL the down programs ask L2 for their weights before they wait (a hint: the same sums)
    prefetched = fused_experts(x, gate_up, down, weights, ids,
                               tiles=ExpertTiles(16, 16, 16, direct=True, prefetch_down=True))
    torch.testing.assert_close(prefetched.float(), expected, **tolerance)


def test_direct_tiles_with_down_columns_fold_the_combine_into_the_down_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct tiles with down_columns launch no combine kernel: the down projection sums the token's k experts itself;
    sorted tiles, and direct ones without down_columns (DIRECT_TILES: the fold read slower on the H100), keep the
    combine. down_columns belongs to direct tiles only."""
    import blockspec.layers.fused_moe as fused_moe

    combined: list[object] = []
    real = fused_moe._combine_kernel

    class Recording:
        def __getitem__(self, grid: object) -> object:
            combined.append(grid)
            return real[grid]

    monkeypatch.setattr(fused_moe, "_combine_kernel", Recording())
    x = torch.randn(1, 32, device=DEVICE)
    gate_up, down = torch.randn(8, 32, 32, device=DEVICE) / 6, torch.randn(8, 32, 16, device=DEVICE) / 4
    weights, ids = routed(1, 8, 2, seed=3)
    expected = experts_reference(x, gate_up, down, weights, ids)
    folded = ExpertTiles(16, 16, 16, direct=True, down_columns=16)
    torch.testing.assert_close(fused_experts(x, gate_up, down, weights, ids, tiles=folded), expected, rtol=1e-5,
                               atol=1e-5)
    assert combined == []
    torch.testing.assert_close(fused_experts(x, gate_up, down, weights, ids, tiles=ExpertTiles(16, 16, 16)), expected,
                               rtol=1e-5, atol=1e-5)
    assert len(combined) == 1
    unfolded = fused_experts(x, gate_up, down, weights, ids, tiles=ExpertTiles(16, 64, 128, direct=True))
    torch.testing.assert_close(unfolded, expected, rtol=1e-5, atol=1e-5)
    assert len(combined) == 2
    with pytest.raises(ValueError, match="direct tiles"):
        ExpertTiles(16, 64, 128, down_columns=16)
    for not_unfolded_direct in (dict(), dict(direct=True, down_columns=16)):
        with pytest.raises(ValueError, match="prefetch_down"):
            ExpertTiles(16, 64, 128, prefetch_down=True, **not_unfolded_direct)
    for columns in (8, 24):
        with pytest.raises(ValueError, match="power of two"):
            ExpertTiles(16, 64, 128, direct=True, down_columns=columns)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k,renormalize", [
    (1, 8, 2, True), (7, 60, 3, False), (33, 128, 8, True), (5, 16, 1, False), (4, 4, 4, True),
])
def test_fused_route_equals_route(dtype: torch.dtype, tokens: int, experts: int, top_k: int,
                                  renormalize: bool) -> None:
    """One launch == route's softmax → top-k → renormalisation: the same experts with the same weights (fp32), in
    the same slots where no two logits tie (fp16 logits tie often: torch.topk orders ties its own way)."""
    generator = torch.Generator().manual_seed(tokens * experts)
    logits = (torch.randn(tokens, experts, generator=generator) * 3).to(dtype)
    expected_weights, expected_ids = route(logits, ExpertRouting(experts, top_k, renormalize))
    weights, ids = fused_route(logits.to(DEVICE), experts, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    weights, ids = weights.cpu(), ids.cpu()
    if dtype != torch.float32:
        ids, order = ids.sort(dim=-1)
        weights = weights.gather(-1, order)
        expected_ids, order = expected_ids.sort(dim=-1)
        expected_weights = expected_weights.gather(-1, order)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def test_fused_route_breaks_ties_by_the_lower_expert() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    weights, ids = fused_route(logits.to(DEVICE), 6, 3, True)
    assert ids.cpu().tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights.cpu(), torch.full((2, 3), 1 / 3))
    empty_weights, empty_ids = fused_route(torch.empty(0, 6, device=DEVICE), 6, 3, True)
    assert empty_weights.shape == empty_ids.shape == (0, 3)


def test_sparse_moe_backends_agree() -> None:
    """SparseMoe with backend "triton" == backend "torch" on the same weights (router included), into a buffer."""
    torch.manual_seed(0)
    routing = ExpertRouting(num_experts=8, top_k=2, renormalize=True)
    reference = SparseMoe(32, 16, routing, backend="torch").to(DEVICE)
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.2)
    fused = SparseMoe(32, 16, routing, backend="triton").to(DEVICE)
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(11, 32, device=DEVICE)
    out = torch.empty_like(x)
    with torch.no_grad():
        expected = reference(x)
        assert fused(x, out) is out
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_tiles_follow_rows_per_expert_unless_batch_invariant() -> None:
    assert choose_tiles(8, 128, num_tokens=1).direct  # a decode step of one token, top 8: no sort
    assert choose_tiles(16, 128, num_tokens=2).block_m == 16 and not choose_tiles(16, 128, num_tokens=2).direct
    assert choose_tiles(32 * 16 * 8, 128).block_m == 32  # 32 verify blocks of 16 tokens: 32 rows per expert
    assert choose_tiles(64 * 16 * 8, 128).block_m == 64  # 64 verify blocks: 64 rows per expert
    assert choose_tiles(4096 * 8, 128).block_m == 64  # a 4096-token extend
    assert choose_tiles(64 * 16 * 8, 128, batch_invariant=True) == choose_tiles(8, 128, batch_invariant=True)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_warm_up_runs_every_tile_set_serving_can_choose(batch_invariant: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up's MoE warm-up (SparseMoe.warm_up) launches the kernels with each tile set choose_tiles can return for
    any batch, so no batch compiles a new variant while serving (the GPU proof: tests/gpu/test_warm_start_gpu.py)."""
    import blockspec.layers.fused_moe as fused_moe

    reachable = {choose_tiles(pairs, experts, batch_invariant, num_tokens=tokens) for experts in (4, 8, 128)
                 for pairs in range(1, 9000) for tokens in (1, 2)}
    assert reachable == set(tile_choices(batch_invariant))
    layer = SparseMoe(32, 16, ExpertRouting(num_experts=8, top_k=2, renormalize=True), backend="triton",
                      kernels=KernelMode(batch_invariant=batch_invariant)).to(DEVICE)
    launched: list[ExpertTiles] = []
    real = fused_moe.fused_experts

    def recording(*args: object, tiles: ExpertTiles, **kwargs: object) -> torch.Tensor:
        launched.append(tiles)
        return real(*args, tiles=tiles, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_moe, "fused_experts", recording)
    with torch.no_grad():
        assert layer.warm_up() == len(launched)
    assert set(launched) == reachable
    # NOTE: the torch reference compiles nothing
    assert SparseMoe(32, 16, ExpertRouting(8, 2, True), backend="torch").warm_up() == 0


def test_empty_batch() -> None:
    x = torch.empty(0, 32, device=DEVICE)
    weights, ids = torch.empty(0, 2, device=DEVICE), torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    assert fused_experts(x, torch.zeros(4, 32, 32, device=DEVICE), torch.zeros(4, 32, 16, device=DEVICE), weights,
                         ids).shape == (0, 32)
