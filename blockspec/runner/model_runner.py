"""ModelRunner: owns the target model, its KV pool, the slot allocator and the req→token table."""
from __future__ import annotations

import logging
import math
import time
from typing import Optional

import torch

from blockspec.attention.base import AttentionBackend
from blockspec.attention.factory import make_backend, resolve_backend_name
from blockspec.attention.triton_backend import DEFAULT_ATTENTION_KERNELS, TritonAttentionBackend
from blockspec.attention.triton_graph_extend import GraphExtendAttention
from blockspec.batch import ForwardBatch, GraphInputs
from blockspec.config.engine_config import EngineConfig
from blockspec.distributed.group import TensorParallel
from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.kv.pool import KVPool
from blockspec.models.config import TargetConfig, load_target_config
from blockspec.models.llama import ModelOutput
from blockspec.models.loader import load_target_model, resolve_dtype
from blockspec.runner.deterministic import batch_invariant_attention, check_device_support, kernel_mode
from blockspec.runner.graph_kind import GraphKind
from blockspec.runner.graphs import CudaGraphs
from blockspec.runner.mirror import ForwardMirror
from blockspec.runner.piecewise_graph import AuxConsumer, PiecewiseGraphRunner, default_buckets

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return resolve_dtype(config.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def kv_slots_in_budget(free: int, total: int, mem_fraction_static: float, bytes_per_slot: int) -> int:
    """KV slots that fit in `mem_fraction_static` of the device's memory beside what is in use already (this
    process's weights, and anything else on the device: another engine of this process counts too)."""
    used = total - free
    budget = total * mem_fraction_static - used
    if budget < bytes_per_slot:
        gib = 2**30
        raise ValueError(
            f"mem_fraction_static {mem_fraction_static} leaves no memory for the KV cache: {used / gib:.1f} of "
            f"{total / gib:.1f} GiB are in use already (weights, other engines or processes on this device); raise "
            "mem_fraction_static, or give --max-total-tokens to size the pool directly"
        )
    return int(math.floor(budget / bytes_per_slot))


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        extra_kv_bytes_per_slot: int = 0,
        extra_positions: int = 0,
        hidden_capture_layer_ids: tuple[int, ...] = (),
        tp: Optional[TensorParallel] = None,
    ) -> None:
        """`extra_kv_bytes_per_slot`: bytes a draft pool will add per slot (sizes the shared budget).
        `extra_positions`: positions past the context length a speculative block may touch.
        `hidden_capture_layer_ids`: the hidden-capture mode of prefill/extend, fixed here for the piecewise graphs:
        FULL at these layers (DFlash) or NONE (empty).
        `tp`: this rank's place in the tensor-parallel group (None: one GPU): the model and KV pool are its shard;
        every rank's pool has the same number of slots (the slot ids rank 0 allocates are valid everywhere)."""
        self.config = config
        self.tp = tp
        self.hidden_capture_layer_ids = hidden_capture_layer_ids
        self.device = config.resolved_device
        self.dtype = pick_dtype(config, self.device)
        check_device_support(config, self.device)
        # NOTE: how every layer of the target (and the draft) computes; batch-invariant under deterministic inference
        self.kernels = kernel_mode(config)
        self.batch_invariant_attention = batch_invariant_attention(config, self.device)
        torch.manual_seed(config.random_seed)
        target_config = load_target_config(config.model_path)
        self.context_length = config.context_length or target_config.max_position_embeddings
        self.max_positions = self.context_length + extra_positions + 1
        started = time.perf_counter()
        self.model, self.model_config = load_target_model(
            config.model_path, self.dtype, self.device, self.max_positions, dummy=config.load_format == "dummy", tp=tp,
            kernels=self.kernels,
        )
        # NOTE: start-up phases in seconds (Engine's start-up report); a draft's weights and pool add to them
        self.startup_seconds = {"weights": time.perf_counter() - started}
        started = time.perf_counter()
        cfg = self.model_config
        attention = self.model.model.layers[0].self_attn
        self.num_local_heads, self.num_local_kv_heads = attention.num_heads, attention.num_kv_heads
        bytes_per_slot = KVPool.bytes_per_slot(cfg.num_layers, self.num_local_kv_heads, cfg.head_dim, self.dtype)
        num_slots = self._num_slots(bytes_per_slot + extra_kv_bytes_per_slot)
        if tp is not None:
            num_slots = tp.min_int(num_slots, self.device)
        page = config.page_size
        num_pages = num_slots // page + 1  # + the dummy page
        self.allocator = PageAllocator(num_pages, page)
        self.kv_pool = KVPool(
            num_pages * page, cfg.num_layers, self.num_local_kv_heads, cfg.head_dim, self.dtype, self.device
        )
        table_width = min(self.max_positions, self.allocator.total_slots + extra_positions + 1)
        self.req_to_token = ReqToTokenTable(config.max_running_requests, table_width, self.device)
        # NOTE: rank 0 of a tensor-parallel group sends every forward to the other ranks first (once the engine starts
        # the mirror, after graph capture); the other ranks receive them (worker/forward_receiver.py)
        self.forward_mirror: Optional[ForwardMirror] = None
        if tp is not None and tp.rank == 0:
            self.forward_mirror = ForwardMirror(tp, self.req_to_token.table,
                                                lambda: (self.graphs.enabled, self.piecewise_enabled))
        self.startup_seconds["kv_pool"] = time.perf_counter() - started
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device)
        self.attention: AttentionBackend = make_backend(
            self.attention_backend, self.kv_pool, self.num_local_heads, self.num_local_kv_heads, cfg.head_dim,
            batch_invariant=self.batch_invariant_attention,
        )
        graphs_available = (
            self.device.type == "cuda" and not config.disable_cuda_graph
            and self.attention_backend in ("triton", "flashinfer")
        )
        self.graphs = CudaGraphs(
            graphs_available,
            config.cuda_graph_bs,
            self.req_to_token,
            self.max_positions,
            self.device,
            self.forward_mirror,
        )
        self.piecewise: Optional[PiecewiseGraphRunner] = None
        self.piecewise_enabled = True  # NOTE: public switch (benchmarks time eager extends); keeps the captured graphs
        self.piecewise_counts = {"piecewise": 0, "piecewise_fallback": 0}
        logger.info(
            "target %s: %d layers, dtype %s, KV pool %d slots (page %d)",
            cfg.architecture, cfg.num_layers, self.dtype, self.allocator.total_slots, page,
        )

    @property
    def target_config(self) -> TargetConfig:
        return self.model_config

    def _num_slots(self, bytes_per_slot: int) -> int:
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        if self.device.type != "cuda":
            return CPU_DEFAULT_MAX_TOTAL_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        return kv_slots_in_budget(free, total, self.config.mem_fraction_static, bytes_per_slot)

    @property
    def forward_counts(self) -> dict[str, int]:
        """Forwards by how they ran: full graph replays and eager uniform forwards (CudaGraphs.run), piecewise
        extend replays and extend batches the piecewise graphs could not take."""
        return {**self.graphs.counts, **self.piecewise_counts}

    def eager_forward(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, ...]:
        """The target forward → (logits, aux hidden): the eager path and the captured function of target graphs."""
        output = self.model(batch, self.attention)
        return output.logits, output.aux_hidden

    @torch.inference_mode()
    def forward_uniform(self, kind: GraphKind, inputs: GraphInputs) -> ModelOutput:
        """A uniform target forward (decode) through the graph registry."""
        logits, aux = self.graphs.run(kind, inputs, self.eager_forward)
        assert logits is not None
        return ModelOutput(logits, aux, None)

    def capture_piecewise(self, aux_consumer: Optional[AuxConsumer] = None) -> None:
        """Piecewise graphs for extend batches, in this runner's fixed hidden-capture mode; `aux_consumer` runs inside
        the last segment's graph (see PiecewiseGraphRunner)."""
        config = self.config
        if not config.piecewise_graphs_on(self.device, self.model_config.architecture):
            if self.device.type == "cuda" and not (config.disable_piecewise_cuda_graph or config.disable_cuda_graph):
                logger.info("piecewise CUDA graphs off for %s by default (not yet run by the GPU suite): "
                            "--enforce-piecewise-cuda-graph captures them", self.model_config.architecture)
            return
        max_tokens = self.config.piecewise_max_tokens
        buckets = self.config.piecewise_cuda_graph_tokens or default_buckets(max_tokens)
        graph_attention = None
        if not config.piecewise_eager_attention and type(self.attention) is TritonAttentionBackend \
                and self.attention.kernels is DEFAULT_ATTENTION_KERNELS:
            graph_attention = GraphExtendAttention(self.attention, self.req_to_token.table, config.max_running_requests,
                                                   max(buckets), max_splits=config.piecewise_attention_max_splits)
        self.piecewise = PiecewiseGraphRunner(
            self.model, self.attention, buckets, self.hidden_capture_layer_ids, self.device, self.graphs.pool,
            aux_consumer, graph_attention,
        )
        started = time.perf_counter()
        with torch.inference_mode():
            self.piecewise.capture()
        self.startup_seconds["piecewise_graphs"] = time.perf_counter() - started

    @torch.inference_mode()
    def forward_extend(self, batch: ForwardBatch) -> ModelOutput:
        """An extend (prefill) batch: piecewise graphs when they can take it, else eager."""
        if self.forward_mirror is not None:
            self.forward_mirror.extend(batch)
        if self.piecewise is not None and self.piecewise_enabled:
            if self.piecewise.can_run(batch):
                self.piecewise_counts["piecewise"] += 1
                return self.piecewise.forward(batch)
            self.piecewise_counts["piecewise_fallback"] += 1
        self.graphs.counts["eager"] += 1
        return self.model(batch, self.attention)
