"""The fused router (layers/fused_router.py) equals the gate's GEMM then the routing: the same experts in the same
slots with the same weights as `fused_route(gate(x))`, and the experts and weights of `route(gate(x))`. Under
Triton's interpreter on CPU (root conftest), natively on CUDA.

NOTE: the inputs are multiples of 1/8 and 1/16 with few terms, so every fp32 sum is exact whatever the order: the
kernel's logits then equal the Linear's bit for bit before the rounding to the Linear's dtype, and bf16 checks that
rounding (the sums have more bits than bf16 keeps)."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

import blockspec.layers.fused_router as fused_router_module  # noqa: E402
from blockspec.layers.fused_moe import fused_route  # noqa: E402
from blockspec.layers.fused_router import (  # noqa: E402
    EXPERTS_PER_PROGRAM, FUSED_ROUTER_MAX_TOKENS, NUM_WARPS, fused_router, new_router_counters,
)
from blockspec.layers.kernel_mode import KernelMode  # noqa: E402
from blockspec.layers.linear import Linear  # noqa: E402
from blockspec.layers.moe import ExpertRouting, SparseMoe, route  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def exact_inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype,
                 seed: int) -> tuple[torch.Tensor, Linear]:
    """Hidden states and a router whose products and sums are exact in fp32 (see the module's NOTE)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (tokens, hidden), generator=generator) / 8
    gate = Linear(hidden, experts)
    with torch.no_grad():
        gate.weight.copy_(torch.randint(-8, 9, (experts, hidden), generator=generator) / 16)
    return x.to(dtype).to(DEVICE), gate.to(DEVICE, dtype)


def check_equals_gate_then_route(x: torch.Tensor, gate: Linear, top_k: int, renormalize: bool,
                                 counters: Optional[torch.Tensor] = None,
                                 launch: tuple[int, int] = (EXPERTS_PER_PROGRAM, NUM_WARPS)) -> int:
    """fused_router (at the launch shape `launch`: experts a program, warps) == fused_route(gate(x)) exactly; ==
    route(gate(x)) (torch) as sets of experts with their weights, on the tokens whose k-th and (k+1)-th logits do not
    tie (there torch.topk picks its own way). Returns how many tokens the torch comparison covered."""
    experts = gate.out_features
    counters = new_router_counters(DEVICE) if counters is None else counters
    weights, ids = fused_router(x, gate.weight, counters, top_k, renormalize, *launch)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and weights.shape == (x.shape[0], top_k)
    assert torch.count_nonzero(counters).item() == 0  # NOTE: left as found, for the next launch or replay
    with torch.no_grad():
        logits = gate(x)
    expected_weights, expected_ids = fused_route(logits, experts, top_k, renormalize)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_weights)
    torch_weights, torch_ids = route(logits.cpu(), ExpertRouting(experts, top_k, renormalize))
    ids, order = ids.cpu().sort(dim=-1)
    weights = weights.cpu().gather(-1, order)
    torch_ids, order = torch_ids.sort(dim=-1)
    torch_weights = torch_weights.gather(-1, order)
    ranked = logits.float().cpu().sort(dim=-1, descending=True).values
    clear = ranked[:, top_k - 1] != ranked[:, top_k] if top_k < experts else torch.ones(x.shape[0], dtype=torch.bool)
    assert torch.equal(ids[clear], torch_ids[clear])
    torch.testing.assert_close(weights[clear], torch_weights[clear], rtol=1e-6, atol=1e-7)
    return int(clear.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden,experts,top_k,renormalize", [
    (1, 32, 8, 2, True),  # a decode step of one token
    (3, 48, 13, 1, False),  # top 1; experts not a multiple of EXPERTS_PER_PROGRAM, hidden not a power of two
    (5, 40, 30, 3, True),
    (FUSED_ROUTER_MAX_TOKENS, 64, 128, 8, True),  # Qwen3-30B-A3B's routing, as many tokens as the counters hold
    (2, 16, 6, 6, False),  # every expert chosen
])
def test_fused_router_equals_gate_then_route(dtype: torch.dtype, tokens: int, hidden: int, experts: int, top_k: int,
                                            renormalize: bool) -> None:
    x, gate = exact_inputs(tokens, hidden, experts, dtype, seed=tokens * experts + top_k)
    assert check_equals_gate_then_route(x, gate, top_k, renormalize) > 0


def test_bf16_logits_are_rounded_as_the_linear_rounds_them() -> None:
    """The routing sees the Linear's bf16 logits: fp32 logits would route these tokens to the same experts with other
    weights (so the kernel does round)."""
    x, gate = exact_inputs(4, 48, 16, torch.bfloat16, seed=7)
    weights, _ = fused_router(x, gate.weight, new_router_counters(DEVICE), 4, True)
    with torch.no_grad():
        expected, _ = fused_route(gate(x), 16, 4, True)
        unrounded, _ = fused_route(x.float() @ gate.weight.float().t(), 16, 4, True)
    assert torch.equal(weights, expected) and not torch.equal(weights, unrounded)


