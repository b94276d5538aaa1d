"""KVPool.move on CUDA: the DDTree compaction as one Triton launch over every layer's K and V.

torch's gather and scatter over the stacked [layers, slots, Hk, D] caches split into many launches once the stack
outgrows 32-bit element offsets (TensorIterator's split): 14 of each per cycle on SmolLM2-135M's pool. Here one
program moves one group's pairs (a request's block) for one layer's K or V and one chunk of its Hk·D elements: it loads
every source row of the group, waits for all its threads (so no destination is written before each source is read,
even where the two overlap), then stores them. Programs never share elements: groups hold disjoint slots (the
caller's contract; a graph's padding rows all name the dummy slot, onto itself, and moves onto itself are skipped),
and layers, caches and chunks are disjoint memory."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockspec.pdl import pdl_launch, wait_for_previous_grid

TILE_ELEMENTS = 4096  # NOTE: pairs x chunk columns one program holds in registers
MIN_BLOCK = 16


@triton.jit
def _move_groups_kernel(k_ptr, v_ptr, sources_ptr, destinations_ptr, group_size, layer_stride, row_elements,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """Program (group, 2·layer + cache, chunk): rows sources[group] → destinations[group] of that layer's K
    (cache 0) or V (cache 1), elements [chunk·BLOCK_C, (chunk + 1)·BLOCK_C) of each row (a slot's row is
    row_elements long: the caches are contiguous)."""
    wait_for_previous_grid(PDL)
    group = tl.program_id(0).to(tl.int64)
    layer_cache = tl.program_id(1)
    chunk = tl.program_id(2)
    if layer_cache % 2 == 0:
        base = k_ptr
    else:
        base = v_ptr
    base += (layer_cache // 2).to(tl.int64) * layer_stride
    pairs = tl.arange(0, BLOCK_P)
    pair_valid = pairs < group_size
    sources = tl.load(sources_ptr + group * group_size + pairs, mask=pair_valid, other=0).to(tl.int64)
    destinations = tl.load(destinations_ptr + group * group_size + pairs, mask=pair_valid, other=0).to(tl.int64)
    columns = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    # NOTE: a pair that moves a slot onto itself is skipped: the pairs past a request's walk, and the padding rows of
    # a graph, which all name the dummy slot 0 (so no two programs write the same element)
    moved = pair_valid & (sources != destinations)
    mask = moved[:, None] & (columns < row_elements)[None, :]
    rows = tl.load(base + sources[:, None] * row_elements + columns[None, :], mask=mask)
    tl.debug_barrier()  # NOTE: every thread's loads are done before any thread stores (overlapping pairs)
    tl.store(base + destinations[:, None] * row_elements + columns[None, :], rows, mask=mask)


def move_slot_groups(k_layers: torch.Tensor, v_layers: torch.Tensor, sources: torch.Tensor,
                     destinations: torch.Tensor) -> None:
    """k_layers / v_layers [layers, slots, Hk, D] (contiguous): every layer's rows at sources [G, P] copied to
    destinations [G, P] (int64), group by group; within a group all sources are read before any destination is
    written, and no two groups may touch the same slot (a pair moving a slot onto itself aside)."""
    groups, group_size = sources.shape
    layers, slots = k_layers.shape[:2]
    row_elements = k_layers[0, 0].numel()
    if groups == 0 or group_size == 0:
        return
    block_p = max(MIN_BLOCK, triton.next_power_of_2(group_size))
    block_c = min(max(MIN_BLOCK, triton.next_power_of_2(row_elements)), max(MIN_BLOCK, TILE_ELEMENTS // block_p))
    grid = (groups, 2 * layers, triton.cdiv(row_elements, block_c))
    _move_groups_kernel[grid](
        k_layers, v_layers, sources.contiguous(), destinations.contiguous(), group_size, slots * row_elements,
        row_elements, BLOCK_P=block_p, BLOCK_C=block_c, **pdl_launch(k_layers),
    )
