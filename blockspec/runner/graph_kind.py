"""The kinds of full CUDA graph an engine captures, and how many tokens per request a uniform forward carries."""
from __future__ import annotations

import enum

from blockspec.batch import ForwardBatch, GraphInputs


class GraphKind(enum.Enum):
    DECODE = "target-decode"  # target-only decode: 1 token per request
    VERIFY = "target-verify"  # DFlash verify: B block tokens per request (+ the draft KV materialise)
    DRAFT = "draft"  # DFlash propose: the draft over [bonus, mask x (B-1)]
    GREEDY_CYCLE = "greedy-cycle"  # a whole greedy DFlash cycle: propose → verify → both argmaxes → acceptance


def tokens_per_request(inputs: GraphInputs) -> int:
    """The uniform number of new tokens per request of a built batch or of rows."""
    if isinstance(inputs, ForwardBatch):
        return -1 if inputs.uniform_q_len is None else inputs.uniform_q_len
    return inputs.q
