"""Vocabulary-parallel embedding and lm_head: each rank holds ceil(V / tp) rows of the vocabulary.

Column-parallel (q|k|v, gate|up) and row-parallel (o, down) projections are plain `nn.Linear` / `StackedLinear`
built at the rank's shard sizes; the model sums the row-parallel outputs with `TensorParallel.all_reduce`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.distributed.group import TensorParallel
from blockspec.layers.argmax import greedy_tokens


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

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax over the whole vocabulary of each row's logits [..], without gathering the logits: each rank's
        best (value, index), gathered; the first rank with the highest value wins (the lower index on ties, as
        torch.argmax over the full row). NOTE: one [.., 2] float64 gather: values and indices are exact in it."""
        local = F.linear(hidden, self.weight)
        start = self.tp.rank * self.out_features
        if start + self.out_features > self.vocab_size:  # NOTE: the padding rows of the last shard never win
            local[..., self.vocab_size - start:] = float("-inf")
        indices = greedy_tokens(local)
        values = local.gather(-1, indices.unsqueeze(-1)).squeeze(-1)
        best = self.tp.gather_last_dim(torch.stack([values.double(), (indices + start).double()], dim=-1))
        best = best.view(*best.shape[:-1], self.tp.size, 2)
        winner = best[..., 0].argmax(-1, keepdim=True)
        return best[..., 1].gather(-1, winner).squeeze(-1).long()


def greedy_head_tokens(lm_head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """argmax of lm_head(hidden) per row; a vocab-parallel head skips gathering the full logits."""
    if isinstance(lm_head, VocabParallelLMHead):
        return lm_head.argmax(hidden)
    return greedy_tokens(lm_head(hidden))
