"""ModelRunner: owns the target model, its KV pool, the slot allocator and the req→token table."""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch

from blockspec.attention.base import AttentionBackend, graph_planner
from blockspec.attention.factory import make_backend, resolve_backend_name
from blockspec.config import EngineConfig
from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.kv.pool import KVPool
from blockspec.models.config import TargetConfig, load_target_config
from blockspec.models.llama import CausalLM, ModelOutput
from blockspec.models.loader import load_target_model, resolve_dtype
from blockspec.runner.cuda_graph import GraphedForward
from blockspec.batch import ForwardBatch, ForwardMode, UniformRows, uniform_batch
from blockspec.runner.piecewise_graph import AuxConsumer, PiecewiseGraphRunner, default_buckets

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return resolve_dtype(config.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        extra_kv_bytes_per_slot: int = 0,
        extra_positions: int = 0,
        hidden_capture_layer_ids: tuple[int, ...] = (),
    ) -> None:
        """`extra_kv_bytes_per_slot`: bytes a draft pool will add per slot (sizes the shared budget).
        `extra_positions`: positions past the context length a speculative block may touch.
        `hidden_capture_layer_ids`: the hidden-capture mode of prefill/extend, fixed here for the piecewise graphs:
        FULL at these layers (DFlash) or NONE (empty)."""
        self.config = config
        self.hidden_capture_layer_ids = hidden_capture_layer_ids
        self.device = config.resolved_device
        self.dtype = pick_dtype(config, self.device)
        torch.manual_seed(config.random_seed)
        target_config = load_target_config(config.model_path)
        self.context_length = config.context_length or target_config.max_position_embeddings
        self.max_positions = self.context_length + extra_positions + 1
        self.model, self.model_config = load_target_model(
            config.model_path, self.dtype, self.device, self.max_positions, dummy=config.load_format == "dummy"
        )
        cfg = self.model_config
        bytes_per_slot = KVPool.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        num_slots = self._num_slots(bytes_per_slot + extra_kv_bytes_per_slot)
        page = config.page_size
        num_pages = num_slots // page + 1  # + the dummy page
        self.allocator = PageAllocator(num_pages, page)
        self.kv_pool = KVPool(num_pages * page, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        table_width = min(self.max_positions, self.allocator.total_slots + extra_positions + 1)
        self.req_to_token = ReqToTokenTable(config.max_running_requests, table_width, self.device)
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device)
        self.attention: AttentionBackend = make_backend(
            self.attention_backend, self.kv_pool, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        )
        self.graphs: dict[ForwardMode, GraphedForward] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.piecewise: Optional[PiecewiseGraphRunner] = None
        self.forward_counts = {"graph": 0, "eager": 0, "piecewise": 0, "piecewise_fallback": 0}
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
        used = total - free
        budget = total * self.config.mem_fraction_static - used
        if budget <= 0:
            raise ValueError("mem_fraction_static leaves no memory for the KV cache; raise it")
        return int(math.floor(budget / bytes_per_slot))

    @property
    def graphs_enabled(self) -> bool:
        """Full CUDA graphs need CUDA and a backend that plans on the device (Triton) or before replay (FlashInfer)."""
        return (
            self.device.type == "cuda" and not self.config.disable_cuda_graph
            and self.attention_backend in ("triton", "flashinfer")
        )

    def eager_forward(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, ...]:
        output = self.model(batch, self.attention)
        return output.logits, output.aux_hidden

    def capture_graph(
        self,
        mode: ForwardMode,
        tokens_per_req: int,
        capture_layer_ids: tuple[int, ...] = (),
        run: Optional[Callable[[ForwardBatch], tuple[torch.Tensor | None, ...]]] = None,
    ) -> None:
        """Captures `run` (default: the target forward → (logits, aux hidden)) for uniform batches of `mode`."""
        run = run or self.eager_forward
        graph = GraphedForward(
            f"target-{mode.value}", run, mode, tokens_per_req, self.config.cuda_graph_bs, self.req_to_token.table,
            self.req_to_token.dummy_row, self.max_positions, capture_layer_ids, self.graph_pool,
            host_planner=graph_planner(self.attention),
        )
        with torch.inference_mode():
            graph.capture()
        self.graphs[mode] = graph

    def capture_piecewise(self, aux_consumer: Optional[AuxConsumer] = None) -> None:
        """Piecewise graphs for extend batches, in this runner's fixed hidden-capture mode; `aux_consumer` runs inside
        the last segment's graph (see PiecewiseGraphRunner)."""
        config = self.config
        if not (config.enforce_piecewise_cuda_graph and self.device.type == "cuda" and not config.disable_cuda_graph):
            return
        max_tokens = self.config.piecewise_cuda_graph_max_tokens
        buckets = self.config.piecewise_cuda_graph_tokens or default_buckets(max_tokens)
        self.piecewise = PiecewiseGraphRunner(
            self.model, self.attention, buckets, self.hidden_capture_layer_ids, self.device, self.graph_pool,
            aux_consumer,
        )
        with torch.inference_mode():
            self.piecewise.capture()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        if batch.mode is ForwardMode.EXTEND and self.piecewise is not None:
            if self.piecewise.can_run(batch):
                self.forward_counts["piecewise"] += 1
                return self.piecewise.forward(batch)
            self.forward_counts["piecewise_fallback"] += 1
        graph = self.graphs.get(batch.mode)
        if graph is not None and graph.can_run(batch):
            return self._replayed(graph.replay(batch))
        self.forward_counts["eager"] += 1
        return self.model(batch, self.attention)

    def _replayed(self, outputs: tuple[torch.Tensor | None, ...]) -> ModelOutput:
        self.forward_counts["graph"] += 1
        logits, aux = outputs
        assert logits is not None
        return ModelOutput(logits, aux, None)

    @torch.inference_mode()
    def forward_uniform(self, rows: UniformRows) -> ModelOutput:
        """A uniform batch from host rows: graph replay with one host→device copy, else eager."""
        graph = self.graphs.get(rows.mode)
        if graph is not None and graph.can_run_rows(rows):
            return self._replayed(graph.replay_rows(rows))
        self.forward_counts["eager"] += 1
        return self.model(rows.to_batch(self.req_to_token.table, self.max_positions), self.attention)

    def can_replay_device_rows(self, mode: ForwardMode) -> bool:
        """Whether a uniform batch of `mode` can run from device rows without host planning (graph or eager)."""
        graph = self.graphs.get(mode)
        return graph is None or graph.host_planner is None

    @torch.inference_mode()
    def forward_device_rows(self, mode: ForwardMode, rows: torch.Tensor) -> ModelOutput:
        """A uniform batch from device rows (UniformRows layout): graph replay without any host data, else eager
        (whose planning reads seq_lens on the host: a sync)."""
        graph = self.graphs.get(mode)
        if graph is not None and graph.can_run_device_rows(rows.shape[0]):
            return self._replayed(graph.replay_device_rows(rows))
        self.forward_counts["eager"] += 1
        return self.model(self.device_rows_batch(mode, rows), self.attention)

    def device_rows_batch(self, mode: ForwardMode, rows: torch.Tensor) -> ForwardBatch:
        """The eager batch for device rows. NOTE: eager planning reads seq_lens on the host (a sync)."""
        return uniform_batch(mode, rows, self.req_to_token.table, rows[:, -1].tolist(), (), self.max_positions)
