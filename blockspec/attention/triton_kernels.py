"""Triton paged attention: one kernel for prefill/extend, decode, verify and DFlash draft attention.

Rows of a program are (query token, query head in the GQA group) pairs of one request and one KV head, so
decode (1 token x group heads) and verify/draft (B tokens x group heads) fill the matrix units. Keys are read
through the req→token table. Long contexts are split over programs (split-K); the last split program of a row
block to finish merges the partial results, so one launch does the whole attention.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _gpu_fence(anchor):
    """fence.acq_rel.gpu in every thread (CUDA only): orders this thread's global stores/loads GPU-wide."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [anchor], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _merge_splits(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, part_rows, o_offsets, row_valid, dims,
                  dim_valid, stride_p_split, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """out = sum_s w_s acc_s / sum_s w_s sum_s with w_s = 2^(max_s - max): the split partials of these rows."""
    overall = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        split_max = tl.load(part_max_ptr + part_rows + s * stride_p_split, mask=row_valid, other=float("-inf"),
                            cache_modifier=".cg")
        overall = tl.maximum(overall, split_max)
    overall = tl.where(overall == float("-inf"), 0.0, overall)
    total = tl.zeros([BLOCK_M], tl.float32)
    merged = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        rows_s = part_rows + s * stride_p_split
        split_max = tl.load(part_max_ptr + rows_s, mask=row_valid, other=float("-inf"), cache_modifier=".cg")
        weight = tl.where(split_max == float("-inf"), 0.0, tl.exp2(split_max - overall))
        total += weight * tl.load(part_sum_ptr + rows_s, mask=row_valid, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_acc_ptr + rows_s[:, None] * BLOCK_D + dims[None, :], mask=row_valid[:, None], other=0.0,
                      cache_modifier=".cg")
        merged += acc * weight[:, None]
    out = merged / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, tickets_ptr,
    req_to_token_ptr, req_rows_ptr, q_starts_ptr, q_lens_ptr, seq_lens_ptr,
    stride_q_tok, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
    stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, stride_p_split,
    qk_scale_log2, window,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, GPU_FENCE: tl.constexpr,
):
    """Scores are kept in log2 units (qk_scale_log2 = softmax scale * log2 e) so every exponential is an exp2.

    Split-K (NUM_SPLITS > 1): each program stores its rows' (acc, max, sum) partials, then takes a ticket on its
    row block's counter in `tickets_ptr`; the program drawing the last ticket merges and resets the counter to 0
    (so the counters are all 0 between launches and the kernel can be replayed in a CUDA graph)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_split = tl.program_id(2)
    req = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    q_len = tl.load(q_lens_ptr + req)
    if pid_m * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    q_start = tl.load(q_starts_ptr + req)
    table_row = tl.load(req_rows_ptr + req).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len * GROUP
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = seq_len - q_len + token
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_offsets = (q_start + token)[:, None].to(tl.int64) * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    kv_end = seq_len
    if CAUSAL:
        kv_end = tl.minimum(seq_len, seq_len - q_len + (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(0, seq_len - q_len + (pid_m * BLOCK_M) // GROUP - window + 1)
    span = tl.maximum(kv_end - kv_begin, 0)
    split_len = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_begin + pid_split * split_len
    hi = tl.minimum(lo + split_len, kv_end)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = req_to_token_ptr + table_row * stride_table_row
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_valid = cols < hi
        slots = tl.load(table + cols, mask=col_valid, other=0).to(tl.int64)
        kv_offsets = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
        kv_mask = col_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * qk_scale_log2
        allowed = row_valid[:, None] & col_valid[None, :]
        distance = q_pos[:, None] - cols[None, :]
        if CAUSAL:
            allowed = allowed & (distance >= 0)
        if USE_WINDOW:
            allowed = allowed & (distance < window)
            if not CAUSAL:
                allowed = allowed & (-distance < window)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, 1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        row_max = new_max

    o_offsets = (q_start + token)[:, None].to(tl.int64) * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    else:
        part_rows = (q_start + token).to(tl.int64) * stride_p_tok + head * stride_p_head
        mine = part_rows + pid_split * stride_p_split
        tl.store(part_acc_ptr + mine[:, None] * BLOCK_D + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(part_max_ptr + mine, row_max, mask=row_valid)
        tl.store(part_sum_ptr + mine, row_sum, mask=row_valid)
        # NOTE: every thread fences its partial stores, the block syncs, then one thread takes the ticket (acq_rel):
        # the last ticket's program then sees all splits' partials (read from L2, .cg).
        if GPU_FENCE:
            _gpu_fence(rows)
        tl.debug_barrier()
        counter = tickets_ptr + pid_m * tl.num_programs(1) + pid_bh
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:
            if GPU_FENCE:
                _gpu_fence(rows)
            _merge_splits(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, part_rows, o_offsets, row_valid, dims,
                          dim_valid, stride_p_split, BLOCK_M, BLOCK_D, NUM_SPLITS)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
