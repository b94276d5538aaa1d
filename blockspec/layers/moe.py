"""Mixture-of-experts MLP: a router scores E experts per token, the top k run on it, their outputs are summed
weighted by the router's probabilities.

One layer, three parts: the router (`gate`, a linear layer to E logits, and `route`, softmax → top-k → optional
renormalisation), the experts (`StackedExperts`: E gated SiLU MLPs, their weights stacked [E, ...]), and the
backend that runs the experts and the weighted combine: the torch reference (`experts_reference`, CPU and tests) or
the fused Triton kernels (`layers/fused_moe.py`: the routing in one launch, tokens sorted by expert, a grouped GEMM
over the experts hit, static shapes so it captures in CUDA graphs; for a few tokens the router's GEMM and the routing
are one launch, `layers/fused_router.py`). Both take the same inputs, so a family with another router or another
expert format changes only its part.

Under tensor parallelism every rank holds every expert, cut along its intermediate dimension (gate|up by rows, down
by columns, as a dense MLP): each rank computes partial outputs of the same routed tokens, the all-reduce sums them.
The router is replicated, so every rank routes alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.distributed.group import TensorParallel
from blockspec.layers.kernel_mode import DEFAULT_KERNELS, KernelMode
from blockspec.layers.linear import Linear

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class ExpertRouting:
    """How tokens pick experts: softmax over `num_experts` router logits, the `top_k` largest probabilities, divided
    by their sum when `renormalize` (HF's norm_topk_prob)."""

    num_experts: int
    top_k: int
    renormalize: bool


@dataclass(frozen=True)
class ExpertPart:
    """Where one checkpoint matrix of one expert lives in the stacked parameters: rows [offset, offset + rows) of
    `param[expert]`."""

    param: str
    expert: int
    offset: int
    rows: int


def route(router_logits: torch.Tensor, routing: ExpertRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token. NOTE: softmax and top-k in fp32, as HF; tied
    probabilities come in torch.topk's order, the same on every TP rank (the Triton backend's `fused_route` puts the
    lower expert first: the same experts and weights, at most in other slots)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class StackedExperts(nn.Module):
    """E gated SiLU MLPs: gate_up_proj [E, 2 I, H] (gate rows, then up rows), down_proj [E, H, I]; I is this rank's
    share of the expert intermediate size. Checkpoints name them per expert (HF's `experts.{e}.gate_proj.weight`,
    `up_proj`, `down_proj`): `checkpoint_parts` says where each lands."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def checkpoint_parts(self) -> dict[str, ExpertPart]:
        """Checkpoint name relative to this module → its place in the stacked parameters."""
        parts: dict[str, ExpertPart] = {}
        size = self.intermediate_size
        for expert in range(self.num_experts):
            parts[f"{expert}.gate_proj.weight"] = ExpertPart("gate_up_proj", expert, 0, size)
            parts[f"{expert}.up_proj.weight"] = ExpertPart("gate_up_proj", expert, size, size)
            parts[f"{expert}.down_proj.weight"] = ExpertPart("down_proj", expert, 0, self.down_proj.shape[1])
        return parts


def experts_reference(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, expert by expert over the tokens routed to
    it (the reference: HF's order of operations, weights cast to x's dtype). NOTE: reads the expert counts on the
    host, so it cannot be captured in a CUDA graph: CUDA runs the fused kernel."""
    top_k = ids.shape[1]
    intermediate = down_proj.shape[-1]
    out = torch.zeros_like(x)
    flat_ids = ids.flatten()
    flat_weights = weights.flatten().to(x.dtype)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], gate_up_proj[expert]).split(intermediate, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down_proj[expert]) * flat_weights[pairs, None]
        out.index_add_(0, tokens, expert_out)
    return out


