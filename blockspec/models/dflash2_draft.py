"""The DFlash2 draft (z-lab, `DFlash2DraftModel`): a DFlash draft whose layers convolve the block rows around
attention and MLP (models/grouped_conv.py), proposing through a candidate selector instead of the argmax
(models/candidate_selector.py). Context K/V are materialised exactly as for DFlash."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from blockspec.attention.base import AttentionBackend
from blockspec.batch import ForwardBatch
from blockspec.distributed.group import TensorParallel
from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.candidate_selector import CandidateSelector
from blockspec.models.dflash_draft import DFlashDraftModel, DraftLayer, proposal_hidden
from blockspec.models.draft_config import DFlash2Fields, DraftConfig
from blockspec.models.grouped_conv import GroupedDynamicCausalConv
from blockspec.models.proposal_rows import CandidateRows, ProposalRows


def _fields(config: DraftConfig) -> DFlash2Fields:
    if config.dflash2 is None:
        raise ValueError("a DFlash2 draft needs a config with DFlash2 fields (conv_kernel_size, ..., selector_top_k)")
    return config.dflash2


class DFlash2DraftLayer(DraftLayer):
    """A draft layer whose attention and MLP each sit between the two halves of a grouped dynamic causal
    convolution: x + after(sublayer(before(norm(x))))."""

    def __init__(self, config: DraftConfig, layer_id: int, tp: Optional[TensorParallel] = None,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__(config, layer_id, tp, kernels)
        fields, hidden = _fields(config), config.hidden_size
        self.attention_conv = GroupedDynamicCausalConv(hidden, fields.conv_kernel_size, fields.conv_group_size, kernels)
        self.mlp_conv = GroupedDynamicCausalConv(hidden, fields.conv_kernel_size, fields.conv_group_size, kernels)

    def forward(
        self, hidden: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        block = batch.uniform_q_len
        assert block is not None, "the draft runs on uniform batches (B rows per request)"
        convolved, after = self.attention_conv.before(self.input_layernorm(hidden), block)
        hidden = hidden + self.attention_conv.after(self.self_attn(convolved, rotary, batch, backend), after, block)
        convolved, after = self.mlp_conv.before(self.post_attention_layernorm(hidden), block)
        return hidden + self.mlp_conv.after(self.mlp(convolved), after, block)


class DFlash2DraftModel(DFlashDraftModel):
    def __init__(self, config: DraftConfig, max_positions: int, tp: Optional[TensorParallel] = None,
                 kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__(config, max_positions, tp, kernels)
        self.candidate_selector = CandidateSelector(config.hidden_size, _fields(config), kernels)

    def build_layer(self, config: DraftConfig, layer_id: int, tp: Optional[TensorParallel],
                    kernels: KernelMode) -> DraftLayer:
        return DFlash2DraftLayer(config, layer_id, tp, kernels)

    def greedy_proposals(self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """The selector's greedy walk over each block's rows (on the device, graph-capturable)."""
        return self.proposal_tensors(hidden, anchors, lm_head)[0]

    def proposal_tensors(
        self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head: nn.Linear
    ) -> tuple[torch.Tensor, ...]:
        """(greedy walk [bs, B-1], unary [bs, B-1, k], candidate ids [bs, B-1, k], transitions [bs, B-1, k, k])."""
        rows = proposal_hidden(hidden, anchors)
        raw = lm_head(rows.reshape(-1, rows.shape[-1])).view(rows.shape[0], rows.shape[1], -1)
        selector = self.candidate_selector
        # NOTE: top-k of the model-dtype logits, then only the k values scaled to float32: no float32 copy of the
        # [bs·(B-1), V] logits (the scaling is monotonic, so the candidates are the scaled logits' top k)
        top, ids = selector.candidates(raw)
        unary = self.scale_logits(top)
        transitions = selector.transitions(rows, ids, anchors)
        return selector.greedy_walk(unary, ids, transitions), unary, ids, transitions

    def proposal_rows(self, tensors: tuple[torch.Tensor, ...], index: int) -> ProposalRows:
        _, unary, ids, transitions = tensors
        return CandidateRows(unary[index], ids[index], transitions[index], _fields(self.config).logits_width)
