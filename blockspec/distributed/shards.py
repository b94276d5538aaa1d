"""Sharded weight loading: each rank reads only its slices of the safetensors (`safe_open(...).get_slice`).

Column-parallel weights (q, k, v, gate, up; the vocabulary rows of embed_tokens / lm_head) are cut along dim 0,
row-parallel ones (o, down) along dim 1; everything else (norms, the draft's fc, an MoE router) is read whole. An
expert's gate / up / down (`mlp.experts.{e}.*`) is cut like a dense MLP's, by the expert intermediate size.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors import safe_open

from blockspec.distributed.group import TensorParallel


@dataclass(frozen=True)
class ShardLayout:
    """The sizes a model's checkpoint names are sharded by."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: Optional[int] = None  # None: no embedding / lm_head (the DFlash draft)
    expert_intermediate_size: Optional[int] = None  # the experts' (`mlp.experts.{e}.*`) of a mixture of experts


@dataclass(frozen=True)
class Cut:
    dim: int  # 0: rows (column-parallel), 1: columns (row-parallel)
    start: int
    length: int
    padded_length: int  # rows this rank holds (> length only for the last vocabulary shard)
    zeros: bool = False  # NOTE: a row-parallel bias lives on rank 0 only, so the all-reduce adds it once


def _local_ffn(name: str, layout: ShardLayout, tp: TensorParallel) -> int:
    """This rank's share of the intermediate size of the MLP `name` belongs to (an expert's or the dense one)."""
    if ".experts." in name:
        assert layout.expert_intermediate_size is not None, f"{name}: the layout has no expert intermediate size"
        return tp.split(layout.expert_intermediate_size, "moe_intermediate_size")
    return tp.split(layout.intermediate_size, "intermediate_size")


def cut_for(name: str, layout: ShardLayout, tp: TensorParallel) -> Optional[Cut]:
    """This rank's cut of checkpoint tensor `name`, None for a replicated one."""
    parts = name.rsplit(".", 2)
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    d = layout.head_dim
    local_heads = tp.split(layout.num_heads, "num_attention_heads")
    local_kv = tp.local_kv_heads(layout.num_kv_heads)
    local_ffn = _local_ffn(name, layout, tp) if module in ("gate_proj", "up_proj", "down_proj") else 0
    if module == "q_proj":
        return Cut(0, tp.rank * local_heads * d, local_heads * d, local_heads * d)
    if module in ("k_proj", "v_proj"):
        start = tp.kv_head_start(layout.num_kv_heads) * d
        return Cut(0, start, local_kv * d, local_kv * d)
    if module in ("gate_proj", "up_proj"):
        return Cut(0, tp.rank * local_ffn, local_ffn, local_ffn)
    if module in ("o_proj", "down_proj"):
        width = local_heads * d if module == "o_proj" else local_ffn
        if kind == "bias":
            return Cut(0, 0, 0, 0, zeros=True) if tp.rank else None
        return Cut(1, tp.rank * width, width, width)
    if module in ("embed_tokens", "lm_head") and layout.vocab_size is not None:
        start, rows = tp.vocab_shard(layout.vocab_size)
        return Cut(0, start, max(0, min(rows, layout.vocab_size - start)), rows)
    return None


def read_cut(handle: Any, name: str, cut: Optional[Cut]) -> torch.Tensor:
    """The tensor `name` of an open safetensors file, cut for this rank (only the slice is read)."""
    if cut is None:
        return handle.get_tensor(name)
    if cut.zeros:
        return handle.get_tensor(name).zero_()
    view = handle.get_slice(name)
    part = view[cut.start:cut.start + cut.length] if cut.dim == 0 else view[:, cut.start:cut.start + cut.length]
    if cut.padded_length > cut.length:
        padding = part.new_zeros((cut.padded_length - cut.length, *part.shape[1:]))
        part = torch.cat([part, padding])
    return part


def iter_sharded_safetensors(
    files: list[Path], layout: ShardLayout, tp: TensorParallel, rename: dict[str, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's cut) for every tensor of `files`; `rename` maps a checkpoint prefix to the model's."""
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                model_name = name
                for old, new in (rename or {}).items():
                    if model_name.startswith(old):
                        model_name = new + model_name[len(old):]
                yield model_name, read_cut(handle, name, cut_for(model_name, layout, tp))
