"""Saves a trained draft in z-lab's DFlash or DFlash2 checkpoint format (loads in blockspec and in `dflash`)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from blockspec.models.config import TargetConfig, load_json
from blockspec.models.draft_config import parse_draft_config
from blockspec.models.draft_loading import draft_parameter_name
from blockspec.models.loader import iter_safetensors, resolve_dtype
from blockspec.train.model import DraftArch, TrainableDraft

INDEX_NAME = "model.safetensors.index.json"
# Qwen3 fields the draft's config.json keeps (to_dict() of some transformers versions adds generic model fields too).
QWEN3_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
    "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "use_sliding_window",
    "sliding_window", "max_window_layers", "layer_types", "attention_dropout", "bos_token_id", "eos_token_id",
    "pad_token_id", "transformers_version",
)


def draft_config_dict(
    arch: DraftArch, target: TargetConfig, layer_ids: list[int], block_size: int, mask_token_id: int, dtype: str
) -> dict[str, Any]:
    """A Qwen3 config (so transformers builds the reference model from it) plus DFlash's fields (and DFlash2's)."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=target.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    raw = {key: value for key, value in config.to_dict().items() if key in QWEN3_KEYS}
    dflash_config: dict[str, Any] = {
        "mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in layer_ids],
    }
    if arch.dflash2 is not None:
        fields = arch.dflash2
        dflash_config.update(conv_kernel_size=fields.conv_kernel_size, conv_group_size=fields.conv_group_size,
                             selector_rank=fields.selector_rank, selector_top_k=fields.selector_top_k)
    raw.update(
        architectures=["DFlashDraftModel" if arch.dflash2 is None else "DFlash2DraftModel"],
        model_type="qwen3",
        dtype=dtype,
        block_size=block_size,
        num_target_layers=target.num_layers,
        dflash_config=dflash_config,
    )
    return raw


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy packing in name order; a tensor larger than `max_bytes` gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def save_draft(
    model: TrainableDraft, out_dir: str | Path, config: dict[str, Any], save_dtype: str, max_shard_mb: float = 16.0
) -> Path:
    """config.json + model.safetensors, or model-0000i-of-0000n.safetensors + index when over `max_shard_mb`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("*.safetensors")) + [out / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    dtype = resolve_dtype(save_dtype)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in model.state_dict().items()}
    shards = _shards(tensors, int(max_shard_mb * 1024 * 1024))
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=metadata)
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata=metadata)
            weight_map.update({key: name for key in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_json(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(out / "config.json", config)
    return out


def write_json(path: Path, content: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(content, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def load_trainable_draft(draft_dir: str | Path, target: TargetConfig) -> tuple[TrainableDraft, list[int], int]:
    """(draft with the checkpoint's weights, its target_layer_ids, its block size): to continue training."""
    raw = load_json(Path(draft_dir) / "config.json")
    config = parse_draft_config(raw, target)
    if config.rope.rope_type != "default" or any(config.layer_windows) or any(config.layer_causal):
        raise ValueError(f"{draft_dir}: only drafts with plain rope and full non-causal layers can be trained further")
    arch = DraftArch(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope.theta, num_taps=len(config.target_layer_ids),
        max_position_embeddings=int(raw.get("max_position_embeddings", target.max_position_embeddings)),
        dflash2=config.dflash2, block_size=config.block_size,
    )
    model = TrainableDraft(arch)
    state = {draft_parameter_name(name): t for name, t in iter_safetensors(draft_dir)}
    result = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"{draft_dir}: weights do not match its architecture (missing {result.missing_keys[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]})")
    return model, config.target_layer_ids, config.block_size
