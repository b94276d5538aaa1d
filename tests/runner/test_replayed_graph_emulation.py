"""The CPU emulation of CUDA graph replay (tests/support/replayed_cuda_graphs.py) behaves as a graph does: a replay
reads the static device rows afresh but keeps every host value of the capture (seq_lens_cpu = [q] x bs), padding rows
read as padding, outputs are sliced to the real batch, and a replay of any graph overwrites every graph's outputs."""
from __future__ import annotations

import pytest
import torch

from blockspec.batch import ForwardBatch, ForwardMode, UniformRows
from blockspec.kv.allocator import ReqToTokenTable
from blockspec.runner.cuda_graph import GraphedForward
from tests.support.replayed_cuda_graphs import replayed_graph_capture

Q = 2


def host_and_device(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: its seq_len as the device sees it, and the longest seq_len as the host saw it."""
    return batch.seq_lens * 1, torch.full_like(batch.seq_lens, max(batch.seq_lens_cpu))


def graphed(name: str, table: ReqToTokenTable) -> GraphedForward:
    graph = GraphedForward(name, host_and_device, ForwardMode.VERIFY, Q, [1, 2, 4], table.table, table.dummy_row, 64)
    graph.capture()
    return graph


def rows(seq_lens: list[int]) -> UniformRows:
    return UniformRows.build(ForwardMode.VERIFY, [[7] * Q for _ in seq_lens], list(range(len(seq_lens))), seq_lens,
                             torch.device("cpu"))


def test_a_replay_reads_device_rows_and_keeps_the_capture_host_values(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = replayed_graph_capture(monkeypatch)
    table = ReqToTokenTable(4, 64, torch.device("cpu"))
    graph = graphed("verify", table)
    device_lens, host_max = graph.replay_rows(rows([10, 30, 20]))  # NOTE: padded to the graph of 4
    assert device_lens.tolist() == [10, 30, 20]
    assert host_max.tolist() == [Q] * 3  # the capture's placeholders, not 30
    assert graph.rows[3].tolist() == graph.padding_rows[3].tolist()
    assert pool.replays == {"verify": 1}


def test_a_replay_overwrites_every_graph_output(monkeypatch: pytest.MonkeyPatch) -> None:
    replayed_graph_capture(monkeypatch)
    table = ReqToTokenTable(4, 64, torch.device("cpu"))
    first, second = graphed("first", table), graphed("second", table)
    earlier, _ = first.replay_rows(rows([5]))
    assert earlier.tolist() == [5]
    second.replay_rows(rows([9, 9]))
    assert earlier.tolist() == [-1]  # NOTE: read after another graph's replay: the pool's memory was reused
