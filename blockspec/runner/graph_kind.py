"""The kinds of full CUDA graph an engine captures, and how many tokens per request a uniform forward carries."""
from __future__ import annotations

import enum

from blockspec.batch import ForwardBatch, GraphInputs


class GraphKind(enum.Enum):
    DECODE = "target-decode"  # target-only decode: 1 token per request
    GREEDY_DECODE = "greedy-decode"  # a whole greedy target-only step: decode → argmax → the next step's rows
    VERIFY = "target-verify"  # DFlash verify: B block tokens per request (+ the draft KV materialise)
    DRAFT = "draft"  # DFlash propose: the draft over [bonus, mask x (B-1)]
    GREEDY_CYCLE = "greedy-cycle"  # a whole greedy DFlash cycle: propose → verify → both argmaxes → acceptance
    # NOTE: DDTree's host step (requests the host chooses for), eager only: two uniform forwards so that
    # tensor-parallel ranks mirror them; the host's choice of each tree row's token comes in between
    TREE_VERIFY = "tree-verify"  # draft → tree → tree-masked verify: the target's logits per tree row
    TREE_WALK = "tree-walk"  # the walk along the host's tokens (the rows' input ids) → compaction


def tokens_per_request(inputs: GraphInputs) -> int:
    """The uniform number of new tokens per request of a built batch or of rows."""
    if isinstance(inputs, ForwardBatch):
        return -1 if inputs.uniform_q_len is None else inputs.uniform_q_len
    return inputs.q
