"""DFlash2's candidate selector: picks each draft row's proposal among the target lm_head's top-k tokens of that row,
scoring candidate c after predecessor p by the unary logit plus a bilinear term ⟨pred[p] ⊙ W·h, succ[c]⟩.

The rows are walked in order (row j's predecessor is row j-1's choice, row 0's the block's anchor token), so the
proposals form a chain the unary argmax alone cannot see. Every (predecessor candidate, candidate) score of every row
is computed at once as one batched matmul (`transitions`); the walk is then a chase through those [k, k] tables:
greedy on the device (`greedy_walk`, static shapes: it runs inside CUDA graphs), sampled or grammar-constrained
on the host a row at a time (models/proposal_rows.py)."""
from __future__ import annotations

import torch
from torch import nn

from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode
from blockspec.layers.linear import Linear
from blockspec.models.draft_config import DFlash2Fields


class CandidateSelector(nn.Module):
    """`predecessor_codebook`, `successor_codebook` [vocab, rank] (bare tensors in published checkpoints) and
    `hidden_projection` H → rank."""

    def __init__(self, hidden_size: int, fields: DFlash2Fields, kernels: KernelMode = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.top_k = fields.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(fields.selector_vocab_size, fields.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(fields.selector_vocab_size, fields.selector_rank))
        self.hidden_projection = Linear(hidden_size, fields.selector_rank, False, kernels)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the top k values [.., k], in the logits' dtype, best first; their token ids [.., k]) of logits [.., V]."""
        values, ids = torch.topk(logits, self.top_k, dim=-1)
        return values, ids

    def transitions(self, hidden: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[N, P, k, k] float32: entry [n, j, a, c] is the bilinear score of candidate c of row j after candidate a of
        row j-1 (after the anchor token for row 0: its k predecessor rows are equal). hidden [N, P, H] (the draft's
        final-normed rows), ids [N, P, k], anchors [N]."""
        n, _, k = ids.shape
        predecessors = torch.cat([anchors.view(n, 1, 1).expand(n, 1, k), ids[:, :-1]], dim=1)
        left = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)[:, :, None, :]
        right = self.successor_codebook[ids]
        return torch.matmul(left.float(), right.float().transpose(-1, -2))

    def scores_after(self, hidden: torch.Tensor, previous: torch.Tensor, ids: torch.Tensor,
                     unary: torch.Tensor) -> torch.Tensor:
        """[.., k] float32 scores of candidates `ids` [.., k] (unary [.., k]) on rows `hidden` [.., H] whose previous
        token is `previous` [..] (training: the true previous token, teacher-forced)."""
        left = self.predecessor_codebook[previous] * self.hidden_projection(hidden)
        return unary + (self.successor_codebook[ids].float() @ left.float()[..., None])[..., 0]

    @staticmethod
    def greedy_walk(unary: torch.Tensor, ids: torch.Tensor, transitions: torch.Tensor) -> torch.Tensor:
        """[N, P] token ids: each row's best-scoring candidate after the one chosen before it.

        NOTE: static shapes, no host reads: the walk is captured in the greedy cycle's CUDA graph. On CUDA one fused
        launch with the same fp32 sums and first-index argmax (layers/dflash2_kernels.py); else torch ops."""
        if unary.is_cuda:
            from blockspec.layers.dflash2_kernels import candidate_walk  # NOTE: needs Triton

            return candidate_walk(unary, ids, transitions)
        return CandidateSelector.reference_walk(unary, ids, transitions)

    @staticmethod
    def reference_walk(unary: torch.Tensor, ids: torch.Tensor, transitions: torch.Tensor) -> torch.Tensor:
        """greedy_walk in torch ops (CPU, and the fused kernel's oracle in tests)."""
        n, rows, k = unary.shape
        chosen = torch.zeros((n, 1), dtype=torch.int64, device=unary.device)
        picks = []
        for j in range(rows):
            after_chosen = transitions[:, j].gather(1, chosen[:, :, None].expand(n, 1, k))[:, 0]
            chosen = (unary[:, j] + after_chosen).argmax(-1, keepdim=True)
            picks.append(chosen)
        return ids.gather(2, torch.cat(picks, dim=1)[:, :, None])[:, :, 0]
