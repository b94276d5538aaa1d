"""Turns sequences + anchors into one masked multi-block training batch (the DFlash recipe).

For an anchor a in the response: block = [token a, mask × (B-1)] at positions a .. a+B-1, the context is the
features of tokens 0..a-1 (exactly what inference has when token a is the last committed token), and the labels
are tokens a+1 .. a+B-1. Every block of a sequence shares one key/value sequence [context ; all blocks]; the mask
lets a block see the context before its anchor and itself (non-causally), nothing else."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from blockspec.models.candidate_selector import CandidateSelector

IGNORE = -100
CONTEXT_MULTIPLE = 64  # the training step's context padding on CUDA (build_block_batch's context_multiple)


@dataclass
class BlockBatch:
    features: torch.Tensor  # [N, C, taps*H] target features of every token (padded)
    block_ids: torch.Tensor  # [N, n, B] anchor token then mask tokens
    positions: torch.Tensor  # [N, n*B]
    mask: torch.Tensor  # [N, n*B, C + n*B] bool, True = visible
    labels: torch.Tensor  # [N, n, B-1] next tokens, IGNORE past the sequence end or for padding blocks
    block_valid: torch.Tensor  # [N, n] False for padding blocks


def sample_anchors(prompt_len: int, seq_len: int, count: int, generator: torch.Generator) -> list[int]:
    """Up to `count` distinct anchors in [prompt_len, seq_len - 2]: response tokens with at least one label."""
    candidates = seq_len - 1 - prompt_len
    if candidates <= 0:
        return []
    picks = torch.randperm(candidates, generator=generator)[:count] + prompt_len
    return sorted(picks.tolist())


def loss_weights(block_size: int, decay: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/γ) for block positions k = 1..B-1: early positions matter most for acceptance."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / decay)


def build_block_batch(
    sequences: list[list[int]], features: list[torch.Tensor], anchors: list[list[int]], block_size: int,
    mask_token_id: int, device: torch.device, context_multiple: int = 1,
) -> BlockBatch:
    """`context_multiple`: the context length is padded up to a multiple of it (the padding is masked out, so the
    loss is the same): fewer distinct attention shapes, each of which cuDNN plans once (≈ 150 ms on the H200)."""
    n_seq, b = len(sequences), block_size
    n_blocks = max(1, max(len(a) for a in anchors))
    longest = max(len(s) for s in sequences)
    context = -(-longest // context_multiple) * context_multiple
    ids = torch.zeros(n_seq, context + b, dtype=torch.int64)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = torch.tensor(seq)
    anchor = torch.zeros(n_seq, n_blocks, dtype=torch.int64)
    valid = torch.zeros(n_seq, n_blocks, dtype=torch.bool)
    for i, picks in enumerate(anchors):
        anchor[i, :len(picks)] = torch.tensor(picks, dtype=torch.int64)
        valid[i, :len(picks)] = True
    # NOTE: only these small index tensors cross to the device; the mask ([N, n*B, C + n*B], tens of MB at the
    # recipe's sizes) is built there, where it costs microseconds instead of host milliseconds and a copy.
    ids, anchor, valid = ids.to(device), anchor.to(device), valid.to(device)
    lengths = torch.tensor([len(s) for s in sequences], device=device)
    offsets = torch.arange(b, device=device)
    positions = anchor[:, :, None] + offsets  # [N, n, B]
    tokens = ids.gather(1, positions.view(n_seq, -1)).view(n_seq, n_blocks, b)
    block_ids = torch.full_like(tokens, mask_token_id)
    block_ids[:, :, 0] = tokens[:, :, 0]
    in_sequence = positions[:, :, 1:] < lengths[:, None, None]
    labels = torch.where(in_sequence & valid[:, :, None], tokens[:, :, 1:], torch.full_like(tokens[:, :, 1:], IGNORE))
    sees_context = torch.arange(context, device=device)[None, None, :] < anchor[:, :, None]  # [N, n, C]
    sees_context = sees_context[:, :, None, :].expand(-1, -1, b, -1).reshape(n_seq, n_blocks * b, context)
    same_block = torch.arange(n_blocks, device=device).repeat_interleave(b)
    sees_blocks = (same_block[:, None] == same_block[None, :]).expand(n_seq, -1, -1)
    padded = torch.nn.utils.rnn.pad_sequence([f.to(device) for f in features], batch_first=True)
    padded = F.pad(padded, (0, 0, 0, context - padded.shape[1]))
    return BlockBatch(
        features=padded,
        block_ids=block_ids,
        positions=positions.view(n_seq, -1),
        mask=torch.cat([sees_context, sees_blocks], dim=2),
        labels=labels,
        block_valid=valid,
    )


@dataclass
class BlockLoss:
    loss: torch.Tensor
    accuracy: float  # top-1 over all labelled positions
    accept_estimate: float  # mean over blocks of 1 + leading correct predictions (teacher-forced τ)


def block_loss(
    hidden: torch.Tensor, batch: BlockBatch, lm_head_weight: torch.Tensor, weights: torch.Tensor,
    selector: Optional[CandidateSelector] = None,
) -> BlockLoss:
    """Weighted CE of block rows 1..B-1 through the frozen target lm_head (the draft has none); with a DFlash2
    `selector`, plus its weighted CE over each row's candidates (selector_loss)."""
    n_seq, n_blocks, b_minus_1 = batch.labels.shape
    rows = hidden.view(n_seq, n_blocks, b_minus_1 + 1, -1)[:, :, 1:]
    labelled = batch.labels != IGNORE
    logits = F.linear(rows[labelled], lm_head_weight).float()
    targets = batch.labels[labelled]
    w = weights.to(hidden.device).expand(n_seq, n_blocks, -1)[labelled]
    ce = F.cross_entropy(logits, targets, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    if selector is not None:
        previous = torch.cat([batch.block_ids[:, :, :1], batch.labels[:, :, :-1]], dim=2)[labelled]
        loss = loss + selector_loss(selector, rows[labelled], logits, previous, targets, w)
    with torch.no_grad():
        correct = torch.zeros_like(labelled)
        correct[labelled] = logits.argmax(-1) == targets
        run = correct.long().cumprod(-1).sum(-1).float()
        accept = 1.0 + run[batch.block_valid].mean().item() if batch.block_valid.any() else 1.0
        accuracy = correct[labelled].float().mean().item() if labelled.any() else 0.0
    return BlockLoss(loss, accuracy, accept)


def selector_loss(
    selector: CandidateSelector, rows: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor,
    targets: torch.Tensor, weights: torch.Tensor,
) -> torch.Tensor:
    """Weighted CE of the selector's scores over each labelled row's top-k candidates, the row's previous token the
    true one (teacher-forced, as the backbone's loss), on the rows whose label is among their candidates (the others
    cannot be proposed: the backbone's loss is what pulls their label in). rows [R, H], logits [R, V], previous,
    targets, weights [R]."""
    unary, ids = selector.candidates(logits)
    hit = ids == targets[:, None]
    present = hit.any(-1)
    if not bool(present.any()):
        return logits.new_zeros(())
    scores = selector.scores_after(rows[present], previous[present], ids[present], unary[present])
    ce = F.cross_entropy(scores, hit[present].float().argmax(-1), reduction="none")
    return (ce * weights[present]).sum() / weights[present].sum().clamp(min=1e-6)
