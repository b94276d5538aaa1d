"""Llama-3.x and Qwen3 causal LMs over the paged KV cache. Parameter names match HF checkpoints."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from blockspec.attention.base import AttentionBackend
from blockspec.layers.activation import GatedMLP
from blockspec.layers.linear import StackedLinear, linear_into
from blockspec.layers.norm import RMSNorm
from blockspec.kv.pool import LayerKVStore
from blockspec.layers.rotary import QKNorm, RotaryEmbedding
from blockspec.models.config import TargetConfig
from blockspec.batch import ForwardBatch


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [len(batch.logits_rows), vocab], float32
    # [T, len(capture_layer_ids) * hidden] or None; from a piecewise graph a view of its static buffer, valid only
    # until the next extend
    aux_hidden: Optional[torch.Tensor]
    hidden: Optional[torch.Tensor]  # [T, hidden] final-normed hidden of every token (None from a graph)
    aux_consumed: bool = False  # a piecewise graph already passed aux_hidden to its consumer (DFlash: draft KV)


class SelfAttention(nn.Module):
    def __init__(self, config: TargetConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = StackedLinear(h, [self.q_size, self.kv_size, self.kv_size], ["q_proj", "k_proj", "v_proj"], bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def project(
        self,
        normed: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        store: Optional[LayerKVStore] = None,
        qkv_out: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(q, k, v, kv_stored): q/k normed (Qwen3) and rotated; on CUDA k and v also land in `store` if given.
        With `qkv_out` [T, (Hq + 2 Hk) D] the projection is written there (on CUDA q, k, v are then views of it)."""
        t = normed.shape[0]
        qkv = linear_into(self.qkv_proj, normed, qkv_out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        qk_norm = QKNorm.of(self.q_norm, self.k_norm) if self.qk_norm else None
        rotated_q, k, kv_stored = rotary.apply(positions, q, k, v, qk_norm, store)
        assert rotated_q is not None
        return rotated_q, k, v, kv_stored


class DecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layer_id)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def pre_attention(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        store: Optional[LayerKVStore] = None,
        qkv_out: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """(q, k, v, residual, kv_stored); `hidden` is the previous layer's MLP output (or the embeddings, residual
        None). With `store`, the new K/V may be written to the cache here (kv_stored tells); `qkv_out` as in
        SelfAttention.project."""
        if residual is None:
            residual = hidden.clone()
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        q, k, v, kv_stored = self.self_attn.project(normed, positions, rotary, store, qkv_out)
        return q, k, v, residual, kv_stored

    def post_attention(
        self, attn: torch.Tensor, residual: torch.Tensor, mlp_out: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual); the layer's output is their sum. `mlp_out`: optional buffer for the MLP output."""
        normed, residual = self.post_attention_layernorm.add_and_norm(self.self_attn.o_proj(attn), residual)
        return self.mlp(normed, mlp_out), residual

    def forward(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        rotary: RotaryEmbedding,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer_id = self.self_attn.layer_id
        store = backend.pool.layer_store(layer_id, batch.out_cache_loc)
        q, k, v, residual, kv_stored = self.pre_attention(hidden, residual, batch.positions, rotary, store)
        return self.post_attention(backend.forward(q, k, v, layer_id, batch, kv_stored=kv_stored), residual)


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
        residual: Optional[torch.Tensor] = None
        captured: dict[int, torch.Tensor] = {}
        capture = set(batch.capture_layer_ids)
        for layer_id, layer in enumerate(self.model.layers):
            hidden, residual = layer(hidden, residual, self.model.rotary, batch, backend)
            if layer_id in capture:
                captured[layer_id] = hidden + residual  # the output of layer `layer_id`
        aux = torch.cat([captured[i] for i in batch.capture_layer_ids], dim=-1) if captured else None
        assert residual is not None
        hidden, _ = self.model.norm.add_and_norm(hidden, residual)
        rows = hidden[batch.logits_rows]
        logits = self.compute_logits(rows) if batch.float_logits else self.lm_head(rows)
        return ModelOutput(logits, aux, hidden)
