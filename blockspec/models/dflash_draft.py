"""The DFlash block-diffusion draft: Qwen3-style layers conditioned on projected target hidden states, proposing the
argmax (or a draw) of each block row's logits. DFlash2 drafts extend it (models/dflash2_draft.py)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from blockspec.attention.base import AttentionBackend
from blockspec.batch import ForwardBatch
from blockspec.distributed.group import TensorParallel
from blockspec.kv.pool import KVPool, LayerKVStore
from blockspec.layers.activation import GatedMLP
from blockspec.layers.argmax import greedy_tokens
from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode
from blockspec.layers.linear import Linear, StackedLinear
from blockspec.layers.norm import RMSNorm
from blockspec.layers.parallel import greedy_head_tokens
from blockspec.layers.rotary import QKNorm, RotaryEmbedding
from blockspec.models.draft_config import DraftConfig
from blockspec.models.logit_scale import LogitScale
from blockspec.models.proposal_rows import ProposalRows, VocabularyRows


class DraftAttention(nn.Module):
    """Under tensor parallelism this rank's heads (sharded as the target's), o_proj summed over ranks."""

    def __init__(self, config: DraftConfig, layer_id: int, tp: Optional[TensorParallel] = None,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        if tp is not None:
            self.num_heads = tp.split(config.num_heads, "the draft's num_attention_heads")
            self.num_kv_heads = tp.local_kv_heads(config.num_kv_heads)
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = StackedLinear(
            h, [self.q_size, self.kv_size, self.kv_size], ["q_proj", "k_proj", "v_proj"], bias, kernels
        )
        self.o_proj = Linear(self.num_heads * d, h, bias, kernels)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def store_context_kv(
        self, context: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, store: LayerKVStore
    ) -> None:
        """k = rope(k_norm(k_proj(c))), v = v_proj(c) written at store.slots (on CUDA in the rope launch)."""
        t = context.shape[0]
        # NOTE: one GEMM for k|v: rows q_size.. of the stacked weight (a view, no copy).
        kv = self.qkv_proj.forward_rows(context, self.q_size, self.qkv_proj.out_features)
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        _, k, kv_stored = rotary.apply(positions, None, k, v, QKNorm.of(None, self.k_norm), store)
        if not kv_stored:
            store.write(k, v)

    def forward(
        self, hidden: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        store = backend.pool.layer_store(self.layer_id, batch.out_cache_loc)
        rotated_q, k, kv_stored = rotary.apply(batch.positions, q, k, v, QKNorm.of(self.q_norm, self.k_norm), store)
        assert rotated_q is not None
        attended = self.o_proj(backend.forward(rotated_q, k, v, self.layer_id, batch, kv_stored=kv_stored))
        return attended if self.tp is None else self.tp.all_reduce(attended)


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig, layer_id: int, tp: Optional[TensorParallel] = None,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, layer_id, tp, kernels)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp=tp, kernels=kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, batch, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(nn.Module):
    """No embedding and no lm_head: the target's are used (see speculative/dflash.py). Under tensor parallelism the
    layers are sharded; fc and the norms are replicated (the aux hidden states they read are replicated too), so
    materialising the draft KV needs no communication. `kernels`: as the target's (KernelMode)."""

    def __init__(self, config: DraftConfig, max_positions: int, tp: Optional[TensorParallel] = None,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(self.build_layer(config, i, tp, kernels) for i in range(config.num_layers))
        self.fc = Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, False, kernels)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions)

    def build_layer(self, config: DraftConfig, layer_id: int, tp: Optional[TensorParallel],
                    kernels: KernelMode) -> DraftLayer:
        return DraftLayer(config, layer_id, tp, kernels)

    def materialise_context(
        self, aux_hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: KVPool
    ) -> None:
        """Writes draft K/V of committed tokens: k = rope(k_norm(k_proj(c))), v = v_proj(c), c = hidden_norm(fc(aux)).

        NOTE: context features do not pass input_layernorm (z-lab's reference does the same)."""
        context = self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))
        for layer in self.layers:
            layer_id = layer.self_attn.layer_id
            layer.self_attn.store_context_kv(context, positions, self.rotary, pool.layer_store(layer_id, slots))

    def forward(self, batch: ForwardBatch, backend: AttentionBackend, block_embeds: torch.Tensor) -> torch.Tensor:
        """Block hidden states [T, H] (final-normed) from the block's (scaled) target embeddings."""
        batch.attn_meta = backend.plan(batch)
        hidden = block_embeds
        for layer in self.layers:
            hidden = layer(hidden, self.rotary, batch, backend)
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """float32 draft logits of rows `hidden` [.., H] through the target's lm_head (× output_multiplier, then the
        final softcap)."""
        return self.scale_logits(lm_head(hidden))

    @property
    def logit_scale(self) -> LogitScale:
        """The draft's output_multiplier and final softcap (models/logit_scale.py)."""
        return LogitScale(self.config.output_multiplier, self.config.final_logit_softcapping)

    def scale_logits(self, raw: torch.Tensor) -> torch.Tensor:
        """float32 draft logits from lm_head outputs `raw`: × output_multiplier, then the final softcap (both
        monotonic: the order of a row's values, its argmax and top-k, is the raw one's)."""
        return self.logit_scale.apply(raw)

    # ---- proposals: what the speculative worker calls -----------------------------------------------------------
    def greedy_proposals(self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """[bs, B-1] greedy proposals d_1..d_{B-1} from the block hidden states [bs·B, H] (`anchors` [bs]: each
        block's row-0 token). Graph-capturable: no host reads.

        Here the argmax of each row's logits; without scaling or softcap straight from the model-dtype logits
        (exact: the fp32 cast preserves order and ties)."""
        rows = proposal_hidden(hidden, anchors)
        flat = rows.reshape(-1, rows.shape[-1])
        if self.logit_scale.is_identity:
            tokens = greedy_head_tokens(lm_head, flat)
        else:
            tokens = greedy_tokens(self.logits(flat, lm_head))
        return tokens.view(rows.shape[0], rows.shape[1])

    def row_head_outputs(self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """[bs, B-1, V] raw lm_head outputs (model dtype) of the block rows 1..B-1, whose logits are
        `logit_scale.apply` of them (each row's own marginal: the rows of a DFlash block do not condition on each
        other's tokens), for a draft tree (speculative/tree_build.py, which scales them as it reads them).
        Graph-capturable."""
        rows = proposal_hidden(hidden, anchors)
        return lm_head(rows.reshape(-1, rows.shape[-1])).view(rows.shape[0], rows.shape[1], -1)

    def proposal_tensors(
        self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head: nn.Linear
    ) -> tuple[torch.Tensor, ...]:
        """Everything a propose step needs from one draft forward, as device tensors (a graph's outputs): first the
        greedy proposals [bs, B-1], then what `proposal_rows` reads (here the draft logits [bs, B-1, V])."""
        rows = proposal_hidden(hidden, anchors)
        logits = self.logits(rows.reshape(-1, rows.shape[-1]), lm_head).view(rows.shape[0], rows.shape[1], -1)
        return greedy_tokens(logits), logits

    def proposal_rows(self, tensors: tuple[torch.Tensor, ...], index: int) -> ProposalRows:
        """Request `index`'s rows of `proposal_tensors`, for proposing on the host (sampled or constrained)."""
        return VocabularyRows(tensors[1][index])


def proposal_hidden(hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[bs, B-1, H]: the block rows 1..B-1 of `hidden` [bs·B, H] (row 0, the anchor's, proposes nothing)."""
    bs = anchors.shape[0]
    return hidden.view(bs, hidden.shape[0] // bs, hidden.shape[-1])[:, 1:]
