"""The forward mirror: rank 0 (scheduler, sampling, acceptance) broadcasts every forward; the other ranks run it.

Every forward of an engine enters through `ModelRunner.forward_extend(batch)` or `CudaGraphs.run(kind, inputs, fn)`.
On rank 0 both first call the mirror, which broadcasts what the forward needs: a fixed int64 header (with rank 0's
graph switches, `graphs.enabled` and `piecewise_enabled`), then one int64 payload (host lists, the batch tensors or
rows, and the req→token table rows of the batch's requests, since the table is written only on rank 0). A receiving
rank rebuilds the same inputs against its own table and runs the same entry point of its own worker
(`Worker.extend_forward`, `graphs.run` with `Worker.uniform_forward_fn`: worker/forward_receiver.py), so every rank
issues the model's collectives in the same order, graph or eager. No pickling: ints and tensors only.
"""
from __future__ import annotations

import enum
from typing import Callable, Union

import torch

from blockspec.batch import DeviceRows, ForwardBatch, ForwardMode, GraphInputs, UniformRows
from blockspec.distributed.group import TensorParallel
from blockspec.runner.graph_kind import GraphKind

HEADER_LEN = 13  # NOTE: [op-specific fields | padding | graph switches, host ints, payload size]
MODES = list(ForwardMode)
KINDS = list(GraphKind)


class Op(enum.IntEnum):
    STOP = 0
    EXTEND = 1  # worker.extend_forward(batch)
    UNIFORM = 2  # worker.runner.graphs.run(kind, inputs, worker.uniform_forward_fn(kind, q))


class Form(enum.IntEnum):
    BATCH = 0
    UNIFORM_ROWS = 1  # host rows
    DEVICE_ROWS = 2


class ForwardMirror:
    """Rank 0's side: sends each forward to the other ranks before running it, once started.

    Built with rank 0's runner (`ModelRunner`, which hands it to its `CudaGraphs`); `graph_switches` reads the
    runner's (graphs.enabled, piecewise_enabled) at each send. NOTE: every rank captures its graphs and times its
    start-up by itself, so the engine starts the mirror after graph capture; from then on every forward is mirrored
    (the kernel warm-up's included)."""

    def __init__(
        self, tp: TensorParallel, table: torch.Tensor, graph_switches: Callable[[], tuple[bool, bool]]
    ) -> None:
        self.tp = tp
        self.table = table
        self.graph_switches = graph_switches
        self.started = False

    def start(self) -> None:
        self.started = True

    def extend(self, batch: ForwardBatch) -> None:
        if self.started:
            self._send_batch(Op.EXTEND, -1, batch)

    def uniform(self, kind: GraphKind, inputs: GraphInputs) -> None:
        if not self.started:
            return
        if isinstance(inputs, ForwardBatch):
            self._send_batch(Op.UNIFORM, KINDS.index(kind), inputs)
        else:
            self._send_rows(KINDS.index(kind), inputs)

    def stop(self) -> None:
        """Tells the other ranks to leave their receive loop (at shutdown; sent whether or not mirroring started)."""
        self.tp.broadcast(self._header([Op.STOP]))

    def _header(self, values: list[int]) -> torch.Tensor:
        header = torch.full((HEADER_LEN,), -1, dtype=torch.int64)
        header[:len(values)] = torch.tensor(values, dtype=torch.int64)
        return header.to(self.table.device)

    def _send(self, header: list[int], host: list[int], device_parts: list[torch.Tensor]) -> None:
        device = self.table.device
        parts = [torch.tensor(host, dtype=torch.int64).to(device), *(p.reshape(-1).to(device) for p in device_parts)]
        payload = torch.cat(parts)
        padding = [-1] * (HEADER_LEN - 3 - len(header))
        graphs_enabled, piecewise_enabled = self.graph_switches()
        switches = int(graphs_enabled) | 2 * int(piecewise_enabled)
        self.tp.broadcast(self._header([*header, *padding, switches, len(host), int(payload.numel())]))
        self.tp.broadcast(payload)

    def _send_batch(self, op: Op, kind: int, batch: ForwardBatch) -> None:
        has_extend = batch.extend_starts is not None and batch.extend_lens is not None
        header = [op, kind, Form.BATCH, MODES.index(batch.mode), batch.num_tokens, batch.batch_size,
                  int(batch.logits_rows.numel()),
                  int(batch.float_logits) | 2 * int(has_extend) | 4 * int(batch.argmax_only),
                  -1 if batch.max_seq_len_hint is None else batch.max_seq_len_hint,
                  -1 if batch.uniform_q_len is None else batch.uniform_q_len]
        host = [*batch.seq_lens_cpu, *batch.extend_lens_cpu, *batch.capture_layer_ids]
        tensors = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_rows, batch.seq_lens,
                   batch.logits_rows]
        if has_extend:
            assert batch.extend_starts is not None and batch.extend_lens is not None
            tensors += [batch.extend_starts, batch.extend_lens]
        self._send(header, host, [*tensors, self.table[batch.req_rows]])

    def _send_rows(self, kind: int, inputs: Union[UniformRows, DeviceRows]) -> None:
        form = Form.UNIFORM_ROWS if isinstance(inputs, UniformRows) else Form.DEVICE_ROWS
        rows = inputs.rows.to(self.table.device, non_blocking=True)
        header = [Op.UNIFORM, kind, form, MODES.index(inputs.mode), inputs.batch_size, inputs.q + 2]
        self._send(header, list(inputs.capture_layer_ids), [rows, self.table[rows[:, inputs.q]]])
