"""The skinny-M Triton GEMM equals x @ weight.T (interpreter on CPU in fp32/fp16; real sizes on the GPU)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from blockspec.layers.skinny_gemm import SkinnyConfig, skinny_linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (10, 96, 256), (16, 33, 100), (7, 130, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [SkinnyConfig(16, 32, 4, 2), SkinnyConfig(32, 64, 4, 3)])
def test_matches_matmul(m: int, n: int, k: int, dtype: torch.dtype, config: SkinnyConfig) -> None:
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) * 0.1).to(dtype)
    expected = (x.float() @ weight.float().t()).to(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(skinny_linear(x, weight, config=config), expected, atol=tolerance, rtol=tolerance)


def test_writes_into_out_view() -> None:
    """`out` may be a column slice of a wider buffer (a stacked projection's static output)."""
    x = torch.randn(3, 64, device=DEVICE)
    weight = torch.randn(24, 64, device=DEVICE)
    buffer = torch.full((3, 40), 7.0, device=DEVICE)
    skinny_linear(x, weight, out=buffer[:, 8:32], config=SkinnyConfig(16, 32, 4, 2))
    torch.testing.assert_close(buffer[:, 8:32], x @ weight.t(), atol=1e-4, rtol=1e-4)
    assert bool((buffer[:, :8] == 7).all()) and bool((buffer[:, 32:] == 7).all())


def test_refuses_too_many_rows() -> None:
    with pytest.raises(ValueError, match="skinny_linear takes x"):
        skinny_linear(torch.randn(17, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE))
