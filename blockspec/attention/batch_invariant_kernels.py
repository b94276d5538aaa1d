"""Batch-invariant paged attention (--enable-deterministic-inference): one kernel for extend, decode, verify, draft.

A query row's keys are cut at fixed absolute positions: chunks of BLOCK_N keys, grouped in lane units of LANE_KEYS
keys; unit u belongs to lane u % LANES. Each lane is one online-softmax stream over its chunks in increasing order,
and the LANES lane partials are folded in lane order (`fold_lane`). Nothing of that depends on the batch, the number
of query tokens of the request, nor on which rows share a program:
- rows sharing a program only widen the key range it walks; a chunk a row may not see is fully masked for it, and a
  fully masked chunk (or lane) leaves its state bit for bit unchanged (its rescale factor is exactly 1, its
  probabilities exactly 0), so a verify row equals the 1-query decode row at the same position;
- SPLIT_LANES only says where the lanes run: one program per lane with the fold in merge_lanes_kernel, or all lanes
  in one program with the same fold in registers. Both fold the same partials with the same `fold_lane` in the same
  order, so the launch policy may pick either per batch (launch with enable_fp_fusion=False: no contraction of the
  fold into FMAs that one variant would do and the other not).
The tiles (BLOCK_M, BLOCK_N, warps, stages) are one fixed set for every mode.
"""
from __future__ import annotations

import triton
import triton.language as tl

from blockspec.attention.triton_kernels import (
    INDEX_POINTERS, _mask_scores, causal_kv_end, load_query_rows, store_partials, store_rows,
)
from blockspec.pdl import wait_for_previous_grid


@triton.jit
def fold_lane(m, s, acc, lane_m, lane_s, lane_acc):
    """(max, sum, acc) of the lanes so far combined with one more lane's; an empty lane (max -inf) changes nothing."""
    new_max = tl.maximum(m, lane_m)
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    a = tl.where(m == new_max, 1.0, tl.exp2(m - safe))
    b = tl.where(lane_m == new_max, 1.0, tl.exp2(lane_m - safe))
    return new_max, s * a + lane_s * b, acc * a[:, None] + lane_acc * b[:, None]


