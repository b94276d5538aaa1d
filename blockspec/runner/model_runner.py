"""ModelRunner: owns the target model, its KV pool, the slot allocator and the req→token table."""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from blockspec.attention.torch_backend import TorchAttentionBackend
from blockspec.config import EngineConfig
from blockspec.kv.allocator import PageAllocator, ReqToTokenTable
from blockspec.kv.pool import KVPool
from blockspec.models.config import TargetConfig, load_target_config
from blockspec.models.llama import CausalLM, ModelOutput
from blockspec.models.loader import load_target_model, resolve_dtype
from blockspec.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return resolve_dtype(config.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class ModelRunner:
    def __init__(self, config: EngineConfig, extra_kv_bytes_per_slot: int = 0, extra_positions: int = 0) -> None:
        """`extra_kv_bytes_per_slot`: bytes a draft pool will add per slot (sizes the shared budget).
        `extra_positions`: positions past the context length a speculative block may touch."""
        self.config = config
        self.device = config.resolved_device
        self.dtype = pick_dtype(config, self.device)
        torch.manual_seed(config.random_seed)
        target_config = load_target_config(config.model_path)
        self.context_length = config.context_length or target_config.max_position_embeddings
        self.max_positions = self.context_length + extra_positions + 1
        self.model, self.model_config = load_target_model(config.model_path, self.dtype, self.device, self.max_positions)
        cfg = self.model_config
        bytes_per_slot = KVPool.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        num_slots = self._num_slots(bytes_per_slot + extra_kv_bytes_per_slot)
        page = config.page_size
        num_pages = num_slots // page + 1  # + the dummy page
        self.allocator = PageAllocator(num_pages, page)
        self.kv_pool = KVPool(num_pages * page, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        table_width = min(self.max_positions, self.allocator.total_slots + extra_positions + 1)
        self.req_to_token = ReqToTokenTable(config.max_running_requests, table_width, self.device)
        self.attention = self._make_backend()
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

    def _make_backend(self) -> TorchAttentionBackend:
        backend = self.config.attention_backend
        if backend not in ("auto", "torch"):
            raise ValueError(f"attention backend {backend!r} is not available in this build; use torch")
        return TorchAttentionBackend(self.kv_pool, scale=self.model_config.head_dim ** -0.5)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        return self.model(batch, self.attention)

