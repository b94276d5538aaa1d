"""Loads HF-style model directories: config.json + *.safetensors (single or sharded with an index)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator, Optional, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from blockspec.distributed.group import TensorParallel
from blockspec.distributed.shards import ShardLayout, iter_sharded_safetensors
from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode
from blockspec.layers.linear import StackedLinear
from blockspec.layers.moe import StackedExperts
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.config import TargetConfig, load_target_config
from blockspec.models.llama import CausalLM
from blockspec.models.qwen3_moe import Qwen3MoeCausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {root} does not exist")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(p.name) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} names shard(s) missing from {root}: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root}")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# NOTE: the target classes by family (models/config.py SUPPORTED_ARCHITECTURES); a family that changes only the MLPs
# is a CausalLM subclass
MODEL_CLASSES: dict[str, type[CausalLM]] = {"llama": CausalLM, "qwen3": CausalLM, "qwen3_moe": Qwen3MoeCausalLM}


def _stacked_targets(module: nn.Module) -> dict[str, tuple[str, Optional[int], int, int]]:
    """Checkpoint name → (stacked parameter name, expert index or None, row offset, rows) for every StackedLinear
    part (q|k|v, gate|up) and every expert matrix of StackedExperts."""
    targets: dict[str, tuple[str, Optional[int], int, int]] = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, StackedLinear):
            parent = prefix.rsplit(".", 1)[0] + "." if "." in prefix else ""
            for shard in sub.shard_names:
                offset, rows = sub.shard_offset(shard)
                for kind in ("weight", "bias"):
                    if getattr(sub, kind, None) is not None:
                        targets[f"{parent}{shard}.{kind}"] = (f"{prefix}.{kind}", None, offset, rows)
        elif isinstance(sub, StackedExperts):
            for name, part in sub.checkpoint_parts().items():
                targets[f"{prefix}.{name}"] = (f"{prefix}.{part.param}", part.expert, part.offset, part.rows)
    return targets


def load_weights_into(
    module: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], ignore: tuple[str, ...] = ()
) -> None:
    """Copies named tensors into `module` (stacking q|k|v, gate|up and the experts); every parameter must be filled
    exactly."""
    params = dict(module.named_parameters())
    stacked = _stacked_targets(module)
    stacked_params = {param_name for param_name, _, _, _ in stacked.values()}
    expected = {name for name in params if name not in stacked_params} | set(stacked)
    filled: set[str] = set()
    for name, tensor in weights:
        if name.startswith(ignore) or name not in expected:
            if not name.startswith(ignore):
                logger.debug("ignoring checkpoint tensor %s", name)
            continue
        if name in stacked:
            param_name, expert, offset, rows = stacked[name]
            whole = params[param_name] if expert is None else params[param_name][expert]
            target = whole.narrow(0, offset, rows)
        else:
            target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)} in the checkpoint, the config implies "
                f"{tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        filled.add(name)
    missing = sorted(expected - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")


def init_dummy_weights(module: nn.Module, seed: int = 0) -> None:
    """Random weights (norms at 1) for benchmarking without a checkpoint."""
    generator = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)


ModuleType = TypeVar("ModuleType", bound=nn.Module)


def materialise(model: ModuleType, dtype: torch.dtype, device: torch.device) -> ModuleType:
    """A model built on the meta device, given uninitialised memory on `device` in `dtype`. NOTE: the dtype first, on
    the meta device: memory is allocated once, in `dtype` (materialising fp32 and casting afterwards would need twice
    a bf16 model's bytes at its peak)."""
    return model.to(dtype).to_empty(device=device)


def load_target_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int, dummy: bool = False,
    tp: Optional[TensorParallel] = None, kernels: KernelMode = DEFAULT_KERNELS,
) -> tuple[CausalLM, TargetConfig]:
    """The target (this rank's shard of it under `tp`, reading only that shard's slices), its layers in `kernels`."""
    config = load_target_config(model_dir)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.family](config, max_positions, tp, kernels)
    model = materialise(model, dtype, device)
    model.model.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions).to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    ignore = ("lm_head.",) if config.tie_word_embeddings else ()
    if dummy:
        init_dummy_weights(model)
    elif tp is None:
        load_weights_into(model, iter_safetensors(model_dir), ignore=ignore)
    else:
        layout = ShardLayout(config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
                             config.vocab_size, None if config.moe is None else config.moe.expert_intermediate_size)
        load_weights_into(model, iter_sharded_safetensors(safetensors_files(model_dir), layout, tp), ignore=ignore)
    model.eval()
    return model, config
