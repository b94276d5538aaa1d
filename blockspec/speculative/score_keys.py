"""Sort keys for Triton top-k selections over fp32 scores (DDTree's vocabulary top-B and tree build): one int64 per
entry, the score's ordered bits above the entry's index, so a descending sort orders by score descending and breaks
ties towards the smaller index (torch's first-in-order), and both halves decode back exactly."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def score_key(score, index, SPAN: tl.constexpr):
    """int64 keys whose descending order is score descending, then index ascending (index in [0, SPAN))."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # NOTE: + 0.0 turns -0.0 into +0.0, which torch calls equal
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # NOTE: signed order of the result = float order of the score
    return (ordered.to(tl.int64) << 32) | (SPAN - 1 - index).to(tl.int64)


@triton.jit
def key_score(key):
    """The fp32 score a score_key holds, bit for bit."""
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def key_index(key, SPAN: tl.constexpr):
    """The index a score_key of the same SPAN holds."""
    return SPAN - 1 - (key & 0xFFFFFFFF)


@triton.jit
def leading(keys, SIZE: tl.constexpr, WIDTH: tl.constexpr):
    """The first WIDTH entries of a [SIZE] tensor (SIZE a multiple of WIDTH)."""
    rows = tl.reshape(keys, (SIZE // WIDTH, WIDTH))
    return tl.sum(tl.where(tl.arange(0, SIZE // WIDTH)[:, None] == 0, rows, 0), axis=0)
