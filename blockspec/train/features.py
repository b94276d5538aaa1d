"""Target features for training: the blockspec target model run as one extend forward with hidden capture.

The features are exactly what inference feeds the draft: for each token, the concatenated outputs of the target
layers `target_layer_ids` (residual stream after layer i; for the last layer the final-normed state, as HF's
`hidden_states[-1]`), from the same model code."""
from __future__ import annotations

from pathlib import Path

import torch

from blockspec.attention.factory import make_backend, resolve_backend_name
from blockspec.batch import ForwardMode, build_batch
from blockspec.kv.pool import KVPool
from blockspec.models.config import TargetConfig
from blockspec.models.llama import CausalLM
from blockspec.models.loader import load_target_model


class TargetFeatures:
    """Frozen target: embeddings, lm_head, and aux hidden states of whole sequences (no grad)."""

    def __init__(
        self, model_dir: str | Path, layer_ids: list[int], device: torch.device, dtype: torch.dtype, max_positions: int,
        dummy: bool = False, attention_backend: str = "auto",
    ) -> None:
        """`dummy`: random weights from config.json alone (timing the training step needs no checkpoint).
        `attention_backend` "auto" is inference's: Triton on CUDA, torch on CPU. (On the H200 the torch backend's
        padded dense attention made a step that extracts new sequences' features ≈ 3x a step on cached ones:
        profile_train_step.py, 2026-12-03.)"""
        self.model: CausalLM
        self.model, self.config = load_target_model(model_dir, dtype, device, max_positions + 1, dummy=dummy)
        self.model.requires_grad_(False)
        self.layer_ids = tuple(layer_ids)
        self.device, self.dtype = device, dtype
        self.attention_backend = resolve_backend_name(attention_backend, device)
        self.max_positions = max_positions
        self._pool_slots = 0
        self._pool: KVPool | None = None

    @property
    def target_config(self) -> TargetConfig:
        return self.config

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def _pool_for(self, num_tokens: int) -> KVPool:
        if self._pool is None or self._pool_slots < num_tokens + 1:
            cfg = self.config
            self._pool_slots = max(num_tokens + 1, 2 * self._pool_slots)
            self._pool = None  # NOTE: free the old pool before allocating the larger one
            self._pool = KVPool(
                self._pool_slots, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device
            )
        return self._pool

    @torch.no_grad()
    def __call__(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence [len, len(layer_ids) * hidden] features, in the target's dtype."""
        lengths = [len(s) for s in sequences]
        if max(lengths) > self.max_positions:
            raise ValueError(
                f"a sequence of {max(lengths)} tokens exceeds the feature extractor's {self.max_positions}"
            )
        pool = self._pool_for(sum(lengths))
        cfg = self.config
        backend = make_backend(self.attention_backend, pool, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        # NOTE: slot 0 stays unused (the torch backend points padded keys at it); sequences own disjoint slot ranges.
        table = torch.zeros(len(sequences), max(lengths), dtype=torch.int64)
        offset = 1
        for row, n in enumerate(lengths):
            table[row, :n] = torch.arange(offset, offset + n)
            offset += n
        ends = torch.tensor(lengths).cumsum(0).sub(1).tolist()
        batch = build_batch(
            ForwardMode.EXTEND, sequences, [0] * len(sequences), list(range(len(sequences))), table.to(self.device),
            ends, self.layer_ids,
        )
        output = self.model(batch, backend)
        assert output.aux_hidden is not None
        return list(output.aux_hidden.split(lengths))
