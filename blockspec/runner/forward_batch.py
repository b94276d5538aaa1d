"""ForwardBatch: everything one model forward needs, passed explicitly down to the attention backend."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill / chunked prefill / re-prefill: causal over cached prefix + new tokens
    DECODE = "decode"  # one new token per request
    VERIFY = "verify"  # B block tokens per request, causal, on top of the target KV
    DRAFT = "draft"  # DFlash propose: B queries per request, non-causal over draft context + block


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot written by each token
    req_rows: torch.Tensor  # [bs] int64, rows of the req→token table
    seq_lens: torch.Tensor  # [bs] int64, KV length per request including this forward's tokens
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]  # new tokens per request; sum == T
    logits_rows: torch.Tensor  # rows of the T tokens whose logits are wanted
    req_to_token: torch.Tensor  # the whole req→token table (read-only here)
    capture_layer_ids: tuple[int, ...] = ()  # target layers whose outputs are returned for every token
    input_embeds: Optional[torch.Tensor] = None  # [T, H] replaces the embedding lookup when given
    uniform_q_len: Optional[int] = None  # every request has this many new tokens (decode / verify / draft)
    max_seq_len_hint: Optional[int] = None  # upper bound of seq_lens, fixed for a captured graph
    attn_meta: Any = field(default=None, repr=False)  # set by backend.plan(batch)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]


def build_batch(
    mode: ForwardMode,
    token_ids: list[list[int]],
    start_positions: list[int],
    req_rows: list[int],
    req_to_token: torch.Tensor,
    logits_rows: list[int],
    capture_layer_ids: tuple[int, ...] = (),
) -> ForwardBatch:
    """Builds a batch for requests whose new tokens `token_ids[i]` start at `start_positions[i]`.

    The slots of the new tokens are read from the req→token table, so they must be allocated first.
    """
    device = req_to_token.device
    extend_lens = [len(t) for t in token_ids]
    seq_lens = [s + n for s, n in zip(start_positions, extend_lens)]
    flat_ids = [t for ids in token_ids for t in ids]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start_positions, extend_lens)])
    rows = torch.tensor(req_rows, dtype=torch.int64)
    row_per_token = torch.repeat_interleave(rows, torch.tensor(extend_lens))
    positions = positions.to(device)
    out_cache_loc = req_to_token[row_per_token.to(device), positions]
    return ForwardBatch(
        mode=mode,
        input_ids=torch.tensor(flat_ids, dtype=torch.int64, device=device),
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_rows=rows.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=extend_lens,
        logits_rows=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        req_to_token=req_to_token,
        capture_layer_ids=capture_layer_ids,
        uniform_q_len=extend_lens[0] if mode is not ForwardMode.EXTEND else None,
    )
