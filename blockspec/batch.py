"""ForwardBatch: everything one model forward needs, passed explicitly down to the attention backend."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch

from blockspec.host_tensors import int64_array, int64_tensor, to_device


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
    uniform_q_len: Optional[int] = None  # every request has this many new tokens (decode / verify / draft)
    max_seq_len_hint: Optional[int] = None  # upper bound of seq_lens, fixed for a captured graph
    float_logits: bool = True  # False: logits stay in the model dtype (callers that only take the argmax)
    argmax_only: bool = False  # the forward returns each logits row's argmax [rows] int64 in place of its logits
    # NOTE: a tree verify (DDTree, speculative/tree_build.py): [bs, q, q] bool, query row i of a request sees its
    # new row j only where set (j is i's ancestor or i itself) besides the whole context; positions follow the tree
    # depths, KV slots the rows. None: the mode's own mask.
    tree_mask: Optional[torch.Tensor] = None
    extend_starts: Optional[torch.Tensor] = None  # [bs] int64 first token row per request (built batches)
    extend_lens: Optional[torch.Tensor] = None  # [bs] int64 device copy of extend_lens_cpu (built batches)
    attn_meta: Any = field(default=None, repr=False)  # set by backend.plan(batch)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


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
    if mode is not ForwardMode.EXTEND and len(set(extend_lens)) > 1:
        raise ValueError(f"{mode.value} batches add the same number of tokens per request, got {extend_lens}")
    bs = len(extend_lens)
    # NOTE: numpy for the per-token arrays: a few µs per operation where torch's CPU ops cost ≈ 5-10 µs each, and
    # token ids through array('q') instead of element by element (2-4x faster batch building, single-threaded).
    lens = np.asarray(extend_lens, dtype=np.int64)
    total = int(lens.sum())
    starts = np.cumsum(lens) - lens  # first row of each request's tokens
    first_positions = np.asarray(start_positions, dtype=np.int64)
    rows = np.asarray(req_rows, dtype=np.int64)
    seq_lens_np = first_positions + lens
    host = np.concatenate([
        np.frombuffer(int64_array(itertools.chain.from_iterable(token_ids)), dtype=np.int64),
        np.arange(total, dtype=np.int64) + np.repeat(first_positions - starts, lens),  # positions
        np.repeat(rows, lens), rows, seq_lens_np, np.asarray(logits_rows, dtype=np.int64), starts, lens,
    ])
    seq_lens = seq_lens_np.tolist()
    # NOTE: one host→device copy for the whole batch (each separate pageable copy stalls the host).
    packed = to_device(torch.from_numpy(host), device)
    input_ids, positions_d, row_per_token, rows_d, seq_lens_d, logits_rows_d, starts_d, lens_d = packed.split(
        [total, total, total, bs, bs, len(logits_rows), bs, bs]
    )
    return ForwardBatch(
        mode=mode,
        input_ids=input_ids,
        positions=positions_d,
        out_cache_loc=req_to_token[row_per_token, positions_d],
        req_rows=rows_d,
        seq_lens=seq_lens_d,
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=extend_lens,
        logits_rows=logits_rows_d,
        req_to_token=req_to_token,
        capture_layer_ids=capture_layer_ids,
        uniform_q_len=extend_lens[0] if mode is not ForwardMode.EXTEND else None,
        extend_starts=starts_d,
        extend_lens=lens_d,
    )


@dataclass
class RowsLayout:
    """Rows [q token ids | req→token row | seq_len after this forward] per request of a uniform batch."""

    mode: ForwardMode
    rows: torch.Tensor  # [bs, q + 2] int64
    capture_layer_ids: tuple[int, ...] = ()

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])

    @property
    def q(self) -> int:
        return int(self.rows.shape[1]) - 2


@dataclass
class UniformRows(RowsLayout):
    """Host-side description of a uniform batch (decode / verify / draft): every request adds q tokens.

    `rows[i]` = [q token ids | req→token row | seq_len after this forward]. Positions and KV slots follow on the
    device (positions seq_len-q .. seq_len-1, slots from the req→token table), so one host→device copy of `rows`
    is the whole input of a forward (a captured graph derives the rest inside the graph). The rows are on the host
    (pinned when the model is on CUDA)."""

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        token_ids: list[list[int]],
        req_rows: list[int],
        seq_lens: list[int],
        device: torch.device,
        capture_layer_ids: tuple[int, ...] = (),
    ) -> "UniformRows":
        host = int64_array()
        for ids, row, seq_len in zip(token_ids, req_rows, seq_lens):
            host.extend(ids)
            host.append(row)
            host.append(seq_len)
        width = len(token_ids[0]) + 2 if token_ids else 2
        if len(host) != width * len(token_ids):
            raise ValueError(f"{mode.value} rows add the same number of tokens per request")
        rows = int64_tensor(host).view(len(token_ids), width)
        return cls(mode, rows.pin_memory() if device.type == "cuda" else rows, capture_layer_ids)

    def to_batch(self, req_to_token: torch.Tensor, max_seq_len_hint: Optional[int] = None) -> ForwardBatch:
        """The eager batch: one host→device copy, then the same derivation a captured graph runs."""
        rows = self.rows.to(req_to_token.device, non_blocking=True)
        seq_lens_cpu = self.rows[:, -1].tolist()
        return uniform_batch(
            self.mode, rows, req_to_token, seq_lens_cpu, self.capture_layer_ids, max_seq_len_hint
        )


@dataclass
class DeviceRows(RowsLayout):
    """A uniform batch whose rows are already on the device, e.g. derived from the previous step's outputs by the
    overlap schedule: replaying a graph from them needs no host data."""

    def to_batch(self, req_to_token: torch.Tensor, max_seq_len_hint: Optional[int] = None) -> ForwardBatch:
        """The eager batch. NOTE: eager planning reads seq_lens on the host (a device sync)."""
        return uniform_batch(
            self.mode, self.rows, req_to_token, self.rows[:, -1].tolist(), self.capture_layer_ids, max_seq_len_hint
        )


GraphInputs = Union[ForwardBatch, UniformRows, DeviceRows]


def uniform_batch(
    mode: ForwardMode,
    rows: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens_cpu: list[int],
    capture_layer_ids: tuple[int, ...] = (),
    max_seq_len_hint: Optional[int] = None,
) -> ForwardBatch:
    """ForwardBatch from device `rows` [bs, q + 2] (see UniformRows) using device ops only (graph-capturable).

    NOTE: `seq_lens_cpu` is only read by eager planning; a graph passes placeholders and a fixed max_seq_len_hint."""
    bs, q = rows.shape[0], rows.shape[1] - 2
    device = rows.device
    req_rows = rows[:, q].contiguous()
    seq_lens = rows[:, q + 1].contiguous()
    positions = (seq_lens - q)[:, None] + torch.arange(q, device=device)
    out_cache_loc = req_to_token[req_rows[:, None], positions]
    return ForwardBatch(
        mode=mode,
        input_ids=rows[:, :q].reshape(-1),
        positions=positions.reshape(-1),
        out_cache_loc=out_cache_loc.reshape(-1),
        req_rows=req_rows,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        extend_lens_cpu=[q] * bs,
        logits_rows=torch.arange(bs * q, device=device),
        req_to_token=req_to_token,
        capture_layer_ids=capture_layer_ids,
        uniform_q_len=q,
        max_seq_len_hint=max_seq_len_hint,
    )


def uniform_prefix(
    batch: ForwardBatch,
    mode: ForwardMode,
    q: int,
    input_ids: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    capture_layer_ids: tuple[int, ...] = (),
    logits_rows: Optional[torch.Tensor] = None,
) -> ForwardBatch:
    """The uniform batch of the first q of uniform `batch`'s n rows per request: what uniform_batch builds from rows
    [first q input ids | req→token row | seq_len - (n - q)] with `batch`'s host seq_lens less n - q and its
    max_seq_len_hint, in fewer device ops (graph-capturable): the positions and KV slots are `batch`'s first q, not
    derived from the req→token table again. `input_ids` / `positions` [bs·q] replace the first q input ids /
    positions; `logits_rows` (default every row: an arange of bs·q) lets batches share one arange's slices.

    NOTE: a uniform batch's positions are seq_len - n .. seq_len - 1 and its slots come from the req→token table
    (uniform_batch, build_batch), so its first q are the prefix's as long as the table's rows are unchanged."""
    bs, n = batch.batch_size, batch.uniform_q_len
    if n is None or not 0 < q <= n:
        raise ValueError(f"a prefix of {q} rows per request of a batch of {n} rows per request")
    device = batch.input_ids.device
    prefixes = [t.view(bs, n)[:, :q] for t in (batch.input_ids, batch.positions, batch.out_cache_loc)]
    if bs == 1 or q == n:  # NOTE: contiguous prefixes: views of `batch`'s tensors, nothing copied
        ids, own_positions, out_cache_loc = (prefix.reshape(bs * q) for prefix in prefixes)
    else:  # NOTE: one copy for the three strided prefixes, replaced ones included
        ids, own_positions, out_cache_loc = torch.stack(prefixes).view(3, bs * q)
    return ForwardBatch(
        mode=mode,
        input_ids=ids if input_ids is None else input_ids,
        positions=own_positions if positions is None else positions,
        out_cache_loc=out_cache_loc,
        req_rows=batch.req_rows,
        seq_lens=batch.seq_lens - (n - q),
        seq_lens_cpu=[s - (n - q) for s in batch.seq_lens_cpu],
        extend_lens_cpu=[q] * bs,
        logits_rows=torch.arange(bs * q, device=device) if logits_rows is None else logits_rows,
        req_to_token=batch.req_to_token,
        capture_layer_ids=capture_layer_ids,
        uniform_q_len=q,
        max_seq_len_hint=batch.max_seq_len_hint,
    )
