"""Triton paged attention: one kernel for prefill/extend, decode, verify and DFlash draft attention.

Rows of a program are (query token, query head in the GQA group) pairs of one request and one KV head, so
decode (1 token x group heads) and verify/draft (B tokens x group heads) fill the matrix units. Keys are read
through the req→token table. Long contexts are split over programs (split-K) and merged by a second kernel.
(Merging inside the attention kernel — the last split of a row block merges, by an atomic ticket — measured
1.3-1.6x slower on the H200: the merge then runs serially in a few programs.)
"""
from __future__ import annotations

import triton
import triton.language as tl

from blockspec.pdl import wait_for_previous_grid

LOG2E = 1.4426950408889634


@triton.jit
def _mask_scores(scores, row_valid, col_valid, q_pos, cols, window, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr):
    allowed = row_valid[:, None] & col_valid[None, :]
    distance = q_pos[:, None] - cols[None, :]
    if CAUSAL:
        allowed = allowed & (distance >= 0)
    if USE_WINDOW:
        allowed = allowed & (distance < window)
        if not CAUSAL:
            allowed = allowed & (-distance < window)
    return tl.where(allowed, scores, float("-inf"))


@triton.jit
def load_query_rows(q_ptr, q_start, q_len, seq_len, pid_m, kv_head, stride_q_tok, stride_q_head,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's query rows, (token, head of the GQA group) pairs of one request and one KV head: the q tile and,
    per row, whether it exists, its token, head and absolute position; the head-dim lanes and which are real."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len * GROUP
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = seq_len - q_len + token
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_offsets = (q_start + token)[:, None].to(tl.int64) * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    return q, row_valid, token, head, q_pos, dims, dim_valid


@triton.jit
def causal_kv_end(seq_len, q_len, pid_m, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key any row of the program may see."""
    kv_end = seq_len
    if CAUSAL:
        kv_end = tl.minimum(seq_len, seq_len - q_len + (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    return kv_end


@triton.jit
def store_rows(out_ptr, values, q_start, token, head, dims, row_valid, dim_valid, stride_o_tok, stride_o_head):
    """Writes each row's [BLOCK_D] result to out[q_start + token, head]."""
    o_offsets = (q_start + token)[:, None].to(tl.int64) * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_offsets, values.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def store_partials(part_acc_ptr, part_max_ptr, part_sum_ptr, base, acc, row_max, row_sum, dims, row_valid,
                   BLOCK_D: tl.constexpr):
    """One split's (or lane's) online-softmax state per row, at partial index `base`, for a merge kernel."""
    tl.store(part_acc_ptr + base[:, None] * BLOCK_D + dims[None, :], acc, mask=row_valid[:, None])
    tl.store(part_max_ptr + base, row_max, mask=row_valid)
    tl.store(part_sum_ptr + base, row_sum, mask=row_valid)


# NOTE: the per-request index arrays are read one scalar per program, so their alignment cannot matter; extend batches
# take them as slices of one packed buffer (build_batch), whose offsets vary with the batch. Specialising on their
# alignment would compile a new variant while serving (issue 25).
INDEX_POINTERS = ("req_rows_ptr", "q_starts_ptr", "q_lens_ptr", "seq_lens_ptr")


@triton.jit(do_not_specialize_on_alignment=INDEX_POINTERS)
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    req_to_token_ptr, req_rows_ptr, q_starts_ptr, q_lens_ptr, seq_lens_ptr, tree_mask_ptr,
    stride_q_tok, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
    stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, stride_p_split, stride_tree_req, stride_tree_row,
    qk_scale_log2, window,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_EDGES_ONLY: tl.constexpr,
    TREE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Scores are kept in log2 units (qk_scale_log2 = softmax scale * log2 e) so every exponential is an exp2; with
    NUM_SPLITS > 1 each program stores its rows' (acc, max, sum) partials for merge_splits_kernel. With
    MASK_EDGES_ONLY, scores are masked only in key blocks that some row may not see (the causal diagonal, the ragged
    end, every block of a windowed layer; padded rows have q = 0, so their unmasked scores stay finite): faster with
    wide key tiles, slower with narrow ones (the branch costs more than the mask), so the launch policy picks."""
    wait_for_previous_grid(PDL)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_split = tl.program_id(2)
    req = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    q_len = tl.load(q_lens_ptr + req)
    if pid_m * BLOCK_M >= q_len * GROUP:
        return
    attend_program(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        req_to_token_ptr, req_rows_ptr, q_starts_ptr, seq_lens_ptr, tree_mask_ptr, req, kv_head, pid_m, pid_split,
        q_len, stride_q_tok, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
        stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, stride_p_split, stride_tree_req, stride_tree_row,
        qk_scale_log2, window,
        GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, NUM_SPLITS, CAUSAL, USE_WINDOW, DOT_PRECISION, MASK_EDGES_ONLY, 0,
        TREE,
    )


@triton.jit(do_not_specialize_on_alignment=INDEX_POINTERS)
def tiled_extend_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    req_to_token_ptr, req_rows_ptr, q_starts_ptr, q_lens_ptr, seq_lens_ptr, tile_req_ptr, tile_m_ptr, tile_count_ptr,
    stride_q_tok, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row, stride_o_tok, stride_o_head,
    stride_p_tok, stride_p_head, qk_scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_EDGES_ONLY: tl.constexpr, PDL: tl.constexpr = False,
):
    """paged_attention_kernel's work for a ragged extend batch without a host-side launch shape (so it can live in
    a CUDA graph): axis 0 walks a tile table made on the device (triton_graph_extend.py), tile t being query-row
    block tile_m[t] of request tile_req[t], for t < tile_count; axis 1 is the KV head; axis 2 the key split. With
    NUM_SPLITS > 1 each split covers its share (at least MIN_SPLIT_KEYS keys) of the program's key span, found at
    run time, and stores partials for merge_real_rows_kernel; a split past the span stores empty ones."""
    wait_for_previous_grid(PDL)
    tile = tl.program_id(0)
    if tile >= tl.load(tile_count_ptr):
        return
    req = tl.load(tile_req_ptr + tile)
    pid_m = tl.load(tile_m_ptr + tile)
    q_len = tl.load(q_lens_ptr + req)
    pid_split = 0
    if NUM_SPLITS > 1:
        pid_split = tl.program_id(2)
    attend_program(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        req_to_token_ptr, req_rows_ptr, q_starts_ptr, seq_lens_ptr, q_ptr, req, tl.program_id(1), pid_m, pid_split,
        q_len, stride_q_tok, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
        stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, 1, 0, 0, qk_scale_log2, window,
        GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, NUM_SPLITS, CAUSAL, USE_WINDOW, DOT_PRECISION, MASK_EDGES_ONLY,
        MIN_SPLIT_KEYS, False,
    )


@triton.jit
def attend_program(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    req_to_token_ptr, req_rows_ptr, q_starts_ptr, seq_lens_ptr, tree_mask_ptr, req, kv_head, pid_m, pid_split,
    q_len, stride_q_tok, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
    stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, stride_p_split, stride_tree_req, stride_tree_row,
    qk_scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASK_EDGES_ONLY: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, TREE: tl.constexpr,
):
    """One program's work: query-row block pid_m of request `req` (it exists: pid_m * BLOCK_M < q_len * GROUP) for
    KV head `kv_head`, over the keys of split pid_split: 1/NUM_SPLITS of the program's key span, but at least
    MIN_SPLIT_KEYS keys (0: no floor), so short spans use fewer splits. A split past the span (lo >= hi) reads no
    key and stores max = -inf, sum = 0, acc = 0, which the merge weighs 0."""
    seq_len = tl.load(seq_lens_ptr + req)
    q_start = tl.load(q_starts_ptr + req)
    table_row = tl.load(req_rows_ptr + req).to(tl.int64)
    q, row_valid, token, head, q_pos, dims, dim_valid = load_query_rows(
        q_ptr, q_start, q_len, seq_len, pid_m, kv_head, stride_q_tok, stride_q_head, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M)

    first_q_pos = seq_len - q_len + (pid_m * BLOCK_M) // GROUP
    kv_end = causal_kv_end(seq_len, q_len, pid_m, GROUP, BLOCK_M, CAUSAL)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(0, first_q_pos - window + 1)
    span = tl.maximum(kv_end - kv_begin, 0)
    split_len = tl.cdiv(span, NUM_SPLITS)
    if MIN_SPLIT_KEYS > 0:
        split_len = tl.maximum(split_len, MIN_SPLIT_KEYS)
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    lo = kv_begin + pid_split * split_len
    hi = tl.minimum(lo + split_len, kv_end)
    # NOTE: keys < seen_by_all are visible to every row here (causal: up to the first row's position).
    seen_by_all = hi
    if CAUSAL:
        seen_by_all = tl.minimum(hi, first_q_pos + 1)
    if USE_WINDOW:
        seen_by_all = lo
    tree_start = seq_len - q_len  # NOTE: the first new row's key (TREE only)
    if TREE:
        seen_by_all = tl.minimum(seen_by_all, tree_start)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = req_to_token_ptr + table_row * stride_table_row
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_valid = cols < hi
        slots = tl.load(table + cols, mask=col_valid, other=0).to(tl.int64)
        kv_offsets = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
        if HEAD_DIM == BLOCK_D:
            kv_mask = col_valid[:, None]
        else:
            kv_mask = col_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if TREE:
            # NOTE: loaded beside K and V (masked off before the tree's keys: no traffic there), not after the dot:
            # the mask's global round trip then overlaps theirs instead of following the scores
            in_tree = col_valid & (cols >= tree_start)
            tree_offsets = req * stride_tree_req + token[:, None] * stride_tree_row + (cols - tree_start)[None, :]
            sees = tl.load(tree_mask_ptr + tree_offsets, mask=row_valid[:, None] & in_tree[None, :], other=0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * qk_scale_log2
        if MASK_EDGES_ONLY:
            if start + BLOCK_N > seen_by_all:
                scores = _mask_scores(scores, row_valid, col_valid, q_pos, cols, window, CAUSAL, USE_WINDOW)
        else:
            scores = _mask_scores(scores, row_valid, col_valid, q_pos, cols, window, CAUSAL, USE_WINDOW)
        if TREE:
            scores = tl.where((sees != 0) | (cols < tree_start)[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, 1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        row_max = new_max

    if NUM_SPLITS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        store_rows(out_ptr, out, q_start, token, head, dims, row_valid, dim_valid, stride_o_tok, stride_o_head)
    else:
        base = (q_start + token).to(tl.int64) * stride_p_tok + head * stride_p_head + pid_split * stride_p_split
        store_partials(part_acc_ptr, part_max_ptr, part_sum_ptr, base, acc, row_max, row_sum, dims, row_valid, BLOCK_D)


@triton.jit
def merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, stride_p_split, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out = sum_s w_s acc_s / sum_s w_s sum_s, w_s = 2^(max_s - max), for BLOCK_H heads of one token."""
    wait_for_previous_grid(PDL)
    merge_token(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, tl.program_id(0).to(tl.int64),
                stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, stride_p_split, num_heads,
                HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_H)


@triton.jit
def merge_real_rows_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, token_count_ptr,
    stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, stride_p_split, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """merge_splits_kernel on a fixed grid over a CUDA graph bucket's rows: only the first tl.load(token_count_ptr)
    rows (the batch's query rows) are merged; the rows after them belong to no request and are left untouched."""
    wait_for_previous_grid(PDL)
    token = tl.program_id(0)
    if token >= tl.load(token_count_ptr):
        return
    merge_token(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, token.to(tl.int64),
                stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, stride_p_split, num_heads,
                HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_H)


@triton.jit
def merge_token(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, token,
    stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, stride_p_split, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The split-K merge of BLOCK_H heads (block tl.program_id(1)) of one token."""
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    base = token * stride_p_tok + heads[:, None] * stride_p_head + splits[None, :] * stride_p_split
    maxes = tl.load(part_max_ptr + base, mask=head_valid[:, None], other=float("-inf"))
    sums = tl.load(part_sum_ptr + base, mask=head_valid[:, None], other=0.0)
    overall = tl.max(maxes, 1)
    overall = tl.where(overall == float("-inf"), 0.0, overall)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - overall[:, None]))
    total = tl.sum(sums * weights, 1)
    # NOTE: a split that saw no key (max -inf: past a short context's span) weighs 0 and holds acc = 0; its acc is not
    # read (the same sum, fewer bytes: a graph's split count is fixed for the longest context it serves)
    live = head_valid[:, None] & (maxes != float("-inf"))
    acc = tl.load(part_acc_ptr + base[:, :, None] * BLOCK_D + dims[None, None, :], mask=live[:, :, None], other=0.0)
    out = tl.sum(acc * weights[:, :, None], 1) / tl.where(total == 0.0, 1.0, total)[:, None]
    o_offsets = token * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(
        out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & (dims < HEAD_DIM)[None, :]
    )
