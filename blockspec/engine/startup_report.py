"""What an engine's start-up did: seconds per phase and the kernel variants it compiled."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from blockspec.engine.compiles import KernelCompile, by_kernel

logger = logging.getLogger(__name__)

PHASES = ("weights", "kv_pool", "graphs", "piecewise_graphs", "kernels")


@dataclass(frozen=True)
class WarmupReport:
    attention_variants: int
    expert_tile_sets: int  # fused MoE tile sets run, summed over expert shapes (0 for a dense model)
    request_passes: int
    seconds: float


def summary_line(startup: dict[str, Any]) -> str:
    """One line of an `as_dict()`: total and phase seconds, then the variants compiled by kernel."""
    seconds = startup["seconds"]
    phases = ", ".join(f"{phase} {seconds[phase]:.1f}" for phase in PHASES)
    kernels = ", ".join(f"{name} x{n}" for name, n in startup["kernel_variants_by_kernel"].items()) or "none"
    return (f"start-up {seconds['total']:.1f} s ({phases}); {startup['kernel_variants_compiled']} Triton kernel "
            f"variants compiled or loaded from Triton's cache: {kernels}")


@dataclass
class StartupReport:
    seconds: dict[str, float]  # PHASES, then "total" (tokenizer and the rest included)
    compiled: list[KernelCompile] = field(default_factory=list)
    warmup: Optional[WarmupReport] = None

    @classmethod
    def build(cls, phases: dict[str, float], total: float, compiled: list[KernelCompile],
              warmup: Optional[WarmupReport]) -> "StartupReport":
        seconds = {phase: round(phases.get(phase, 0.0), 3) for phase in PHASES}
        seconds["total"] = round(total, 3)
        return cls(seconds, compiled, warmup)

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": dict(self.seconds),
            "kernel_variants_compiled": len(self.compiled),
            "kernel_variants_by_kernel": by_kernel(self.compiled),
            "attention_variants_warmed": self.warmup.attention_variants if self.warmup else 0,
            "expert_tile_sets_warmed": self.warmup.expert_tile_sets if self.warmup else 0,
        }

    def log(self) -> None:
        """INFO lines: the phases, the variants by kernel, the warm-up (DEBUG: every variant)."""
        phases = ", ".join(f"{phase} {self.seconds[phase]:.1f} s" for phase in (*PHASES, "total"))
        logger.info("start-up: %s", phases)
        kernels = ", ".join(f"{name} x{n}" for name, n in by_kernel(self.compiled).items()) or "none"
        logger.info("start-up compiled %d Triton kernel variants (or loaded them from Triton's cache): %s",
                    len(self.compiled), kernels)
        if self.warmup is None:
            logger.info("kernel warm-up skipped: Triton compiles nothing off CUDA")
        else:
            logger.info("kernel warm-up: %d attention variants, %d MoE tile sets, %d request passes in %.1f s",
                        self.warmup.attention_variants, self.warmup.expert_tile_sets, self.warmup.request_passes,
                        self.warmup.seconds)
        for event in self.compiled:
            logger.debug("compiled at start-up: %s", event.variant)
