"""A CPU stand-in for FlashInfer's two paged wrappers (plan/run), in plain torch, for plumbing tests.

Semantics as in FlashInfer's kernels: queries are aligned to the end of their request's KV (query j sits at
position kv_len - qo_len + j); causal admits keys at or before the query; window_left admits keys at distance
<= window_left behind it (keys ahead are not windowed). Plans read the indptrs on the host; CUDA-graph
wrappers copy the indices into their fixed buffer, which run() then reads.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class _PagedWrapper:
    def __init__(
        self, workspace: torch.Tensor, layout: str = "NHD", use_cuda_graph: bool = False,
        use_tensor_cores: bool = False, backend: str = "auto", **buffers: torch.Tensor,
    ) -> None:
        assert layout == "NHD"
        self.use_cuda_graph = use_cuda_graph
        self.buffers = buffers
        self.planned: Optional[tuple[Any, ...]] = None

    def _plan(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
        page_size: int, causal: bool, window_left: int, q_data_type: torch.dtype, sm_scale: float,
    ) -> None:
        assert page_size == 1 and bool((last_page_len == 1).all())
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu"
        assert {qo_indptr.dtype, kv_indptr.dtype, indices.dtype} == {torch.int32}
        assert len(indices) == int(kv_indptr[-1])
        if self.use_cuda_graph:
            fixed = self.buffers.get("paged_kv_indices_buf", self.buffers.get("paged_kv_indices_buffer"))
            assert fixed is not None and len(indices) <= len(fixed)
            fixed[: len(indices)].copy_(indices)
            indices = fixed
        self.planned = (qo_indptr.clone(), kv_indptr.clone(), indices, causal, window_left, sm_scale, q_data_type)

    def run(self, q: torch.Tensor, paged_kv: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        assert self.planned is not None
        qo_indptr, kv_indptr, indices, causal, window_left, scale, dtype = self.planned
        k_cache, v_cache = paged_kv
        assert q.dtype == dtype and k_cache.shape[1] == 1
        group = q.shape[1] // k_cache.shape[2]
        for i in range(len(kv_indptr) - 1):
            q0, q1, k0, k1 = int(qo_indptr[i]), int(qo_indptr[i + 1]), int(kv_indptr[i]), int(kv_indptr[i + 1])
            slots = indices[k0:k1].long()
            keys = k_cache[slots, 0].float().repeat_interleave(group, 1)  # [kv_len, Hq, D]
            values = v_cache[slots, 0].float().repeat_interleave(group, 1)
            query_pos = torch.arange(q1 - q0) + (k1 - k0) - (q1 - q0)
            key_pos = torch.arange(k1 - k0)
            allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
            if causal:
                allowed &= key_pos[None] <= query_pos[:, None]
            if window_left >= 0:
                allowed &= key_pos[None] >= query_pos[:, None] - window_left
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * scale
            scores = scores.masked_fill(~allowed[None], float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(out.dtype)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
        window_left: int = -1, q_data_type: torch.dtype = torch.float16, kv_data_type: Optional[torch.dtype] = None,
        sm_scale: float = 1.0,
    ) -> None:
        self._plan(qo_indptr, kv_indptr, indices, last_page_len, page_size, causal, window_left, q_data_type, sm_scale)


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(
        self, kv_indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, window_left: int = -1,
        q_data_type: torch.dtype = torch.float16, kv_data_type: Optional[torch.dtype] = None, sm_scale: float = 1.0,
    ) -> None:
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo_indptr, kv_indptr, indices, last_page_len, page_size, False, window_left, q_data_type, sm_scale)
