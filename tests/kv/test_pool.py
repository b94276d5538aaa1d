"""KVPool: the per-layer caches, and `move` (the DDTree compaction) over all layers at once."""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec.kv.pool import KVPool


def _filled_pool(num_layers: int, num_slots: int = 12) -> KVPool:
    pool = KVPool(num_slots, num_layers, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(num_layers)
    for layer in range(num_layers):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=generator))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=generator))
    return pool


def test_move_copies_every_layer_reading_all_sources_first() -> None:
    pool = _filled_pool(num_layers=3)
    before_k = [cache.clone() for cache in pool.k]
    before_v = [cache.clone() for cache in pool.v]
    # NOTE: overlapping: slot 4 is both read (to 2) and written (from 6), slot 2 read (to 3) and written
    sources = torch.tensor([[2, 4, 6]])
    destinations = torch.tensor([[3, 2, 4]])
    pool.move(sources, destinations)
    for layer in range(3):
        for before, after in ((before_k[layer], pool.k[layer]), (before_v[layer], pool.v[layer])):
            expected = before.clone()
            expected[destinations[0]] = before[sources[0]]
            assert torch.equal(after, expected)


def test_layer_stores_write_through_to_the_stacked_caches() -> None:
    pool = _filled_pool(num_layers=2)
    k = torch.full((1, 2, 4), 7.0)
    pool.store(1, torch.tensor([5]), k, -k)
    assert torch.equal(pool.k_layers[1, 5], k[0]) and torch.equal(pool.v_layers[1, 5], -k[0])
    assert all(cache.is_contiguous() for cache in (*pool.k, *pool.v))


def _scatter_ops(pool: KVPool) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pool.move(torch.tensor([[1], [2]]), torch.tensor([[3], [4]]))
    return sum(event.count for event in prof.key_averages() if event.key == "aten::index_put_")


def test_move_is_one_scatter_per_stack_whatever_the_layer_count() -> None:
    """Each op is a kernel launch inside the DDTree cycle's graph: a launch per layer and cache was 2 × layers."""
    assert _scatter_ops(_filled_pool(num_layers=2)) == _scatter_ops(_filled_pool(num_layers=30)) == 2