@triton.jit
def _lane_stream(
    q, k_cache_ptr, v_cache_ptr, table, kv_head, stride_kv_slot, stride_kv_head, dims, dim_valid, row_valid, q_pos,
    lane, kv_begin, kv_end, window, qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LANES: tl.constexpr, LANE_KEYS: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One lane's (max, sum, acc): its chunks inside [kv_begin, kv_end) (kv_begin a multiple of BLOCK_N)."""
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first_unit = kv_begin // LANE_KEYS
    unit = first_unit + (lane - first_unit % LANES + LANES) % LANES
    for unit_start in range(unit * LANE_KEYS, kv_end, LANES * LANE_KEYS):
        for start in range(tl.maximum(unit_start, kv_begin), tl.minimum(unit_start + LANE_KEYS, kv_end), BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_valid = cols < kv_end
            slots = tl.load(table + cols, mask=col_valid, other=0).to(tl.int64)
            kv_offsets = slots[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
            if HEAD_DIM == BLOCK_D:
                kv_mask = col_valid[:, None]
            else:
                kv_mask = col_valid[:, None] & dim_valid[None, :]
            k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * qk_scale_log2
            scores = _mask_scores(scores, row_valid, col_valid, q_pos, cols, window, CAUSAL, USE_WINDOW)
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp2(scores - safe_max[:, None])
            # NOTE: exactly 1 where the max did not move: a chunk fully masked for a row leaves the row as it was.
            correction = tl.where(row_max == new_max, 1.0, tl.exp2(row_max - safe_max))
            row_sum = row_sum * correction + tl.sum(probs, 1)
            pv = tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
            acc = acc * correction[:, None] + pv
            row_max = new_max
    return row_max, row_sum, acc


@triton.jit(do_not_specialize_on_alignment=INDEX_POINTERS)
def batch_invariant_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    req_to_token_ptr, req_rows_ptr, q_starts_ptr, q_lens_ptr, seq_lens_ptr,
    stride_q_tok, stride_q_head, stride_kv_slot, stride_kv_head, stride_table_row,
    stride_o_tok, stride_o_head, stride_p_tok, stride_p_head,
    qk_scale_log2, window,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LANES: tl.constexpr, LANE_KEYS: tl.constexpr,
    SPLIT_LANES: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Programs: (row block, request x KV head, lane if SPLIT_LANES). Scores in log2 units (qk_scale_log2 = softmax
    scale * log2 e). With SPLIT_LANES each program stores its lane's (acc, max, sum) for merge_lanes_kernel."""
    wait_for_previous_grid(PDL)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    req = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    q_len = tl.load(q_lens_ptr + req)
    if pid_m * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    q_start = tl.load(q_starts_ptr + req)
    table_row = tl.load(req_rows_ptr + req).to(tl.int64)
    q, row_valid, token, head, q_pos, dims, dim_valid = load_query_rows(
        q_ptr, q_start, q_len, seq_len, pid_m, kv_head, stride_q_tok, stride_q_head, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M)
    kv_end = causal_kv_end(seq_len, q_len, pid_m, GROUP, BLOCK_M, CAUSAL)
    kv_begin = 0
    if USE_WINDOW:
        first_q_pos = seq_len - q_len + (pid_m * BLOCK_M) // GROUP
        kv_begin = tl.maximum(0, first_q_pos - window + 1) // BLOCK_N * BLOCK_N
    table = req_to_token_ptr + table_row * stride_table_row
    if SPLIT_LANES:
        lane = tl.program_id(2)
        m, s, acc = _lane_stream(q, k_cache_ptr, v_cache_ptr, table, kv_head, stride_kv_slot, stride_kv_head, dims,
                                 dim_valid, row_valid, q_pos, lane, kv_begin, kv_end, window, qk_scale_log2,
                                 HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, LANES, LANE_KEYS, CAUSAL, USE_WINDOW,
                                 DOT_PRECISION)
        base = (q_start + token).to(tl.int64) * stride_p_tok + head * stride_p_head + lane
        store_partials(part_acc_ptr, part_max_ptr, part_sum_ptr, base, acc, m, s, dims, row_valid, BLOCK_D)
    else:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first_unit = kv_begin // LANE_KEYS
        active = tl.minimum(tl.cdiv(kv_end, LANE_KEYS) - first_unit, LANES)
        for lane in range(LANES):
            # NOTE: a lane without keys here would fold in as (-inf, 0, 0), which changes nothing: skipped.
            if (lane - first_unit % LANES + LANES) % LANES < active:
                lane_m, lane_s, lane_acc = _lane_stream(
                    q, k_cache_ptr, v_cache_ptr, table, kv_head, stride_kv_slot, stride_kv_head, dims, dim_valid,
                    row_valid, q_pos, lane, kv_begin, kv_end, window, qk_scale_log2,
                    HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, LANES, LANE_KEYS, CAUSAL, USE_WINDOW, DOT_PRECISION)
                m, s, acc = fold_lane(m, s, acc, lane_m, lane_s, lane_acc)
        out = acc / tl.where(s == 0.0, 1.0, s)[:, None]
        store_rows(out_ptr, out, q_start, token, head, dims, row_valid, dim_valid, stride_o_tok, stride_o_head)


@triton.jit
def merge_lanes_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_o_tok, stride_o_head, stride_p_tok, stride_p_head, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, LANES: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out = the lanes' partials folded in lane order (fold_lane), for BLOCK_H heads of one token."""
    wait_for_previous_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    dims = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for lane in range(LANES):
        base = token * stride_p_tok + heads * stride_p_head + lane
        lane_m = tl.load(part_max_ptr + base, mask=head_valid, other=float("-inf"))
        lane_s = tl.load(part_sum_ptr + base, mask=head_valid, other=0.0)
        lane_acc = tl.load(part_acc_ptr + base[:, None] * BLOCK_D + dims[None, :], mask=head_valid[:, None], other=0.0)
        m, s, acc = fold_lane(m, s, acc, lane_m, lane_s, lane_acc)
    out = acc / tl.where(s == 0.0, 1.0, s)[:, None]
    o_offsets = token * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(
        out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & (dims < HEAD_DIM)[None, :]
    )
