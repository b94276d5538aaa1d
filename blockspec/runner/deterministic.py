"""--enable-deterministic-inference: the kernel settings it hands the model (its flag checks: config/deterministic.py).

With the flag every kernel with a reduction computes a row the same way whatever the batch: GEMMs (every linear
layer and the lm_head) run the batch-invariant Triton matmul, attention the batch-invariant Triton kernels (fixed
tiles, fixed-size KV lanes folded in a fixed order); RMSNorm / rope / SiLU·mul / argmax are per-row already (Triton
on CUDA, torch on CPU).
So a token's logits are bit-identical in a 1-token decode, a DFlash verify block, an extend chunk, and at any batch
size; greedy DFlash output equals target-only output and does not depend on the batch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from blockspec.config.engine_config import EngineConfig
from blockspec.layers.kernel_mode import KernelMode

if TYPE_CHECKING:
    from blockspec.attention.batch_invariant_backend import BatchInvariantAttention


def check_device_support(config: EngineConfig, device: torch.device) -> None:
    """On CPU the Triton kernels run only in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)."""
    if not config.enable_deterministic_inference or device.type == "cuda":
        return
    import triton

    if not triton.knobs.runtime.interpret:
        raise ValueError(f"enable_deterministic_inference on {device.type} runs its Triton kernels in Triton's "
                         "interpreter: set TRITON_INTERPRET=1 before starting (slow; meant for tests)")


def kernel_mode(config: EngineConfig) -> KernelMode:
    return KernelMode(batch_invariant=config.enable_deterministic_inference)


def batch_invariant_attention(config: EngineConfig, device: torch.device) -> Optional["BatchInvariantAttention"]:
    """The batch-invariant attention settings (shared by the target's and the draft's backend), or None. NOTE: on CPU
    the interpreter runs programs one after another, so lanes never get programs of their own there (launch policy
    only: the bits are the same either way)."""
    if not config.enable_deterministic_inference:
        return None
    from blockspec.attention.batch_invariant_backend import DEFAULT_LANE_KEYS, BatchInvariantAttention

    lane_keys = config.triton_attention_split_tile_size or DEFAULT_LANE_KEYS
    if device.type != "cuda":
        return BatchInvariantAttention(lane_keys=lane_keys, max_split_programs=0)
    return BatchInvariantAttention(lane_keys=lane_keys)


def deterministic_info(settings: Optional["BatchInvariantAttention"]) -> dict[str, Any]:
    """What /server_info reports about the mode, from the engine's attention settings (None: the mode is off)."""
    if settings is None:
        return {"enabled": False}
    return {"enabled": True, "gemm": "batch-invariant triton matmul", "attention": "batch-invariant triton",
            "attention_split_tile_size": settings.lane_keys, "attention_lanes": settings.lanes,
            "attention_tiles": [settings.tiles.block_m, settings.tiles.block_n]}
