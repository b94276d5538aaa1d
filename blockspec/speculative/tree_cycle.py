"""The DDTree cycle: the DFlash draft's block → a draft tree of B nodes → one tree-masked target verify over
[root, nodes] → the walk → the walked rows' KV compacted into the block's first slots. Greedy, it is one function of
the cycle's input batch on the device (graph-capturable: no host read); for requests that sample, penalise or follow
a grammar the target's token at every tree row is chosen between the verify and the walk (tree_sampling.py,
DFlashWorker's synchronous step).

The cycle's input rows are a chain cycle's at verify length b + B (b the draft block, B the budget): [bonus, mask x
(b + B - 1) | req→token row | kv_len + b + B], so the verify-length policy, the overlap schedule's next_cycle_rows and
the slot reservation treat the tree as one more verify length (speculative/verify_length.py). Slots and positions: a
request's tree row i (root 0, nodes 1..B, parents first) is written at the slot of position kv_len + i and runs at
position kv_len + depth(i); the draft block takes the slots of kv_len .. kv_len + b - 1. After the walk the target
K/V of the walked row at depth d moves to the slot of position kv_len + d and the draft K/V of position kv_len + d is
materialised from that row's aux hidden states, so the next cycle sees exactly what a chain cycle that accepted the
same tokens leaves behind. Rows past the walk are garbage in slots past the committed length, rewritten before
anything reads them (as the chain's rejected rows).

Output per request, the chain cycle's layout at n = b + B: [accepted | walked tokens d_1..d_{b-1} (the first
`accepted` valid), B zeros | the target's token at the walked rows of depth 0..b-1, B zeros], so committing it and
deriving the next cycle's rows are the chain's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from blockspec.batch import ForwardBatch
from blockspec.kv.pool import KVPool
from blockspec.models.dflash_draft import DFlashDraftModel
from blockspec.runner.model_runner import ModelRunner
from blockspec.speculative.simulated_accept import SimulatedAcceptance
from blockspec.speculative.tree_batches import cycle_logits_rows, tree_draft_batch, tree_verify_batch
from blockspec.speculative.tree_build import DraftTree, build_tree
from blockspec.speculative.tree_walk import greedy_walk_outputs, simulated_tree_walk
from blockspec.speculative.walk_outputs import walk_outputs

DraftHidden = Callable[[ForwardBatch], torch.Tensor]


@dataclass(frozen=True)
class VerifiedTree:
    """A tree verify's results: the tree, the token of every tree row [bs, B + 1] (the root's, the last committed one,
    then the nodes'), the cycle's KV slots [bs, b + B] (of positions kv_len ..), the block's positions and slots
    [bs·b] (kv_len .. kv_len + b - 1: where the walk's rows go), and the target's outputs per tree row (logits or
    argmax, see TreeCycle.verify; aux hidden states)."""

    tree: DraftTree
    row_tokens: torch.Tensor
    slots: torch.Tensor
    block_positions: torch.Tensor
    block_slots: torch.Tensor
    logits: torch.Tensor
    aux_hidden: torch.Tensor


class TreeCycle:
    """The greedy cycle of a draft tree of `budget` nodes over draft blocks of `block_size` rows."""

    def __init__(self, runner: ModelRunner, draft: DFlashDraftModel, draft_pool: KVPool, draft_hidden: DraftHidden,
                 block_size: int, budget: int, capture: tuple[int, ...],
                 simulated: Optional[SimulatedAcceptance] = None) -> None:
        if draft.config.dflash2 is not None:
            # NOTE: a DFlash2 draft proposes through its candidate selector, which scores a row's candidate together
            # with the one before it; a tree of the rows' independent marginals would ignore that pairwise score.
            raise ValueError("speculative_tree_budget (DDTree) needs a DFlash draft: a DFlash2 draft's candidate "
                             "selector scores consecutive rows together, which the tree build does not model")
        vocab = runner.target_config.vocab_size
        if budget > vocab:
            raise ValueError(f"speculative_tree_budget {budget} exceeds the vocabulary ({vocab} tokens)")
        self.runner = runner
        self.draft = draft
        self.draft_pool = draft_pool
        self.draft_hidden = draft_hidden
        self.block_size = block_size
        self.budget = budget
        self.capture = capture
        self.simulated = simulated  # NOTE: benchmarking: the walk's length drawn, not verified (simulated_accept.py)
        # NOTE: the host step's verified tree, from its TREE_VERIFY forward to the TREE_WALK forward that follows
        self.pending: Optional[VerifiedTree] = None
        # NOTE: the output rows' zero padding is this one zero expanded: no fill launched per cycle
        self.zero = torch.zeros((1, 1), dtype=torch.int64, device=runner.device)

    @property
    def cycle_length(self) -> int:
        """The verify length that stands for this tree cycle: its input rows carry b + B tokens per request."""
        return self.block_size + self.budget

    def __call__(self, batch: ForwardBatch) -> tuple[torch.Tensor]:
        """The greedy cycle of a batch of `cycle_length` rows per request (module docstring); returns [bs, 2(b + B)]
        int64 rows."""
        verified = self.verify(batch, argmax_only=True)
        rows, _ = self.walk(batch, verified, verified.logits.view(batch.batch_size, self.budget + 1))
        return (rows,)

    def host_verify(self, batch: ForwardBatch) -> tuple[torch.Tensor]:
        """The host step's first forward (GraphKind.TREE_VERIFY): `verify` with logits, kept in `pending` for the
        walk; returns the logits [bs·(B + 1), V]."""
        self.pending = self.verify(batch, argmax_only=False)
        return (self.pending.logits,)

    def host_walk(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The host step's second forward (GraphKind.TREE_WALK): the walk of the pending tree along the tokens the
        host chose per tree row (the batch's input ids, B + 1 per request), then the compaction."""
        verified, self.pending = self.pending, None
        if verified is None:
            raise RuntimeError("a DDTree walk without the tree verify before it")
        return self.walk(batch, verified, batch.input_ids.view(batch.batch_size, self.budget + 1))

    def verify(self, batch: ForwardBatch, argmax_only: bool) -> VerifiedTree:
        """The draft over the full block, its tree, and the target's tree-masked forward over [root, nodes] (logits
        [bs·(B + 1), V] float32 per tree row, or their argmax with `argmax_only`)."""
        bs, b, budget = batch.batch_size, self.block_size, self.budget
        runner = self.runner
        logits_rows = cycle_logits_rows(batch, b, budget)
        draft_batch = tree_draft_batch(batch, b, logits_rows)
        anchors = batch.input_ids.view(bs, self.cycle_length)[:, 0]
        hidden = self.draft_hidden(draft_batch)
        tree = build_tree(self.draft.row_head_outputs(hidden, anchors, runner.model.lm_head), budget,
                          self.draft.logit_scale)
        row_tokens = torch.cat([anchors[:, None], tree.tokens], 1)
        verify = tree_verify_batch(batch, tree, row_tokens, self.capture, argmax_only, logits_rows)
        output = runner.model(verify, runner.attention)
        assert output.aux_hidden is not None
        return VerifiedTree(tree, row_tokens, batch.out_cache_loc.view(bs, self.cycle_length), draft_batch.positions,
                            draft_batch.out_cache_loc, output.logits, output.aux_hidden)

    def walk(self, batch: ForwardBatch, verified: VerifiedTree, target_tokens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The walk along the target's token at every tree row `target_tokens` [bs, B + 1] (its argmax, or the
        request's own choice: tree_sampling.py), then the compaction; returns the [bs, 2(b + B)] rows of the module
        docstring and the walked rows [bs, b] (WalkOutputs.walked_rows: the first `accepted` + 1 are the walk's)."""
        bs, b, budget = batch.batch_size, self.block_size, self.budget
        aux_hidden = verified.aux_hidden
        if self.simulated is None:
            walked = greedy_walk_outputs(verified.tree, verified.row_tokens, target_tokens, verified.slots)
        else:
            # NOTE: at most b - 1 and B accepted: the path's rows 0..accepted exist in every tree
            drawn = self.simulated.accepted(bs, min(b, budget + 1), target_tokens.device)
            accepted, path = simulated_tree_walk(drawn, b - 1)
            walked = walk_outputs(accepted, path, verified.row_tokens, target_tokens, verified.slots, budget, self.zero)
        # NOTE: compaction: path[d] is the walked row at depth d (d itself past the walk: moved onto itself); row i
        # sits at the slot of position kv_len + i, and i < b + B, so the cycle's slots hold every source. A request's
        # moves form one group (path[d] >= d: a destination is a source of its own group only).
        self.runner.kv_pool.move(walked.sources, verified.block_slots.view(bs, b))
        width = aux_hidden.shape[-1]
        aux = aux_hidden.view(bs, budget + 1, width).gather(1, walked.walked_rows[:, :, None].expand(-1, -1, width))
        self.draft.materialise_context(aux.reshape(bs * b, width), verified.block_positions, verified.block_slots,
                                       self.draft_pool)
        return walked.rows, walked.walked_rows