class SparseMoe(nn.Module):
    """The MoE MLP of one layer: `gate` (the router, [E, H], replicated) and `experts`. Called as a dense MLP is:
    `forward(x [T, H], out)` → [T, H], summed over TP ranks in place.

    `backend`: "torch" (experts_reference) or "triton" (the fused kernel); None picks by device: Triton on CUDA
    and, on CPU, under batch-invariant kernels (its tiles do not follow the batch; Triton's interpreter), else torch.

    The Triton backend routes up to `fused_router_tokens` tokens with the fused router (layers/fused_router.py: the
    gate's GEMM and the routing in one launch; None: up to its FUSED_ROUTER_MAX_TOKENS; 0 turns it off, e.g. to
    time the unfused path), more with the gate's GEMM and `fused_route`. NOTE: off under batch-invariant kernels:
    the two paths sum the logits in different orders, so a token's routing could change with the batch size across
    the threshold."""

    def __init__(
        self, hidden_size: int, expert_intermediate_size: int, routing: ExpertRouting,
        tp: Optional[TensorParallel] = None, kernels: KernelMode = DEFAULT_KERNELS, backend: Optional[str] = None,
    ) -> None:
        super().__init__()
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"unknown MoE backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if tp is not None:
            expert_intermediate_size = tp.split(expert_intermediate_size, "moe_intermediate_size")
        self.routing = routing
        self.tp = tp
        self.kernels = kernels
        self.backend = backend
        self.gate = Linear(hidden_size, routing.num_experts, False, kernels)
        self.experts = StackedExperts(routing.num_experts, hidden_size, expert_intermediate_size)
        self.fused_router_tokens: Optional[int] = 0 if kernels.batch_invariant else None
        # NOTE: the fused router's arrival counters, allocated zeroed on the first Triton forward (or warm_up) on the
        # layer's device, not at construction: models are built on the meta device and given uninitialised memory
        # (models/loader.py materialise), which would leave a buffer's counters arbitrary. Every launch leaves them
        # zeroed, which CUDA graph replays rely on (layers/fused_router.py).
        self.router_counters: Optional[torch.Tensor] = None

    def uses_triton(self, x: torch.Tensor) -> bool:
        """Whether the experts of input `x` run on the fused Triton kernel (else the torch reference)."""
        if self.backend is not None:
            return self.backend == "triton"
        return x.is_cuda or self.kernels.batch_invariant

    def warm_up(self) -> int:
        """Compiles every fused-kernel variant this layer can launch (start-up's warm-up, engine/warmup.py): the
        router's for one token, then the experts'; returns the experts' tile sets run (0 on the torch reference,
        which compiles nothing)."""
        experts = self.experts
        if not self.uses_triton(experts.gate_up_proj):
            return 0
        from blockspec.layers.fused_moe import warm_up_experts  # NOTE: needs Triton

        self.route_triton(torch.zeros((1, experts.gate_up_proj.shape[2]), dtype=experts.gate_up_proj.dtype,
                                      device=experts.gate_up_proj.device))  # NOTE: the router's variant for 1 token
        return warm_up_experts(experts.gate_up_proj, experts.down_proj, self.routing.top_k,
                               self.kernels.batch_invariant)

    def counters(self, device: torch.device) -> torch.Tensor:
        """The fused router's zeroed arrival counters on `device`, allocated on first use. NOTE: never inside a CUDA
        graph capture: its zero-fill would run at the first replay only, not before eager calls (graph capture
        runs each graph's forward eagerly first, which allocates them)."""
        counters = self.router_counters
        if counters is None or counters.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("SparseMoe: run the layer once (or warm_up) before capturing it in a CUDA graph")
            from blockspec.layers.fused_router import new_router_counters  # NOTE: needs Triton

            counters = self.router_counters = new_router_counters(device)
        return counters

    def route_triton(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) of the Triton backend: the fused router for up to fused_router_tokens tokens, else the
        gate's GEMM and fused_route."""
        from blockspec.layers.fused_moe import fused_route  # NOTE: needs Triton
        from blockspec.layers.fused_router import FUSED_ROUTER_MAX_TOKENS, fused_router

        routing, limit = self.routing, self.fused_router_tokens
        limit = FUSED_ROUTER_MAX_TOKENS if limit is None else min(limit, FUSED_ROUTER_MAX_TOKENS)
        if 0 < x.shape[0] <= limit and self.gate.bias is None:
            return fused_router(x, self.gate.weight, self.counters(x.device), routing.top_k, routing.renormalize)
        return fused_route(self.gate(x), routing.num_experts, routing.top_k, routing.renormalize)

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`out`: optional [T, H] buffer the combined output is written into."""
        experts, routing = self.experts, self.routing
        if self.uses_triton(x):
            from blockspec.layers.fused_moe import fused_experts  # NOTE: needs Triton

            weights, ids = self.route_triton(x)
            combined = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, out,
                                     batch_invariant=self.kernels.batch_invariant)
        else:
            weights, ids = route(self.gate(x), routing)
            combined = experts_reference(x, experts.gate_up_proj, experts.down_proj, weights, ids)
            if out is not None:
                combined = out.copy_(combined)
        return combined if self.tp is None else self.tp.all_reduce(combined)
