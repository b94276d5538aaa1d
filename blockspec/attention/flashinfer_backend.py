"""FlashInfer attention backend (optional, CUDA only): FlashInfer's paged wrappers over the slot pool.

The pool is read as FlashInfer pages of one slot each (indices = the slots of a request's positions from the
req→token table), which works for every page size of ours. DECODE uses the decode wrapper; EXTEND, VERIFY
(causal) and DRAFT (non-causal, sliding layers windowed) use the prefill wrapper. Layers are grouped by
(causal, window): one wrapper per group, all planned once per forward.

FlashInfer plans on the host, so it cannot run inside a CUDA graph. `plan_for_graph` plans a graph's static
batch into per-batch-size CUDA-graph wrappers (fixed buffers the captured kernels read); GraphedForward calls
it before capture and before every replay. Inside the graph, `plan` returns that meta untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import flashinfer
import torch

from blockspec.attention.base import PagedBackendBase, layer_is_causal, layer_window
from blockspec.batch import ForwardBatch, ForwardMode
from blockspec.kv.pool import KVPool

Wrapper = Union[flashinfer.BatchPrefillWithPagedKVCacheWrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper]
LayerKey = tuple[bool, int]  # (causal, FlashInfer window_left; -1 = no window)

MAX_CTA_TILE_Q = 128  # FlashInfer FA2's largest query tile (packed query rows of a CTA)
MIN_CTA_TILE_Q = 16
WORKSPACE_SLACK = 16 * 2**20
MIN_WORKSPACE = 128 * 2**20


@dataclass
class FlashInferMeta:
    wrappers: dict[LayerKey, Wrapper]  # planned for this batch, by layer group
    for_graph: bool  # planned by plan_for_graph into a CUDA graph's fixed buffers


def kv_indices(batch: ForwardBatch, total: int) -> torch.Tensor:
    """Slots of positions 0..seq_len-1 of every request, concatenated [total] int32 (device ops, no host sync)."""
    device = batch.seq_lens.device
    owner = torch.repeat_interleave(
        torch.arange(batch.batch_size, device=device), batch.seq_lens, output_size=total
    )
    starts = torch.cumsum(batch.seq_lens, 0) - batch.seq_lens
    positions = torch.arange(total, device=device) - starts[owner]
    return batch.req_to_token[batch.req_rows[owner], positions].to(torch.int32)


def cumulative(lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0+l1, ...] as a host int32 tensor (FlashInfer's planner reads indptrs on the host)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"FlashInfer attention needs CUDA and bfloat16/float16 (--dtype bfloat16), got {dtype} on {device}"
        )


class FlashInferAttentionBackend(PagedBackendBase):
    def __init__(
        self,
        pool: KVPool,
        scale: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_windows: Optional[list[Optional[int]]] = None,
        draft_layer_causal: Optional[list[bool]] = None,
    ) -> None:
        super().__init__(pool, scale, num_heads, num_kv_heads, head_dim, sliding_windows, draft_layer_causal)
        self.dtype = pool.k[0].dtype
        self.device = pool.k[0].device
        check_supported(self.device, self.dtype)
        # NOTE: FlashInfer NHD paged layout [pages, page_size=1, Hk, D]; views of the pool, made once.
        self.paged_k = [k.unsqueeze(1) for k in pool.k]
        self.paged_v = [v.unsqueeze(1) for v in pool.v]
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.workspace: Optional[torch.Tensor] = None
        self.eager_wrappers: dict[tuple[bool, LayerKey], Wrapper] = {}
        self.graph_wrappers: dict[tuple[bool, int, int, LayerKey], Wrapper] = {}
        self.graph_buffers: dict[str, torch.Tensor] = {}

    # ---- layer groups ----------------------------------------------------------------------------
    def layer_key(self, mode: ForwardMode, layer_id: int) -> LayerKey:
        window = layer_window(self.sliding_windows, layer_id)
        # NOTE: our window admits keys at distance < window; FlashInfer's window_left is inclusive.
        return layer_is_causal(mode, self.draft_layer_causal, layer_id), -1 if window is None else window - 1

    def layer_keys(self, mode: ForwardMode) -> list[LayerKey]:
        return sorted({self.layer_key(mode, layer_id) for layer_id in range(len(self.pool.k))})

    # ---- buffers ---------------------------------------------------------------------------------
    def float_workspace(self, split_rows: int) -> torch.Tensor:
        """A workspace for split-KV partial outputs of `split_rows` query-tile rows (FlashInfer's sizing:
        num_qo_heads x rows x (head_dim + 1) floats). Shared by this backend's wrappers (one stream)."""
        need = max(MIN_WORKSPACE, 4 * self.num_heads * (self.head_dim + 1) * split_rows + WORKSPACE_SLACK)
        if self.workspace is None or self.workspace.numel() < need:
            # NOTE: a replaced workspace stays alive through the wrappers (and captured graphs) that use it.
            self.workspace = torch.zeros(need, dtype=torch.uint8, device=self.device)
        return self.workspace

    def split_rows_bound(self, batch_size: int, total_rows: int) -> int:
        """Upper bound of FlashInfer's padded tiles x CTA_TILE_Q for a CUDA-graph plan (split-KV always on)."""
        group = self.num_heads // self.num_kv_heads
        return max(
            total_rows * group + MAX_CTA_TILE_Q * batch_size, MAX_CTA_TILE_Q * (2 * self.num_sms // self.num_kv_heads)
        )

    def graph_buffer(self, name: str, size: int) -> torch.Tensor:
        """An int32 buffer shared by the graph wrappers of every batch size (one graph replays at a time)."""
        buffer = self.graph_buffers.get(name)
        if buffer is None or buffer.numel() < size:
            buffer = torch.zeros(size, dtype=torch.int32, device=self.device)
            self.graph_buffers[name] = buffer
        return buffer

    # ---- wrappers --------------------------------------------------------------------------------
    def make_wrapper(self, decode: bool, graph_batch_size: Optional[int] = None, tokens_per_req: int = 1) -> Wrapper:
        if graph_batch_size is None:
            workspace = self.float_workspace(self.split_rows_bound(0, 0))
            if decode:
                return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
            return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        bs, rows = graph_batch_size, graph_batch_size * tokens_per_req
        workspace = self.float_workspace(self.split_rows_bound(bs, rows))
        # NOTE: every real request's positions own distinct slots, so a batch reads at most num_slots of them
        # plus tokens_per_req per padded request.
        kv_indptr = self.graph_buffer("kv_indptr", bs + 1)[: bs + 1]
        kv_indices = self.graph_buffer("kv_indices", self.pool.num_slots + rows)
        last_page_len = self.graph_buffer("last_page_len", bs)[:bs]
        if decode:
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=kv_indptr,
                paged_kv_indices_buffer=kv_indices, paged_kv_last_page_len_buffer=last_page_len,
            )
        qo_indptr = self.graph_buffer("qo_indptr", bs + 1)[: bs + 1]
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_indptr, paged_kv_indptr_buf=kv_indptr,
            paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=last_page_len, backend="fa2",
        )

    def wrappers_for(self, batch: ForwardBatch, for_graph: bool) -> dict[LayerKey, Wrapper]:
        with torch.inference_mode(False):
            # NOTE: wrapper buffers are normal tensors, so plan() may update them in or out of inference mode.
            return self._wrappers_for(batch, for_graph)

    def _wrappers_for(self, batch: ForwardBatch, for_graph: bool) -> dict[LayerKey, Wrapper]:
        decode = batch.mode is ForwardMode.DECODE
        wrappers: dict[LayerKey, Wrapper] = {}
        for key in self.layer_keys(batch.mode):
            if for_graph:
                q = batch.uniform_q_len
                assert q is not None, "CUDA graphs run uniform batches only"
                cache_key = (decode, batch.batch_size, q, key)
                if cache_key not in self.graph_wrappers:
                    self.graph_wrappers[cache_key] = self.make_wrapper(decode, batch.batch_size, q)
                wrappers[key] = self.graph_wrappers[cache_key]
            else:
                if (decode, key) not in self.eager_wrappers:
                    self.eager_wrappers[(decode, key)] = self.make_wrapper(decode)
                wrappers[key] = self.eager_wrappers[(decode, key)]
        return wrappers

    # ---- planning (host side) --------------------------------------------------------------------
    def plan_wrappers(self, wrappers: dict[LayerKey, Wrapper], batch: ForwardBatch) -> None:
        if batch.tree_mask is not None:  # NOTE: EngineConfig refuses the combination first
            raise ValueError("FlashInfer attention cannot run a tree verify (speculative_tree_budget): the tree's "
                             "mask is built inside the cycle's CUDA graph and FlashInfer plans on the host; use the "
                             "Triton backend")
        kv_indptr = cumulative(batch.seq_lens_cpu)
        indices = kv_indices(batch, int(kv_indptr[-1]))
        last_page_len = torch.ones(batch.batch_size, dtype=torch.int32)
        qo_indptr = cumulative(batch.extend_lens_cpu)
        max_q_len = max(batch.extend_lens_cpu)
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, 1)
        for (causal, window_left), wrapper in wrappers.items():
            if not causal and window_left >= 0 and max_q_len > min(window_left + 1, MIN_CTA_TILE_Q):
                # NOTE: FlashInfer windows only keys behind the query (ours also bounds keys ahead of it: a no-op
                # while q_len <= window), and its split-KV plan assumes the causal span (exact while
                # q_len <= its query tile).
                raise ValueError(f"FlashInfer non-causal sliding window {window_left + 1}: {max_q_len} queries per "
                                 f"request is more than min(window, {MIN_CTA_TILE_Q})")
            if isinstance(wrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper):
                wrapper.plan(kv_indptr, indices, last_page_len, *heads, window_left=window_left, **common)
            else:
                wrapper.plan(
                    qo_indptr,
                    kv_indptr,
                    indices,
                    last_page_len,
                    *heads,
                    causal=causal,
                    window_left=window_left,
                    **common,
                )

    def plan(self, batch: ForwardBatch) -> FlashInferMeta:
        if isinstance(batch.attn_meta, FlashInferMeta) and batch.attn_meta.for_graph:
            return batch.attn_meta  # NOTE: planned outside the graph (plan_for_graph); no host work in here
        if batch.input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FlashInfer plans on the host, so a CUDA graph that runs it must be planned outside the "
                               "capture: pass this backend to CudaGraphs.capture(attention=...)")
        wrappers = self.wrappers_for(batch, for_graph=False)
        self.plan_wrappers(wrappers, batch)
        return FlashInferMeta(wrappers, for_graph=False)

    def plan_for_graph(self, batch: ForwardBatch) -> FlashInferMeta:
        """Plans a CUDA graph's padded static batch into that batch size's graph wrappers; must run outside
        the graph, before capture and before every replay."""
        wrappers = self.wrappers_for(batch, for_graph=True)
        self.plan_wrappers(wrappers, batch)
        return FlashInferMeta(wrappers, for_graph=True)

    # ---- per layer -------------------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        kv_stored: bool = False, out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        meta: FlashInferMeta = batch.attn_meta
        q, _, _, result = self.stored_query_and_output(q, k, v, layer_id, batch, kv_stored, out)
        wrapper = meta.wrappers[self.layer_key(batch.mode, layer_id)]
        wrapper.run(q, (self.paged_k[layer_id], self.paged_v[layer_id]), out=result)
        return result.reshape(q.shape[0], -1)
