"""Fused Triton ops (RMSNorm+residual, rotary, SiLU·mul) equal their torch definitions (interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from blockspec.layers import triton_ops  # noqa: E402
from blockspec.layers.rotary import RotaryEmbedding  # noqa: E402
from blockspec.models.config import RopeConfig  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dim", [32, 48])
def test_rmsnorm_and_residual(dim: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, dim, device=DEVICE)
    residual = torch.randn(5, dim, device=DEVICE)
    weight = torch.randn(dim, device=DEVICE)
    torch.testing.assert_close(triton_ops.rmsnorm(x, weight, 1e-6), torch_rmsnorm(x, weight, 1e-6))
    expected_residual = residual + x
    out = triton_ops.rmsnorm(x, weight, 1e-6, residual=residual)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(out, torch_rmsnorm(expected_residual, weight, 1e-6))


def test_rotary_matches_reference() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(16, RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=32), 128)
    q = torch.randn(7, 4, 16)
    k = torch.randn(7, 2, 16)
    positions = torch.tensor([0, 1, 2, 50, 51, 100, 127])
    expected_q, expected_k = rope(positions, q, k)  # CPU torch path
    half = 8
    got_q = triton_ops.rotary_inplace(q.clone().to(DEVICE), positions.to(DEVICE), rope.cos_table[:, :half].to(DEVICE), rope.sin_table[:, :half].to(DEVICE))
    got_k = triton_ops.rotary_inplace(k.clone().to(DEVICE), positions.to(DEVICE), rope.cos_table[:, :half].to(DEVICE), rope.sin_table[:, :half].to(DEVICE))
    torch.testing.assert_close(got_q.cpu(), expected_q)
    torch.testing.assert_close(got_k.cpu(), expected_k)


def test_rotary_on_strided_view() -> None:
    """q and k arrive as views of the fused qkv output (row stride = q+k+v width)."""
    rope = RotaryEmbedding(16, RopeConfig(), 64)
    qkv = torch.randn(3, 4 * 16 + 2 * 16 + 2 * 16, device=DEVICE)
    q = qkv[:, :64].view(3, 4, 16)
    expected = rope.apply_one(torch.tensor([3, 9, 60]), q.cpu().clone())
    triton_ops.rotary_inplace(q, torch.tensor([3, 9, 60], device=DEVICE), rope.cos_table[:, :8].to(DEVICE), rope.sin_table[:, :8].to(DEVICE))
    torch.testing.assert_close(qkv[:, :64].view(3, 4, 16).cpu(), expected)


def test_silu_mul() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2 * 1500, device=DEVICE)
    gate, up = gate_up.split(1500, dim=-1)
    torch.testing.assert_close(triton_ops.silu_mul(gate_up), F.silu(gate) * up)
