"""Triton attention kernels equal the torch reference backend for every attention kind.

On CPU they run under TRITON_INTERPRET=1 (set by the root conftest; fp32/fp16: the interpreter's bf16 dot is
wrong); on CUDA natively."""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

triton = pytest.importorskip("triton")

from blockspec.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from blockspec.attention.triton_backend import (  # noqa: E402
    BLOCK_POLICY, DECODE_POLICY, DEFAULT_ATTENTION_KERNELS, EXTEND_POLICY, SMALL_EXTEND_POLICY, WIDE_BLOCK_POLICY,
    AttentionKernels, KernelTiles, TritonAttentionBackend, launch_policy,
)
from blockspec.attention.triton_kernels import merge_splits_kernel, paged_attention_kernel  # noqa: E402
from blockspec.batch import ForwardMode  # noqa: E402
from tests.support.attention_cases import CASES, DEVICE, make_case  # noqa: E402


@pytest.mark.parametrize("mode,prefix,new,page,window,draft_causal", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("max_splits", [1, 4])
def test_triton_matches_torch(mode, prefix, new, page, window, draft_causal, dtype, max_splits) -> None:
    heads, kv_heads, head_dim = 4, 2, 16
    if dtype == torch.float16 and DEVICE.type == "cpu" and max_splits == 4:
        pytest.skip("one fp16 sweep on CPU is enough")
    batch, pool_a, pool_b, q, k, v = make_case(mode, prefix, new, page, heads, kv_heads, head_dim, dtype)
    windows = [window]
    causal = [draft_causal] if draft_causal is not None else None
    reference = TorchAttentionBackend(pool_a, head_dim ** -0.5, windows, causal)
    triton_backend = TritonAttentionBackend(
        pool_b, head_dim**-0.5, heads, kv_heads, head_dim, windows, causal, max_splits
    )
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q.float() if dtype == torch.float16 else q, k, v, 0, batch)
    meta = triton_backend.plan(batch)
    if max_splits > 1:
        meta.num_splits = max_splits  # force split-K even at these tiny lengths
    batch.attn_meta = meta
    got = triton_backend.forward(q, k, v, 0, batch)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(pool_b.k[0], pool_a.k[0])


@pytest.mark.parametrize("backend_kind", ["torch", "triton"])
def test_kv_stored_skips_the_backend_store(backend_kind: str) -> None:
    """With kv_stored=True (the rope kernel already wrote K/V) the backend neither writes k, v nor needs them."""
    heads, kv_heads, head_dim = 4, 2, 16
    batch, pool_a, pool_b, q, k, v = make_case(
        ForwardMode.VERIFY, [4, 90], [8, 8], 4, heads, kv_heads, head_dim, torch.float32
    )
    reference = TorchAttentionBackend(pool_a, head_dim ** -0.5)
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q, k, v, 0, batch)
    pool_b.store(0, batch.out_cache_loc, k, v)
    backend = (
        TorchAttentionBackend(pool_b, head_dim ** -0.5) if backend_kind == "torch"
        else TritonAttentionBackend(pool_b, head_dim ** -0.5, heads, kv_heads, head_dim)
    )
    batch.attn_meta = backend.plan(batch)
    got = backend.forward(
        q, torch.full_like(k, float("nan")), torch.full_like(v, float("nan")), 0, batch, kv_stored=True
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool_b.k[0], pool_a.k[0])


