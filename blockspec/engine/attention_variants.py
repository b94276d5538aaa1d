"""Every Triton attention kernel variant an engine can launch, and one tiny launch of each to compile it.

A variant of paged_attention_kernel is fixed by the launch tiles and split count (`launch_policy` and
`TritonAttentionBackend.choose_splits` from the batch size, query rows and longest sequence), by the layer's
causality and window, and by the dtype of the per-request index arrays (int64 from `build_batch` for extends, int32
from `plan` for uniform batches); head layout, dtypes and strides are fixed per backend. The batch shapes an engine
can run are bounded by its flags, so the reachable (tiles, splits) pairs are enumerated over them here, and each
variant is compiled by a one-request launch over the dummy req→token row (it reads and writes only the dummy page).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import triton

from blockspec.attention.base import PagedBackendBase, layer_is_causal, layer_window
from blockspec.attention.triton_backend import (
    KernelTiles, LaunchPolicy, TritonAttentionBackend, TritonAttentionMeta, block_mode, launch_policy,
)
from blockspec.batch import ForwardBatch, ForwardMode

ROW_BLOCK = 16  # NOTE: every policy's block_m and row threshold is a multiple of this (checked by the tests)


@dataclass(frozen=True)
class AttentionWorkload:
    """How an engine calls one backend in one mode: new tokens per request in [min_q, max_q], up to
    `max_batch_size` requests, sequences (cached + new) of at most `max_seq_len` tokens."""

    backend: TritonAttentionBackend
    mode: ForwardMode
    min_q: int
    max_q: int
    max_batch_size: int
    max_seq_len: int
    tree: bool = False  # a DDTree verify: the kernel's TREE variants (ForwardBatch.tree_mask)


@dataclass(frozen=True)
class AttentionVariant:
    mode: ForwardMode
    tiles: KernelTiles
    splits: int
    layer_id: int  # the first layer of its (causal, window) class
    # NOTE: a DDTree verify's rows per request (B + 1), 0 without a tree: the warm-up's tree mask has the served
    # mask's strides, [bs, B + 1, B + 1] (Triton specialises an integer argument of 1, so a 1 x 1 mask compiled
    # another variant than serving launches)
    tree_rows: int = 0

    def describe(self) -> str:
        t = self.tiles
        edges = ", edge masks" if t.mask_edges_only else ""
        tree = f", tree of {self.tree_rows} rows" if self.tree_rows else ""
        return (f"{self.mode.value}{tree} {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}{edges}, "
                f"{self.splits} split(s), layer {self.layer_id}")


def query_lengths(min_q: int, max_q: int, group: int) -> Iterator[int]:
    """The shortest query length of each run of lengths whose rows (q x group) fill the same number of ROW_BLOCK
    blocks: within a run the launch policy and every cdiv(rows, block_m) are the same."""
    q = min_q
    while q <= max_q:
        yield q
        blocks = triton.cdiv(q * group, ROW_BLOCK)
        q = max(q + 1, blocks * ROW_BLOCK // group + 1)


def _split_test_lengths(policy: LaunchPolicy, shortest: int, longest: int, max_splits: int) -> set[int]:
    """Sequence lengths at which choose_splits can change (its doubling thresholds), within [shortest, longest]."""
    lengths = {shortest, longest}
    splits = 1
    while splits < max_splits:
        threshold = splits * 2 * policy.min_split_keys
        if shortest <= threshold <= longest:
            lengths.add(threshold)
        splits *= 2
    return lengths


def reachable_launches(workload: AttentionWorkload) -> set[tuple[KernelTiles, int]]:
    """Every (tiles, splits) the backend picks for some batch of the workload."""
    backend = workload.backend
    group = backend.num_heads // backend.num_kv_heads
    # NOTE: splits depend on (batch size, rows) only through the program count; among batches of one
    # (policy, programs) the one with the shortest queries allows the shortest sequences, so it reaches every split.
    # NOTE: once programs * 2 > policy.max_programs, more programs (longer queries, same batch size) can only give
    # the splits `min_splits` forces, which the first such query (allowing the shortest sequences) already gives.
    # For one batch size each policy holds one interval of query lengths (checked by the tests), so a saturated
    # policy that is also the longest query's ends the scan.
    shortest: dict[tuple[LaunchPolicy, int], tuple[int, int, int]] = {}
    block = block_mode(workload.mode)
    for batch_size in range(1, workload.max_batch_size + 1):
        last_policy = launch_policy(workload.max_q * group, batch_size, backend.num_kv_heads, block)
        for q in query_lengths(workload.min_q, workload.max_q, group):
            rows = q * group
            policy = launch_policy(rows, batch_size, backend.num_kv_heads, block)
            programs = batch_size * backend.num_kv_heads * triton.cdiv(rows, policy.tiles.block_m)
            saturated = programs * 2 > policy.max_programs
            known = shortest.get((policy, programs))
            if known is None or q < known[2]:
                shortest[(policy, programs)] = (batch_size, rows, q)
            if saturated and policy == last_policy:
                break
    launches: set[tuple[KernelTiles, int]] = set()
    for (policy, _), (batch_size, rows, q) in shortest.items():
        if q > workload.max_seq_len:
            continue
        for seq_len in _split_test_lengths(policy, q, workload.max_seq_len, backend.max_splits):
            launches.add((policy.tiles, backend.choose_splits(batch_size, rows, policy, seq_len)))
    return launches


def layer_classes(backend: PagedBackendBase, mode: ForwardMode) -> list[int]:
    """The first layer of each (causal, window) class of the backend's layers in `mode`."""
    first: dict[tuple[bool, Optional[int]], int] = {}
    for layer_id in range(len(backend.pool.k)):
        key = (
            layer_is_causal(mode, backend.draft_layer_causal, layer_id),
            layer_window(backend.sliding_windows, layer_id),
        )
        first.setdefault(key, layer_id)
    return sorted(first.values())


