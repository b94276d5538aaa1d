"""Tiny random HF checkpoints written to disk, for oracle tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, PreTrainedModel

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}


def tiny_config(kind: str, **overrides: Any) -> LlamaConfig | Qwen3Config:
    fields = {**TINY, **overrides}
    if kind == "llama":
        return LlamaConfig(rope_scaling=dict(LLAMA3_ROPE), **fields)
    if kind == "llama_tied":
        return LlamaConfig(rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=True, **fields)
    if kind == "qwen3":
        return Qwen3Config(head_dim=16, **fields)
    raise ValueError(kind)


def build_tiny_model(kind: str, seed: int = 0, residual_scale: float = 1.0, **overrides: Any) -> PreTrainedModel:
    """`residual_scale` < 1 shrinks every layer's contribution: the target becomes more predictable, so a
    briefly trained draft reaches multi-token acceptance."""
    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    model = (Qwen3ForCausalLM if kind == "qwen3" else LlamaForCausalLM)(config).eval()
    with torch.no_grad():
        # NOTE: random tiny models have near-tied logits; a sharper head makes greedy argmax decisive.
        model.lm_head.weight.mul_(4.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
    return model


def save_tiny_model(kind: str, directory: Path, seed: int = 0, residual_scale: float = 1.0, **overrides: Any) -> PreTrainedModel:
    model = build_tiny_model(kind, seed, residual_scale, **overrides)
    model.save_pretrained(directory)
    return model


def save_tiny_draft(
    directory: Path,
    target: PreTrainedModel,
    target_layer_ids: list[int],
    block_size: int,
    num_layers: int = 2,
    seed: int = 1,
    mask_token_id: int | None = None,
    head_dim: int = 16,
    **overrides: Any,
) -> Any:
    """A random z-lab format DFlash draft (built with the `dflash` reference itself) for `target`."""
    from dflash.model import DFlashDraftModel

    torch.manual_seed(seed)
    tc = target.config
    config = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=1e-6,
        **overrides,
    )
    config.architectures = ["DFlashDraftModel"]
    config.num_target_layers = tc.num_hidden_layers
    config.block_size = block_size
    config.dflash_config = {
        "mask_token_id": mask_token_id if mask_token_id is not None else tc.vocab_size - 1,
        "target_layer_ids": list(target_layer_ids),
    }
    draft = DFlashDraftModel(config).eval()
    draft.save_pretrained(directory)
    return draft
