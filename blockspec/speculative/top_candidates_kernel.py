"""DDTree's top-B over the vocabulary (tree_build.top_candidates: each draft position's B most likely tokens and their
log-probabilities) in two Triton launches with static shapes and no host read, so it stays inside the greedy-cycle
CUDA graph. The torch form reads the logits three times (the fp32 copy, the top-k, the logsumexp) and its top-k is a
general selection; here every logit is read once and does O(1) work, and the sorts see only small sets.

The selection goes through groups of GROUP consecutive tokens. A group's key is its largest logit and its index (the
64-bit keys of tree_build_kernel.py: fp32 bits above the reversed index, so a descending sort of integers orders by
value, then by the smaller index). The top-K tokens of a row (K >= B) lie in the top-K groups: a token of a group
outside them is beaten by the first maximum of each of those K groups (a larger logit, or an equal one at a smaller
token, since groups are contiguous and ordered like their tokens). The same holds per chunk: the row's top-K groups
lie in the union of the chunks' top-K groups. So

  stage 1, grid (rows, chunks of CHUNK tokens): load the chunk once in its own dtype, upcast to fp32; write the
           chunk's max and Σ exp(x - max), and the keys of its top-K groups (a sort of CHUNK / GROUP group keys);
  stage 2, grid (rows): logsumexp from the chunks' (max, sum); the top-K groups of the chunks' K each (one sort of
           chunks · K keys); their K · GROUP logits gathered again (from cache) as token keys, sorted, and the first B
           written: log-probability logit - logsumexp in fp32, token int64, descending, ties to the smaller token.

NOTE: the tokens and their order equal a stable descending sort of the fp32-upcast row; the scores equal the torch
form's up to the rounding of the logsumexp (a sum over chunks in another order, and Triton's exp / log), a few ulp.
With a draft's multiplier and softcap applied in the kernels (`LogitScale`), the scaled values equal `scale.apply`'s
up to a few ulp of the softcap's tanh (here 2σ(2y) − 1): distinct logits that a saturated softcap brings within an
ulp of each other may tie or swap against torch's order (no draft caps below its largest logits)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from blockspec.models.logit_scale import UNSCALED, LogitScale
from blockspec.pdl import pdl_launch, wait_for_previous_grid
from blockspec.speculative.score_keys import key_index, key_score, leading, score_key
from blockspec.speculative.tree_budget import check_budget

GROUP = 16  # NOTE: tokens per group: stage 2 gathers and sorts K · GROUP logits, stage 1 sorts CHUNK / GROUP keys
MIN_K = 16  # NOTE: no block edge below it (a budget of 1 would make one-element blocks)
MAX_FUSED_BUDGET = 128  # NOTE: above it (K >= 256) the sorts outgrow the registers: build_tree takes the torch form
MIN_CHUNK = 4096
MAX_CHUNK = 8192  # NOTE: a chunk is loaded whole into one program's registers (stage 1); ptxas for sm90 spills
# registers at twice this, and keeps this spill-free at 16 warps
MAX_MERGE = 4096  # NOTE: the group keys stage 2 sorts (chunks rounded up to a power of two, times K); chunks grow to
# keep under it where they can (a larger vocabulary just sorts more)
ELEMENTS_PER_THREAD = 16  # NOTE: stage 1's warps: the chunk over 32 · this (8 warps at 4096, 16 at 8192)
MERGE_WARPS, MERGE_WARPS_LARGE, MERGE_KEYS_SMALL = 8, 16, 2048  # NOTE: stage 2 takes 16 warps above 2048 group keys
# (more keys a thread at 8 warps crowd the registers, as ptxas for sm90 reports)
TOKEN_SPAN = 2 ** 31  # NOTE: token and group indices lie in [0, SPAN) (the keys' low 32 bits); the kernels' SPAN


@triton.jit
def _scaled(x, multiplier, softcap, SCALED: tl.constexpr, SOFTCAP: tl.constexpr):
    """fp32 logits from raw head outputs x (fp32): × multiplier, then softcap · tanh(· / softcap), as
    models.logit_scale.LogitScale.apply up to a few ulp (tanh(y) = 2σ(2y) − 1, which maps ±inf to ±1)."""
    if SCALED:
        x = x * multiplier
    if SOFTCAP:
        x = (2.0 * tl.sigmoid(2.0 * (x / softcap)) - 1.0) * softcap
    return x


@triton.jit
def _chunk_groups_kernel(logits_ptr, group_keys_ptr, chunk_max_ptr, chunk_sum_ptr, vocab, stride_row, num_chunks,
                         multiplier, softcap, CHUNK: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr,
                         SPAN: tl.constexpr, SCALED: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """Per (row, chunk): the chunk's max and Σ exp(x - max) in fp32, and the keys of its K best groups, descending.
    Tokens past the vocabulary are masked to -inf (never read); their groups sort below every real one."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    tokens = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + tokens, mask=tokens < vocab, other=0.0).to(tl.float32)
    x = tl.where(tokens < vocab, _scaled(x, multiplier, softcap, SCALED, SOFTCAP), float("-inf"))
    top = tl.max(x, 0)
    total = tl.sum(tl.exp(x - top), 0)  # NOTE: a chunk always holds a real token (chunks = cdiv(vocab, CHUNK))
    group_max = tl.max(tl.reshape(x, (CHUNK // GROUP, GROUP)), axis=1)
    groups = chunk * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP)
    best = leading(tl.sort(score_key(group_max, groups, SPAN), descending=True), CHUNK // GROUP, K)
    at = row * num_chunks + chunk
    tl.store(group_keys_ptr + at * K + tl.arange(0, K), best)
    tl.store(chunk_max_ptr + at, top)
    tl.store(chunk_sum_ptr + at, total)


@triton.jit
def _merge_top_kernel(logits_ptr, group_keys_ptr, chunk_max_ptr, chunk_sum_ptr, scores_ptr, tokens_ptr, vocab,
                      stride_row, num_chunks, budget, multiplier, softcap, BLOCK_CHUNKS: tl.constexpr,
                      GROUP: tl.constexpr, K: tl.constexpr, SPAN: tl.constexpr, SCALED: tl.constexpr = False,
                      SOFTCAP: tl.constexpr = False, PDL: tl.constexpr = False):
    """Per row: the logsumexp from the chunks' (max, sum), the top-K groups over all chunks, and the top-B tokens of
    those groups' K · GROUP logits (read again, masked past the vocabulary): scores [budget] fp32, tokens [budget]."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    in_row = chunks < num_chunks
    maxima = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=in_row, other=float("-inf"))
    sums = tl.load(chunk_sum_ptr + row * num_chunks + chunks, mask=in_row, other=0.0)
    top = tl.max(maxima, 0)
    lse = top + tl.log(tl.sum(sums * tl.exp(maxima - top), 0))

    slots = tl.arange(0, BLOCK_CHUNKS * K)
    written = slots < num_chunks * K
    keys = tl.load(group_keys_ptr + row * num_chunks * K + slots, mask=written, other=0)
    # NOTE: padding below every written key (-inf at the last index; written keys' indices are smaller): it is
    # never among the top K, since every chunk writes K keys
    lowest = score_key(tl.full((BLOCK_CHUNKS * K,), float("-inf"), tl.float32),
                        tl.full((BLOCK_CHUNKS * K,), SPAN - 1, tl.int64), SPAN)
    keys = tl.where(written, keys, lowest)
    groups = key_index(leading(tl.sort(keys, descending=True), BLOCK_CHUNKS * K, K), SPAN)

    tokens = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [K, GROUP]
    x = tl.load(logits_ptr + row * stride_row + tokens, mask=tokens < vocab, other=0.0).to(tl.float32)
    x = tl.where(tokens < vocab, _scaled(x, multiplier, softcap, SCALED, SOFTCAP), float("-inf"))
    token_keys = tl.reshape(score_key(x, tokens, SPAN), (K * GROUP,))
    best = leading(tl.sort(token_keys, descending=True), K * GROUP, K)
    out = tl.arange(0, K)
    in_budget = out < budget
    tl.store(scores_ptr + row * budget + out, key_score(best) - lse, mask=in_budget)
    tl.store(tokens_ptr + row * budget + out, key_index(best, SPAN), mask=in_budget)


def candidate_width(budget: int) -> int:
    """K: the top-K kept per chunk and over the groups, a power of two >= the budget (at least MIN_K)."""
    return max(MIN_K, triton.next_power_of_2(budget))


def chunk_size(vocab: int, budget: int) -> int:
    """Tokens per stage-1 program: MIN_CHUNK, doubled while stage 2's group keys (chunks rounded up to a power of two,
    times K) exceed MAX_MERGE, up to MAX_CHUNK. Always >= K · GROUP (a chunk has K groups to give)."""
    k = candidate_width(budget)
    chunk = max(MIN_CHUNK, k * GROUP)
    while triton.next_power_of_2(triton.cdiv(vocab, chunk)) * k > MAX_MERGE and chunk < MAX_CHUNK:
        chunk *= 2
    return chunk


def fused_top_candidates(logits: torch.Tensor, budget: int, chunk: Optional[int] = None,
                         scale: LogitScale = UNSCALED) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_build.top_candidates in two launches: logits [..., V] (fp32, fp16 or bf16, finite) → (scores fp32,
    tokens int64) [..., budget], each row descending, ties to the smaller token. `chunk`: tokens per stage-1 program
    (a power of two >= K · GROUP; default chunk_size, tests pass small ones to get several chunks). Budgets up to
    MAX_FUSED_BUDGET. `scale`: the logits are raw head outputs, scaled in the kernels as `scale.apply` does, up to
    the softcap's rounding (module NOTE; no fp32 copy of the rows first)."""
    vocab = logits.shape[-1]
    check_budget(budget, vocab)
    if budget > MAX_FUSED_BUDGET:
        raise ValueError(f"the fused top-B takes budgets up to {MAX_FUSED_BUDGET} (got {budget}): the torch form "
                         "tree_build.top_candidates takes larger ones")
    k = candidate_width(budget)
    chunk = chunk or chunk_size(vocab, budget)
    if chunk & (chunk - 1) or not k * GROUP <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk must be a power of two in [{k * GROUP}, {MAX_CHUNK}] at budget {budget}, got {chunk}")
    lead = logits.shape[:-1]
    device = logits.device
    rows_view = logits.reshape(-1, vocab)
    if rows_view.stride(-1) != 1:
        rows_view = rows_view.contiguous()
    rows = rows_view.shape[0]
    scores = torch.empty((*lead, budget), dtype=torch.float32, device=device)
    tokens = torch.empty((*lead, budget), dtype=torch.int64, device=device)
    if rows == 0:
        return scores, tokens
    num_chunks = triton.cdiv(vocab, chunk)
    group_keys = torch.empty((rows, num_chunks, k), dtype=torch.int64, device=device)
    chunk_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=device)
    chunk_sum = torch.empty((rows, num_chunks), dtype=torch.float32, device=device)
    # NOTE: both stages read logits, so both scale them alike (module NOTE)
    scale_values = (scale.multiplier, scale.softcap or 1.0)
    scale_flags = dict(SCALED=scale.multiplier != 1.0, SOFTCAP=bool(scale.softcap))
    _chunk_groups_kernel[(rows, num_chunks)](
        rows_view, group_keys, chunk_max, chunk_sum, vocab, rows_view.stride(0), num_chunks, *scale_values,
        CHUNK=chunk, GROUP=GROUP, K=k, SPAN=TOKEN_SPAN, **scale_flags,
        num_warps=max(1, chunk // (32 * ELEMENTS_PER_THREAD)), **pdl_launch(rows_view),
    )
    block_chunks = triton.next_power_of_2(num_chunks)
    _merge_top_kernel[(rows,)](
        rows_view, group_keys, chunk_max, chunk_sum, scores, tokens, vocab, rows_view.stride(0), num_chunks, budget,
        *scale_values, BLOCK_CHUNKS=block_chunks, GROUP=GROUP, K=k, SPAN=TOKEN_SPAN, **scale_flags,
        num_warps=MERGE_WARPS_LARGE if block_chunks * k > MERGE_KEYS_SMALL else MERGE_WARPS, **pdl_launch(rows_view),
    )
    return scores, tokens