def workload_variants(workload: AttentionWorkload) -> list[AttentionVariant]:
    launches = sorted(reachable_launches(workload), key=lambda launch: (repr(launch[0]), launch[1]))
    layers = layer_classes(workload.backend, workload.mode)
    tree_rows = workload.max_q if workload.tree else 0  # NOTE: a tree workload's one query length, B + 1
    return [AttentionVariant(workload.mode, tiles, splits, layer, tree_rows) for tiles, splits in launches
            for layer in layers]


def launch_variant(backend: TritonAttentionBackend, variant: AttentionVariant, req_to_token: torch.Tensor,
                   dummy_row: int) -> None:
    """One request, one query token, one key (the dummy row's slot), with the variant's tiles and splits. q, k, v
    are views of one projection buffer as the models pass them (same strides, so the same specialisation)."""
    k_cache = backend.pool.k[variant.layer_id]
    device, dtype = k_cache.device, k_cache.dtype
    hq, hk, d = backend.num_heads, backend.num_kv_heads, backend.head_dim
    qkv = torch.zeros((1, (hq + 2 * hk) * d), dtype=dtype, device=device)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    index_dtype = torch.int64 if variant.mode is ForwardMode.EXTEND else torch.int32
    one = torch.ones(1, dtype=torch.int64, device=device)
    batch = ForwardBatch(
        mode=variant.mode, input_ids=one * 0, positions=one * 0, out_cache_loc=one * 0,
        req_rows=one * dummy_row, seq_lens=one, seq_lens_cpu=[1], extend_lens_cpu=[1], logits_rows=one * 0,
        req_to_token=req_to_token, uniform_q_len=None if variant.mode is ForwardMode.EXTEND else 1,
        tree_mask=(torch.ones((1, variant.tree_rows, variant.tree_rows), dtype=torch.bool, device=device)
                   if variant.tree_rows else None),
    )
    batch.attn_meta = TritonAttentionMeta(
        torch.zeros(1, dtype=index_dtype, device=device), torch.ones(1, dtype=index_dtype, device=device), 1,
        variant.splits, variant.tiles,
    )
    backend.forward(q.view(1, hq, d), k.view(1, hk, d), v.view(1, hk, d), variant.layer_id, batch, kv_stored=True)
