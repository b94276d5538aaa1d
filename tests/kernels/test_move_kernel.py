"""KVPool.move's Triton kernel (kv/move_kernel.py) equals the torch form (a gather, then a scatter, per stack): every
layer's K and V, rows wider than one chunk, pairs that overlap inside a group (a destination that is a source of an
earlier or later pair), the DDTree compaction's shape, and padding groups that all move the dummy slot onto itself.
Under Triton's interpreter on CPU (root conftest), natively on CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda  # NOTE: runs on CUDA where there is one (make gpu-test)

pytest.importorskip("triton")

from blockspec.kv import move_kernel  # noqa: E402
from blockspec.kv.move_kernel import move_slot_groups  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _stacks(layers: int, slots: int, heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(layers * slots + heads * dim)
    shape = (layers, slots, heads, dim)
    return (torch.randn(shape, generator=generator).to(dtype).to(DEVICE),
            torch.randn(shape, generator=generator).to(dtype).to(DEVICE))


def _expected(stack: torch.Tensor, sources: torch.Tensor, destinations: torch.Tensor) -> torch.Tensor:
    out = stack.clone()
    out[:, destinations.reshape(-1)] = stack[:, sources.reshape(-1)]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_with_overlapping_pairs_move_like_the_torch_form(dtype: torch.dtype) -> None:
    k, v = _stacks(layers=3, slots=40, heads=3, dim=8, dtype=dtype)
    # NOTE: group 0 is a walk's compaction (path 0, 2, 5, 6 onto 0..3: slot 12 is read for pair 1 and written by
    # pair 2); group 1 reads slot 21 for pair 0 and writes it in pair 1, and swaps 22 and 23
    sources = torch.tensor([[10, 12, 15, 16], [21, 24, 23, 22]], device=DEVICE)
    destinations = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]], device=DEVICE)
    expected_k, expected_v = _expected(k, sources, destinations), _expected(v, sources, destinations)
    move_slot_groups(k, v, sources, destinations)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_rows_wider_than_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row of Hk·D = 3·24 = 72 elements in chunks of 16 (a small tile): five programs per row, the last partial."""
    monkeypatch.setattr(move_kernel, "TILE_ELEMENTS", 256)
    k, v = _stacks(layers=2, slots=20, heads=3, dim=24, dtype=torch.float32)
    sources = torch.tensor([[3, 5], [8, 9], [17, 11]], device=DEVICE)
    destinations = torch.tensor([[2, 3], [7, 8], [10, 11]], device=DEVICE)
    expected_k, expected_v = _expected(k, sources, destinations), _expected(v, sources, destinations)
    move_slot_groups(k, v, sources, destinations)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_padding_groups_on_the_dummy_slot_leave_it_unchanged() -> None:
    k, v = _stacks(layers=2, slots=10, heads=2, dim=4, dtype=torch.float32)
    before_k, before_v = k.clone(), v.clone()
    sources = torch.tensor([[4, 6], [0, 0], [0, 0]], device=DEVICE)
    destinations = torch.tensor([[3, 4], [0, 0], [0, 0]], device=DEVICE)
    move_slot_groups(k, v, sources, destinations)
    assert torch.equal(k, _expected(before_k, sources[:1], destinations[:1]))
    assert torch.equal(v, _expected(before_v, sources[:1], destinations[:1]))
