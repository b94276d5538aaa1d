"""Llama-3.x and Qwen3 causal LMs over the paged KV cache. Parameter names match HF checkpoints."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from blockspec.attention.base import AttentionBackend
from blockspec.layers.activation import GatedMLP
from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.config import TargetConfig
from blockspec.runner.forward_batch import ForwardBatch


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [len(batch.logits_rows), vocab], float32
    aux_hidden: Optional[torch.Tensor]  # [T, len(capture_layer_ids) * hidden] or None
    hidden: Optional[torch.Tensor]  # [T, hidden] final-normed hidden of every token (None from a graph)


class SelfAttention(nn.Module):
    def __init__(self, config: TargetConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(
        self, hidden: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        t = hidden.shape[0]
        q = self.q_proj(hidden).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(batch.positions, q, k)
        return self.o_proj(backend.forward(q, k, v, self.layer_id, batch))


class DecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layer_id)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, batch, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, config: TargetConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions)


class CausalLM(nn.Module):
    """LlamaForCausalLM / Qwen3ForCausalLM (the family only changes q/k norms, set by the config)."""

    def __init__(self, config: TargetConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> ModelOutput:
        batch.attn_meta = backend.plan(batch)
        hidden = batch.input_embeds if batch.input_embeds is not None else self.embed(batch.input_ids)
        captured: list[torch.Tensor] = []
        capture = set(batch.capture_layer_ids)
        for layer_id, layer in enumerate(self.model.layers):
            hidden = layer(hidden, self.model.rotary, batch, backend)
            if layer_id in capture:
                captured.append(hidden)
        if captured:
            order = {layer_id: i for i, layer_id in enumerate(sorted(capture))}
            aux = torch.cat([captured[order[i]] for i in batch.capture_layer_ids], dim=-1)
        else:
            aux = None
        hidden = self.model.norm(hidden)
        return ModelOutput(self.compute_logits(hidden[batch.logits_rows]), aux, hidden)
