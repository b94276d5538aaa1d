"""Tiny random HF checkpoints written to disk, for oracle tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

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


# NOTE: Qwen3-MoE: 8 experts, top 2; layer 2 dense (mlp_only_layers), the others sparse. "qwen3_moe_step2": every
# second layer sparse (decoder_sparse_step), top 3 renormalised (norm_topk_prob).
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[2])
QWEN3_MOE_STEP2 = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=2,
                       norm_topk_prob=True)
MODEL_CLASSES = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "qwen3_moe_step2": Qwen3MoeForCausalLM}


def tiny_config(kind: str, **overrides: Any) -> LlamaConfig | Qwen3Config | Qwen3MoeConfig:
    fields = {**TINY, **overrides}
    if kind == "llama":
        return LlamaConfig(rope_scaling=dict(LLAMA3_ROPE), **fields)
    if kind == "llama_tied":
        return LlamaConfig(rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=True, **fields)
    if kind == "qwen3":
        return Qwen3Config(head_dim=16, **fields)
    if kind in ("qwen3_moe", "qwen3_moe_step2"):
        return Qwen3MoeConfig(head_dim=16, **{**(QWEN3_MOE if kind == "qwen3_moe" else QWEN3_MOE_STEP2), **fields})
    raise ValueError(kind)


def build_tiny_model(kind: str, seed: int = 0, residual_scale: float = 1.0, **overrides: Any) -> PreTrainedModel:
    """`residual_scale` < 1 shrinks every layer's contribution: the target becomes more predictable, so a
    briefly trained draft reaches multi-token acceptance."""
    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    model = MODEL_CLASSES.get(kind, LlamaForCausalLM)(config).eval()
    with torch.no_grad():
        # NOTE: random tiny models have near-tied logits; a sharper head makes greedy argmax decisive (and a
        # sharper router, the top-k choice of experts). Experts ×4: at HF's init scale they barely move the
        # residual stream (greedy tokens hardly change without them), so a routing or combine error would go unseen.
        model.lm_head.weight.mul_(4.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.mul_(4.0)
                layer.mlp.experts.gate_up_proj.mul_(4.0)
                layer.mlp.experts.down_proj.mul_(4.0 * residual_scale)
            else:
                layer.mlp.down_proj.weight.mul_(residual_scale)
    return model


def save_tiny_model(
    kind: str, directory: Path, seed: int = 0, residual_scale: float = 1.0, **overrides: Any
) -> PreTrainedModel:
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