@pytest.mark.parametrize("tiles", [
    KernelTiles(16, 32, 4, 2), KernelTiles(64, 64, 4, 3), KernelTiles(128, 32, 8, 2),
    KernelTiles(16, 32, 4, 2, mask_edges_only=True), KernelTiles(64, 64, 4, 3, mask_edges_only=True),
])
@pytest.mark.parametrize("mode,prefix,new", [
    (ForwardMode.EXTEND, [16, 3], [40, 70]), (ForwardMode.VERIFY, [4, 90, 13], [8, 8, 8]),
    (ForwardMode.DRAFT, [4, 90], [8, 8]),
])
def test_every_tile_shape_matches_torch(
    tiles: KernelTiles, mode: ForwardMode, prefix: list[int], new: list[int]
) -> None:
    """The tile shape is a pure launch choice (benchmarks/tune_attention.py picks it): results must not depend on it."""
    heads, kv_heads, head_dim = 4, 2, 16
    batch, pool_a, pool_b, q, k, v = make_case(mode, prefix, new, 1, heads, kv_heads, head_dim, torch.float32)
    reference = TorchAttentionBackend(pool_a, head_dim ** -0.5)
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q, k, v, 0, batch)
    backend = TritonAttentionBackend(pool_b, head_dim ** -0.5, heads, kv_heads, head_dim)
    meta = backend.plan(batch)
    meta.tiles, meta.num_splits = tiles, 2
    batch.attn_meta = meta
    out = torch.full((q.shape[0], heads * head_dim), float("nan"), device=DEVICE)
    got = backend.forward(q, k, v, 0, batch, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_launch_policy_and_split_count() -> None:
    """Llama-8B heads (32/8): decode rows 4, a 10-token verify block 40, a 256-token extend 1024."""
    backend = TritonAttentionBackend(None, 1.0, 32, 8, 128)  # type: ignore[arg-type]
    assert launch_policy(4, 1, 8) is DECODE_POLICY and launch_policy(40, 16, 8) is BLOCK_POLICY
    assert launch_policy(40, 32, 8) is WIDE_BLOCK_POLICY and WIDE_BLOCK_POLICY.tiles.mask_edges_only
    assert launch_policy(1024, 1, 8) is SMALL_EXTEND_POLICY and launch_policy(1024, 8, 8) is EXTEND_POLICY
    # NOTE: a DDTree verify of 32 nodes at group 3 (99 rows) is a block, not an extend
    assert launch_policy(99, 1, 3) is SMALL_EXTEND_POLICY and launch_policy(99, 1, 3, block=True) is BLOCK_POLICY
    assert launch_policy(260, 64, 8, block=True) is WIDE_BLOCK_POLICY

    def splits(rows: int, bs: int, max_seq: int) -> int:
        return backend.choose_splits(bs, rows, launch_policy(rows, bs, 8), max_seq)

    assert splits(40, 1, 8202) == 16 and splits(40, 4, 8202) == 8  # small batches: fill the GPU with splits
    assert splits(40, 16, 8202) == 2  # at least min_splits even when programs abound
    assert splits(40, 32, 8202) == 1 and splits(40, 64, 8202) == 1  # from 256 (request, KV head) pairs: unsplit
    assert splits(40, 1, 40) == 1  # never below min_split_keys keys per split
    assert splits(4, 64, 8202) == 2 and splits(4, 1, 8202) == 16
    assert splits(1024, 1, 256) == 1 and splits(1024, 1, 8192) == 2  # extends split only over long cached prefixes
    assert TritonAttentionBackend(None, 1.0, 32, 8, 128, max_splits=1).choose_splits(  # type: ignore[arg-type]
        64, 40, BLOCK_POLICY, 8202) == 1


@pytest.mark.parametrize("merge_tile", [32, 128, 96])
def test_merge_over_head_blocks(monkeypatch: pytest.MonkeyPatch, merge_tile: int) -> None:
    """The split merge covers heads in blocks (1 or 4 of 6 heads per program here, masked at the end)."""
    import blockspec.attention.triton_backend as triton_backend_module

    monkeypatch.setattr(triton_backend_module, "MERGE_TILE", merge_tile)
    heads, kv_heads, head_dim = 6, 2, 16
    batch, pool_a, pool_b, q, k, v = make_case(
        ForwardMode.VERIFY, [4, 90], [8, 8], 1, heads, kv_heads, head_dim, torch.float32
    )
    reference = TorchAttentionBackend(pool_a, head_dim ** -0.5)
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q, k, v, 0, batch)
    backend = TritonAttentionBackend(pool_b, head_dim ** -0.5, heads, kv_heads, head_dim)
    meta = backend.plan(batch)
    meta.num_splits = 2
    batch.attn_meta = meta
    torch.testing.assert_close(backend.forward(q, k, v, 0, batch), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", [ForwardMode.VERIFY, ForwardMode.DRAFT, ForwardMode.DECODE, ForwardMode.EXTEND])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("mask_edges_only", [False, True])
def test_padded_head_dim_small_tiles(mode: ForwardMode, splits: int, mask_edges_only: bool) -> None:
    """Head dim 24 (padded to 32 lanes, masked) with 16-key tiles: many whole tiles, a causal edge, split ends."""
    heads, kv_heads, head_dim = 4, 2, 24
    new = {ForwardMode.DECODE: [1, 1], ForwardMode.EXTEND: [8, 5]}.get(mode, [8, 8])  # verify/draft: uniform
    batch, pool_a, pool_b, q, k, v = make_case(mode, [70, 33], new, 1, heads, kv_heads, head_dim, torch.float32)
    reference = TorchAttentionBackend(pool_a, head_dim ** -0.5)
    batch.attn_meta = reference.plan(batch)
    expected = reference.forward(q, k, v, 0, batch)
    backend = TritonAttentionBackend(pool_b, head_dim ** -0.5, heads, kv_heads, head_dim)
    meta = backend.plan(batch)
    meta.tiles, meta.num_splits = KernelTiles(16, 16, 4, 2, mask_edges_only), splits
    batch.attn_meta = meta
    torch.testing.assert_close(backend.forward(q, k, v, 0, batch), expected, atol=1e-4, rtol=1e-4)


def test_uniform_modes_refuse_ragged_batches() -> None:
    """Decode / verify / draft batches are planned as uniform: ragged token counts are refused, not mis-planned."""
    with pytest.raises(ValueError, match="same number of tokens"):
        make_case(ForwardMode.VERIFY, [70, 33], [8, 5], 1, 4, 2, 16, torch.float32)


def test_backend_launches_the_kernels_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kernels=` (the hook of benchmarks/tune_attention.py): the backend launches those kernels, hands them to
    pdl_launch, and never the defaults; fresh jit copies of the engine's kernels give the default output exactly."""
    import blockspec.attention.triton_backend as triton_backend_module
    from blockspec.pdl import pdl_launch

    assert DEFAULT_ATTENTION_KERNELS == AttentionKernels(paged_attention_kernel, merge_splits_kernel)
    kernels = AttentionKernels(triton.jit(paged_attention_kernel.fn), triton.jit(merge_splits_kernel.fn))
    launched: list[str] = []
    kernels.attention.add_pre_run_hook(lambda *args, **kwargs: launched.append("attention"))
    kernels.merge.add_pre_run_hook(lambda *args, **kwargs: launched.append("merge"))
    inspected: list[Any] = []

    def recording_pdl_launch(tensor: torch.Tensor, kernel: Optional[Any] = None) -> dict[str, bool]:
        inspected.append(kernel)
        return pdl_launch(tensor, kernel)

    monkeypatch.setattr(triton_backend_module, "pdl_launch", recording_pdl_launch)
    heads, kv_heads, head_dim = 4, 2, 16
    batch, pool_a, pool_b, q, k, v = make_case(
        ForwardMode.VERIFY, [4, 90], [8, 8], 1, heads, kv_heads, head_dim, torch.float32
    )
    default = TritonAttentionBackend(pool_a, head_dim ** -0.5, heads, kv_heads, head_dim)
    candidate = TritonAttentionBackend(pool_b, head_dim ** -0.5, heads, kv_heads, head_dim, kernels=kernels)
    assert default.kernels is DEFAULT_ATTENTION_KERNELS and candidate.kernels is kernels
    meta = default.plan(batch)
    meta.num_splits = 2  # both kernels run
    batch.attn_meta = meta
    expected = default.forward(q, k, v, 0, batch)
    assert launched == [] and inspected == [paged_attention_kernel, merge_splits_kernel]
    inspected.clear()
    got = candidate.forward(q, k, v, 0, batch)
    assert launched == ["attention", "merge"] and inspected == [kernels.attention, kernels.merge]
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
