"""Llama-3.x and Qwen3 causal LMs over the paged KV cache. Parameter names match HF checkpoints.

The forward is cut at each attention into pieces (`CausalLM.run_piece`, state in `PieceState`): the eager forward
runs them with attention in between, and so do the piecewise CUDA graphs, with static buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from blockspec.attention.base import AttentionBackend
from blockspec.batch import ForwardBatch
from blockspec.distributed.group import TensorParallel
from blockspec.kv.pool import LayerKVStore
from blockspec.layers.activation import GatedMLP
from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode
from blockspec.layers.linear import Linear, StackedLinear, linear_into
from blockspec.layers.norm import RMSNorm
from blockspec.layers.parallel import VocabParallelEmbedding, VocabParallelLMHead, greedy_head_tokens
from blockspec.layers.rotary import QKNorm, RotaryEmbedding
from blockspec.models.config import TargetConfig
from blockspec.models.pieces import PieceState


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [len(batch.logits_rows), vocab], float32 (batch.argmax_only: their argmax, [rows] int64)
    # [T, len(capture_layer_ids) * hidden] or None; from a piecewise graph a view of its static buffer, valid only
    # until the next extend
    aux_hidden: Optional[torch.Tensor]
    hidden: Optional[torch.Tensor]  # [T, hidden] final-normed hidden of every token (None from a graph)
    aux_consumed: bool = False  # a piecewise graph already passed aux_hidden to its consumer (DFlash: draft KV)


class SelfAttention(nn.Module):
    """Under tensor parallelism this rank's heads only (q|k|v column-parallel, o row-parallel: the caller sums)."""

    def __init__(self, config: TargetConfig, layer_id: int, tp: Optional[TensorParallel] = None,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads if tp is None else tp.split(config.num_heads, "num_attention_heads")
        self.num_kv_heads = config.num_kv_heads if tp is None else tp.local_kv_heads(config.num_kv_heads)
        self.head_dim = config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = StackedLinear(
            h, [self.q_size, self.kv_size, self.kv_size], ["q_proj", "k_proj", "v_proj"], bias, kernels
        )
        self.o_proj = Linear(self.num_heads * d, h, bias, kernels)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k, v [T, Hk, D]: views of the projection qkv [T, (Hq + 2 Hk) D]."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
        )

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
        q, k, v = self.split_heads(linear_into(self.qkv_proj, normed, qkv_out))
        qk_norm = QKNorm.of(self.q_norm, self.k_norm) if self.qk_norm else None
        rotated_q, k, kv_stored = rotary.apply(positions, q, k, v, qk_norm, store)
        assert rotated_q is not None
        return rotated_q, k, v, kv_stored


class DecoderLayer(nn.Module):
    """`mlp`: the layer's MLP, called as `mlp(x [T, H], out)` → [T, H] summed over TP ranks (GatedMLP, SparseMoe)."""

    def __init__(self, config: TargetConfig, layer_id: int, mlp: nn.Module, tp: Optional[TensorParallel] = None,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layer_id, tp, kernels)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderModel(nn.Module):
    """`mlps`: each layer's MLP, in layer order."""

    def __init__(self, config: TargetConfig, max_positions: int, mlps: list[nn.Module],
                 tp: Optional[TensorParallel] = None, kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size) if tp is None
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, mlp, tp, kernels) for i, mlp in enumerate(mlps))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions)


