"""The per-row ops deterministic inference relies on without a mode of their own (RMSNorm with and without the
residual add, q/k norm + rope, SiLU·mul, argmax with ties, the logprobs' log_softmax): a row's result is bit-identical
whatever rows come with it. The Triton kernels (CUDA's; on CPU under TRITON_INTERPRET=1, root conftest) and the
layers as the model calls them (torch ops on CPU), fp32 and fp16."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.layers import triton_ops  # noqa: E402
from blockspec.layers.norm import RMSNorm  # noqa: E402
from blockspec.layers.rotary import QKNorm, RotaryEmbedding  # noqa: E402
from blockspec.layers.rotary import RopeConfig  # noqa: E402
from blockspec.request import Req, SamplingParams  # noqa: E402
from blockspec.sample.sampling import append_logprobs  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16]


def rows(count: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, width, generator=generator).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_rows(dtype: torch.dtype) -> None:
    x, residual, weight = rows(37, 48, dtype), rows(37, 48, dtype, 1), rows(1, 48, dtype, 2)[0]
    full = triton_ops.rmsnorm(x, weight, 1e-6)
    summed = residual.clone()
    full_with_residual = triton_ops.rmsnorm(x, weight, 1e-6, residual=summed)
    for m in (1, 3, 16):
        assert torch.equal(triton_ops.rmsnorm(x[:m], weight, 1e-6), full[:m])
        part = residual[:m].clone()
        assert torch.equal(triton_ops.rmsnorm(x[:m], weight, 1e-6, residual=part), full_with_residual[:m])
        assert torch.equal(part, summed[:m])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_qk_norm_rows(dtype: torch.dtype) -> None:
    q, k = rows(37, 4 * 16, dtype).view(37, 4, 16), rows(37, 2 * 16, dtype, 1).view(37, 2, 16)
    positions = torch.arange(5, 42, device=DEVICE)
    angles = torch.outer(torch.arange(64.0), torch.arange(8.0) / 8)
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    norm = (rows(1, 16, dtype, 2)[0], rows(1, 16, dtype, 3)[0], 1e-6)
    full_q, full_k = q.clone(), k.clone()
    triton_ops.rope_norm_store(full_q, full_k, positions, cos, sin, norm)
    for m in (1, 3, 16):
        part_q, part_k = q[:m].clone(), k[:m].clone()
        triton_ops.rope_norm_store(part_q, part_k, positions[:m], cos, sin, norm)
        assert torch.equal(part_q, full_q[:m]) and torch.equal(part_k, full_k[:m])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_rows(dtype: torch.dtype) -> None:
    gate_up = rows(37, 2 * 40, dtype)
    full = triton_ops.silu_mul(gate_up)
    assert all(torch.equal(triton_ops.silu_mul(gate_up[:m]), full[:m]) for m in (1, 3, 16))


def test_argmax_rows_and_ties() -> None:
    logits = rows(37, 300, torch.float16)
    logits[4, [7, 250]] = 50.0  # a tie across chunks: the first index wins
    logits[9, [3, 4]] = 50.0
    full = triton_ops.argmax_rows(logits, block=128)
    assert full[4] == 7 and full[9] == 3
    assert torch.equal(full.cpu(), logits.float().argmax(-1).cpu())
    assert all(torch.equal(triton_ops.argmax_rows(logits[:m], block=128), full[:m]) for m in (1, 3, 16))


def test_logprobs_of_a_row_do_not_depend_on_the_rows_with_it() -> None:
    """A DFlash verify block's rows (several at once) give each row's log-probs as target-only decoding (one row)."""
    logits = rows(6, 96, torch.float32) * 4
    tokens = logits.argmax(-1).tolist()
    block = Req([1, 2], SamplingParams())
    block.top_logprobs_num = 3
    append_logprobs(block, logits, tokens)
    for i, token in enumerate(tokens):
        one = Req([1, 2], SamplingParams())
        one.top_logprobs_num = 3
        append_logprobs(one, logits[i:i + 1], [token])
        assert one.output_token_logprobs == block.output_token_logprobs[i:i + 1]
        assert one.output_top_logprobs == block.output_top_logprobs[i:i + 1]


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_norm_and_rope_layers_rows(dtype: torch.dtype) -> None:
    """The layers' own path on this device (torch ops on CPU): norm + residual add, q/k norm + rope."""
    norm = RMSNorm(48, 1e-6).to(DEVICE, dtype)
    norm.weight.copy_(rows(1, 48, dtype, 2)[0])
    x, residual = rows(37, 48, dtype), rows(37, 48, dtype, 1)
    full, full_residual = norm.add_and_norm(x, residual.clone())
    rope = RotaryEmbedding(16, RopeConfig(theta=10000.0), 64).to(DEVICE)
    q_norm = RMSNorm(16, 1e-6).to(DEVICE, dtype)
    k_norm = RMSNorm(16, 1e-6).to(DEVICE, dtype)
    q, k = rows(37, 64, dtype, 3).view(37, 4, 16), rows(37, 32, dtype, 4).view(37, 2, 16)
    positions = torch.arange(5, 42, device=DEVICE)
    full_q, full_k, _ = rope.apply(positions, q.clone(), k.clone(), qk_norm=QKNorm.of(q_norm, k_norm))
    for m in (1, 3, 16):
        part, part_residual = norm.add_and_norm(x[:m], residual[:m].clone())
        assert torch.equal(part, full[:m]) and torch.equal(part_residual, full_residual[:m])
        part_q, part_k, _ = rope.apply(positions[:m], q[:m].clone(), k[:m].clone(), qk_norm=QKNorm.of(q_norm, k_norm))
        assert part_q is not None and full_q is not None
        assert torch.equal(part_q, full_q[:m]) and torch.equal(part_k, full_k[:m])
