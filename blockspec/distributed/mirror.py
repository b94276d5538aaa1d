"""The forward mirror: rank 0 (scheduler, sampling, acceptance) broadcasts every forward; the other ranks run it.

Every forward of an engine enters through `ModelRunner.forward_extend(batch)` or `CudaGraphs.run(kind, inputs, fn)`.
On rank 0 both first call the mirror, which broadcasts what the forward needs: a fixed int64 header (with rank 0's
graph switches, `graphs.enabled` and `piecewise_enabled`), then one int64 payload (host lists, the batch tensors or
rows, and the req→token table rows of the batch's requests, since the table is written only on rank 0). A receiving
rank rebuilds the same inputs against its own table and runs the same entry point of its own worker
(`Worker.extend_forward`, `graphs.run` with `Worker.uniform_forward_fn`), so every rank issues the model's
collectives in the same order, graph or eager. No pickling: ints and tensors only.
"""
from __future__ import annotations

import enum
from typing import Union

import torch

from blockspec.batch import DeviceRows, ForwardBatch, ForwardMode, GraphInputs, UniformRows
from blockspec.distributed.group import TensorParallel
from blockspec.runner.graphs import GraphKind, tokens_per_request
from blockspec.runner.model_runner import ModelRunner
from blockspec.step.target_worker import TargetWorker

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
    """Rank 0's side: sends each forward to the other ranks before running it."""

    def __init__(self, tp: TensorParallel, runner: ModelRunner) -> None:
        self.tp = tp
        self.runner = runner
        self.table = runner.req_to_token.table

    def extend(self, batch: ForwardBatch) -> None:
        self._send_batch(Op.EXTEND, -1, batch)

    def uniform(self, kind: GraphKind, inputs: GraphInputs) -> None:
        if isinstance(inputs, ForwardBatch):
            self._send_batch(Op.UNIFORM, KINDS.index(kind), inputs)
        else:
            self._send_rows(KINDS.index(kind), inputs)

    def stop(self) -> None:
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
        switches = int(self.runner.graphs.enabled) | 2 * int(self.runner.piecewise_enabled)
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


class ForwardReceiver:
    """A worker rank's side: receives each forward and runs it on its own shard, until rank 0 stops it."""

    def __init__(self, tp: TensorParallel, worker: TargetWorker) -> None:
        self.tp = tp
        self.worker = worker
        self.table = worker.runner.req_to_token.table

    def serve(self) -> None:
        while self.step():
            pass

    def step(self) -> bool:
        """Receives and runs one forward; False once rank 0 sent STOP."""
        header = self.tp.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=self.table.device)).tolist()
        op = Op(header[0])
        if op is Op.STOP:
            return False
        switches, num_host, size = header[-3:]
        runner = self.worker.runner
        runner.graphs.enabled, runner.piecewise_enabled = bool(switches & 1), bool(switches & 2)
        payload = self.tp.broadcast(torch.empty(size, dtype=torch.int64, device=self.table.device))
        host, tensors = payload[:num_host].tolist(), payload[num_host:]
        with torch.inference_mode():
            if Form(header[2]) is Form.BATCH:
                batch = self._batch(header, host, tensors)
                if op is Op.EXTEND:
                    self.worker.extend_forward(batch)
                else:
                    self._uniform(KINDS[header[1]], batch)
            else:
                self._uniform(KINDS[header[1]], self._rows(header, host, tensors))
        return True

    def _uniform(self, kind: GraphKind, inputs: GraphInputs) -> None:
        fn = self.worker.uniform_forward_fn(kind, tokens_per_request(inputs))
        self.worker.runner.graphs.run(kind, inputs, fn)

    def _write_table(self, req_rows: torch.Tensor, flat_rows: torch.Tensor) -> None:
        self.table[req_rows] = flat_rows.view(req_rows.numel(), self.table.shape[1])

    def _batch(self, header: list[int], host: list[int], tensors: torch.Tensor) -> ForwardBatch:
        mode, t, bs, num_logits, flags, hint, q_len = MODES[header[3]], *header[4:10]
        has_extend = bool(flags & 2)
        sizes = [t, t, t, bs, bs, num_logits, *([bs, bs] if has_extend else [])]
        parts = list(tensors.split([*sizes, tensors.numel() - sum(sizes)]))
        input_ids, positions, out_cache_loc, req_rows, seq_lens, logits_rows = parts[:6]
        self._write_table(req_rows, parts[-1])
        return ForwardBatch(
            mode=mode, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc, req_rows=req_rows,
            seq_lens=seq_lens, seq_lens_cpu=host[:bs], extend_lens_cpu=host[bs:2 * bs], logits_rows=logits_rows,
            req_to_token=self.table, capture_layer_ids=tuple(host[2 * bs:]),
            uniform_q_len=None if q_len < 0 else q_len, max_seq_len_hint=None if hint < 0 else hint,
            float_logits=bool(flags & 1), argmax_only=bool(flags & 4), extend_starts=parts[6] if has_extend else None,
            extend_lens=parts[7] if has_extend else None,
        )

    def _rows(self, header: list[int], host: list[int], tensors: torch.Tensor) -> Union[UniformRows, DeviceRows]:
        mode, form, bs, width = MODES[header[3]], Form(header[2]), header[4], header[5]
        rows, table_rows = tensors.split([bs * width, tensors.numel() - bs * width])
        rows = rows.view(bs, width)
        self._write_table(rows[:, width - 2], table_rows)
        if form is Form.DEVICE_ROWS:
            return DeviceRows(mode, rows, tuple(host))
        host_rows = rows.cpu().pin_memory() if rows.is_cuda else rows.clone()
        return UniformRows(mode, host_rows, tuple(host))



def install_mirror(tp: TensorParallel, worker: TargetWorker) -> ForwardMirror:
    """Rank 0: from now on every forward of `worker`'s runner is mirrored (install after graph capture and start-up
    timing, which every rank runs by itself)."""
    runner = worker.runner
    mirror = ForwardMirror(tp, runner)
    runner.forward_mirror = mirror
    runner.graphs.forward_mirror = mirror
    return mirror
