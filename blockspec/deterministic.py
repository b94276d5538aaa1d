"""--enable-deterministic-inference: what it requires, what it forces, and the kernel settings it hands the model.

With the flag every kernel with a reduction computes a row the same way whatever the batch: GEMMs (every linear
layer and the lm_head) run the batch-invariant Triton matmul, attention the batch-invariant Triton kernels (fixed
tiles, fixed-size KV lanes folded in a fixed order); RMSNorm / rope / SiLU·mul / argmax are per-row already (Triton
on CUDA, torch on CPU).
So a token's logits are bit-identical in a 1-token decode, a DFlash verify block, an extend chunk, and at any batch
size; greedy DFlash output equals target-only output and does not depend on the batch. Unsupported combinations are
errors, never silently weaker guarantees."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Optional

import torch

from blockspec.layers.kernel_mode import KernelMode

if TYPE_CHECKING:
    from blockspec.attention.batch_invariant_backend import BatchInvariantAttention
    from blockspec.config import EngineConfig

SPLIT_TILE_MULTIPLE = 32  # NOTE: the batch-invariant attention's key block (BatchInvariantAttention.tiles.block_n)


def check_deterministic_flags(config: "EngineConfig") -> None:
    """Validates the flag against the others; forces the Triton attention backend when it was `auto`."""
    split = config.triton_attention_split_tile_size
    if not config.enable_deterministic_inference:
        if split is not None:
            raise ValueError("triton_attention_split_tile_size is the KV split of the batch-invariant attention: it "
                             "needs enable_deterministic_inference")
        return
    if config.attention_backend in ("torch", "flashinfer"):
        raise ValueError(f"enable_deterministic_inference needs attention_backend triton (or auto), got "
                         f"{config.attention_backend}: the {config.attention_backend} backend's reduction order "
                         "depends on the batch")
    if importlib.util.find_spec("triton") is None:
        raise ValueError("enable_deterministic_inference runs Triton kernels: pip install triton")
    if config.tp_size > 1:
        raise ValueError("enable_deterministic_inference supports tp_size 1 only: the tensor-parallel all-reduce "
                         "sums in an order that depends on the message size, i.e. on the batch")
    if split is not None and split % SPLIT_TILE_MULTIPLE:
        raise ValueError(f"triton_attention_split_tile_size must be a multiple of {SPLIT_TILE_MULTIPLE}, got {split}")
    config.attention_backend = "triton"


def check_device_support(config: "EngineConfig", device: torch.device) -> None:
    """On CPU the Triton kernels run only in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)."""
    if not config.enable_deterministic_inference or device.type == "cuda":
        return
    import triton

    if not triton.knobs.runtime.interpret:
        raise ValueError(f"enable_deterministic_inference on {device.type} runs its Triton kernels in Triton's "
                         "interpreter: set TRITON_INTERPRET=1 before starting (slow; meant for tests)")


def kernel_mode(config: "EngineConfig") -> KernelMode:
    return KernelMode(batch_invariant=config.enable_deterministic_inference)


def batch_invariant_attention(config: "EngineConfig", device: torch.device) -> Optional["BatchInvariantAttention"]:
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
