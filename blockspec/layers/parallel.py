"""Vocabulary-parallel embedding and lm_head: each rank holds ceil(V / tp) rows of the vocabulary.

Column-parallel (q|k|v, gate|up) and row-parallel (o, down) projections are plain `nn.Linear` / `StackedLinear`
built at the rank's shard sizes; the model sums the row-parallel outputs with `TensorParallel.all_reduce`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.distributed.group import TensorParallel


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + rows) of the embedding; a token outside them contributes zeros, the all-reduce sums."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        self.start, rows = tp.vocab_shard(vocab_size)
        super().__init__(rows, hidden_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        embedded = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(embedded.masked_fill_(outside.unsqueeze(-1), 0.0))


class VocabParallelLMHead(nn.Linear):
    """This rank's logits [.., rows], gathered to the full [.., vocab_size] on every rank (replicated logits:
    sampling and acceptance read them as at TP=1)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        _, rows = tp.vocab_shard(vocab_size)
        super().__init__(hidden_size, rows, bias=False)
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather_last_dim(F.linear(hidden, self.weight))
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., :self.vocab_size].contiguous()  # NOTE: drops the last shard's padding rows
