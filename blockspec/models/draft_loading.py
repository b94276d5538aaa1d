"""Builds a DFlash or DFlash2 draft (the architecture its config names) and loads its z-lab checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from blockspec.distributed.group import TensorParallel
from blockspec.distributed.shards import ShardLayout, iter_sharded_safetensors
from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.dflash2_draft import DFlash2DraftModel
from blockspec.models.dflash_draft import DFlashDraftModel
from blockspec.models.draft_config import DraftConfig
from blockspec.models.loader import (
    init_dummy_weights, iter_safetensors, load_weights_into, materialise, safetensors_files,
)

# NOTE: published DFlash2 checkpoints store the selector's codebooks as bare tensors; the reference's own
# save_pretrained writes them as embedding weights (`<codebook>.weight`). Both load.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def draft_parameter_name(checkpoint_name: str) -> str:
    """The draft model's parameter name of a checkpoint tensor."""
    name = checkpoint_name.removeprefix("model.")
    for codebook in CODEBOOKS:
        if name == f"{codebook}.weight":
            return codebook
    return name


def load_draft_model(
    draft_dir: str | Path, config: DraftConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
    dummy: bool = False, tp: Optional[TensorParallel] = None, kernels: KernelMode = DEFAULT_KERNELS,
) -> DFlashDraftModel:
    """A DFlash2 draft when the config has DFlash2 fields, else a DFlash one; under `tp` its layers sharded (the
    convolutions and the selector replicated, like fc and the norms)."""
    architecture = DFlash2DraftModel if config.dflash2 is not None else DFlashDraftModel
    with torch.device("meta"):
        model = architecture(config, max_positions, tp, kernels)
    model = materialise(model, dtype, device)
    model.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions).to(device)
    if dummy:
        init_dummy_weights(model, seed=1)
        return model.eval()
    if tp is None:
        tensors = iter_safetensors(draft_dir)
    else:
        layout = ShardLayout(config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size)
        tensors = iter_sharded_safetensors(safetensors_files(draft_dir), layout, tp)
    load_weights_into(model, ((draft_parameter_name(name), tensor) for name, tensor in tensors))
    return model.eval()
