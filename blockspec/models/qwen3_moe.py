"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention, norms and pieces, with a
mixture-of-experts MLP in its sparse layers (config.moe.sparse_layers) and a dense one in the others.

Checkpoint names follow HF: `mlp.gate.weight` (the router), `mlp.experts.{e}.{gate,up,down}_proj.weight` (stacked
into SparseMoe's experts by the loader). The MoE MLP is one piece of the layer like a dense MLP, so the eager
forward, the piecewise graphs and the full graphs run this model unchanged.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from blockspec.distributed.group import TensorParallel
from blockspec.layers.kernel_mode import KernelMode
from blockspec.layers.moe import SparseMoe
from blockspec.models.config import TargetConfig
from blockspec.models.llama import CausalLM


class Qwen3MoeCausalLM(CausalLM):
    @staticmethod
    def build_mlp(config: TargetConfig, layer_id: int, tp: Optional[TensorParallel], kernels: KernelMode) -> nn.Module:
        if not config.is_sparse(layer_id):
            return CausalLM.build_mlp(config, layer_id, tp, kernels)
        assert config.moe is not None
        return SparseMoe(config.hidden_size, config.moe.expert_intermediate_size, config.moe.routing, tp, kernels)