class CausalLM(nn.Module):
    """LlamaForCausalLM / Qwen3ForCausalLM (the family only changes q/k norms, set by the config). A family that
    keeps this attention and changes the MLPs subclasses it and overrides `build_mlp` (models/qwen3_moe.py).

    With `tp` this rank's shard: vocab-parallel embedding and lm_head (full logits on every rank), sharded heads and
    MLP, the o / down projections summed over ranks; hidden states, aux hidden and logits are replicated.
    `kernels`: how every layer computes (KernelMode; batch-invariant under --enable-deterministic-inference)."""

    def __init__(self, config: TargetConfig, max_positions: int, tp: Optional[TensorParallel] = None,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        assert tp is None or not kernels.batch_invariant, "batch-invariant kernels need tp_size 1"
        self.config = config
        self.tp = tp
        self.kernels = kernels
        mlps = [self.build_mlp(config, layer_id, tp, kernels) for layer_id in range(config.num_layers)]
        self.model = DecoderModel(config, max_positions, mlps, tp, kernels)
        self.lm_head = (
            Linear(config.hidden_size, config.vocab_size, False, kernels) if tp is None
            else VocabParallelLMHead(config.hidden_size, config.vocab_size, tp)
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def build_mlp(config: TargetConfig, layer_id: int, tp: Optional[TensorParallel], kernels: KernelMode) -> nn.Module:
        """Layer `layer_id`'s MLP: a dense gated SiLU MLP in Llama and Qwen3."""
        return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp, kernels)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- pieces: the model code between two attentions ----------------------------------------------
    @property
    def num_pieces(self) -> int:
        """One piece before each layer's attention, plus the last (after the last attention)."""
        return len(self.model.layers) + 1

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k, v [T, Hk, D] as views of a projection buffer (the same layout in every layer)."""
        return self.model.layers[0].self_attn.split_heads(qkv)

    def run_piece(self, index: int, state: PieceState) -> None:
        """Runs piece `index` of `num_pieces` on `state` (see PieceState for what it reads and leaves there):
        0: embed + layer 0 up to attention; i in 1..L-1: layer i-1 after attention (o_proj, post-attention norm,
        MLP, capture of its output) + layer i up to attention; L: layer L-1 after attention + final norm (and the
        capture of the final-normed hidden for a tap on layer L-1).
        "Up to attention": input norm, q/k/v projection, q/k norm (Qwen3), rope, K/V stored at state.kv_slots."""
        layers = self.model.layers
        if index == 0:
            assert all(0 <= layer_id < len(layers) for layer_id in state.capture_layer_ids), state.capture_layer_ids
            state.residual = state.place(self.embed(state.input_ids), state.residual)
            self._prepare_attention(0, layers[0].input_layernorm(state.residual), state)
            return
        self._finish_layer(index - 1, state)
        if index < len(layers):
            self._prepare_attention(index, self._add_mlp_out_and_norm(layers[index].input_layernorm, state), state)
        else:
            state.hidden = state.place(self._add_mlp_out_and_norm(self.model.norm, state), state.hidden)
            self._capture_output(index - 1, state, state.hidden)

    def _add_mlp_out_and_norm(self, norm: RMSNorm, state: PieceState) -> torch.Tensor:
        """norm(residual + mlp_out); the sum becomes the residual."""
        assert state.mlp_out is not None and state.residual is not None
        normed, residual = norm.add_and_norm(state.mlp_out, state.residual)
        state.residual = state.place(residual, state.residual)
        return normed

    def _prepare_attention(self, layer_id: int, normed: torch.Tensor, state: PieceState) -> None:
        """Layer `layer_id` from its normed input to q, k, v in the state, its K/V stored in the cache."""
        attention = self.model.layers[layer_id].self_attn
        store = state.kv_pool.layer_store(layer_id, state.kv_slots)
        qkv_out = state.buffer(state.qkv)
        q, k, v, kv_stored = attention.project(normed, state.positions, self.model.rotary, store, qkv_out)
        if qkv_out is not None:
            static_q, static_k, _ = attention.split_heads(qkv_out)
            q, k = state.place(q, static_q), state.place(k, static_k)
        if not kv_stored:
            store.write(k, v)
        state.q, state.k, state.v = q, k, v

    def _finish_layer(self, layer_id: int, state: PieceState) -> None:
        """Layer `layer_id` after attention: leaves its MLP output in state.mlp_out (its output: + residual)."""
        layer = self.model.layers[layer_id]
        assert state.attn_out is not None and state.residual is not None
        attended = layer.self_attn.o_proj(state.attn_out)
        if self.tp is not None:
            self.tp.all_reduce(attended)
        normed, residual = layer.post_attention_layernorm.add_and_norm(attended, state.residual)
        state.residual = state.place(residual, state.residual)
        state.mlp_out = state.place(layer.mlp(normed, state.buffer(state.mlp_out)), state.mlp_out)
        if layer_id < len(self.model.layers) - 1:
            self._capture_output(layer_id, state)

    def _capture_output(self, layer_id: int, state: PieceState, final_normed: Optional[torch.Tensor] = None) -> None:
        """The tapped feature of layer `layer_id` into its column block(s) of state.aux: the layer's output
        (mlp_out + residual), or `final_normed` (the last layer's, given by the last piece). NOTE: the last layer's
        tap is the state after the final norm, as HF's hidden_states[-1], which z-lab's drafts are trained on."""
        assert state.mlp_out is not None and state.residual is not None
        hidden_size = state.mlp_out.shape[-1]
        for column, captured_id in enumerate(state.capture_layer_ids):
            if captured_id != layer_id:
                continue
            if state.aux is None:
                state.aux = state.mlp_out.new_empty(state.mlp_out.shape[0], len(state.capture_layer_ids) * hidden_size)
            block = state.aux[:, column * hidden_size:(column + 1) * hidden_size]
            if final_normed is not None:
                block.copy_(final_normed)
            else:
                torch.add(state.mlp_out, state.residual, out=block)

    # ---- eager forward ----------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> ModelOutput:
        """The pieces with attention in between (the pieces already stored K/V, hence kv_stored). NOTE: captured
        inside full CUDA graphs (decode / verify / greedy cycle): no host syncs, no data-dependent Python here or in
        the pieces."""
        batch.attn_meta = backend.plan(batch)
        state = PieceState(
            batch.input_ids, batch.positions, batch.out_cache_loc, backend.pool, tuple(batch.capture_layer_ids)
        )
        for index in range(self.num_pieces):
            self.run_piece(index, state)
            if index < len(self.model.layers):
                assert state.q is not None and state.k is not None and state.v is not None
                state.attn_out = backend.forward(state.q, state.k, state.v, index, batch, kv_stored=True)
        hidden = state.hidden
        assert hidden is not None
        rows = hidden[batch.logits_rows]
        if batch.argmax_only:  # NOTE: a vocab-parallel head compares per-shard maxima instead of gathering logits
            return ModelOutput(greedy_head_tokens(self.lm_head, rows), state.aux, hidden)
        logits = self.compute_logits(rows) if batch.float_logits else self.lm_head(rows)
        return ModelOutput(logits, state.aux, hidden)
