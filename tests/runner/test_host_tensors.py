"""Host-side int64 index arrays: the same values as torch.tensor(list), views without copies, empty inputs."""
from __future__ import annotations

import itertools

import pytest
import torch

from blockspec.batch import ForwardMode, UniformRows, build_batch
from blockspec.host_tensors import int64_array, int64_tensor, to_device


def test_int64_tensor_matches_torch_tensor() -> None:
    values = [0, 1, -5, 2**40, 7]
    assert torch.equal(int64_tensor(values), torch.tensor(values, dtype=torch.int64))
    assert torch.equal(int64_tensor(iter(values)), torch.tensor(values, dtype=torch.int64))
    assert int64_tensor([]).shape == (0,) and int64_tensor([]).dtype == torch.int64
    host = int64_array(values)
    view = int64_tensor(host)
    host[0] = 42  # NOTE: an array('q') is viewed, not copied
    assert int(view[0]) == 42
    assert torch.equal(to_device(view, torch.device("cpu")), view)
    with pytest.raises(OverflowError):
        int64_tensor([2**63])


def test_build_batch_layout() -> None:
    table = torch.arange(6 * 16, dtype=torch.int64).view(6, 16)
    batch = build_batch(ForwardMode.EXTEND, [[11, 12, 13], [21, 22]], [0, 7], [2, 5], table, [2, 4])
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22] and batch.positions.tolist() == [0, 1, 2, 7, 8]
    assert batch.out_cache_loc.tolist() == [32, 33, 34, 87, 88] and batch.req_rows.tolist() == [2, 5]
    assert batch.seq_lens.tolist() == batch.seq_lens_cpu == [3, 9] and batch.extend_lens_cpu == [3, 2]
    assert batch.logits_rows.tolist() == [2, 4]
    assert batch.extend_starts.tolist() == [0, 3] and batch.extend_lens.tolist() == [3, 2]
    assert all(isinstance(n, int) for n in batch.seq_lens_cpu)
    with pytest.raises(ValueError, match="same number of tokens"):
        build_batch(ForwardMode.VERIFY, [[1, 2], [3]], [0, 0], [0, 1], table, [0, 1])


def test_uniform_rows_build() -> None:
    rows = UniformRows.build(ForwardMode.DECODE, [[7], [8]], [3, 4], [10, 11], torch.device("cpu"))
    assert rows.rows.tolist() == [[7, 3, 10], [8, 4, 11]]
    with pytest.raises(ValueError, match="same number of tokens"):
        UniformRows.build(ForwardMode.VERIFY, [[1, 2], [3]], [0, 1], [5, 5], torch.device("cpu"))
    flat = int64_tensor(itertools.chain.from_iterable((i, 2 * i) for i in range(3))).view(3, 2)
    assert flat.tolist() == [[0, 0], [1, 2], [2, 4]]
