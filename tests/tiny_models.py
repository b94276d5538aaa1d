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


def build_tiny_model(kind: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    model = (Qwen3ForCausalLM if kind == "qwen3" else LlamaForCausalLM)(config).eval()
    with torch.no_grad():
        # NOTE: random tiny models have near-tied logits; a sharper head makes greedy argmax decisive.
        model.lm_head.weight.mul_(4.0)
    return model


def save_tiny_model(kind: str, directory: Path, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    model = build_tiny_model(kind, seed, **overrides)
    model.save_pretrained(directory)
    return model
