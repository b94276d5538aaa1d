"""Fused Triton ops (RMSNorm+residual, rotary, SiLU·mul) equal their torch definitions (interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.layers import triton_ops  # noqa: E402
from blockspec.kv.pool import KVPool  # noqa: E402
from blockspec.layers.rotary import QKNorm, RotaryEmbedding  # noqa: E402
from blockspec.layers.rotary import RopeConfig  # noqa: E402

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


def rope_tables(rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    half = rope.cos_table.shape[1] // 2
    return rope.cos_table[:, :half].to(DEVICE), rope.sin_table[:, :half].to(DEVICE)


def test_rotary_matches_reference() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(
        16, RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=32), 128
    )
    q = torch.randn(7, 4, 16)
    k = torch.randn(7, 2, 16)
    positions = torch.tensor([0, 1, 2, 50, 51, 100, 127])
    expected_q, expected_k = rope(positions, q, k)  # CPU torch path
    got_q, got_k = q.clone().to(DEVICE), k.clone().to(DEVICE)
    triton_ops.rope_norm_store(got_q, got_k, positions.to(DEVICE), *rope_tables(rope))
    torch.testing.assert_close(got_q.cpu(), expected_q)
    torch.testing.assert_close(got_k.cpu(), expected_k)


def test_rotary_on_strided_view() -> None:
    """q and k arrive as views of the fused qkv output (row stride = q+k+v width)."""
    rope = RotaryEmbedding(16, RopeConfig(), 64)
    qkv = torch.randn(3, 4 * 16 + 2 * 16 + 2 * 16, device=DEVICE)
    q, k = qkv[:, :64].view(3, 4, 16), qkv[:, 64:96].view(3, 2, 16)
    positions = torch.tensor([3, 9, 60])
    expected_q, expected_k = rope(positions, q.cpu().clone(), k.cpu().clone())
    triton_ops.rope_norm_store(q, k, positions.to(DEVICE), *rope_tables(rope))
    torch.testing.assert_close(qkv[:, :64].view(3, 4, 16).cpu(), expected_q)
    torch.testing.assert_close(qkv[:, 64:96].view(3, 2, 16).cpu(), expected_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_norm_store_matches_norm_rope_then_store(dtype: torch.dtype, with_q: bool, qk_norm: bool) -> None:
    """One launch == [q/k RMSNorm (Qwen3 / draft order: norm, then rope)] + rope + KVPool.store of k and v."""
    torch.manual_seed(1)
    rope = RotaryEmbedding(32, RopeConfig(theta=10000.0), 64)
    t, heads, kv_heads, d = 5, 6, 3, 32  # NOTE: head counts that are not powers of two exercise the masks
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    positions = torch.tensor([0, 7, 8, 33, 63])
    slots = torch.tensor([9, 2, 4, 11, 0])
    norm = (
        QKNorm(torch.rand(d).to(dtype) + 0.5 if with_q else None, torch.rand(d).to(dtype) + 0.5, 1e-6)
        if qk_norm
        else None
    )
    expected_q, expected_k, stored = rope.apply(positions, q.clone() if with_q else None, k.clone(), v, norm)
    assert not stored  # the CPU torch path never stores
    expected_pool = KVPool(12, 1, kv_heads, d, dtype, torch.device("cpu"))
    expected_pool.store(0, slots, expected_k, v)

    got_qkv = qkv.clone().to(DEVICE)
    got_q, got_k, got_v = got_qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    got_q, got_k, got_v = got_q.view(t, heads, d), got_k.view(t, kv_heads, d), got_v.view(t, kv_heads, d)
    pool = KVPool(12, 1, kv_heads, d, dtype, DEVICE)
    weights = None if norm is None else (
        None if norm.q_weight is None else norm.q_weight.to(DEVICE), norm.k_weight.to(DEVICE), norm.eps
    )
    triton_ops.rope_norm_store(
        got_q if with_q else None, got_k, positions.to(DEVICE), *rope_tables(rope), weights, got_v,
        (pool.k[0], pool.v[0], slots.to(DEVICE)),
    )
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    if with_q:
        assert expected_q is not None
        torch.testing.assert_close(got_q.cpu(), expected_q, **tolerance)
    torch.testing.assert_close(got_k.cpu(), expected_k, **tolerance)
    torch.testing.assert_close(pool.k[0].cpu(), expected_pool.k[0], **tolerance)
    torch.testing.assert_close(pool.v[0].cpu(), expected_pool.v[0])


def test_silu_mul() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2 * 1500, device=DEVICE)
    gate, up = gate_up.split(1500, dim=-1)
    torch.testing.assert_close(triton_ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_cols", [1, 100, 300])
def test_argmax_rows_matches_torch_with_ties_nan_and_chunks(dtype: torch.dtype, n_cols: int) -> None:
    """Several chunks per row (block 64): the first index of the max wins across chunks; NaN counts as largest."""
    torch.manual_seed(0)
    x = torch.randint(-3, 4, (7, n_cols), device=DEVICE).to(dtype)  # small integers: many ties
    x[1] = float("-inf")
    if n_cols > 70:
        x[2, 65] = 50.0
        x[2, 130 % n_cols] = 50.0  # tie in a later chunk: the earlier index wins
        x[3, 80] = float("nan")
        x[3, 5] = float("inf")
    got = triton_ops.argmax_rows(x, block=64)
    assert got.dtype == torch.int64
    torch.testing.assert_close(got, x.float().argmax(-1))
    assert triton_ops.argmax_rows(x[:0], block=64).shape == (0,)


def test_greedy_tokens_keeps_leading_dims() -> None:
    from blockspec.layers.argmax import greedy_tokens

    x = torch.randn(2, 3, 50, device=DEVICE)
    torch.testing.assert_close(greedy_tokens(x), x.argmax(-1))