def test_hidden_in_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hidden size above MAX_BLOCK_H is summed chunk by chunk (Qwen3-30B-A3B's 2048 fits one chunk)."""
    monkeypatch.setattr(fused_router_module, "MAX_BLOCK_H", 16)
    x, gate = exact_inputs(3, 56, 10, torch.float32, seed=11)
    check_equals_gate_then_route(x, gate, 3, True)


@pytest.mark.parametrize("experts_per_program, num_warps", [(1, 1), (2, 2), (8, 1), (16, 4)])
def test_launch_shapes_route_alike(experts_per_program: int, num_warps: int) -> None:
    """Every launch shape (`benchmarks/moe.py --parts router` times them) routes as the gate then the routing, with
    a last program group that is partly past the experts; a shape that is no power of two is an error. NOTE: 13
    experts, within one warp's lanes: past 32 only ROUTE_NUM_WARPS (the default) rounds the softmax sum as
    `fused_route` does, which the 128-expert case of test_fused_router_equals_gate_then_route pins on a GPU."""
    x, gate = exact_inputs(3, 40, 13, torch.float32, seed=experts_per_program)
    check_equals_gate_then_route(x, gate, 3, True, launch=(experts_per_program, num_warps))
    with pytest.raises(ValueError, match="power of two"):
        fused_router(x, gate.weight, new_router_counters(DEVICE), 3, True, 3, num_warps)


def test_counters_are_reset_for_the_next_launch() -> None:
    """The same counters across launches of other inputs and token counts (as graph replays and the next layer's
    call): each launch finds them zeroed, routes right, and leaves them zeroed."""
    counters = new_router_counters(DEVICE)
    for seed, tokens in enumerate((2, 2, 1, FUSED_ROUTER_MAX_TOKENS, 5)):
        x, gate = exact_inputs(tokens, 32, 9, torch.float32, seed=seed)
        check_equals_gate_then_route(x, gate, 2, seed % 2 == 0, counters)
    with pytest.raises(ValueError, match="counters"):
        x, gate = exact_inputs(FUSED_ROUTER_MAX_TOKENS + 1, 32, 9, torch.float32, seed=0)
        fused_router(x, gate.weight, counters, 2, True)
    empty_weights, empty_ids = fused_router(x[:0], gate.weight, counters, 2, True)
    assert empty_weights.shape == empty_ids.shape == (0, 2)


def test_ties_go_to_the_lower_expert() -> None:
    """Equal logits (equal router rows) across expert groups: the lower expert first, as fused_route."""
    hidden, experts = 16, 11
    assert experts % EXPERTS_PER_PROGRAM != 0
    weight = torch.zeros(experts, hidden)
    weight[[2, 5, 10]] = 0.5  # NOTE: three experts in three programs tie at the top
    weight[[3, 4]] = 0.25
    gate = Linear(hidden, experts).to(DEVICE)
    with torch.no_grad():
        gate.weight.copy_(weight)
    x = torch.stack([torch.ones(hidden), torch.zeros(hidden)]).to(DEVICE)  # NOTE: row 1: every logit 0
    weights, ids = fused_router(x, gate.weight, new_router_counters(DEVICE), 4, True)
    assert ids.cpu().tolist() == [[2, 5, 10, 3], [0, 1, 2, 3]]
    torch.testing.assert_close(weights[1].cpu(), torch.full((4,), 0.25))
    check_equals_gate_then_route(x, gate, 4, True)
    check_equals_gate_then_route(x, gate, 2, False)


@pytest.mark.parametrize("tokens", [1, FUSED_ROUTER_MAX_TOKENS, FUSED_ROUTER_MAX_TOKENS + 1])
def test_sparse_moe_fuses_the_router_for_few_tokens(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """SparseMoe's Triton backend runs the fused router up to FUSED_ROUTER_MAX_TOKENS tokens (more: the gate's GEMM
    and fused_route), off with fused_router_tokens 0 and under batch-invariant kernels; the layer's output is the
    same either way."""
    launched: list[int] = []
    real = fused_router_module.fused_router

    def recording(x: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        launched.append(x.shape[0])
        return real(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_router_module, "fused_router", recording)
    routing = ExpertRouting(num_experts=8, top_k=2, renormalize=True)
    fused = SparseMoe(32, 16, routing, backend="triton").to(DEVICE)
    generator = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        for param in fused.parameters():
            param.copy_(torch.randint(-8, 9, param.shape, generator=generator) / 32)
    unfused = SparseMoe(32, 16, routing, backend="triton").to(DEVICE)
    unfused.load_state_dict(fused.state_dict())
    unfused.fused_router_tokens = 0
    x = (torch.randint(-8, 9, (tokens, 32), generator=generator) / 8).to(DEVICE)
    with torch.no_grad():
        got = fused(x)
        assert launched == ([tokens] if tokens <= FUSED_ROUTER_MAX_TOKENS else [])
        expected = unfused(x)
    assert len(launched) <= 1
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert SparseMoe(32, 16, routing, kernels=KernelMode(batch_invariant=True)).fused_router_tokens == 0


def test_warm_up_allocates_the_counters_and_compiles_the_router() -> None:
    layer = SparseMoe(32, 16, ExpertRouting(8, 2, True), backend="triton").to(DEVICE)
    assert layer.router_counters is None  # NOTE: not at construction (models are built on the meta device)
    with torch.no_grad():
        layer.warm_up()
    counters = layer.router_counters
    assert counters is not None and counters.device.type == DEVICE.type
    assert counters.shape == (FUSED_ROUTER_MAX_TOKENS,) and torch.count_nonzero(counters).item() == 0
